"""`kvtier processor`'s metrics, on the default registry its --metrics-port serves.

All of them are here, in one module below processor.py, recovery.py and expiry.py, so each of
those can count what it does without importing another.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

APPLIED_BATCHES = Counter("kvtier_processor_applied_batches_total", "Batches applied to Redis")
APPLIED_TRANSITIONS = Counter("kvtier_processor_applied_transitions_total", "Page tier transitions applied")
SKIPPED = Counter("kvtier_processor_skipped_batches_total", "Batches skipped", ["reason"])
GAPS = Counter("kvtier_processor_gaps_total", "Seq gaps seen", ["outcome"])
DEAD_LETTERS = Counter("kvtier_processor_dead_letters_total", "Messages dead-lettered", ["reason"])
ANNOUNCES = Counter("kvtier_processor_announces_total", "Worker announcements (lease heartbeats) applied")
EXPIRED = Counter("kvtier_processor_expired_workers_total", "Workers cleared after their lease expired")
RESYNCS = Counter("kvtier_processor_resync_requests_total", "Resync requests sent to bridges")
FORGOTTEN = Counter("kvtier_processor_forgotten_workers_total",
                    "Dead workers removed for good once gone longer than --worker-retention")
STALE_WORKERS = Gauge("kvtier_processor_stale_workers", "Workers whose state is marked stale")
PARTIAL_WORKERS = Gauge("kvtier_processor_partial_workers",
                        "Workers whose state began after their engine's first batch (routed to, but missing what "
                        "the engine held before)")
PENDING = Gauge("kvtier_processor_consumer_pending", "Messages not yet delivered", ["partition"])
HASH_PAGES = Counter("kvtier_processor_hash_checked_pages_total",
                     "Stored pages whose hash was recomputed from their tokens, by outcome", ["outcome"])
HASH_MISMATCHES = Counter("kvtier_processor_hash_mismatch_pages_total",
                          "Stored pages whose published hash is not SGLang's chain over their tokens",
                          ["model", "worker", "kind"])
REBUILDS = Counter("kvtier_processor_state_rebuilds_total",
                   "Models whose tier state was rebuilt from the stream after its incarnation marker went "
                   "missing; reason lost (acked batches had to be re-applied) or new (nothing was lost)", ["reason"])
REBUILDING = Gauge("kvtier_processor_rebuilding_models", "Models whose state is being rebuilt from the stream")
LAG = Histogram("kvtier_processor_event_lag_seconds", "Engine emit -> visible in Redis",
                buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
