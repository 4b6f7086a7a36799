"""`kvtier analytics`' /metrics: a `TierAnalytics` and the durable consumers' positions,
rendered as Prometheus families at scrape time (the service is analytics.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.consumers.analytics_model import TIER_NAMES, TierAnalytics


@dataclass
class ConsumerStats:
    pending: int = 0
    ack_pending: int = 0
    counted: int = 0
    rebuilt: int = 0
    last_time: float = 0.0


class AnalyticsCollector:
    """Renders a `TierAnalytics` (and the consumers' positions) at scrape time."""

    def __init__(self, analytics: TierAnalytics, consumers: dict[str, ConsumerStats] | None = None,
                 rebuilding=lambda: False, clock=time.time):
        self.a = analytics
        self.consumers = consumers or {}
        self.rebuilding = rebuilding
        self.clock = clock

    def collect(self):
        # Each step imports prometheus_client when scraped, not this module: `kvtier report`
        # loads this module (through analytics.py's MessageFeeder) and never scrapes.
        yield from self._worker_pages()
        yield from self._page_transitions()
        yield from self._routing_decisions()
        yield from self._memory()
        yield from self._consumer_positions()

    def _worker_pages(self):
        """Resident pages per worker and tier, and workers by lease state."""
        from prometheus_client.core import GaugeMetricFamily

        a = self.a
        resident = GaugeMetricFamily("kvtier_analytics_resident_pages",
                                     "Pages a worker holds on a tier now, from its events",
                                     labels=["model", "worker", "tier"])
        workers = GaugeMetricFamily("kvtier_analytics_workers",
                                    "Workers seen, by lease state (live: announced and not expired; expired; unleased: "
                                    "events but no announcement)", labels=["model", "state"])
        states: dict[tuple[str, str], int] = {}
        for w in a.workers.values():
            state = "unleased" if w.lease_until is None else "expired" if w.expired else "live"
            states[(w.model, state)] = states.get((w.model, state), 0) + 1
            if w.expired and not w.pages():
                continue
            for i, pages in enumerate(w.tiers):
                resident.add_metric([w.model, w.worker, TIER_NAMES[i]], len(pages))
        for (model, state), n in sorted(states.items()):
            workers.add_metric([model, state], n)
        yield resident
        yield workers

    def _page_transitions(self):
        """What the events did: transitions, no-ops, batches, epochs and page lifetimes."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        a = self.a
        transitions = CounterMetricFamily(
            "kvtier_analytics_transitions", "Page transitions by kind (stored, removed, copy, promotion, demotion, "
            "eviction, cleared, new_epoch, gap, lease_expired); tier: where the page landed (stored, copy, promotion, "
            "demotion) or which tier it left", labels=["model", "worker", "kind", "tier"])
        for key, n in sorted(a.transitions.items()):
            transitions.add_metric(list(key), n)
        yield transitions
        noops = CounterMetricFamily("kvtier_analytics_noop_events",
                                    "Page events that changed nothing (store of a page already there, remove of one "
                                    "not there)", labels=["model", "worker", "kind"])
        for key, n in sorted(a.noops.items()):
            noops.add_metric(list(key), n)
        yield noops
        batches = CounterMetricFamily("kvtier_analytics_batches", "Event batches by outcome (applied, duplicate, "
                                      "old_epoch)", labels=["model", "outcome"])
        for key, n in sorted(a.batches.items()):
            batches.add_metric(list(key), n)
        yield batches
        epochs = CounterMetricFamily("kvtier_analytics_epochs", "Epochs begun, by the bridge's reason",
                                     labels=["model", "worker", "reason"])
        for key, n in sorted(a.epochs.items()):
            epochs.add_metric(list(key), n)
        yield epochs
        lifetimes = HistogramMetricFamily("kvtier_analytics_page_lifetime_seconds",
                                          "Time a page stayed on a tier, store to remove (engine timestamps)",
                                          labels=["model", "tier"])
        for (model, tier), hist in sorted(a.lifetimes.items()):
            lifetimes.add_metric([model, tier], hist.cumulative(), hist.sum)
        yield lifetimes

    def _routing_decisions(self):
        """What the decisions said: chosen workers, predicted hits, request tokens, the shared pool."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        a = self.a
        decisions = CounterMetricFamily("kvtier_analytics_decisions", "Routing decisions by chosen worker",
                                        labels=["model", "worker"])
        for key, n in sorted(a.decisions.items()):
            decisions.add_metric(list(key), n)
        yield decisions
        hits = CounterMetricFamily("kvtier_analytics_predicted_hit_tokens",
                                   "Tokens of routed requests the chosen worker was predicted to hit, by tier "
                                   "(device/host/disk: the walk; shared_beyond: shared-pool pages beyond its device "
                                   "prefix)", labels=["model", "worker", "tier"])
        for key, n in sorted(a.hit_tokens.items()):
            hits.add_metric(list(key), n)
        yield hits
        request_tokens = CounterMetricFamily("kvtier_analytics_request_tokens",
                                             "Tokens (full pages) of routed requests", labels=["model"])
        for model, n in sorted(a.request_tokens.items()):
            request_tokens.add_metric([model], n)
        yield request_tokens
        degraded = CounterMetricFamily("kvtier_analytics_degraded_decisions",
                                       "Decisions made without an input, by what was missing",
                                       labels=["model", "reason"])
        for key, n in sorted(a.degraded.items()):
            degraded.add_metric(list(key), n)
        yield degraded
        shared_decisions = CounterMetricFamily("kvtier_analytics_shared_pool_decisions",
                                               "Decisions that queried the shared pool", labels=["model"])
        rate = GaugeMetricFamily("kvtier_analytics_shared_pool_hit_rate",
                                 "Shared-pool pages beyond the chosen worker's device prefix / request pages, over "
                                 "decisions that queried the pool (since start)", labels=["model"])
        for model, n in sorted(a.shared_queried.items()):
            shared_decisions.add_metric([model], n)
            value = a.shared_pool_hit_rate(model)
            if value is not None:
                rate.add_metric([model], value)
        yield shared_decisions
        yield rate
        per_decision = HistogramMetricFamily("kvtier_analytics_shared_pool_decision_hit_rate",
                                             "Per decision: shared-pool pages beyond the device prefix / request pages",
                                             labels=["model"])
        for model, hist in sorted(a.shared_hit_rate.items()):
            per_decision.add_metric([model], hist.cumulative(), hist.sum)
        yield per_decision

    def _memory(self):
        """What the model holds in memory, and pages waiting out the write-back window."""
        from prometheus_client.core import GaugeMetricFamily

        a = self.a
        memory = GaugeMetricFamily("kvtier_analytics_tracked_page_tiers",
                                   "(page, tier) entries held in memory (~110-150 bytes each)")
        memory.add_metric([], a.tracked_page_tiers())
        yield memory
        limbo = GaugeMetricFamily("kvtier_analytics_writeback_pending_pages",
                                  "Pages removed from their last tier, waiting out the write-back window")
        limbo.add_metric([], a.limbo_pages())
        yield limbo

    def _consumer_positions(self):
        """Where the durable consumers stand, what was done with their messages, and the rebuild."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        a = self.a
        pending = GaugeMetricFamily("kvtier_analytics_consumer_pending",
                                    "Messages not yet delivered to this analytics' durable consumer", labels=["stream"])
        ack_pending = GaugeMetricFamily("kvtier_analytics_consumer_ack_pending",
                                        "Messages delivered, not yet acked", labels=["stream"])
        lag = GaugeMetricFamily("kvtier_analytics_consumer_lag_seconds",
                                "Age of the last counted message while messages are pending (0: caught up)",
                                labels=["stream"])
        messages = CounterMetricFamily("kvtier_analytics_messages", "Stream messages by what was done with them "
                                       "(counted; rebuilt: re-read at start to rebuild state; undecodable)",
                                       labels=["stream", "outcome"])
        now = self.clock()
        for stream, stats in sorted(self.consumers.items()):
            pending.add_metric([stream], stats.pending)
            ack_pending.add_metric([stream], stats.ack_pending)
            behind = stats.pending > 0 and stats.last_time > 0
            lag.add_metric([stream], max(0.0, now - stats.last_time) if behind else 0.0)
            messages.add_metric([stream, "counted"], stats.counted)
            messages.add_metric([stream, "rebuilt"], stats.rebuilt)
            messages.add_metric([stream, "undecodable"], a.undecodable.get(stream, 0))
        yield pending
        yield ack_pending
        yield lag
        yield messages
        rebuilding = GaugeMetricFamily("kvtier_analytics_rebuilding",
                                       "1 while the tier state is being rebuilt from the stream at start")
        rebuilding.add_metric([], 1 if self.rebuilding() else 0)
        yield rebuilding
