"""The router's `GET /healthz` body: what one replica can reach and whether it routes degraded.

Written by `router/service.py`, read by `kvtier doctor` (and by operators and probes). Every
field has a default so that a body from an older or newer router still decodes: unknown
fields are ignored, a missing one reads as "nothing to report".
"""

from __future__ import annotations

import msgspec

from .limits import guarded


class StateStoreHealth(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool = True
    #: The ping's failure, else the last error a state read met ("" when none).
    error: str = ""


class SharedPoolHealth(msgspec.Struct, frozen=True, kw_only=True):
    #: The router asks a Mooncake master (--mooncake-master): to credit the pages workers can
    #: fetch from it, or only to price them in the rates' predictions.
    enabled: bool = False
    #: Its pages are credited in the formula (--shared-cache-type hicache).
    credited: bool = False
    #: The last query's failure; "" once a query succeeds again.
    last_error: str = ""


class MismatchedWorker(msgspec.Struct, frozen=True, kw_only=True):
    """A worker whose published page hashes fail the processors' check (schemas/health.py
    `HashCheck`): routed to on load only, its pages can never match."""

    model: str
    worker_id: str
    mismatched_pages: int = 0
    checked_pages: int = 0
    #: Mismatched pages by `HashMismatchKind` value.
    kinds: dict[str, int] = {}
    explanation: str = ""


class HashSchemeHealth(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool = True
    mismatched_workers: list[MismatchedWorker] = []


class PartialWorker(msgspec.Struct, frozen=True, kw_only=True):
    """Routed to, but its state began after the engine's first batch: it lacks what the
    engine held before (until a flush or a full turnover of the device cache)."""

    model: str
    worker_id: str


class DecisionLogHealth(msgspec.Struct, frozen=True, kw_only=True):
    #: The router publishes its decisions (started with --nats).
    enabled: bool = False
    connected: bool = False


class IndexHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One model's in-memory tier index in this replica (router/index_feed.py)."""

    model: str
    #: Following the change feed: decisions read it. False while it bootstraps.
    ready: bool = False
    #: The feed entry applied last (stream id) and its change number `n`.
    position: str = ""
    change: int = 0
    #: The incarnation marker the index was built under.
    marker_id: str = ""
    entries: int = 0
    #: Seconds from the last applied entry's append to its application.
    lag_seconds: float = 0.0
    bootstraps: int = 0
    last_bootstrap_reason: str = ""
    last_bootstrap_seconds: float = 0.0


class TokenizerMismatch(msgspec.Struct, frozen=True, kw_only=True):
    """One proxied text request whose prompt the engine counted differently from the router."""

    worker_id: str
    router_tokens: int
    engine_tokens: int
    #: Unix time of the answer.
    at: float = 0.0


class TokenizerHealth(msgspec.Struct, frozen=True, kw_only=True):
    """The router's tokenization of one model checked against its engines: each proxied text
    request's prompt length as the router counted it, against the engine's `usage.prompt_tokens`.
    A difference means the router's tokenizer or chat template is not the engine's, so none of
    its page hashes past the first differing token can match the engine's pages."""

    model: str
    checked: int = 0
    mismatched: int = 0
    #: Mismatches among the most recent checks (`recent_window` of them): what `ok` judges, so a
    #: fixed tokenizer clears it.
    recent_mismatched: int = 0
    recent_window: int = 0
    last_mismatch: TokenizerMismatch | None = None
    #: Answers whose engine found more of the prompt cached than the router's state showed on
    #: that worker (beyond a page): the sign of a same-length difference, or of a lagging view.
    cached_beyond_overlap: int = 0
    #: Seconds after each proxied text request, whether its worker holds the request's last
    #: full page under the router's hash (on any tier): a tokenization that differs without
    #: changing the prompt's length never stores it. Checked, missing, and missing among the
    #: most recent `recent_pages_window` checks.
    pages_checked: int = 0
    pages_missing: int = 0
    recent_pages_missing: int = 0
    recent_pages_window: int = 0
    #: The router's verdict: no recent count mismatch, and the recent pages mostly found.
    ok: bool = True


class OpenCircuitHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A worker this replica leaves out of its candidates for now: it failed `failures` times
    in a row before the first byte of an answer (router/breaker.py)."""

    model: str
    worker_id: str
    failures: int
    reopens_in_s: float


class QueueHealth(msgspec.Struct, frozen=True, kw_only=True):
    """The router's queue of requests waiting for a worker under its busy thresholds."""

    depth: int = 0
    peak: int = 0
    size: int = 0
    timeout_s: float = 0.0


class ProcessHealth(msgspec.Struct, frozen=True, kw_only=True):
    """One process of a replica serving its port from several (`kvtier router --processes N`),
    as it answered its sibling."""

    index: int
    pid: int = 0
    #: Its own status ("ok", "degraded", "draining"), or "unreachable" when it did not answer.
    status: str = ""
    decisions: int = 0  # made since it started
    in_flight: int = 0  # requests it is serving now
    queue_depth: int = 0
    #: Every model's index follows the feed in it (False while one bootstraps).
    indexes_ready: bool = False


class EngineQueueHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's engine's own queue, as its bridge last read the engine's /metrics."""

    model: str
    worker_id: str
    waiting: int
    running: int
    read_ago_s: float


class WorkerRatesHealth(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's rates as the routers learned them from its first tokens (schemas/rates.py):
    multipliers on the prior's seconds per token (2.0: twice as slow), per kind of work."""

    model: str
    worker_id: str
    compute: float
    host_load: float
    l3_load: float
    #: The prefill booked ahead of its first tokens, per token at the prior's compute rate
    #: (under its compute multiplier: a queued page is partly loaded, partly done).
    queued: float = 1.0
    samples: int
    #: The fit's running mean error relative to its predictions (0.1: first tokens 10% off).
    relative_error: float
    #: How far its first tokens came from what the rates predicted just before each, over
    #: about the last 20 (schemas/rates.py PredictionError): the mean absolute percentage
    #: error and the mean signed error (> 0: predicted too long), as fractions of the true time;
    #: and how many first tokens were compared (0: none yet, both 0).
    ttft_mape: float = 0.0
    ttft_bias: float = 0.0
    ttft_compared: int = 0


class RouterHealth(msgspec.Struct, frozen=True, kw_only=True):
    #: "ok", "draining" (SIGTERM: refusing new requests), or "degraded" when the state store,
    #: the shared pool, a worker's hashes or the
    #: router's tokenization of a model fail.
    status: str = ""
    router_id: str = ""
    #: "tier-aware", or how it routes without the state store.
    routing: str = ""
    state_store: StateStoreHealth = StateStoreHealth()
    shared_pool: SharedPoolHealth = SharedPoolHealth()
    hash_scheme: HashSchemeHealth = HashSchemeHealth()
    partial_workers: list[PartialWorker] = []
    #: Workers whose bridge reads their engine's queue (SGLang's /metrics); [] where none does.
    engine_queues: list[EngineQueueHealth] = []
    #: What decides: "formula", or "learned-rates" (--router-mode predicted-ttft: the formula,
    #: overridden for a clearly faster worker).
    pricing: str = ""
    #: Each worker's learned rates (every scoring router learns them; predicted-ttft prices by them).
    worker_rates: list[WorkerRatesHealth] = []
    #: The router's --page-size; None: it hashes at each worker's announced size; UNSET: a
    #: router too old to report it.
    page_size: int | None | msgspec.UnsetType = msgspec.UNSET
    decision_log: DecisionLogHealth = DecisionLogHealth()
    #: Models this replica has been asked to route (and knew).
    models: list[str] = []
    #: Where decisions read tier overlaps: the in-memory index of each model, following its
    #: change feed ("index"; routers before it said "mirror", which reads the same, see
    #: `reads_index`), or "redis" (the Lua walk); "" from a router too old to say.
    state_source: str = ""
    #: Each model's index, when the replica reads indexes.
    indexes: list[IndexHealth] = []
    #: Proxied text requests' tokenization checked against the engines (--proxy --tokenizer).
    tokenizers: list[TokenizerHealth] = []
    #: Workers left out after failing to answer (--breaker-failures); a router too old to say: [].
    open_circuits: list[OpenCircuitHealth] = []
    queue: QueueHealth = QueueHealth()
    #: Every process of a replica started with --processes N, the one answering included; its
    #: status is the worst of theirs. [] for a replica of one process.
    processes: list[ProcessHealth] = []
    #: True: this router has --auth-token and the request did not give it, so only the status,
    #: the routing and whether the state store answers are shown (a load balancer's check
    #: needs no more; the workers' rates, queues and circuits are the operator's).
    summary_only: bool = False

    @property
    def reads_index(self) -> bool:
        """Whether the replica's decisions read in-memory indexes."""
        return self.state_source in INDEX_STATE_SOURCES


#: `state_source` of a replica that reads in-memory indexes: "index", and "mirror", what
#: routers said before the --state-source value was renamed.
INDEX_STATE_SOURCES = frozenset({"mirror", "index"})

_decoder = msgspec.json.Decoder(RouterHealth)


def decode_router_health(body: bytes | str) -> RouterHealth:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_decoder.decode, body)
