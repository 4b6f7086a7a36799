"""The bridge's Prometheus metrics, one set per process, labelled by worker."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

BATCHES = Counter("kvtier_bridge_engine_batches_total", "Engine batches received", ["worker", "outcome"])
PUBLISHED = Counter("kvtier_bridge_published_messages_total", "kvtier batches published to JetStream", ["worker"])
EVENTS = Counter("kvtier_bridge_events_total", "Tier events forwarded", ["worker"])
GAPS = Counter("kvtier_bridge_gaps_total", "Engine seq gaps", ["worker", "recovered"])
CATCH_UPS = Counter("kvtier_bridge_catch_ups_total",
                    "Quiet spells after which the replay socket held batches the live path never brought", ["worker"])
EPOCHS = Counter("kvtier_bridge_epochs_total", "New epochs begun", ["worker", "reason"])
DEAD_LETTERS = Counter("kvtier_bridge_dead_letters_total", "Engine input dead-lettered", ["worker"])
PUBLISH_RETRIES = Counter("kvtier_bridge_publish_retries_total", "JetStream publish retries", ["worker"])
DUPLICATES = Counter("kvtier_bridge_duplicate_publishes_total",
                     "Batches the stream dropped as duplicates of a message this bridge did not send", ["worker"])
LAST_SEQ = Gauge("kvtier_bridge_last_engine_seq", "Last engine seq forwarded", ["worker"])
