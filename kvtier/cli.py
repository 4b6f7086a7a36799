"""The `kvtier` command. Every flag can also be set by an environment variable
KVTIER_<FLAG> (e.g. --nats -> KVTIER_NATS, --page-size -> KVTIER_PAGE_SIZE); a flag on the
command line wins over the environment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from kvtier.streams import DEFAULT_PARTITIONS, StreamSettings


def _env_name(flag: str) -> str:
    return "KVTIER_" + flag.lstrip("-").upper().replace("-", "_")


class _EnvDefaults(argparse.ArgumentParser):
    """ArgumentParser whose options take their default from KVTIER_<FLAG>."""

    def add_argument(self, *names, **kwargs):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag and flag != "--help":
            env = _env_name(flag)
            kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
            if env in os.environ:
                raw = os.environ[env]
                if kwargs.get("action") == "store_true":
                    kwargs["default"] = raw.lower() in ("1", "true", "yes", "on")
                else:
                    kwargs["default"] = kwargs["type"](raw) if "type" in kwargs else raw
                kwargs["required"] = False
        return super().add_argument(*names, **kwargs)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _worker_id(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_\-]{1,128}", text):
        raise argparse.ArgumentTypeError(
            f"worker id {text!r} must be 1-128 characters of letters, digits, '_' or '-' "
            "(it becomes a NATS subject token and part of Redis keys)")
    return text


def _default_trace() -> str:
    """The full public trace where this checkout sits beside it, else the sample shipped here."""
    import pathlib

    shared = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_conversation_trace.jsonl"
    if shared.exists():
        return str(shared)
    return str(pathlib.Path(__file__).resolve().parent / "data" / "mooncake_trace_sample.jsonl")


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _partition_list(text: str) -> list[int] | str | None:
    if text in ("", "all"):
        return None
    if text == "auto":
        return "auto"
    parts: list[int] = []
    for piece in text.split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            parts.extend(range(int(lo), int(hi) + 1))
        else:
            parts.append(int(piece))
    if any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError("partitions are non-negative integers")
    return sorted(set(parts))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Log verbosity.")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off).")
    p.add_argument("--metrics-host", default="127.0.0.1", help="Address the metrics server binds to.")


def _add_stream_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-partitions", type=_positive_int, default=None,
                   help=f"Partitions of the events stream when this process creates it (default "
                        f"{DEFAULT_PARTITIONS}). If the stream exists with another count, giving this flag is an error.")
    p.add_argument("--stream-max-age", type=_positive_float, default=24 * 3600.0,
                   help="Keep events this many seconds in the stream (replay window), when creating it.")
    p.add_argument("--stream-max-bytes", type=int, default=-1,
                   help="Cap the stream's size in bytes, oldest dropped first (-1: no cap), when creating it.")
    p.add_argument("--stream-replicas", type=_positive_int, default=1,
                   help="JetStream replicas of the streams (1 for a single server, 3 for a cluster).")


def _stream_settings(args) -> tuple[StreamSettings, bool]:
    return StreamSettings(
        partitions=args.stream_partitions or DEFAULT_PARTITIONS, max_age_s=args.stream_max_age,
        max_bytes=args.stream_max_bytes, replicas=args.stream_replicas,
    ), args.stream_partitions is not None


def build_parser() -> argparse.ArgumentParser:
    parser = _EnvDefaults(prog="kvtier", description="Tier-aware KV-cache routing for SGLang HiCache clusters.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_EnvDefaults)

    b = sub.add_parser("bridge", help="Forward one SGLang worker's ZMQ KV events to NATS JetStream.",
                       description="Subscribe to an SGLang worker's KV events (--kv-events-config publisher zmq) and "
                                   "publish them, in order and gap-free, to JetStream subject "
                                   "kvtier.events.<model>.<worker>. Recovers missed batches from the engine's replay "
                                   "socket and announces the worker (metadata + lease) every heartbeat.")
    b.add_argument("--endpoint", required=True,
                   help="The worker's ZMQ PUB endpoint to connect to, e.g. tcp://10.0.0.5:5557 (the 'endpoint' of "
                        "--kv-events-config with '*' replaced by the worker's address). DP rank r uses port + r.")
    b.add_argument("--replay-endpoint", default="",
                   help="The worker's ZMQ replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558. Without it a gap or a "
                        "bridge restart cannot be recovered and starts a new epoch (the worker's state is rebuilt).")
    b.add_argument("--topic", default="", help="ZMQ topic to subscribe to ('' = all, SGLang's default).")
    b.add_argument("--worker-id", required=True, type=_worker_id,
                   help="Stable id of this worker (letters, digits, '_', '-'); routers return it. With --dp-size N>1 "
                        "rank r becomes <worker-id>-dp<r>.")
    b.add_argument("--model", required=True, help="Served model name, as clients send it to the router.")
    b.add_argument("--page-size", required=True, type=_positive_int,
                   help="SGLang --page-size of the worker (tokens per KV page).")
    b.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    b.add_argument("--dp-size", type=_positive_int, default=1,
                   help="Attention data-parallel ranks of the worker; each rank publishes on endpoint port + rank.")
    b.add_argument("--tp-size", type=_positive_int, default=1, help="Tensor-parallel size (Mooncake key layout).")
    b.add_argument("--pp-size", type=_positive_int, default=1, help="Pipeline-parallel size (Mooncake key layout).")
    b.add_argument("--mooncake-attention", choices=["mha", "mla"], default="mha",
                   help="Attention kind, which decides the Mooncake key layout of a page (mha: _k/_v per TP rank; "
                        "mla: one __k key).")
    b.add_argument("--mooncake-key-prefix", default="", help="Prefix SGLang puts before Mooncake keys, if any.")
    b.add_argument("--hicache-storage-backend", choices=["none", "mooncake"], default="none",
                   help="The worker's SGLang --hicache-storage-backend; with mooncake its key layout is announced "
                        "and routers credit it for pages in the shared pool.")
    b.add_argument("--worker-url", default="", dest="http_endpoint",
                   help="The engine's HTTP base URL (e.g. http://10.0.0.5:30000), for a router in --proxy mode.")
    b.add_argument("--heartbeat", type=_positive_float, default=2.0, dest="heartbeat_s",
                   help="Seconds between announcements (metadata + lease renewal).")
    b.add_argument("--lease-ttl", type=_positive_float, default=10.0, dest="lease_ttl_s",
                   help="Seconds a worker stays live without a heartbeat; then its pages are removed.")
    b.add_argument("--max-batches-per-message", type=_positive_int, default=512,
                   help="Engine batches a burst may merge into one NATS message.")
    b.add_argument("--max-pages-per-message", type=_positive_int, default=16384,
                   help="Page transitions per NATS message before it is split (keeps messages under 1 MB).")
    b.add_argument("--drop-token-ids", action="store_true",
                   help="Do not forward token ids of stored pages (smaller messages; disables hash validation).")
    _add_stream_flags(b)
    _add_common(b)

    p = sub.add_parser("processor", help="Apply tier events from JetStream to Redis, in order, exactly once.",
                       description="Durable JetStream consumer that keeps each worker's pages per tier in Redis. Run "
                                   "several with disjoint --partitions to share the work; a worker's events always "
                                   "belong to one partition, so they stay in order.")
    p.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    p.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    p.add_argument("--partitions", type=_partition_list, default=None,
                   help="Partitions this processor consumes: 'all' (default), a list like 0-3,6, or 'auto' (claim a "
                        "fair share through Redis leases and take over those of a processor that dies).")
    p.add_argument("--durable-prefix", default="kvtier-processor",
                   help="Durable consumer name prefix; partition k uses <prefix>-p<k>.")
    p.add_argument("--fetch-batch", type=_positive_int, default=256, help="Messages fetched (and pipelined) at once.")
    p.add_argument("--gap-timeout", type=_positive_float, default=10.0, dest="gap_timeout_s",
                   help="Seconds to wait for a missing batch before the worker is cleared, marked stale and asked "
                        "to resync.")
    p.add_argument("--ack-wait", type=_positive_float, default=30.0, dest="ack_wait_s",
                   help="JetStream ack wait of the consumers (redelivery delay of unacked messages).")
    p.add_argument("--reap-interval", type=_positive_float, default=1.0, dest="reap_interval_s",
                   help="Seconds between lease-expiry sweeps.")
    _add_stream_flags(p)
    _add_common(p)

    r = sub.add_parser("router", help="Serve tier-aware routing decisions over HTTP (a stateless replica).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--redis", required=True, help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    r.add_argument("--nats", default="", help="NATS URL for the decision log (kvtier.decisions.<model>); '' = off.")
    r.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds to.")
    r.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one, printed at start).")
    r.add_argument("--router-mode", choices=["kv", "load"], default="kv",
                   help="kv: tier-aware scoring; load: booked load only (cache weights 0).")
    r.add_argument("--shared-cache-type", choices=["none", "hicache"], default="none",
                   help="hicache: credit pages workers can fetch from the shared Mooncake pool.")
    r.add_argument("--mooncake-master", default="",
                   help="The Mooncake master's HTTP address (its metrics port, serving /batch_query_keys).")
    r.add_argument("--shared-cache-multiplier", type=_non_negative_float, default=0.5,
                   help="Credit per shared-pool page beyond the device prefix (0: query but ignore).")
    r.add_argument("--shared-cache-timeout-ms", type=_positive_float, default=50.0,
                   help="Budget for the shared-pool query; past it the decision scores without it.")
    r.add_argument("--overlap-score-credit", type=_non_negative_float, default=1.0, help="Credit per device page.")
    r.add_argument("--host-cache-hit-weight", type=_non_negative_float, default=0.75, help="Credit per host page.")
    r.add_argument("--disk-cache-hit-weight", type=_non_negative_float, default=0.25, help="Credit per disk page.")
    r.add_argument("--prefill-load-scale", type=_non_negative_float, default=1.0,
                   help="Weight of the (adjusted) prefill pages against decode pages.")
    r.add_argument("--temperature", type=_non_negative_float, default=0.0,
                   help="0: best score, ties at random; >0: softmax sampling over normalised scores.")
    r.add_argument("--page-size", type=_positive_int, default=None,
                   help="Expected worker page size; workers announcing another get no shared-pool credit "
                        "(default: trust each worker's announced size).")
    r.add_argument("--booking-ttl", type=_positive_float, default=600.0, dest="booking_ttl_s",
                   help="Seconds a booking holds load if never released (a router died mid-request).")
    r.add_argument("--state-timeout-ms", type=_positive_float, default=250.0,
                   help="Redis call budget; past it the decision routes by load/round robin.")
    r.add_argument("--max-request-tokens", type=_positive_int, default=1 << 20,
                   help="Longest token_ids accepted (longer: 413).")
    r.add_argument("--max-body-bytes", type=_positive_int, default=32 << 20, help="Largest request body (413).")
    r.add_argument("--proxy", action="store_true",
                   help="Also serve SGLang's /generate: route, forward to the worker, stream the answer back.")
    r.add_argument("--model", default="", help="Model of proxied requests that name none.")
    r.add_argument("--router-id", default="", help="Name in the decision log (default: random).")
    _add_common(r)

    w = sub.add_parser("sim-worker", help="Simulated SGLang HiCache workers speaking SGLang's KV-event wire format.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("--ranks", type=_positive_int, default=1,
                   help="Simulated workers (DP ranks); rank r publishes on --port + r (bridge: --dp-size).")
    w.add_argument("--port", type=int, required=True, help="ZMQ PUB port of rank 0.")
    w.add_argument("--replay-port", type=int, required=True, help="ZMQ replay ROUTER port of rank 0.")
    w.add_argument("--http-port", type=int, default=0, help="HTTP port for requests (0: a free one, printed).")
    w.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    w.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per KV page.")
    w.add_argument("--device-pages", type=_positive_int, default=4096, help="GPU KV pool, in pages.")
    w.add_argument("--host-pages", type=int, default=None,
                   help="Host (L2) pool in pages; default --hicache-ratio x device pages; 0 = no HiCache.")
    w.add_argument("--hicache-ratio", type=_non_negative_float, default=2.0, help="Host pool / device pool.")
    w.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through", help="HiCache write policy (SGLang's --hicache-write-policy).")
    w.add_argument("--dma-delay-ms", type=_non_negative_float, default=2.0,
                   help="Simulated device->host copy time before the host store event.")
    w.add_argument("--prefill-us-per-token", type=_non_negative_float, default=25.0,
                   help="Cost model: prefill compute per recomputed token.")
    w.add_argument("--l3", action="store_true", help="Write pages to a shared L3 pool and prefetch from it.")
    w.add_argument("--l3-pages", type=_positive_int, default=None, help="L3 pool capacity in pages (default: unbounded).")
    w.add_argument("--mooncake-rpc", default="",
                   help="With --l3: a real Mooncake master's RPC address (host:port) to write and find pages in.")
    w.add_argument("--mooncake-metadata", default="",
                   help="With --mooncake-rpc: the master's HTTP metadata URL (http://host:port/metadata).")
    _add_common(w)

    s = sub.add_parser("servers", help="Run embedded nats-server (JetStream) and Redis-protocol servers.",
                       description="Start nats-server with JetStream and a Redis-protocol server on loopback, print "
                                   "their URLs, and stop both on Ctrl-C/SIGTERM.")
    s.add_argument("--nats-port", type=int, default=0, help="NATS port (0: a free one).")
    s.add_argument("--redis-port", type=int, default=0, help="Redis port (0: a free one).")
    _add_common(s)

    i = sub.add_parser("inspect", help="Show each worker's tier state in Redis: pages per tier, epoch, seq, lease.",
                       description="Read what the processors keep in Redis: per worker, pages on each tier, the applied "
                                   "(epoch, seq), how long ago it was applied, its lease, and whether it is stale.")
    i.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    i.add_argument("--model", default=None, help="Only this model (default: every model).")
    i.add_argument("--worker", default=None, help="Only this worker.")
    i.add_argument("--json", action="store_true", help="Print one JSON array instead of a table.")
    _add_common(i)

    d = sub.add_parser("demo", help="Replay a sample of the Mooncake conversation trace on a simulated HiCache "
                                    "cluster, once per routing policy, and compare them (embedded servers).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--requests", type=_positive_int, default=1000, help="Requests of the sample trace to replay.")
    d.add_argument("--trace", default="", help="Another trace in the same format (default: the shipped sample).")
    d.add_argument("--workers", type=_positive_int, default=4, help="Simulated workers.")
    d.add_argument("--page-size", type=_positive_int, default=128, help="Tokens per KV page.")
    d.add_argument("--device-pages", type=_positive_int, default=512, help="GPU pool per worker, in pages.")
    d.add_argument("--host-pages", type=_positive_int, default=4096, help="Host pool per worker, in pages.")
    d.add_argument("--time-scale", type=_positive_float, default=20.0, help="Trace seconds per wall second.")
    d.add_argument("--out", default="kvtier-demo", help="Folder for report.json and policies.png.")
    d.add_argument("--seed", type=int, default=1)
    _add_common(d)

    bench = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_EnvDefaults)
    ingest = bench_sub.add_parser("ingest", help="Processor ingest: transitions/s NATS->Redis and event->visible lag.",
                                  description="Publishes pre-built kvtier batches to an embedded JetStream, runs one "
                                              "processor process, and measures block transitions applied per second "
                                              "end to end, then event->visible lag at half that rate.")
    ingest.add_argument("--transitions", type=_positive_int, default=2_000_000,
                        help="Transitions in the throughput phase.")
    ingest.add_argument("--workers", type=_positive_int, default=16, help="Simulated workers.")
    ingest.add_argument("--pages-per-event", type=_positive_int, default=16, help="Hashes per stored/removed event.")
    ingest.add_argument("--events-per-message", type=_positive_int, default=32,
                        help="Events per NATS message (the bridge's batching).")
    ingest.add_argument("--lag-seconds", type=_positive_float, default=10.0, help="Duration of the lag phase.")
    ingest.add_argument("--lag-rate", type=_positive_float, default=None,
                        help="Transitions/s in the lag phase (default: half the measured throughput).")
    ingest.add_argument("--no-token-ids", action="store_true",
                        help="Messages without token ids (as from `kvtier bridge --drop-token-ids`): ~4x smaller.")
    ingest.add_argument("--dynamo", action="store_true",
                        help="Also time Dynamo's RadixTree.apply_event on the device-tier events of the same messages "
                             "(needs: pip install -e '.[bench-dynamo]').")
    ingest.add_argument("--trace", action="store_true",
                        help="Also print lag p50/max per quarter second of the lag phase (to see bursts).")
    ingest.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(ingest)
    route = bench_sub.add_parser("route", help="Router decision latency and throughput (64 workers, 128-page "
                                               "requests), beside Dynamo's find_matches.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    route.add_argument("--workers", type=_positive_int, default=64, help="Live workers with tier state.")
    route.add_argument("--request-pages", type=_positive_int, default=128, help="Pages per request.")
    route.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per page.")
    route.add_argument("--conversations", type=_positive_int, default=256, help="Distinct 128-page prefixes.")
    route.add_argument("--conversations-per-worker", type=_positive_int, default=24,
                       help="Prefixes each worker caches (random device/host/disk split).")
    route.add_argument("--noise-pages", type=int, default=2000, help="Unrelated pages per worker and tier.")
    route.add_argument("--decisions", type=_positive_int, default=3000, help="Decisions per measurement.")
    route.add_argument("--concurrency", type=_positive_int, default=16, help="Concurrent in-process decisions.")
    route.add_argument("--http-concurrency", type=_positive_int, default=32, help="Concurrent HTTP clients.")
    route.add_argument("--shared-pool", action="store_true",
                       help="Also measure with a real Mooncake master (needs a private network namespace).")
    route.add_argument("--seed", type=int, default=1)
    route.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(route)
    rp = bench_sub.add_parser("replay", help="Replay a Mooncake-format trace on a simulated HiCache cluster, "
                                             "once per routing policy, through the real pipeline and router.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    rp.add_argument("--trace", default=_default_trace(), help="Trace file (Mooncake FAST'25 JSONL format).")
    rp.add_argument("--requests", type=_positive_int, default=None, help="Only the first N requests.")
    rp.add_argument("--workers", type=_positive_int, default=8, help="Simulated workers.")
    rp.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per KV page.")
    rp.add_argument("--device-pages", type=_positive_int, default=2048, help="GPU pool per worker, in pages.")
    rp.add_argument("--host-pages", type=_positive_int, default=16384, help="Host pool per worker, in pages.")
    rp.add_argument("--l3-pages", type=_positive_int, default=None,
                    help="Shared L3 pool, in pages (default: the workers' host pools together).")
    rp.add_argument("--no-l3", action="store_true", help="No shared L3 pool in the simulated cluster.")
    rp.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                    default="write_through")
    rp.add_argument("--time-scale", type=_positive_float, default=30.0,
                    help="Trace seconds per wall second (30: an hour of trace in two minutes).")
    rp.add_argument("--policies", default="", help="Comma-separated subset of: " + ", ".join(
        ["random", "round_robin", "least_load", "device_only", "tier_aware", "tier_aware_shared"]))
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(rp)
    return parser


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _setup(args) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    if args.command in ("bench", "demo"):
        # SIGTERM unwinds like Ctrl-C, so the embedded servers these start are stopped too.
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def _run_until_signal(main) -> None:
    """Run an async main(stop_event) until it returns or SIGTERM/SIGINT sets the event."""
    try:
        import uvloop  # type: ignore

        uvloop.install()
    except ImportError:
        pass

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


async def _run_router(args, stop) -> None:
    from kvtier.router.service import RouterConfig, ServiceSettings, run_router
    from kvtier.schemas.routing import ScoringWeights

    if args.shared_cache_type == "hicache" and not args.mooncake_master:
        raise SystemExit("kvtier router: --shared-cache-type hicache needs --mooncake-master http://HOST:PORT "
                         "(the master's HTTP port serving /batch_query_keys)")
    config = RouterConfig(
        redis_url=args.redis, nats_url=args.nats, host=args.host, http_port=args.http_port,
        router_mode=args.router_mode, shared_cache_type=args.shared_cache_type, mooncake_master=args.mooncake_master,
        shared_cache_timeout_s=args.shared_cache_timeout_ms / 1000, page_size=args.page_size,
        booking_ttl_s=args.booking_ttl_s, state_timeout_s=args.state_timeout_ms / 1000, router_id=args.router_id,
        weights=ScoringWeights(
            overlap_score_credit=args.overlap_score_credit, host_cache_hit_weight=args.host_cache_hit_weight,
            disk_cache_hit_weight=args.disk_cache_hit_weight, shared_cache_multiplier=args.shared_cache_multiplier,
            prefill_load_scale=args.prefill_load_scale, temperature=args.temperature),
        service=ServiceSettings(max_request_tokens=args.max_request_tokens, max_body_bytes=args.max_body_bytes,
                                proxy=args.proxy, default_model=args.model),
    )
    await run_router(config, stop, ready=lambda port: print(f"kvtier router listening on http://{args.host}:{port}",
                                                            flush=True))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup(args)
    try:
        if args.command == "bridge":
            from kvtier.producers.bridge import BridgeConfig, run_bridge

            streams, explicit = _stream_settings(args)
            config = BridgeConfig(
                endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
                worker_id=args.worker_id, model=args.model, page_size=args.page_size, nats_url=args.nats,
                dp_size=args.dp_size, tp_size=args.tp_size, pp_size=args.pp_size,
                mooncake_attention=args.mooncake_attention, mooncake_key_prefix=args.mooncake_key_prefix,
                hicache_storage_backend=args.hicache_storage_backend, http_endpoint=args.http_endpoint,
                heartbeat_s=args.heartbeat_s, lease_ttl_s=args.lease_ttl_s,
                max_batches_per_message=args.max_batches_per_message,
                max_pages_per_message=args.max_pages_per_message, keep_token_ids=not args.drop_token_ids,
                streams=streams, partitions_explicit=explicit,
            )
            _run_until_signal(lambda stop: run_bridge(config, stop))
        elif args.command == "processor":
            from kvtier.consumers.processor import Processor, ProcessorConfig

            streams, explicit = _stream_settings(args)
            config = ProcessorConfig(
                nats_url=args.nats, redis_url=args.redis,
                partitions=None if args.partitions == "auto" else args.partitions,
                auto_partitions=args.partitions == "auto",
                durable_prefix=args.durable_prefix, fetch_batch=args.fetch_batch, gap_timeout_s=args.gap_timeout_s,
                ack_wait_s=args.ack_wait_s, reap_interval_s=args.reap_interval_s, streams=streams,
                partitions_explicit=explicit,
            )
            _run_until_signal(lambda stop: Processor(config).run(stop))
        elif args.command == "router":
            _run_until_signal(lambda stop: _run_router(args, stop))
        elif args.command == "sim-worker":
            from kvtier.producers.hicache_sim import SimConfig
            from kvtier.producers.sim_worker import SimWorkerConfig, run_sim_worker

            host_pages = args.host_pages if args.host_pages is not None else int(args.device_pages * args.hicache_ratio)
            sim = SimConfig(page_size=args.page_size, device_pages=args.device_pages, host_pages=host_pages,
                            write_policy=args.write_policy, dma_delay_s=args.dma_delay_ms / 1000,
                            prefill_s_per_token=args.prefill_us_per_token / 1e6, l3=args.l3)
            if args.mooncake_rpc and not (args.l3 and args.mooncake_metadata):
                raise SystemExit("kvtier sim-worker: --mooncake-rpc needs --l3 and --mooncake-metadata")
            config = SimWorkerConfig(ranks=args.ranks, port=args.port, replay_port=args.replay_port,
                                     http_port=args.http_port, host=args.host, sim=sim, l3_pages=args.l3_pages,
                                     mooncake_rpc=args.mooncake_rpc, mooncake_metadata=args.mooncake_metadata)
            _run_until_signal(lambda stop: run_sim_worker(config, stop))
        elif args.command == "servers":
            from kvtier.embedded import NatsServer, RedisServer

            async def serve(stop):
                with NatsServer(port=args.nats_port) as nats_server, RedisServer(port=args.redis_port) as redis_server:
                    print(f"NATS  {nats_server.url}  (pid {nats_server.pid})")
                    print(f"Redis {redis_server.url}  (pid {redis_server.pid})", flush=True)
                    await stop.wait()

            _run_until_signal(serve)
        elif args.command == "inspect":
            from kvtier.inspect import run_inspect

            return run_inspect(args)
        elif args.command == "demo":
            from kvtier.demo import run_demo

            return run_demo(args)
        elif args.command == "bench" and args.bench == "replay":
            from kvtier.bench.replay import run_replay_bench

            return run_replay_bench(args)
        elif args.command == "bench" and args.bench == "route":
            from kvtier.bench.route import run_route_bench

            return run_route_bench(args)
        elif args.command == "bench" and args.bench == "ingest":
            from kvtier.bench.ingest import run_ingest_bench

            return run_ingest_bench(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI reports errors as one clear line
        from kvtier.errors import user_facing

        message = user_facing(exc)
        if message is None:
            raise
        print(f"kvtier {args.command}: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
