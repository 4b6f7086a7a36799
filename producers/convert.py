"""SGLang events -> kvtier tier events. Pure: no I/O, so the bridge, the simulator and the
tests share it."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvtier.schemas.events import AllCleared, PagesRemoved, PagesStored, TierEvent, pack_token_ids
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
            token_ids=pack_token_ids(event.token_ids if keep_token_ids and not bigram else []),
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


__all__ = ["Converted", "convert_batch", "UnknownMedium"]
