"""SGLang events -> kvtier tier events. Pure: no I/O, so the bridge, the simulator and the
tests share it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import msgspec

from kvtier.schemas.events import EMPTY_TOKENS, AllCleared, PagesRemoved, PagesStored, TierEvent, pack_token_ids
from kvtier.schemas.limits import MAX_TIMESTAMP_S
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from kvtier.schemas.tiers import UnknownMedium, tier_of_medium

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class Converted:
    events: list[TierEvent] = field(default_factory=list)
    #: (raw msgpack of the bad event, reason) for events that cannot be applied.
    rejected: list[tuple[bytes, str]] = field(default_factory=list)


def convert_batch(batch: DecodedBatch, keep_token_ids: bool = True) -> Converted:
    out = Converted(rejected=[(raw, reason) for _index, raw, reason in batch.rejected])
    for index, event in enumerate(batch.events):
        try:
            out.events.append(_convert_event(event, keep_token_ids))
        except ValueError as exc:
            out.rejected.append((_encode(event), f"event {index}: {exc}"))
    return out


def _convert_event(event, keep_token_ids: bool) -> TierEvent:
    if isinstance(event, BlockStored):
        if event.block_size <= 0:
            raise ValueError(f"page size (block_size) must be positive, got {event.block_size}")
        tier = tier_of_medium(event.medium)
        bigram = bool(event.token_ids) and isinstance(event.token_ids[0], list)
        return PagesStored(
            tier=tier,
            hashes=event.block_hashes,
            parent=event.parent_block_hash,
            page_size=event.block_size,
            token_ids=pack_token_ids(cast("list[int]", event.token_ids) if keep_token_ids and not bigram else []),
            lora_id=event.lora_id,
            namespace=BIGRAM_NAMESPACE if bigram else _namespace(event),
        )
    if isinstance(event, BlockRemoved):
        return PagesRemoved(tier=tier_of_medium(event.medium), hashes=event.block_hashes)
    if isinstance(event, AllBlocksCleared):
        return AllCleared()
    raise ValueError(f"unsupported event type {type(event).__name__}")


#: Pages keyed by token pairs (EAGLE): their tokens are not forwarded (the hash check cannot
#: recompute them, and a router hashing plain tokens cannot match them).
BIGRAM_NAMESPACE = "eagle-bigram"


def _namespace(event: BlockStored) -> str | None:
    if event.lora_name:
        return f"lora:{event.lora_name}"
    if event.cache_salt is not None:
        return "cache_salt"
    return None


def source_timestamp(ts: float | None, now: float) -> float:
    """An engine batch's timestamp as an EventBatch's `source_ts`: SGLang's own when it is a
    unix time (finite, positive), else `now` (a NaN or negative ts must not make the processor
    refuse the whole kvtier batch: the events are good, only the clock reading is not)."""
    if ts is not None and math.isfinite(ts) and 0 < ts <= MAX_TIMESTAMP_S:
        return ts
    return now


# --- fitting events into NATS messages ---------------------------------------------------
#: Upper bounds of one msgpack element: an int or float (9 bytes), a container header (5).
_NUM, _HEADER = 9, 5


def encoded_size_bound(event: TierEvent) -> int:
    """An upper bound of the event's msgpack size inside an EventBatch (cheap: no encoding)."""
    if isinstance(event, PagesStored):
        namespace = 4 * len(event.namespace) + _HEADER if event.namespace else 1
        return 64 + _NUM * len(event.hashes) + len(event.token_ids) + namespace
    if isinstance(event, PagesRemoved):
        return 32 + _NUM * len(event.hashes)
    return 16


def split_to_fit(event: TierEvent, max_pages: int, max_bytes: int) -> list[TierEvent]:
    """The event as consecutive events of at most `max_pages` pages and `max_bytes` encoded
    bytes each, applying to the same state in the same order: a store of pages p1..pn with
    parent P is a store of p1..pk with parent P, then of pk+1..pn with parent pk. A stored
    event's tokens are split with its pages when they are exactly page_size per page;
    otherwise (and for a single page too large on its own) the pieces carry no tokens, which
    the hash check counts as unverifiable."""
    if not isinstance(event, (PagesStored, PagesRemoved)):
        return [event]
    n = len(event.hashes)
    if n <= max_pages and encoded_size_bound(event) <= max_bytes:
        return [event]
    if isinstance(event, PagesRemoved):
        k = max(1, min(max_pages, (max_bytes - 32) // _NUM))
        return [PagesRemoved(tier=event.tier, hashes=event.hashes[i:i + k]) for i in range(0, n, k)]
    try:
        tokens = msgspec.msgpack.decode(event.token_ids) if len(event.token_ids) > 1 else []
    except (msgspec.DecodeError, RecursionError):
        tokens = None  # not what the bridge packs: the pieces go without
    size = event.page_size
    if not (isinstance(tokens, list) and len(tokens) == n * size):
        tokens = []
    sliceable = bool(tokens)
    per_page = _NUM + (len(event.token_ids) / n if sliceable else 0)
    fixed = encoded_size_bound(PagesStored(tier=event.tier, hashes=[], namespace=event.namespace))
    pieces: list[TierEvent] = []
    start, parent = 0, event.parent
    while start < n:
        k = max(1, min(max_pages, n - start, int((max_bytes - fixed) // per_page)))
        while True:
            piece = PagesStored(
                tier=event.tier, hashes=event.hashes[start:start + k], parent=parent, page_size=size,
                token_ids=pack_token_ids(tokens[start * size:(start + k) * size]) if sliceable else EMPTY_TOKENS,
                lora_id=event.lora_id, namespace=event.namespace)
            bound = encoded_size_bound(piece)
            if bound <= max_bytes:
                break
            if k == 1:
                piece = msgspec.structs.replace(piece, token_ids=EMPTY_TOKENS)
                break
            k = max(1, min(k // 2, k * max_bytes // bound))
        pieces.append(piece)
        start += k
        parent = piece.hashes[-1]
    return pieces


__all__ = ["Converted", "convert_batch", "UnknownMedium", "source_timestamp", "encoded_size_bound",
           "split_to_fit"]
