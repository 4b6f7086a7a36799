"""The OpenAI-compatible API as the router's proxy reads it and the simulated worker answers
it: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, and OpenAI's error shape.

A proxying router reads only the fields it needs to route (the model, the prompt or messages,
the output budget, and of a chat what its template renders: tools, tool calls and results,
chat_template_kwargs, reasoning effort); the body is forwarded unchanged, so every other field
reaches the worker as the client sent it. Unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

import msgspec

from .limits import guarded
from .routing import check_token_ids

ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ImageURL(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    detail: str | None = None


class MediaURL(msgspec.Struct, frozen=True, kw_only=True):
    url: str


class InputAudio(msgspec.Struct, frozen=True, kw_only=True):
    data: str
    format: str


class ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    """One part of a message's content: {"type": "text", "text"}, or a medium ("image_url",
    "video_url", "audio_url", "input_audio"), or another kind the engine may know (SGLang's
    "thinking" and GLM's "tool_reference"); any `type` decodes, only text is rendered by the
    router (see ChatMessage.template_message)."""

    type: str
    text: str = ""
    #: An object as OpenAI's API has it, or a bare URL as some clients send it.
    image_url: ImageURL | str | None = None
    video_url: MediaURL | str | None = None
    audio_url: MediaURL | str | None = None
    input_audio: InputAudio | None = None
    #: A "tool_reference" part's tool.
    name: str | None = None

    def template_input(self) -> dict[str, Any]:
        """The part as the template preparation sees it: a text part's text, other parts by kind
        (a template never sees a medium's data: the engine puts its own placeholder tokens there)."""
        if self.type == "text":
            return {"type": "text", "text": self.text}
        if self.type == "tool_reference":
            return {"type": "tool_reference", "name": self.name}
        return {"type": self.type}


class _FunctionName(TypedDict):
    name: str


class FunctionDefinition(_FunctionName, total=False):
    """A tool's function as OpenAI's API describes it. A typed dict, not a struct: SGLang hands the
    template the function's fields in the order the client sent them (a template writing
    `tool | tojson` puts that order into the prompt), and a decoded dict keeps it, unknown
    fields dropped."""

    description: str | None
    #: A JSON schema (an object, or true/false); its key order is kept as sent, too.
    parameters: dict[str, Any] | bool | None
    strict: bool | None
    defer_loading: bool | None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    type: Annotated[str, msgspec.Meta(max_length=64)] = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None

    @property
    def name(self) -> str:
        return self.function["name"]

    def template_input(self) -> dict[str, Any]:
        """The tool as SGLang (0.5.23, protocol.py `Tool`/`Function`) dumps it for the template:
        {"type", "function", "defer_loading"}; the function's description and parameters always
        there (null when not sent), `strict` and `defer_loading` only when set (a tool's
        `defer_loading` carried into its function), in the client's order, the fields it did not
        send after those it did."""
        sent = self.function
        fields: dict[str, Any] = {"description": sent.get("description"), "name": sent["name"],
                                  "parameters": sent.get("parameters")}
        if sent.get("strict") is not None:
            fields["strict"] = sent["strict"]
        defer = sent.get("defer_loading")
        if defer is None:
            defer = self.defer_loading
        if defer is not None:
            fields["defer_loading"] = defer
        ordered = {key: fields[key] for key in sent if key in fields}
        ordered.update((key, value) for key, value in fields.items() if key not in ordered)
        return {"type": self.type, "function": ordered, "defer_loading": self.defer_loading}


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str | None = None
    #: A JSON text, as OpenAI sends it (the template preparation parses it), or already an object.
    arguments: str | dict[str, Any] | None = None


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: str | None = None
    index: int | None = None
    type: Annotated[str, msgspec.Meta(max_length=64)] = "function"
    function: FunctionCall

    def template_input(self) -> dict[str, Any]:
        """As SGLang dumps a tool call: every field, unset ones null."""
        return {"id": self.id, "index": self.index, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


#: The roles SGLang's generic message takes, matched without case (SGLang writes them in lower
#: case); "user" is a message of its own, with a role and content only.
_GENERIC_ROLES = frozenset({"system", "assistant", "tool", "function", "developer", "latest_reminder", "root"})


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    #: Text, or a list of parts (text, media).
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    #: An earlier assistant turn's reasoning (templates such as Qwen3's render it).
    reasoning_content: str | None = None
    #: Tools declared in a system or developer message (SGLang passes them with the message).
    tools: list[Tool] | None = None
    phase: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    prefix: bool | None = None

    def text(self) -> str | None:
        """The text of the content; parts' texts joined by spaces, as SGLang flattens them for a
        template that reads content as a string."""
        if isinstance(self.content, list):
            return " ".join(part.text for part in self.content if part.type == "text")
        return self.content

    def template_input(self) -> dict[str, Any]:
        """template_message with the content as text (parts' texts joined by spaces, media left
        out): what a template reading content as a string gets. Kept for callers that size or
        encode messages by their text; ModelTokenizer.tokenize_chat_request takes the parts."""
        return self.template_message() | {"content": self.text()}

    def template_message(self) -> dict[str, Any]:
        """The message as SGLang hands it to the chat template's preparation (the router and the
        engine alike; kvtier/plumbing/tokenizer.py does the rest): SGLang's dump of its message
        model with the unset fields left out. A user message is a role and content only (SGLang's
        user message has no other field); other roles are written in lower case. Content parts
        stay a list: how they reach the template depends on the template."""
        role = self.role.lower() if self.role.lower() in _GENERIC_ROLES else self.role
        content: str | list[dict[str, Any]] | None = self.content if not isinstance(self.content, list) else [
            part.template_input() for part in self.content]
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "user":
            return turn
        fields: dict[str, Any] = {
            "tool_call_id": self.tool_call_id, "name": self.name, "phase": self.phase,
            "reasoning_content": self.reasoning_content,
            "tool_calls": None if self.tool_calls is None else [call.template_input() for call in self.tool_calls],
            "tools": None if self.tools is None else [tool.template_input() for tool in self.tools],
            "prefix": self.prefix}
        turn.update((key, value) for key, value in fields.items() if value is not None)
        return turn


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool = False


class NamedFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: str | None = None


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """{"type": "function", "function": {"name"}}: that tool only."""

    type: Annotated[str, msgspec.Meta(max_length=64)] = "function"
    function: NamedFunction | None = None


class Reasoning(msgspec.Struct, frozen=True, kw_only=True):
    """SGLang's `reasoning` object: an effort and an on/off switch for thinking."""

    effort: str | float | None = None
    reasoning_effort: str | float | None = None
    enabled: bool | str | None = None
    enable: bool | str | None = None


#: SGLang's reasoning effort levels (protocol.py ReasoningEffortTier, 0.5.23).
_EFFORT_LEVELS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"})
_TRUE_WORDS = frozenset({"1", "true", "yes", "y", "on"})


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelName | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    tools: list[Tool] | None = None
    #: "none", "auto", "required", or one tool by name.
    tool_choice: Annotated[str, msgspec.Meta(max_length=64)] | NamedToolChoice | None = None
    #: Extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Annotated[str, msgspec.Meta(max_length=64)] | float | None = None
    reasoning: Reasoning | None = None
    #: The final assistant message is continued (SGLang's default: it is sent as a user turn).
    continue_final_message: bool = False

    @property
    def output_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 0

    def text_bytes(self) -> int:
        """UTF-8 bytes of the text the chat template gets from the request (contents, reasoning,
        tool calls and results, tools' schemas, chat_template_kwargs): the rendered prompt's
        size less the template's own text, known before rendering."""
        size = 0
        for message in self.messages:
            for text in (message.text(), message.reasoning_content):
                if text:
                    size += len(text.encode("utf-8", "surrogatepass"))
            for call in message.tool_calls or ():
                arguments = call.function.arguments
                if isinstance(arguments, str):
                    size += len(arguments.encode("utf-8", "surrogatepass"))
                elif arguments is not None:
                    size += len(_json.encode(arguments))
            for tool in message.tools or ():
                size += len(_json.encode(tool.function))
        for tool in self.tools or ():
            size += len(_json.encode(tool.function))
        if self.chat_template_kwargs:
            size += len(_json.encode(self.chat_template_kwargs))
        return size

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template gets, as SGLang picks them: none when the request has none
        or says tool_choice "none"; the named one alone for a named choice; else all of them."""
        if not self.tools or self.tool_choice == "none":
            return None
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            wanted = choice.function.name if choice.function is not None else None
            return [tool.template_input() for tool in self.tools if tool.name == wanted] or None
        return [tool.template_input() for tool in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables as SGLang (0.5.23) builds them: `chat_template_kwargs`,
        and `reasoning_effort` from it, else from the request (or its `reasoning` object). A
        request naming an effort also sets `thinking` and `enable_thinking` (true unless the
        effort is "none") where chat_template_kwargs does not."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning_effort
        thinking: bool | None = None
        if self.reasoning is not None:
            asked = self.reasoning.effort if self.reasoning.effort is not None else self.reasoning.reasoning_effort
            if isinstance(asked, float) or asked in _EFFORT_LEVELS:
                effort = asked
            switch = self.reasoning.enabled if self.reasoning.enabled is not None else self.reasoning.enable
            if isinstance(switch, str):
                switch = switch.strip().lower() in _TRUE_WORDS
            if switch:
                thinking = True
        if effort is not None:
            thinking = effort != "none"
        if thinking is not None:
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("enable_thinking", thinking)
        named = kwargs.pop("reasoning_effort", None)
        if named is not None:
            effort = named
        return ({"reasoning_effort": effort} if effort is not None else {}) | kwargs


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelName | None = None
    #: Text, or token ids (used as they are: no tokenizer needed).
    prompt: str | list[int]  # the ids each a uint32: check_token_ids in __post_init__
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = 16

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            check_token_ids(self.prompt, "prompt")

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


_json = msgspec.json.Encoder()
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_chat_decoder.decode, body)


def decode_completion_request(body: bytes) -> CompletionRequest:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_completion_decoder.decode, body)


_body_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_FALSE = (b"false", b"null")


def completion_with_prompt_ids(body: bytes, ids: list[int]) -> bytes | None:
    """The completion request `body` (already decoded as a CompletionRequest) with its text
    prompt replaced by `ids`, every other field as the client sent it; None when the answer
    would show the difference: `echo` returns the prompt, and the engine would write back the
    text of the ids rather than the client's own."""
    fields = guarded(_body_fields.decode, body)
    echo = fields.get("echo")
    if echo is not None and bytes(echo).strip() not in _FALSE:
        return None
    fields["prompt"] = msgspec.Raw(_json.encode(ids))
    return _json.encode(fields)


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
