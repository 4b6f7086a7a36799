"""What one `kvtier processor` is told: `ProcessorConfig`, each setting declared once with its
flag (kvtier/plumbing/settings.py), so `kvtier processor`'s flags and docs/DEPLOY.md's table
come from here. Kept apart from processor.py so building the parser imports no Redis client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.consumers.hash_check import DEFAULT_BUDGET_PAGES_PER_S
from kvtier.plumbing.settings import (
    group,
    non_negative_float,
    on_off,
    partition_list,
    positive_float,
    positive_int,
    required,
    setting,
)
from kvtier.plumbing.stream_flags import StreamFlags
from kvtier.plumbing.streams import StreamSettings
from kvtier.schemas.changes import DEFAULT_CHANGES_MAXLEN


@dataclass(kw_only=True)
class ProcessorConfig:
    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    redis_url: str = required(flag="--redis", dest="redis", help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    #: None: all partitions of the stream; "auto": a fair share claimed through Redis leases.
    partitions: list[int] | Literal["auto"] | None = setting(
        None, flag="--partitions", parse=partition_list,
        help="Partitions this processor consumes: 'all' (default), a list like 0-3,6, or 'auto' (claim a fair "
             "share through Redis leases and take over those of a processor that dies).")
    durable_prefix: str = setting(
        "kvtier-processor", flag="--durable-prefix",
        help="Durable consumer name prefix; partition k uses <prefix>-p<k>.")
    fetch_batch: int = setting(256, flag="--fetch-batch", parse=positive_int,
                               help="Messages fetched (and pipelined) at once.")
    gap_timeout_s: float = setting(
        10.0, flag="--gap-timeout", parse=positive_float,
        help="Seconds to wait for a missing batch before the worker is cleared, marked stale and asked to resync.")
    #: A gap held back this long is taken for deliveries lost with a pull: the partition's
    #: consumer is rewound to its ack floor (once per gap), well within the gap timeout.
    lost_delivery_s: float = setting(
        1.0, flag="--lost-delivery-after", parse=positive_float,
        help="A gap held back this long is taken for deliveries lost with a pull: the partition's consumer is "
             "rewound to its ack floor (once per gap), so they come back before --gap-timeout.")
    ack_wait_s: float = setting(
        30.0, flag="--ack-wait", parse=positive_float,
        help="JetStream ack wait of the consumers (redelivery delay of unacked messages).")
    reap_interval_s: float = setting(1.0, flag="--reap-interval", parse=positive_float,
                                     help="Seconds between lease-expiry sweeps.")
    partition_lease_s: float = setting(
        5.0, flag="--partition-lease", parse=positive_float,
        help="With --partitions auto: seconds a partition's lease lasts unrenewed (a dead processor's partitions "
             "are taken over after it).")
    #: A worker gone (no lease) longer than this is forgotten: every key it left is removed.
    worker_retention_s: float = setting(
        3600.0, flag="--worker-retention", parse=positive_float,
        help="Seconds a dead worker's leftovers (meta, state, set members) are kept before it is forgotten.")
    #: Recompute SGLang's page hash of stored pages from their tokens (schemas/health.py).
    hash_check: bool = on_off(
        True, flag="--hash-check",
        help="Recompute SGLang's page hash of every stored page from its tokens and record mismatches per worker "
             "(kvt:{model}:hash_check, /metrics, the router's /healthz). 'off' saves the CPU when the engine's "
             "scheme is known to match.")
    #: At most this many pages recomputed per second (0: no limit).
    hash_check_budget: float = setting(
        DEFAULT_BUDGET_PAGES_PER_S, flag="--hash-check-budget", parse=non_negative_float,
        help="Pages the hash check recomputes per second at most (0: no limit); pages over it are counted as "
             "skipped, pages already verified (host copies, load_backs) are not recomputed.")
    changes_maxlen: int = setting(
        DEFAULT_CHANGES_MAXLEN, flag="--changes-maxlen", parse=positive_int,
        help="Entries each model's change feed (kvt:{model}:changes) keeps, at least: routers' in-memory indexes "
             "follow it, and one that falls further behind bootstraps again from the pages sets.")
    stream: StreamFlags = group(StreamFlags)
    resync_min_interval_s: float = 2.0
    #: A rebuild claimed by a processor that then went silent this long is taken over.
    rebuild_scan_timeout_s: float = 10.0
    #: A worker whose last message is older than this (when it announced no lease) counts as dead.
    default_lease_s: float = 10.0

    @property
    def auto_partitions(self) -> bool:
        """--partitions auto: claim a fair share of partitions through Redis leases."""
        return self.partitions == "auto"

    @property
    def listed_partitions(self) -> list[int] | None:
        """The partitions given by number; None: all of them, or a fair share (auto)."""
        return None if self.partitions == "auto" else self.partitions

    @property
    def streams(self) -> StreamSettings:
        return self.stream.settings()

    @property
    def partitions_explicit(self) -> bool:
        return self.stream.partitions_explicit
