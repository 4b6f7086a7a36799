"""What a replica re-reads of the whole store every few seconds, beside its decisions: the
processors' hash checks, the workers whose state began late, and every worker's learned rates.
Each is shown in /healthz and exported as metrics; none of them is on the decision path."""

from __future__ import annotations

import logging
import time

from kvtier.schemas.health import HashCheck
from kvtier.schemas.router_health import WorkerRatesHealth

from .metrics import RouterMetrics
from .state import read_hash_mismatches, read_partial_workers, read_worker_rates

log = logging.getLogger("kvtier.router")


class ClusterChecks:
    def __init__(self, redis_client, metrics: RouterMetrics) -> None:
        self.redis = redis_client
        self.metrics = metrics
        self.hash_mismatches: list[tuple[str, HashCheck]] = []
        self.partial_workers: dict[str, list[str]] = {}
        self.worker_rates: list[WorkerRatesHealth] = []
        self.read_at = -1e9  # time.monotonic() of the last refresh

    async def refresh(self) -> list[tuple[str, HashCheck]]:
        """Re-read all three; the workers that fail their hash checks (logged once each)."""
        found = await read_hash_mismatches(self.redis)
        self.partial_workers = await read_partial_workers(self.redis)
        self.worker_rates = await read_worker_rates(self.redis)
        self.read_at = time.monotonic()
        metrics = self.metrics
        metrics.replace_series(metrics.partial_workers,
                               {(model,): len(workers) for model, workers in self.partial_workers.items()})
        metrics.replace_series(metrics.worker_rate, {
            (r.model, r.worker_id, kind): value for r in self.worker_rates
            for kind, value in (("compute", r.compute), ("host_load", r.host_load), ("l3_load", r.l3_load),
                                ("queued", r.queued))})
        metrics.replace_series(metrics.worker_rate_samples,
                               {(r.model, r.worker_id): r.samples for r in self.worker_rates})
        compared = [r for r in self.worker_rates if r.ttft_compared]
        metrics.replace_series(metrics.ttft_prediction_error, {
            (r.model, r.worker_id, stat): value for r in compared
            for stat, value in (("mape", r.ttft_mape), ("bias", r.ttft_bias))})
        metrics.replace_series(metrics.ttft_predictions_compared,
                               {(r.model, r.worker_id): r.ttft_compared for r in compared})
        metrics.replace_series(metrics.worker_hash_mismatch,
                               {(model, check.worker_id): check.mismatched for model, check in found})
        for model, check in found:
            if all((model, check.worker_id) != (m, c.worker_id) for m, c in self.hash_mismatches):
                log.error("worker %s/%s publishes page hashes routers cannot match (%d of %d checked pages): %s",
                          model, check.worker_id, check.mismatched, check.checked, check.explanation)
        self.hash_mismatches = found
        return found
