"""Tokenizing once what a conversation repeats. A Hugging Face tokenizer cuts a text at its added
tokens (the special tokens a chat template writes around every turn) before anything else, and
encodes the pieces between them apart: normalizing, pre-tokenizing and the model never see
across an added token. So a text's ids are its pieces' ids in order, and a piece seen before (a
conversation's earlier turns, a shared system prompt) need not be encoded again. `PieceCache`
cuts a text as the library does, keeps each piece's ids (an LRU bounded by bytes), and encodes
only the new pieces, together, in one batch (which the library runs on several threads). The
library cuts in two passes (below); a segment of the first pass is kept whole too, so a chat's
earlier turns are found in one lookup each, not cut again. A long new piece is itself cut into
parts encoded in that batch, where that is provably exact (kvtier/plumbing/parallel_encode.py);
its kept ids are the same either way.

Exact where the library's cut is exactly this one (`PieceCache.for_tokenizer` returns None
otherwise, and the text is encoded whole):
- no normalizer, or an empty sequence of them: added tokens are then matched on the text as
  given, whether marked `normalized` or not;
- no added token strips the whitespace around it (`lstrip`, `rstrip`) or matches whole words
  only (`single_word`): the pieces are then exactly the text between matches;
- matching as the library matches: first the tokens not `normalized`, leftmost-longest over
  the whole text, then the `normalized` ones, leftmost-longest within each piece left.
A text's special tokens added by the post-processor (a BOS) are found by probing, and checked.
tests/plumbing/test_tokenizer_cache.py compares it with one full encode on random chats (unicode,
system prompts, tool messages) with the real DeepSeek-V4 byte-level BPE tokenizer.
"""

from __future__ import annotations

import array
import collections
import json
import re
import threading
from typing import Any

from .parallel_encode import (
    ParallelEncoder,
    cuts_are_exact,
    paragraphs,
    special_additions,
    whole_ids,
    why_not_cut_at_added_tokens,
)

#: Pieces shorter than this are encoded every time: looking them up costs about as much.
MIN_CACHED_CHARS = 32
#: Where plain text can be cut exactly (kvtier/plumbing/parallel_encode.py), a piece is kept in
#: parts of at least this many characters (about 120 tokens of prose), so prompts that share
#: their start without added tokens between (a long document, then different questions) find
#: the shared parts; shorter, and a lookup would cost about what encoding it does.
MIN_PARAGRAPH_CHARS = 512


class _Trie:
    """Fixed strings, found leftmost-longest (as Aho-Corasick with that semantics finds them)."""

    def __init__(self, words: list[str]):
        self.root: dict = {}
        for word in words:
            node = self.root
            for ch in word:
                node = node.setdefault(ch, {})
            node[""] = word  # the end of a word
        firsts = sorted(self.root)
        self.first = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") if firsts else None

    def spans(self, text: str, start: int = 0, end: int | None = None):
        """(begin, end) of each match in text[start:end], left to right, none overlapping."""
        end = len(text) if end is None else end
        if self.first is None:
            return
        search = self.first.search
        pos = start
        while pos < end:
            found = search(text, pos, end)
            if found is None:
                return
            at = found.start()
            node, longest, i = self.root, -1, at
            while i < end and text[i] in node:
                node = node[text[i]]
                i += 1
                if "" in node:
                    longest = i
            if longest < 0:
                pos = at + 1
                continue
            yield at, longest
            pos = longest


class PieceCache:
    def __init__(self, tokenizer: Any, added: dict[str, int], unnormalized: list[str], normalized: list[str],
                 max_bytes: int, prefix: tuple[int, ...] = (), suffix: tuple[int, ...] = (),
                 special_checked: bool = False, parallel: ParallelEncoder | None = None,
                 paragraph_chars: int = 0):
        self._tokenizer = tokenizer
        #: Plain pieces are kept in parts of at least this many characters; 0: whole.
        self.paragraph_chars = paragraph_chars
        #: Encodes a batch of new pieces, long ones in parts; None: each piece whole.
        self.parallel = parallel
        self._added = added  # content -> id
        self._first = _Trie(unnormalized)
        self._second = _Trie(normalized)
        self.max_bytes = max_bytes
        self._prefix, self._suffix = list(prefix), list(suffix)
        self._special_checked = special_checked  # add_special_tokens=True is prefix + ids + suffix
        self._pieces: collections.OrderedDict[str, array.array] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, tokenizer_json: str, max_bytes: int,
                      parts: int | None = None) -> PieceCache | None:
        """A cache for `tokenizer` (a `tokenizers.Tokenizer`) read from `tokenizer_json` (its
        file's text), or None when pieces cannot be proved to encode as the whole does.
        `parts`: the most parts a long piece is encoded in at once (ParallelEncoder's default
        when None; 1: never cut)."""
        if max_bytes <= 0:
            return None
        spec = json.loads(tokenizer_json)
        if why_not_cut_at_added_tokens(spec) is not None:
            return None
        added_tokens = spec.get("added_tokens") or []
        added = {t["content"]: int(t["id"]) for t in added_tokens if t.get("content")}
        unnormalized = [t["content"] for t in added_tokens if t.get("content") and not t.get("normalized")]
        normalized = [t["content"] for t in added_tokens if t.get("content") and t.get("normalized")]
        cache = cls(tokenizer, added, unnormalized, normalized, max_bytes,
                    parallel=ParallelEncoder.for_tokenizer(tokenizer, spec, parts),
                    paragraph_chars=MIN_PARAGRAPH_CHARS if cuts_are_exact(tokenizer, spec) else 0)
        # What the post-processor adds around a text; one whose additions vary with the text is
        # encoded whole.
        found = special_additions(tokenizer)
        if found is not None:
            cache._prefix, cache._suffix = found
            cache._special_checked = True
        return cache

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        return whole_ids(self._tokenizer, text, add_special_tokens)

    def segments(self, text: str) -> list[tuple[str, bool]]:
        """The library's first cut, at the added tokens not `normalized`: (segment, is such a
        token), in order. A segment's ids depend on it alone, whatever else it holds."""
        out: list[tuple[str, bool]] = []
        pos = 0
        for begin, end in self._first.spans(text):
            if begin > pos:
                out.append((text[pos:begin], False))
            out.append((text[begin:end], True))
            pos = end
        if len(text) > pos:
            out.append((text[pos:], False))
        return out

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """The text cut as the library cuts it: (piece, is an added token), in order."""
        out: list[tuple[str, bool]] = []
        for segment, is_added in self.segments(text):
            if is_added:
                out.append((segment, True))
            else:
                self._cut_second(segment, out)
        return out

    def _cut_second(self, segment: str, out: list[tuple[str, bool]]) -> None:
        pos = 0
        for begin, stop in self._second.spans(segment):
            if begin > pos:
                out.append((segment[pos:begin], False))
            out.append((segment[begin:stop], True))
            pos = stop
        if len(segment) > pos:
            out.append((segment[pos:], False))

    def _parts(self, segment: str) -> list[tuple[str, bool]]:
        """`segment`'s pieces, each plain one cut further into paragraphs where that is exact."""
        pieces: list[tuple[str, bool]] = []
        self._cut_second(segment, pieces)
        if not self.paragraph_chars:
            return pieces
        out: list[tuple[str, bool]] = []
        for piece, is_added in pieces:
            if is_added or len(piece) < 2 * self.paragraph_chars:
                out.append((piece, is_added))
            else:
                out.extend((part, False) for part in paragraphs(piece, self.paragraph_chars))
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens and not self._special_checked:
            return self._whole(text, True)
        # A segment seen before (a chat's earlier turns, between the tokens that close them) is
        # looked up whole; only the others are cut at the `normalized` tokens, piece by piece.
        segments = self.segments(text)
        known: list[array.array | None] = []
        with self._lock:
            for segment, is_added in segments:
                ids = None if is_added or len(segment) < MIN_CACHED_CHARS else self._pieces.get(segment)
                if ids is not None:
                    self._pieces.move_to_end(segment)
                    self.hits += 1
                known.append(ids)
        unknown = [segment for (segment, is_added), ids in zip(segments, known) if ids is None and not is_added]
        encoded = self._encode_segments(unknown)
        out: list[int] = list(self._prefix) if add_special_tokens else []
        for (segment, is_added), ids in zip(segments, known):
            if is_added:
                out.append(self._added[segment])
            else:
                out.extend(ids if ids is not None else encoded[segment])
        if add_special_tokens:
            out.extend(self._suffix)
        return out

    def _encode_segments(self, segments: list[str]) -> dict[str, list[int]]:
        """The ids of each segment, from its pieces' ids (kept ones looked up, new ones encoded
        together in one batch); keeps the new pieces, and each segment of several pieces whole."""
        cut: dict[str, list[tuple[str, bool]]] = {}
        for segment in segments:
            if segment not in cut:
                cut[segment] = self._parts(segment)
        found: dict[str, array.array | None] = {}
        new: dict[str, None] = {}
        with self._lock:
            for pieces in cut.values():
                for piece, is_added in pieces:
                    if is_added or piece in found:
                        continue
                    kept = self._pieces.get(piece) if len(piece) >= MIN_CACHED_CHARS else None
                    if kept is not None:
                        self._pieces.move_to_end(piece)
                        self.hits += 1
                    elif len(piece) >= MIN_CACHED_CHARS:
                        new[piece] = None
                        self.misses += 1
                    found[piece] = kept
        batch = [piece for piece, ids in found.items() if ids is None]
        encoded = dict(zip(batch, self._encode_new(batch)))
        out: dict[str, list[int]] = {}
        whole: dict[str, list[int]] = {}
        for segment, pieces in cut.items():
            joined: list[int] = []
            for piece, is_added in pieces:
                if is_added:
                    joined.append(self._added[piece])
                else:
                    kept = found[piece]
                    joined.extend(kept if kept is not None else encoded[piece])
            out[segment] = joined
            if len(pieces) > 1 and len(segment) >= MIN_CACHED_CHARS:
                whole[segment] = joined
        self._keep({**{piece: encoded[piece] for piece in new}, **whole})
        return out

    def _encode_new(self, batch: list[str]) -> list[list[int]]:
        if self.parallel is not None:
            return self.parallel.encode_plain(batch)
        return [e.ids for e in self._tokenizer.encode_batch_fast(batch, add_special_tokens=False)]

    def _keep(self, pieces: dict[str, list[int]]) -> None:
        with self._lock:
            for piece, ids in pieces.items():
                if piece in self._pieces:
                    continue
                kept = array.array("I", ids)
                self._pieces[piece] = kept
                self.bytes += _cost(piece, kept)
            while self.bytes > self.max_bytes and self._pieces:
                piece, kept = self._pieces.popitem(last=False)
                self.bytes -= _cost(piece, kept)


def _cost(piece: str, ids: array.array) -> int:
    """About what a kept piece holds in memory: its text (UTF-8 size as a floor), its ids, and
    the entry's own overhead."""
    return len(piece.encode("utf-8", "surrogatepass")) + 4 * len(ids) + 200
