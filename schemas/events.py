"""kvtier's own messages on NATS JetStream (subject `kvtier.events.<model>.<worker>`).

Two kinds share a worker's subject, told apart by the "kind" tag:
- `EventBatch`: tier transitions in the worker's order, numbered by (epoch, seq) without gaps.
- `WorkerAnnounce`: metadata + lease heartbeat + the bridge's cursor (for a restarted bridge).

Forward compatibility: unknown fields are ignored; a message whose major version `v` is
newer than `SCHEMA_VERSION` is refused with a clear reason (dead-lettered), never guessed at.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from .hashes import WireBlockHash
from .limits import MAX_SAFE_INT, MAX_TIMESTAMP_S, Name, guarded
from .subjects import subject_token
from .tiers import Tier
from .worker import WorkerMetadata

SCHEMA_VERSION = 1

#: Both at most 2**53 - 1: the apply script compares them as Lua numbers (schemas/limits.py).
Seq = Annotated[int, msgspec.Meta(ge=1, le=MAX_SAFE_INT)]
Epoch = Annotated[int, msgspec.Meta(ge=1, le=MAX_SAFE_INT)]
PageSize = Annotated[int, msgspec.Meta(gt=0)]
Timestamp = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMESTAMP_S)]
# NaN is refused because a comparison with it is always false (ge=0 rejects NaN too); the
# upper bound refuses infinity.


class EpochReason(str, enum.Enum):
    """Why a bridge began a new epoch (the processor clears the worker's state on it)."""

    BRIDGE_START = "bridge_start"  # could not prove continuity with the stream's last cursor
    PUBLISHER_RESTART = "publisher_restart"  # SGLang's seq went back: a new engine process
    UNRECOVERED_GAP = "unrecovered_gap"  # missed batches no longer in SGLang's replay buffer
    RESYNC_REQUESTED = "resync_requested"  # a processor found the state incomplete


EMPTY_TOKENS = msgspec.Raw(b"\x90")  # msgpack []
_tokens_encoder = msgspec.msgpack.Encoder()
_tokens_decoder = msgspec.msgpack.Decoder(list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]])


def pack_token_ids(token_ids: list[int]) -> msgspec.Raw:
    return msgspec.Raw(_tokens_encoder.encode(token_ids)) if token_ids else EMPTY_TOKENS


def token_ids_of(event: PagesStored) -> list[int]:
    """Decode a stored event's token ids (uint32 each, as SGLang hashes them); raises
    msgspec.DecodeError/ValidationError when they are not that (they are not checked when the
    message is decoded)."""
    return guarded(_tokens_decoder.decode, event.token_ids)


class PagesStored(msgspec.Struct, tag="stored", array_like=True):
    tier: Tier
    hashes: list[WireBlockHash]
    parent: WireBlockHash | None = None
    page_size: PageSize = 1
    #: Tokens of the stored pages when the engine sent them, kept for hash validation. Raw
    #: msgpack (an array of ints): applying state never needs them, so they are not decoded
    #: on the hot path; `token_ids_of()` decodes them when wanted.
    token_ids: msgspec.Raw = EMPTY_TOKENS
    lora_id: int | None = None
    #: Set when the engine namespaced these hashes (SGLang's cache salt or LoRA adapter name:
    #: "cache_salt", "lora:<name>"): the hash check then explains a mismatch by it.
    namespace: str | None = None


class PagesRemoved(msgspec.Struct, tag="removed", array_like=True):
    tier: Tier
    hashes: list[WireBlockHash]


class AllCleared(msgspec.Struct, tag="cleared", array_like=True):
    pass


TierEvent = PagesStored | PagesRemoved | AllCleared


class EventBatch(msgspec.Struct, tag_field="kind", tag="batch", kw_only=True):
    v: int = SCHEMA_VERSION
    worker_id: Name
    model: Name
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    epoch: Epoch
    seq: Seq
    #: When the bridge published (unix seconds).
    ts: Timestamp
    #: When the engine emitted the first included batch (unix seconds): lag is measured from it.
    source_ts: Timestamp
    #: SGLang seq numbers of the first and last included engine batches.
    source_seq_first: int = -1
    source_seq_last: int = -1
    #: The engine's timestamp of the last included batch: with source_seq_last it identifies
    #: that batch in the engine's replay buffer, which lets a restarted bridge prove continuity.
    source_ts_last: float = 0.0
    #: Set on the first batch of an epoch.
    epoch_reason: EpochReason | None = None
    #: On the first batch of an epoch: the epoch begins at the engine's first batch (engine
    #: seq 0, or an engine that had published nothing), so the stream holds its whole history.
    #: False otherwise: the state will lack what the engine held before (it is `partial`).
    epoch_from_start: bool = False
    events: list[TierEvent] = []

    @property
    def msg_id(self) -> str:
        """JetStream's dedupe id: unique per model, worker, epoch and seq (two models may
        have a worker of the same name start an epoch in the same millisecond)."""
        return f"{subject_token(self.model)}:{self.worker_id}:{self.epoch}:{self.seq}"


class BridgeCursor(msgspec.Struct, kw_only=True):
    """Where a bridge stands: enough for a restarted bridge to prove it can continue."""

    epoch: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
    source_seq_last: int = -1
    source_ts_last: float = 0.0


class EngineQueue(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's own queue, as its `/metrics` said when the bridge last asked: SGLang's
    `sglang:num_queue_reqs` (waiting, not yet in a batch) and `sglang:num_running_reqs`."""

    waiting: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
    running: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
    read_ts: Timestamp


#: Where the processor keeps a worker's last EngineQueue: fields of its state hash, so they
#: are forgotten with the worker.
ENGINE_QUEUE_FIELDS = ("engine_waiting", "engine_running", "engine_queue_ms")


def engine_queue_fields(queue: EngineQueue) -> dict[Any, int]:
    """The state-hash fields (ENGINE_QUEUE_FIELDS) holding `queue`. (Keys typed Any: redis-py's
    `hset` wants a mapping keyed by its own union, which a dict[str, ...] is not.)"""
    return dict(zip(ENGINE_QUEUE_FIELDS, (queue.waiting, queue.running, int(queue.read_ts * 1000))))


def engine_queue_from_fields(values: list) -> EngineQueue | None:
    """The EngineQueue those fields hold (values in ENGINE_QUEUE_FIELDS order, bytes or text),
    None where the worker's bridge never sent one."""
    if any(value is None for value in values):
        return None
    waiting, running, read_ms = values
    return EngineQueue(waiting=int(waiting), running=int(running), read_ts=int(read_ms) / 1000)


class WorkerAnnounce(msgspec.Struct, tag_field="kind", tag="announce", kw_only=True):
    v: int = SCHEMA_VERSION
    metadata: WorkerMetadata
    ts: Timestamp
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    cursor: BridgeCursor
    #: None where the bridge cannot read the engine's metrics (no worker URL, metrics off).
    engine_queue: EngineQueue | None = None


class WorkerExpired(msgspec.Struct, tag_field="kind", tag="expired", kw_only=True):
    """A processor's decision, recorded in the worker's subject: its lease, running out at
    `lease_expiry_ms`, was not renewed before its partition had been applied past that moment.
    Applied in stream order like everything else, and only if the lease is still that one (an
    announce applied before it renewed it: nothing happens), so a replay of the stream expires
    exactly the workers the live processors expired."""

    v: int = SCHEMA_VERSION
    model: Name
    worker_id: Name
    lease_expiry_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)]
    ts: Timestamp
    #: Where the worker's state stood when the decision was taken.
    epoch: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)] = 0
    seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAFE_INT)] = 0

    @property
    def msg_id(self) -> str:
        """The same decision taken by two processors is stored once."""
        return f"expired:{subject_token(self.model)}:{self.worker_id}:{self.lease_expiry_ms}"


StreamMessage = EventBatch | WorkerAnnounce | WorkerExpired

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamMessage)


class UnsupportedVersion(ValueError):
    pass


def encode_message(message: StreamMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(data: bytes) -> StreamMessage:
    """Decode a stream message; raises msgspec.DecodeError/ValidationError or
    UnsupportedVersion, each with a message that says what is wrong and where."""
    message = guarded(_decoder.decode, data)
    if message.v > SCHEMA_VERSION:
        raise UnsupportedVersion(
            f"message schema v{message.v} is newer than this kvtier (v{SCHEMA_VERSION}); upgrade kvtier"
        )
    return message


class ControlRequest(msgspec.Struct, kw_only=True):
    """JSON on `kvtier.control.<model>.<worker>`, from a processor to that worker's bridge.
    The one request is "resync" (begin a new epoch); a bridge ignores others, with a warning."""

    request: str
    reason: str = ""


_control_decoder = msgspec.json.Decoder(ControlRequest)


def encode_control(request: ControlRequest) -> bytes:
    return msgspec.json.encode(request)


def decode_control(data: bytes) -> ControlRequest:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_control_decoder.decode, data)
