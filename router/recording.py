"""What each decision leaves behind: its metrics, and its record in the decision log."""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvtier.schemas.routing import CandidateScore, RouteDecision, RouteResponse, ScoringWeights

from . import steps
from .hashing import RequestPages
from .metrics import RouterMetrics


class DecisionRecorder:
    def __init__(self, metrics: RouterMetrics, decision_log, router_id: str) -> None:
        self.metrics = metrics
        self.decision_log = decision_log  # None: decisions are not published
        self.router_id = router_id

    def observe(self, response: RouteResponse, shared: steps.SharedAnswer | None, n_pages: int, latency: float,
                mode: str) -> None:
        """The decision's metrics: its mode and latency, the chosen worker's overlap by tier,
        the shared pool's hits."""
        m = self.metrics
        m.decisions_by_mode(mode).inc()
        m.decision_latency.observe(latency)
        m.request_pages.observe(n_pages)
        o = response.overlap
        device, host, disk, beyond = m.chosen_overlap_by_tier
        device.observe(o.device)
        host.observe(o.host)
        disk.observe(o.disk)
        beyond.observe(o.shared_beyond)
        if shared:
            hits = max((p.hits for layouts in shared.values() for p in layouts.values()), default=0)
            if n_pages:
                m.shared_cache_hit_rate.observe(hits / n_pages)
            m.shared_cache_beyond_blocks.observe(o.shared_beyond)

    def log(self, *, request_id: str, model: str, weights: ScoringWeights, u: float,
            pages_by_size: Mapping[int, RequestPages], n_pages: int, chosen: str, candidates: list[CandidateScore],
            degraded: list[str], latency: float, shared: steps.SharedAnswer | None,
            predicted_ttft_ms: float | None = None) -> RouteDecision | None:
        """The decision, submitted to the decision log; None when none is configured."""
        if self.decision_log is None:
            return None
        decision = steps.decision_record(
            request_id=request_id, model=model, router_id=self.router_id, ts=time.time(), weights=weights, u=u,
            pages_by_size=pages_by_size, n_pages=n_pages, chosen=chosen, candidates=candidates, degraded=degraded,
            latency_s=latency, shared_queried=shared is not None, predicted_ttft_ms=predicted_ttft_ms)
        self.decision_log.submit(decision)
        return decision
