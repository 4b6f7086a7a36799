"""SGLang's KV-event wire format, as published by `ZmqEventPublisher` (sglang 0.5.x).

A ZMQ message is three frames: topic, seq (8 bytes big-endian), payload. The payload is
msgpack `[ts, [event, ...], attn_dp_rank]`. Events are maps with a "type" key since 0.5.20
and tagged arrays `["BlockStored", ...]` up to 0.5.19; both decode here. Unknown extra
fields are ignored so newer engines keep working.

Limits (schemas/README.md): a batch holds at most `MAX_EVENTS_PER_BATCH` events, an event at
most `MAX_PAGES_PER_EVENT` page hashes and `MAX_TOKENS_PER_EVENT` token ids, a LoRA name at most
`MAX_LORA_NAME_CHARS` characters. A longer array is refused from its msgpack header, before
its elements are read: a batch over a limit is malformed, an event over one is rejected
(dead-lettered) on its own. The bounds are far above what an engine emits (an event is one
radix-tree insert: a 4M-token sequence at most) and bound what one payload can cost the
bridge (~150 MB of Python ints at worst).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from .hashes import WireBlockHash
from .limits import guarded

SEQ_BYTES = 8
#: End-of-replay marker: seq -1 as 8-byte signed big-endian.
REPLAY_END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


# --- map encoding (>= 0.5.20): {"type": "BlockStored", ...} -------------------------------
class _MapEvent(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


MAX_EVENTS_PER_BATCH = 1 << 16
MAX_PAGES_PER_EVENT = 1 << 20
MAX_TOKENS_PER_EVENT = 1 << 22
#: A LoRA adapter name travels on (as the stored pages' namespace "lora:<name>").
MAX_LORA_NAME_CHARS = 1024

#: A page's tokens: ints, or [a, b] pairs when the radix keys are bigrams (EAGLE speculative
#: decoding, whose pages SGLang publishes as token pairs).
TokenIds = Annotated[list[int | list[int]], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]
BlockHashes = Annotated[list[WireBlockHash], msgspec.Meta(max_length=MAX_PAGES_PER_EVENT)]


class BlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: BlockHashes
    parent_block_hash: WireBlockHash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    #: Since 0.5.23 (map encoding only): the request's cache salt and the LoRA adapter name.
    #: When either is set, SGLang namespaces the published hashes (sha256 of a seed and the
    #: plain hash), so they are opaque ids a router cannot compute from tokens alone.
    cache_salt: str | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)] | None = None


class BlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: BlockHashes
    medium: str | None = None


class AllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


SglangEvent = BlockStored | BlockRemoved | AllBlocksCleared


# --- array encoding (<= 0.5.19): ["BlockStored", hashes, parent, tokens, size, lora, medium]
# The fields those versions had, in their order, as tagged arrays. Declared apart from the
# map types because fields added since (cache_salt, lora_name) must not grow the array.
class _ArrayEvent(msgspec.Struct, tag_field="type", array_like=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: BlockHashes
    parent_block_hash: WireBlockHash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: BlockHashes
    medium: str | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


_ArrayEventUnion = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared
_AS_MAP = {_ArrayBlockStored: BlockStored, _ArrayBlockRemoved: BlockRemoved,
           _ArrayAllBlocksCleared: AllBlocksCleared}
_AS_ARRAY = {v: k for k, v in _AS_MAP.items()}


def _relayout(event, table):
    """The same event in the other encoding's type; fields the target lacks are dropped."""
    target = table[type(event)]
    fields = msgspec.structs.asdict(event)
    return target(**{name: fields[name] for name in target.__struct_fields__ if name in fields})


class SglangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH)]
    attn_dp_rank: int | None = None


class DecodedBatch(msgspec.Struct):
    ts: float
    attn_dp_rank: int | None
    events: list[SglangEvent]
    #: (index in the batch, raw msgpack of the event, reason) for events that did not decode.
    rejected: list[tuple[int, bytes, str]]


class MalformedBatch(ValueError):
    pass


_batch_decoder = msgspec.msgpack.Decoder(SglangBatch)
_map_decoder = msgspec.msgpack.Decoder(SglangEvent)
_array_decoder = msgspec.msgpack.Decoder(_ArrayEventUnion)
_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def decode_event(raw: bytes) -> SglangEvent:
    """Decode one event in either encoding; raises msgspec.DecodeError/ValidationError."""
    if raw[:1] and raw[0] in _MAP_FIRST_BYTES:
        return guarded(_map_decoder.decode, raw)
    return _relayout(guarded(_array_decoder.decode, raw), _AS_MAP)


def decode_payload(payload: bytes) -> DecodedBatch:
    """Decode an SGLang payload. A batch that is not `[ts, [..], rank]` raises MalformedBatch;
    a single bad event inside a good batch is returned in `rejected` (the rest still apply)."""
    try:
        batch = guarded(_batch_decoder.decode, payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedBatch(f"not an SGLang event batch: {exc}") from None
    events: list[SglangEvent] = []
    rejected: list[tuple[int, bytes, str]] = []
    for index, raw in enumerate(batch.events):
        data = bytes(raw)
        try:
            events.append(decode_event(data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            rejected.append((index, data, f"event {index}: {exc}"))
    return DecodedBatch(ts=batch.ts, attn_dp_rank=batch.attn_dp_rank, events=events, rejected=rejected)


# --- encoders, for publishers in tests and the simulator ----------------------------------
_encoder = msgspec.msgpack.Encoder()


def encode_payload(ts: float, events: list[SglangEvent], attn_dp_rank: int | None = None,
                   array_encoding: bool = False) -> bytes:
    """Encode a batch the way SGLang does: maps (>=0.5.20) or tagged arrays (<=0.5.19)."""
    encoded = [_relayout(event, _AS_ARRAY) for event in events] if array_encoding else events
    body: list[Any] = [ts, encoded] if attn_dp_rank is None else [ts, encoded, attn_dp_rank]
    return _encoder.encode(body)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise MalformedBatch(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
