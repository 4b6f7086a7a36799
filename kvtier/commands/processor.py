"""`kvtier processor`: tier events from JetStream applied to Redis (consumers/processor.py)."""

from __future__ import annotations

from kvtier.commands.flags import (
    add_common,
    add_stream_flags,
    non_negative_float,
    partition_list,
    positive_float,
    positive_int,
    run_until_signal,
    stream_settings,
)


def register(sub) -> None:
    p = sub.add_parser("processor", help="Apply tier events from JetStream to Redis, in order, exactly once.",
                       description="Durable JetStream consumer that keeps each worker's pages per tier in Redis. Run "
                                   "several with disjoint --partitions to share the work; a worker's events always "
                                   "belong to one partition, so they stay in order.")
    p.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    p.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    p.add_argument("--partitions", type=partition_list, default=None,
                   help="Partitions this processor consumes: 'all' (default), a list like 0-3,6, or 'auto' (claim a "
                        "fair share through Redis leases and take over those of a processor that dies).")
    p.add_argument("--durable-prefix", default="kvtier-processor",
                   help="Durable consumer name prefix; partition k uses <prefix>-p<k>.")
    p.add_argument("--fetch-batch", type=positive_int, default=256, help="Messages fetched (and pipelined) at once.")
    p.add_argument("--gap-timeout", type=positive_float, default=10.0, dest="gap_timeout_s",
                   help="Seconds to wait for a missing batch before the worker is cleared, marked stale and asked "
                        "to resync.")
    p.add_argument("--lost-delivery-after", type=positive_float, default=1.0, dest="lost_delivery_s",
                   help="A gap held back this long is taken for deliveries lost with a pull: the partition's consumer "
                        "is rewound to its ack floor (once per gap), so they come back before --gap-timeout.")
    p.add_argument("--ack-wait", type=positive_float, default=30.0, dest="ack_wait_s",
                   help="JetStream ack wait of the consumers (redelivery delay of unacked messages).")
    p.add_argument("--reap-interval", type=positive_float, default=1.0, dest="reap_interval_s",
                   help="Seconds between lease-expiry sweeps.")
    p.add_argument("--partition-lease", type=positive_float, default=5.0, dest="partition_lease_s",
                   help="With --partitions auto: seconds a partition's lease lasts unrenewed (a dead processor's "
                        "partitions are taken over after it).")
    p.add_argument("--worker-retention", type=positive_float, default=3600.0, dest="worker_retention_s",
                   help="Seconds a dead worker's leftovers (meta, state, set members) are kept before it is forgotten.")
    p.add_argument("--hash-check", choices=["on", "off"], default="on",
                   help="Recompute SGLang's page hash of every stored page from its tokens and record mismatches per "
                        "worker (kvt:{model}:hash_check, /metrics, the router's /healthz). 'off' saves the CPU "
                        "when the engine's scheme is known to match.")
    p.add_argument("--hash-check-budget", type=non_negative_float, default=50_000.0,
                   help="Pages the hash check recomputes per second at most (0: no limit); pages over it are "
                        "counted as skipped, pages already verified (host copies, load_backs) are not recomputed.")
    p.add_argument("--changes-maxlen", type=positive_int, default=50_000,
                   help="Entries each model's change feed (kvt:{model}:changes) keeps, at least: routers' in-memory "
                        "indexes follow it, and one that falls further behind bootstraps again from the pages sets.")
    add_stream_flags(p)
    add_common(p)
    p.set_defaults(run=run)


def run(args) -> None:
    from kvtier.consumers.processor import Processor, ProcessorConfig

    streams, explicit = stream_settings(args)
    config = ProcessorConfig(
        nats_url=args.nats, redis_url=args.redis,
        partitions=None if args.partitions == "auto" else args.partitions,
        auto_partitions=args.partitions == "auto",
        durable_prefix=args.durable_prefix, fetch_batch=args.fetch_batch, gap_timeout_s=args.gap_timeout_s,
        lost_delivery_s=args.lost_delivery_s,
        worker_retention_s=args.worker_retention_s, partition_lease_s=args.partition_lease_s,
        ack_wait_s=args.ack_wait_s, reap_interval_s=args.reap_interval_s, streams=streams,
        partitions_explicit=explicit, hash_check=args.hash_check == "on",
        hash_check_budget=args.hash_check_budget, changes_maxlen=args.changes_maxlen,
    )
    run_until_signal(lambda stop: Processor(config).run(stop))
