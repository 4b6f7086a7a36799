"""A model's tokenizer and chat template, loaded from local files only (never downloaded), so
that the router computes the same token ids, and so the same page hashes, as the engine.

A tokenizer folder is what Hugging Face models ship: `tokenizer.json` (the fast tokenizer,
read with the `tokenizers` library) and `tokenizer_config.json` (its `chat_template`, and the
special tokens the template may name). Applied as SGLang applies them (docs/DESIGN.md §8):
- a completion's text prompt is encoded with the tokenizer's special tokens added (its
  post-processor, e.g. a BOS);
- a chat is rendered with the template (a sandboxed Jinja2 environment as transformers builds
  it: `trim_blocks`, `lstrip_blocks`, loop controls, `{% generation %}` blocks, `tojson` without
  ASCII escapes, `raise_exception` and `strftime_now`), and the text is encoded with no special
  tokens added: the template writes them itself.

What the template sees is what SGLang's OpenAI server (0.5.23, entrypoints/openai/serving_chat.py
`_apply_jinja_template`) gives transformers' `apply_chat_template`:
- `messages`: each message as SGLang's request model dumps it, unset fields left out
  (schemas/openai.py ChatMessage.template_message); missing content is empty text; an assistant
  turn's `tool_calls[].function.arguments`, sent as JSON text, parsed into an object (anything
  but a JSON object is refused, as SGLang refuses it). Content given as parts reaches a template
  that iterates `message.content` (or that names images, audio, video or vision anywhere: SGLang
  looks for those words) as a list of parts, media reduced to {"type": "image"/"video"/"audio"};
  any other template gets the parts' texts joined by spaces, media left out. A tool result
  given as text parts is their texts joined by spaces either way.
- `tools`: the request's tools (schemas/openai.py ChatCompletionRequest.template_tools); if the
  template refuses to render with them, it is rendered again with each tool's `function` alone
  (some templates, e.g. Mistral's, read tools in that flat form), as SGLang does. `documents`:
  a `documents` entry of chat_template_kwargs, else none.
- `add_generation_prompt` true, every special token by name, `reasoning_effort` ("medium" when
  the request names none, as SGLang 0.5.5 sent; 0.5.23 sends none), then the request's chat_template_kwargs
  (ChatCompletionRequest.template_kwargs), which override any of those.
- A final assistant turn with text content is continued when the request asks for it
  (`continue_final_message`): it is left out of the template, and its text is encoded (special
  tokens added, a leading BOS dropped) and appended; otherwise SGLang sends it as a user turn.
  (`encode_chat` called without a request continues it, as this module always did.)

The ids are the engine's for text. A request with a medium (an image, audio or video part) is
not: the engine's processor replaces the medium with as many placeholder tokens as the medium's
size asks for, which the router cannot know. Such a request still gets ids (the text rendering,
good enough to route by its text prefix), marked `exact=False`: its prompt count must not be
checked against the engine's. The same holds for a tool schema with a non-standard type name
(SGLang rewrites "varchar" and the like before rendering) and for chat_template_kwargs that name
one of apply_chat_template's own parameters (transformers takes those, not the template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .parallel_encode import ParallelEncoder, whole_ids
from .piece_cache import PieceCache

if TYPE_CHECKING:
    from kvtier.schemas.openai import ChatCompletionRequest

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: What SGLang 0.5.5 passes a chat template when the request names no reasoning effort; 0.5.23
#: passes none, and the templates that read it (gpt-oss's) take "medium" themselves then.
DEFAULT_REASONING_EFFORT = "medium"
#: apply_chat_template's own parameters: a chat_template_kwargs entry so named is taken (or
#: refused) by transformers instead of reaching the template; "documents" is passed on as such.
_TRANSFORMERS_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
#: JSON Schema's type names; SGLang rewrites others ("varchar", "int", ...) before rendering.
_SCHEMA_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
#: How SGLang names a medium part for a template that iterates content parts.
_MEDIA_KINDS = {"image_url": "image", "input_image": "image", "video_url": "video", "audio_url": "audio",
                "input_audio": "audio"}
#: Words that make SGLang give a template content as parts (it takes them for a multimodal one).
_MEDIA_WORDS = ("image", "audio", "video", "vision")
#: What becomes of a final assistant turn: continued, sent as a user turn, or rendered as it is.
FinalTurn = Literal["continue", "user", "keep"]


class TokenizerError(Exception):
    """A tokenizer folder that cannot be loaded (the message says which file and why)."""


class ChatTemplateError(ValueError):
    """Messages the model's chat template refuses, or a model with no chat template."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTokens:
    """A chat's prompt ids, and whether they are the engine's own (`exact`). Inexact ids route the
    request (they are its text rendering) but are no measure of the engine's tokenizer: the
    caller must not check the engine's prompt count against them. `why` says what made them so."""

    ids: list[int]
    exact: bool = True
    why: str | None = None


@dataclass
class _Chat:
    """What a chat template is rendered with, prepared as SGLang prepares it."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    documents: Any
    variables: dict[str, Any]
    prefix: str | None = None  # the final assistant turn's text, to continue
    why_inexact: list[str] = field(default_factory=list)


@dataclass
class ModelTokenizer:
    path: str
    _tokenizer: Any
    _template: Any  # a compiled Jinja2 template, or None
    _special: dict[str, str]
    #: How the template takes content given as parts: "openai" (a list of parts), "string" (text).
    _content_format: str = "string"
    #: The ids of pieces seen before (kvtier/plumbing/piece_cache.py); None: every text encoded whole.
    _pieces: PieceCache | None = None
    #: Encodes a long text in parts at once where provably exact (kvtier/plumbing/parallel_encode.py);
    #: the piece cache's own when there is one. None: every text encoded in one go.
    _parallel: ParallelEncoder | None = None

    @classmethod
    def load(cls, path: str | Path, cache_bytes: int = 0, encode_parts: int | None = None) -> ModelTokenizer:
        """`cache_bytes`: the most the ids of pieces seen before may hold (0: no cache).
        `encode_parts`: the most parts a long text is encoded in at once (None: as many as the
        cores, up to 4; 1: never cut)."""
        folder = Path(path).expanduser()
        if folder.is_file():
            folder = folder.parent
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json (give the folder of a Hugging Face model's "
                                 "tokenizer files, e.g. a snapshot in the local Hugging Face cache)")
        try:
            from tokenizers import Tokenizer

            tokenizer_text = tokenizer_file.read_text(encoding="utf-8")
            tokenizer = Tokenizer.from_str(tokenizer_text)
        except Exception as exc:  # noqa: BLE001 - the library raises its own kinds
            raise TokenizerError(f"{tokenizer_file}: cannot be read ({exc})") from None
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{config_file}: cannot be read ({exc})") from None
        special: dict[str, Any] = {name: text for name in _SPECIAL_TOKENS
                                   if (text := _token_text(config.get(name))) is not None}
        extra = [t for t in (_token_text(x) for x in config.get("additional_special_tokens") or []) if t]
        if extra:
            special["additional_special_tokens"] = extra
        template_text = config.get("chat_template")
        if isinstance(template_text, list):  # named templates: the default one
            template_text = next((t.get("template") for t in template_text
                                  if isinstance(t, dict) and t.get("name") == "default"), None)
        template, content_format = None, "string"
        if isinstance(template_text, str):
            template = _compile(template_text, config_file)
            content_format = _content_format(template, template_text)
        pieces = PieceCache.for_tokenizer(tokenizer, tokenizer_text, cache_bytes, encode_parts) if cache_bytes else None
        parallel = pieces.parallel if pieces is not None else \
            ParallelEncoder.for_tokenizer(tokenizer, tokenizer_text, encode_parts)
        return cls(str(folder), tokenizer, template, special, content_format, pieces, parallel)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    @property
    def piece_cache(self) -> PieceCache | None:
        return self._pieces

    @property
    def parallel_encoder(self) -> ParallelEncoder | None:
        return self._parallel

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._pieces is not None:
            return self._pieces.encode(text, add_special_tokens)
        if self._parallel is not None:
            return self._parallel.encode(text, add_special_tokens)
        return whole_ids(self._tokenizer, text, add_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat template's text for these messages, all of them (a final assistant turn too),
        with the generation prompt."""
        return self._render(self._prepare(messages, tools, template_kwargs, final="keep"))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, *, continue_final_message: bool = True,
                    ) -> list[int]:
        """The chat's prompt ids (tokenize_chat's, exact or not)."""
        return self.tokenize_chat(messages, tools, template_kwargs, continue_final_message=continue_final_message).ids

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                      template_kwargs: Mapping[str, Any] | None = None, *, continue_final_message: bool = True,
                      ) -> ChatTokens:
        """The prompt ids of a chat given as the template sees it (`messages` as
        ChatMessage.template_message writes them, `tools` as ChatCompletionRequest.template_tools,
        `template_kwargs` as ChatCompletionRequest.template_kwargs). A final assistant turn with
        text content is continued, or with `continue_final_message=False` sent as a user turn.
        Raises ChatTemplateError for a chat the template (or SGLang) refuses."""
        chat = self._prepare(messages, tools, template_kwargs, final="continue" if continue_final_message else "user")
        ids = self._encode(self._render(chat), add_special_tokens=False)
        if chat.prefix:
            tail = self.encode_prompt(chat.prefix)
            bos = self._special.get("bos_token")
            if tail and bos is not None and tail[0] == self._tokenizer.token_to_id(bos):
                tail = tail[1:]
            ids += tail
        why = "; ".join(chat.why_inexact) or None
        return ChatTokens(ids, why is None, why)

    def tokenize_chat_request(self, request: ChatCompletionRequest) -> ChatTokens:
        """An OpenAI chat request's prompt ids, as SGLang computes them (see the module's doc)."""
        return self.tokenize_chat([m.template_message() for m in request.messages], request.template_tools(),
                                  request.template_kwargs(), continue_final_message=request.continue_final_message)

    def _prepare(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                 template_kwargs: Mapping[str, Any] | None, final: FinalTurn) -> _Chat:
        if self._template is None:
            raise ChatTemplateError(f"the tokenizer at {self.path} has no chat template "
                                    "(tokenizer_config.json chat_template)")
        why: list[str] = []
        turns = [self._turn(m, why) for m in messages]
        prefix = None
        last = turns[-1] if turns else None
        if last is not None and last.get("role") == "assistant" and isinstance(last.get("content"), str) \
                and final != "keep":
            if final == "continue":
                prefix, turns = last["content"], turns[:-1]
            else:
                turns[-1] = {"role": "user", "content": last["content"]}
        variables: dict[str, Any] = {**self._special, "reasoning_effort": DEFAULT_REASONING_EFFORT}
        documents = None
        for name, value in (template_kwargs or {}).items():
            if name == "documents":
                documents = _documents(value)
            elif name in _TRANSFORMERS_PARAMETERS:
                _note(why, f"chat_template_kwargs names {name!r}, one of apply_chat_template's own parameters")
            else:
                variables[name] = value
        declared = [*(tools or ()), *(t for turn in turns for t in turn.get("tools") or ())]
        if any(_odd_schema_type(_parameters(tool)) for tool in declared):
            _note(why, "a tool's parameters name a type JSON Schema does not have (SGLang rewrites it)")
        return _Chat(turns, None if tools is None else list(tools), documents, variables, prefix, why)

    def _turn(self, message: Mapping[str, Any], why: list[str]) -> dict[str, Any]:
        """One message as SGLang hands it to the template."""
        turn = dict(message)
        if turn.get("role") == "assistant" and isinstance(turn.get("tool_calls"), list):
            turn["tool_calls"] = [_parsed_arguments(call) for call in turn["tool_calls"]]
        content = turn.get("content")
        if content is None:
            turn["content"] = ""
        elif isinstance(content, list):
            parts = [p for p in content if isinstance(p, Mapping)]
            if any(p.get("type") != "text" for p in parts):
                _note(why, "a message has a non-text part (the engine puts its own placeholder tokens there)")
            if self._content_format == "openai":
                kept = [_template_part(p) for p in parts]
                del turn["content"]  # SGLang writes the parts back last
                turn["content"] = [p for p in kept if p is not None]
            else:
                turn["content"] = " ".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")
        turn = {key: value for key, value in turn.items() if value is not None}
        content = turn.get("content")
        if turn.get("role") == "tool" and isinstance(content, list) and all(
                isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            turn["content"] = " ".join(str(p.get("text", "")) for p in content)
        return turn

    def _render(self, chat: _Chat) -> str:
        """Rendered with the tools as they are, or else with each tool's function alone."""
        try:
            return self._render_with(chat, chat.tools)
        except Exception:  # noqa: BLE001 - SGLang retries on any failure of the first rendering
            flat = None if not chat.tools else [
                t["function"] if isinstance(t, Mapping) and "function" in t else t for t in chat.tools]
            try:
                return self._render_with(chat, flat)
            except Exception as exc:  # noqa: BLE001 - a template is the model's code: any failure is the request's
                raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None

    def _render_with(self, chat: _Chat, tools: list[Any] | None) -> str:
        return self._template.render(messages=chat.messages, tools=tools, documents=chat.documents,
                                     add_generation_prompt=True, **chat.variables)


def _note(why: list[str], reason: str) -> None:
    if reason not in why:
        why.append(reason)


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose function's arguments, JSON text, are parsed into the object templates
    expect (SGLang refuses arguments that are not a JSON object)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments, parse_constant=_no_constant)
        except ValueError:
            raise ChatTemplateError("an assistant tool call's function.arguments must be valid JSON") from None
        if not isinstance(parsed, dict):
            raise ChatTemplateError("an assistant tool call's function.arguments must be a JSON object")
        function["arguments"] = parsed
    return {**call, "function": function}


def _parameters(tool: Any) -> Any:
    """A tool's parameters schema, the tool given whole ({"type", "function"}) or as its function."""
    function = tool.get("function", tool) if isinstance(tool, Mapping) else None
    return function.get("parameters") if isinstance(function, Mapping) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _template_part(part: Mapping[str, Any]) -> dict[str, Any] | None:
    """A content part as SGLang gives it to a template that iterates parts: text as it is, a
    medium as its kind alone, a GLM tool reference as it is; anything else left out."""
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    if kind in _MEDIA_KINDS:
        return {"type": _MEDIA_KINDS[kind]}
    if kind == "tool_reference":
        return dict(part)
    return None


def _documents(value: Any) -> list[Any] | None:
    """apply_chat_template's `documents`: dicts, or none."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, Mapping) for d in value):
        raise ChatTemplateError("chat_template_kwargs documents must be a list of objects")
    return value


def _odd_schema_type(schema: Any) -> bool:
    """Whether a JSON schema, anywhere inside, names a type JSON Schema does not have."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, Mapping):
            kind = node.get("type")
            names: Iterable[Any] = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
            if any(isinstance(n, str) and n not in _SCHEMA_TYPES for n in names):
                return True
            stack.extend(v for v in node.values() if isinstance(v, (list, Mapping)))
    return False


def _content_format(template: Any, source: str) -> str:
    """"openai" when the template names a medium or iterates a message's content (as SGLang
    decides, parser/jinja_template_utils.py detect_jinja_template_content_format), else "string"."""
    from jinja2 import nodes

    if any(word in source for word in _MEDIA_WORDS):
        return "openai"
    try:
        tree = template.environment.parse(source)
    except Exception:  # noqa: BLE001 - it compiled; a second parse failing changes nothing
        return "string"
    return "openai" if any(_reads_content(loop.iter, nodes) for loop in tree.find_all(nodes.For)) else "string"


def _reads_content(node: Any, nodes: Any) -> bool:
    """`message.content` (or msg's, or m's), `message['content']`, through filters, tests and slices."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if isinstance(node, nodes.Getattr):
        key, owner = node.attr, node.node
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        key, owner = node.arg.value, node.node
    else:
        return False
    return key == "content" and isinstance(owner, nodes.Name) and owner.name in ("message", "msg", "m")


def _compile(text: str, where: Path):
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with
        it (for training masks); rendered, it is its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        template = env.from_string(text)
    except TemplateError as exc:
        raise TokenizerError(f"{where}: the chat template does not compile ({exc})") from None
    return template
