"""The router's settings (RouterSettings): how it scores, books, reads state and admits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.schemas.routing import AdmissionSettings, ScoringWeights


@dataclass
class RouterSettings:
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    shared_cache: bool = False  # --shared-cache-type hicache
    router_page_size: int | None = None  # --page-size: workers that differ get no shared credit
    booking_ttl_s: float = 600.0
    router_id: str = ""
    state_retry_s: float = 0.5  # after a Redis failure, how long to route without it before retrying
    #: How the worker is picked among the scored candidates: "score" (the formula), or a
    #: baseline for A/B tests, "round-robin" (one turn counter shared by every replica) or
    #: "random". Baselines still score (the answer shows what the formula would say) and book.
    selection: str = "score"
    #: Book each request's pages as predicted device pages on its worker until it completes
    #: (--predicted-pages), credited at `predicted_page_weight`.
    predicted_pages: bool = False
    #: Where decisions read tier overlaps (--state-source): "mirror", an in-memory index per
    #: model following the change feed (router/mirror.py), or "redis", the Lua walk in Redis
    #: for every decision. Predicted pages live in Redis only: with them on, the walk is used.
    state_source: str = "mirror"
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

    @property
    def reads_index(self) -> bool:
        return self.state_source == "mirror" and not self.predicted_pages
