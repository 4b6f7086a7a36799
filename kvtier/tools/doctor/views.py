"""What the I/O edge of `kvtier doctor` observed, as plain values (`NatsView`, `RedisView`, `RouterView`,
`MooncakeView`, `Observation`), and what a judgement is (`Status`, `Finding`). No I/O, no judgement."""

from __future__ import annotations

import enum

import msgspec

from kvtier.schemas.health import HashCheck
from kvtier.schemas.router_health import RouterHealth
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata

DEVICE_BIT = Tier.DEVICE.bit
#: Dead letters whose reasons are quoted in the finding.
LATEST_DEAD_LETTERS = 3
#: A Mooncake probe key: never an SGLang page key, so the query answers OBJECT_NOT_FOUND.
MOONCAKE_PROBE_KEY = "kvtier-doctor-probe"


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One judged fact. `check` is a stable id (nats, streams, redis, workers, events, tiers,
    page_size, mooncake, router, router_index, router_tokenizer, router_circuit, router_queue,
    hash_scheme, dead_letters);
    `subject` what it is about (a URL, a stream, model/worker)."""

    check: str
    status: Status
    subject: str = ""
    finding: str
    fix: str = ""


# --- views: what the I/O edge observed ------------------------------------------------------
class StreamView(msgspec.Struct, kw_only=True):
    name: str
    exists: bool
    messages: int = 0
    partitions: int | None = None


class LastMessage(msgspec.Struct, kw_only=True):
    """The newest message on a worker's events subject."""

    kind: str  # "batch" | "announce" | "unreadable"
    age_s: float
    #: The batch's (epoch, seq), or the announcing bridge's cursor (last batch it published).
    epoch: int = 0
    seq: int = 0


class DeadLetter(msgspec.Struct, kw_only=True):
    subject: str
    stage: str = ""
    reason: str = ""
    age_s: float | None = None


class NatsView(msgspec.Struct, kw_only=True):
    url: str
    reachable: bool
    error: str = ""
    jetstream: bool = True
    streams: dict[str, StreamView] = {}
    latest_dead_letters: list[DeadLetter] = []
    #: "model token/worker" -> newest message on that worker's subject (absent: none stored).
    last_messages: dict[str, LastMessage] = {}


class WorkerRecord(msgspec.Struct, kw_only=True):
    """One worker's record in Redis (state, lease, metadata, hash check), as observed; part of
    `RedisView`."""

    model: str  # the model token (as in Redis keys)
    worker: str
    lease_left_s: float | None = None
    epoch: int = 0
    seq: int = 0
    stale: bool = False
    stale_reason: str = ""
    #: Its epoch began after the engine's first batch: routed to, missing what the engine held.
    partial: bool = False
    gaps: int = 0
    applied_ago_s: float | None = None
    pages: dict[str, int] = {}
    #: OR of every tier bit the worker ever stored on; None when the processor does not record it.
    tiers_seen: int | None = None
    page_size: int | None = None
    meta: WorkerMetadata | None = None
    #: The metadata says HiCache is on (a Mooncake layout, or an explicit hicache flag).
    hicache: bool = False
    hash_check: HashCheck | None = None

    @property
    def key(self) -> str:
        return f"{self.model}/{self.worker}"

    @property
    def live(self) -> bool:
        return self.lease_left_s is not None and self.lease_left_s > 0

    @property
    def tier_bits(self) -> int:
        bits = self.tiers_seen or 0
        for tier in Tier:
            if self.pages.get(tier.value, 0) > 0:
                bits |= tier.bit
        return bits


class FeedHead(msgspec.Struct, kw_only=True):
    """A model's change feed as Redis had it: its last change number, and the marker's id."""

    change: int = 0
    marker_id: str = ""


class RedisView(msgspec.Struct, kw_only=True):
    url: str
    reachable: bool
    error: str = ""
    #: Model tokens in Redis (`kvt:models`).
    models: list[str] = []
    #: The model asked for with --model (its token), if any.
    requested_model: str | None = None
    workers: list[WorkerRecord] = []
    #: model token -> its change feed's head (routers' indexes must reach it).
    feeds: dict[str, FeedHead] = {}


class RouterView(msgspec.Struct, kw_only=True):
    url: str
    reachable: bool
    error: str = ""
    http_status: int = 0
    healthz: RouterHealth = RouterHealth()
    #: router_shared_pool_errors_total by reason (None: /metrics unreadable).
    shared_pool_errors: dict[str, float] | None = None
    page_size_mismatches: float | None = None


class MooncakeView(msgspec.Struct, kw_only=True):
    url: str
    reachable: bool
    error: str = ""
    detail: str = ""


class Observation(msgspec.Struct, kw_only=True):
    nats: NatsView
    redis: RedisView
    routers: list[RouterView] = []
    mooncake: MooncakeView | None = None
    events_window_s: float = 300.0
