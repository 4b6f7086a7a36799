"""`kvtier bridge`: one SGLang worker's ZMQ KV events to NATS JetStream (producers/bridge.py)."""

from __future__ import annotations

from kvtier.commands.flags import (
    add_common,
    add_stream_flags,
    positive_float,
    positive_int,
    run_until_signal,
    stream_settings,
    worker_id_text,
)


def register(sub) -> None:
    b = sub.add_parser("bridge", help="Forward one SGLang worker's ZMQ KV events to NATS JetStream.",
                       description="Subscribe to an SGLang worker's KV events (--kv-events-config publisher zmq) and "
                                   "publish them, in order and gap-free, to JetStream subject "
                                   "kvtier.events.<model>.<worker>. Recovers missed batches from the engine's replay "
                                   "socket and announces the worker (metadata + lease) every heartbeat while its "
                                   "engine answers its health endpoint.")
    b.add_argument("--sglang-url", default="",
                   help="The SGLang server's HTTP address (e.g. http://10.0.0.5:30000). At start the bridge reads its "
                        "/server_info and /get_hicache_l3_cache_layout and takes the endpoints, page size, DP/TP/PP "
                        "sizes, model and Mooncake layout from them; a flag that disagrees with the server is an "
                        "error.")
    b.add_argument("--sglang-timeout", type=positive_float, default=5.0,
                   help="Seconds to wait for each of SGLang's replies at start (--sglang-url).")
    b.add_argument("--sglang-api-key", default="",
                   help="SGLang's --api-key, sent as a bearer token to /server_info (--sglang-url), if it has one.")
    b.add_argument("--endpoint", default=None,
                   help="The worker's ZMQ PUB endpoint to connect to, e.g. tcp://10.0.0.5:5557 (the 'endpoint' of "
                        "--kv-events-config with '*' replaced by the worker's address). DP rank r uses port + r. "
                        "Required unless --sglang-url is given.")
    b.add_argument("--replay-endpoint", default=None,
                   help="The worker's ZMQ replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558. Without it a gap or a "
                        "bridge restart cannot be recovered and starts a new epoch (the worker's state is rebuilt). "
                        "Discovered with --sglang-url when SGLang has one.")
    b.add_argument("--topic", default=None, help="ZMQ topic to subscribe to ('' = all, SGLang's default).")
    b.add_argument("--worker-id", required=True, type=worker_id_text,
                   help="Stable id of this worker (letters, digits, '_', '-'); routers return it. With --dp-size N>1 "
                        "rank r becomes <worker-id>-dp<r>.")
    b.add_argument("--model", default=None,
                   help="Served model name, as clients send it to the router. Required unless --sglang-url is given "
                        "(then SGLang's served_model_name).")
    b.add_argument("--page-size", default=None, type=positive_int,
                   help="SGLang --page-size of the worker (tokens per KV page). Required unless --sglang-url is given.")
    b.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    b.add_argument("--dp-size", type=positive_int, default=None,
                   help="Attention data-parallel ranks of the worker; each rank publishes on endpoint port + rank "
                        "(default 1).")
    b.add_argument("--tp-size", type=positive_int, default=None,
                   help="Tensor-parallel size (Mooncake key layout; default 1).")
    b.add_argument("--pp-size", type=positive_int, default=None,
                   help="Pipeline-parallel size (Mooncake key layout; default 1).")
    b.add_argument("--mooncake-attention", choices=["mha", "mla"], default=None,
                   help="Attention kind, which decides the Mooncake key layout of a page (mha, the default: _k/_v per "
                        "TP rank; mla: one __k key).")
    b.add_argument("--mooncake-key-prefix", default=None, help="Prefix SGLang puts before Mooncake keys, if any.")
    b.add_argument("--hicache-storage-backend", choices=["none", "mooncake"], default=None,
                   help="The worker's SGLang --hicache-storage-backend (default none); with mooncake its key layout is "
                        "announced and routers credit it for pages in the shared pool. With --sglang-url, mooncake "
                        "also announces an MHA layout that SGLang itself declines to describe.")
    b.add_argument("--hicache", choices=["on", "off"], default=None,
                   help="Whether the worker runs SGLang HiCache (--enable-hierarchical-cache), announced so "
                        "`kvtier doctor` can tell a missing host tier from a disabled one (with --sglang-url: read "
                        "from the server).")
    b.add_argument("--hicache-write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default=None, help="The worker's SGLang --hicache-write-policy (with --sglang-url: read from "
                                      "the server).")
    b.add_argument("--worker-url", default=None, dest="http_endpoint",
                   help="The engine's HTTP base URL (e.g. http://10.0.0.5:30000), for a router in --proxy mode and "
                        "for the bridge's engine health check (--engine-health-path; default: --sglang-url).")
    b.add_argument("--heartbeat", type=positive_float, default=2.0, dest="heartbeat_s",
                   help="Seconds between announcements (metadata + lease renewal).")
    b.add_argument("--lease-ttl", type=positive_float, default=10.0, dest="lease_ttl_s",
                   help="Seconds a worker stays live without a heartbeat; then its pages are removed.")
    b.add_argument("--engine-health-path", default="/health",
                   help="Path under the worker URL (--worker-url, else --sglang-url) of the engine's health endpoint "
                        "(SGLang: /health). Before each heartbeat the bridge GETs it and renews the worker's lease "
                        "only on a 2xx answer, so a dead or hung engine's lease runs out (--lease-ttl) and routers "
                        "stop choosing it; a worker whose engine has not answered yet is not announced. KV events "
                        "are forwarded either way. '' turns the check off (the lease is renewed whatever the engine "
                        "does); without a worker URL there is nothing to check.")
    b.add_argument("--engine-health-timeout", type=positive_float, default=None, dest="engine_health_timeout_s",
                   help="Seconds to wait for the engine's health answer; none counts as down. SGLang answers /health "
                        "only after polling its scheduler for a second or two, so keep this above 2. Must be shorter "
                        "than --lease-ttl (default: 5, or half of --lease-ttl when that is shorter).")
    b.add_argument("--max-batches-per-message", type=positive_int, default=512,
                   help="Engine batches a burst may merge into one NATS message.")
    b.add_argument("--max-pages-per-message", type=positive_int, default=16384,
                   help="Page transitions per NATS message before it is split (keeps messages under 1 MB).")
    b.add_argument("--replay-timeout", type=positive_float, default=3.0, dest="replay_timeout_s",
                   help="Seconds to wait for the engine's replay socket to answer; a starting bridge asks up to "
                        "3 times, doubling it, before it begins an epoch without the replay (partial).")
    b.add_argument("--drop-token-ids", action="store_true",
                   help="Do not forward token ids of stored pages (smaller messages; disables hash validation).")
    add_stream_flags(b)
    add_common(b)
    b.set_defaults(run=run)


def run(args) -> None:
    from kvtier.producers.bridge import BridgeConfig, EngineHealthCheck, run_bridge
    from kvtier.producers.sglang_discovery import WorkerFlags, resolve_worker

    health_path = _engine_health_path(args)
    streams, explicit = stream_settings(args)
    worker = resolve_worker(WorkerFlags(
        endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic, model=args.model,
        page_size=args.page_size, dp_size=args.dp_size, tp_size=args.tp_size, pp_size=args.pp_size,
        hicache_storage_backend=args.hicache_storage_backend, mooncake_attention=args.mooncake_attention,
        mooncake_key_prefix=args.mooncake_key_prefix, http_endpoint=args.http_endpoint,
        hicache_enabled=None if args.hicache is None else args.hicache == "on",
        hicache_write_policy=args.hicache_write_policy,
    ), sglang_url=args.sglang_url, timeout_s=args.sglang_timeout, api_key=args.sglang_api_key)
    layout = worker.mooncake
    config = BridgeConfig(
        endpoint=worker.endpoint, replay_endpoint=worker.replay_endpoint, topic=worker.topic,
        worker_id=args.worker_id, model=worker.model, page_size=worker.page_size, nats_url=args.nats,
        dp_size=worker.dp_size, tp_size=worker.tp_size, pp_size=worker.pp_size,
        mooncake_attention=layout.attention.value if layout else "mha",
        mooncake_key_prefix=layout.key_prefix if layout else "",
        hicache_storage_backend="mooncake" if layout else "none", http_endpoint=worker.http_endpoint,
        engine_version=worker.engine_version, hicache_enabled=worker.hicache_enabled,
        hicache_write_policy=worker.hicache_write_policy,
        heartbeat_s=args.heartbeat_s, lease_ttl_s=args.lease_ttl_s, replay_timeout_s=args.replay_timeout_s,
        engine_health=EngineHealthCheck(url=worker.http_endpoint.rstrip("/") + health_path,
                                        timeout_s=args.engine_health_timeout_s)
        if worker.http_endpoint and health_path else None,
        max_batches_per_message=args.max_batches_per_message,
        max_pages_per_message=args.max_pages_per_message, keep_token_ids=not args.drop_token_ids,
        streams=streams, partitions_explicit=explicit,
    )
    run_until_signal(lambda stop: run_bridge(config, stop))


def _engine_health_path(args) -> str:
    """--engine-health-path, checked before anything is contacted (ValueError: one line, exit 2)."""
    path = args.engine_health_path.strip()
    if args.engine_health_timeout_s is None:
        args.engine_health_timeout_s = min(5.0, args.lease_ttl_s / 2)
    if path and not path.startswith("/"):
        raise ValueError(f"--engine-health-path {path!r} must start with '/' (e.g. /health), or be '' for no check")
    if path and args.engine_health_timeout_s >= args.lease_ttl_s:
        # A healthy engine answering near the timeout would let the lease run out between renewals.
        raise ValueError(f"--engine-health-timeout ({args.engine_health_timeout_s:g}s) must be shorter than "
                         f"--lease-ttl ({args.lease_ttl_s:g}s)")
    return path
