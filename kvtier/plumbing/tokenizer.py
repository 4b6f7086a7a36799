"""A model's tokenizer and chat template, loaded from local files only (never downloaded), so
that the router computes the same token ids, and so the same page hashes, as the engine.

A tokenizer folder is what Hugging Face models ship: `tokenizer.json` (the fast tokenizer,
read with the `tokenizers` library) and `tokenizer_config.json` (its `chat_template`, and the
special tokens the template may name). Applied as SGLang applies them (docs/DESIGN.md §8):
- a completion's text prompt is encoded with the tokenizer's special tokens added (its
  post-processor, e.g. a BOS);
- a chat is rendered with the template (a sandboxed Jinja2 environment as transformers builds
  it: `trim_blocks`, `lstrip_blocks`, loop controls, `tojson` without ASCII escapes,
  `raise_exception` and `strftime_now`; variables: the messages, no tools or documents,
  `add_generation_prompt` true, `reasoning_effort` "medium" as SGLang sends by default, and
  every special token), and the text is encoded with no special tokens added: the template
  writes them itself. A chat ending with an assistant turn continues it: that turn is left out
  of the template, and its text is encoded (special tokens added, a leading BOS dropped) and
  appended.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: What SGLang passes a chat template when the request names no reasoning effort.
DEFAULT_REASONING_EFFORT = "medium"


class TokenizerError(Exception):
    """A tokenizer folder that cannot be loaded (the message says which file and why)."""


class ChatTemplateError(ValueError):
    """Messages the model's chat template refuses, or a model with no chat template."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class ModelTokenizer:
    path: str
    _tokenizer: Any
    _template: Any  # a compiled Jinja2 template, or None
    _special: dict[str, str]

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        folder = Path(path).expanduser()
        if folder.is_file():
            folder = folder.parent
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json (give the folder of a Hugging Face model's "
                                 "tokenizer files, e.g. a snapshot in the local Hugging Face cache)")
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(tokenizer_file))
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
        template = None
        if isinstance(template_text, str):
            template = _compile(template_text, config_file)
        return cls(str(folder), tokenizer, template, special)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The ids without the character offsets `encode` also tracks: half the time, the same ids.
        return list(self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        if self._template is None:
            raise ChatTemplateError(f"the tokenizer at {self.path} has no chat template "
                                    "(tokenizer_config.json chat_template)")
        from jinja2.exceptions import TemplateError

        turns = [m | {"content": m.get("content") or ""} for m in messages]
        try:
            return self._template.render(messages=turns, tools=None, documents=None, add_generation_prompt=True,
                                         reasoning_effort=DEFAULT_REASONING_EFFORT, **self._special)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if messages and messages[-1].get("role") == "assistant":  # continue the final assistant turn
            head = self._encode_rendered(messages[:-1])
            tail = self.encode_prompt(messages[-1].get("content") or "")
            bos = self._special.get("bos_token")
            if tail and bos is not None and tail[0] == self._tokenizer.token_to_id(bos):
                tail = tail[1:]
            return head + tail
        return self._encode_rendered(messages)

    def _encode_rendered(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self._encode(self.render_chat(messages), add_special_tokens=False)


def _compile(text: str, where: Path):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(text)
    except TemplateError as exc:
        raise TokenizerError(f"{where}: the chat template does not compile ({exc})") from None
