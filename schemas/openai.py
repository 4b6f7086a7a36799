"""The OpenAI-compatible API as the router's proxy reads it and the simulated worker answers
it: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and OpenAI's error shape.

A proxying router reads only the fields it needs to route (the model, the prompt or messages,
the output budget); the body is forwarded unchanged, so every other field reaches the worker
as the client sent it. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .limits import guarded
from .routing import TokenId

ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    #: Text, or parts of which the text ones are kept (a chat template sees their text).
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if part.type == "text")
        return self.content

    def template_input(self) -> dict[str, str | None]:
        """The message as a chat template sees it (the router and the engine alike)."""
        turn: dict[str, str | None] = {"role": self.role, "content": self.text()}
        if self.name:
            turn["name"] = self.name
        return turn


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelName | None = None
    #: Text, or token ids (used as they are: no tokenizer needed).
    prompt: str | list[TokenId]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16

    @property
    def output_budget(self) -> int:
        return self.max_tokens or 0


class OpenAIError(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | int | None = None


class OpenAIErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: OpenAIError


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "kvtier"


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard] = []


# --- what a worker answers (the simulated worker writes these; tests read them) -------------
class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatReply | None = None
    delta: ChatReply | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_chat_decoder.decode, body)


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_completion_decoder.decode, body)


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    """What any OpenAI response, a whole body or one streamed chunk, says the engine counted."""

    usage: Usage | None = None


_usage_report = msgspec.json.Decoder(UsageReport)


def reported_usage(body: bytes, streamed: bool) -> Usage | None:
    """The engine's `usage` in a JSON answer or, streamed (SSE), in the last event carrying one
    (sent when the request asked `stream_options.include_usage`). None when there is none or
    it cannot be read: the answer is the engine's, passed on unchanged whatever it holds."""
    events = [body] if not streamed else [
        line[5:].strip() for line in reversed(body.split(b"\n")) if line.startswith(b"data:")]
    for event in events:
        if not event or event == b"[DONE]":
            continue
        try:
            usage = _usage_report.decode(event).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if usage is not None:
            return usage
    return None
