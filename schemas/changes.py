"""The change feed: every write to a model's pages sets, as one entry of the model's Redis
stream `kvt:{m}:changes` (state_keys.py), appended by the same script that made the write
(consumers/changes.lua), so the feed and the state never disagree. Routers' in-memory tier
indexes follow it (router/index_feed.py).

An entry has three fields:
  n  the model's change counter after this entry: consecutive, so a reader that sees a
     number skipped knows it missed entries (trimmed away, or lost with the store)
  w  the worker whose pages changed
  o  the changes, in the order applied, comma-separated: "C" (every page of the worker gone:
     a new epoch, a rebase, an engine flush, an expired or forgotten worker), or an op letter
     S (stored) | R (removed), the tier bit as one hex digit, then the page keys, 16 hex
     digits each (schemas/hashes.py PageKey)
Set operations are idempotent: applying an entry twice, or to a state that already holds part
of it, ends where applying it once to the state before it ends. Bootstrapping relies on it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .hashes import BlockHash, block_hashes_of_keys
from .state_keys import as_text
from .tiers import TIER_BITS, Tier

#: Entries each model's change feed keeps by default: at 128-page batches, ~60 s of a
#: 100k-transitions/s model, ~1-2 KB each (`kvtier processor --changes-maxlen`).
DEFAULT_CHANGES_MAXLEN = 50_000

_TIER_OF_DIGIT = {format(bit, "x"): tier for tier, bit in TIER_BITS.items()}


class ChangeKind(str, enum.Enum):
    STORE = "S"
    REMOVE = "R"
    CLEAR = "C"


@dataclass(frozen=True, slots=True)
class ChangeOp:
    kind: ChangeKind
    tier: Tier | None  # None for CLEAR
    pages: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class TierChange:
    """One feed entry, decoded."""

    entry_id: str  # the stream id, "<ms>-<seq>": where a reader resumes
    n: int
    worker_id: str
    ops: tuple[ChangeOp, ...]

    @property
    def written_ms(self) -> int:
        """When Redis appended the entry (its clock, from the id)."""
        return int(self.entry_id.split("-", 1)[0])


class MalformedChange(ValueError):
    """A feed entry kvtier's scripts would not write (a reader resyncs rather than guess)."""


def decode_ops(text: str) -> tuple[ChangeOp, ...]:
    ops = []
    for part in text.split(",") if text else ():
        if part == "C":
            ops.append(ChangeOp(ChangeKind.CLEAR, None))
            continue
        if len(part) < 2 or part[0] not in "SR" or part[1] not in _TIER_OF_DIGIT or (len(part) - 2) % 16:
            raise MalformedChange(f"bad op {part[:40]!r}")
        try:
            pages = block_hashes_of_keys(part[2:])
        except ValueError:
            raise MalformedChange(f"bad page keys in op {part[:40]!r}") from None
        ops.append(ChangeOp(ChangeKind(part[0]), _TIER_OF_DIGIT[part[1]], pages))
    return tuple(ops)


def decode_change(entry_id: bytes | str, fields: dict) -> TierChange:
    """A stream entry as XREAD/XRANGE return it (field names and values as bytes or str)."""
    values = {as_text(k): as_text(v) for k, v in fields.items()}
    try:
        n, worker, ops = values["n"], values["w"], values["o"]
    except KeyError as missing:
        raise MalformedChange(f"entry {as_text(entry_id)} lacks field {missing}") from None
    if not n.isdigit():
        raise MalformedChange(f"entry {as_text(entry_id)} has n={n[:20]!r}")
    return TierChange(as_text(entry_id), int(n), worker, decode_ops(ops))
