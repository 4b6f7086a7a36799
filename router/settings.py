"""The router's settings (RouterSettings): how it scores, books, reads state and admits; the
modes `kvtier router` is given by name; the booking TTL."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.plumbing.settings import Choice
from kvtier.schemas.routing import AdmissionSettings, ScoringWeights

#: How long a booking holds its worker's load when no release comes (its router died
#: mid-request): the default of --booking-ttl, of LoadBook and of the fallback's in-flight map.
BOOKING_TTL_S = 600.0


class RouterMode(Choice):
    """--router-mode: how the worker is picked."""

    KV = "kv"  # tier-aware scoring
    LOAD = "load"  # booked load only (every cache weight 0)
    #: tier-aware scoring, overridden where a worker is clearly faster at its learned rates
    #: (router/rates.py `faster_than_formula`)
    PREDICTED_TTFT = "predicted-ttft"
    ROUND_ROBIN = "round-robin"  # baselines for A/B tests; they still score and book
    RANDOM = "random"


class SharedCacheType(Choice):
    """--shared-cache-type: whether pages in the shared Mooncake pool are credited."""

    NONE = "none"
    HICACHE = "hicache"


class StateSource(Choice):
    """--state-source: where decisions read tier overlaps."""

    INDEX = "index"  # an in-memory index per model, following its change feed (router/index_feed.py)
    REDIS = "redis"  # the Lua walk in Redis for every decision

    @classmethod
    def former_names(cls) -> dict[str, str]:
        return {"mirror": "index"}  # the in-memory index's name until 2026-12-03


@dataclass
class RouterSettings:
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    shared_cache: bool = False  # --shared-cache-type hicache: the pool's pages are credited
    router_page_size: int | None = None  # --page-size: workers that differ get no shared credit
    booking_ttl_s: float = BOOKING_TTL_S
    router_id: str = ""
    state_retry_s: float = 0.5  # after a Redis failure, how long to route without it before retrying
    #: How the worker is picked among the scored candidates: "score" (the formula), or a
    #: baseline for A/B tests, "round-robin" (one turn counter shared by every replica) or
    #: "random". Baselines still score (the answer shows what the formula would say) and book.
    selection: str = "score"
    #: Move a request off the formula's choice to a worker clearly faster at its learned rates
    #: (--router-mode predicted-ttft; router/rates.py `faster_than_formula`, FasterPick).
    faster_pick: bool = False
    #: Bookings keep the work their decision predicted, so that their first token's release
    #: teaches the worker's rates (--learn-rates; what `faster_pick` judges by).
    learn_rates: bool = True
    #: Book each request's pages as predicted device pages on its worker until it completes
    #: (--predicted-pages), credited at `predicted_page_weight`.
    predicted_pages: bool = False
    #: Where decisions read tier overlaps (--state-source). Predicted pages live in Redis
    #: only: with them on, the walk in Redis is used whatever this says.
    state_source: StateSource = StateSource.INDEX
    #: A worker failed this many times in a row before its first byte is left out for
    #: `breaker_backoff_s` (doubling while it keeps failing): router/breaker.py
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0
    #: Busy thresholds (a worker whose booked prefill tokens or decode pages are at or over
    #: them takes no new request; when every candidate is, the decision raises Busy) and the
    #: service's queue. Replaced at run time through the service's /v1/admission.
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    #: How long a session id keeps its worker (seconds since its last request).
    session_ttl_s: float = 600.0
    #: How long the index's XREAD waits for new feed entries (ms); below the client's socket
    #: timeout, so a quiet feed is not a failed read.
    index_block_ms: int = 100

    def __post_init__(self) -> None:
        self.state_source = StateSource(self.state_source)  # also when given by name ("mirror")

    @property
    def reads_index(self) -> bool:
        return self.state_source is StateSource.INDEX and not self.predicted_pages
