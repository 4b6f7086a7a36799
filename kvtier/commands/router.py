"""`kvtier router`: a stateless routing replica over HTTP (router/service.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import (
    add_common,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_until_signal,
)
from kvtier.router.weight_flags import add_scoring_weight_arguments, scoring_weights_from


def register(sub) -> None:
    r = sub.add_parser("router", help="Serve tier-aware routing decisions over HTTP (a stateless replica).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--redis", required=True, help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    r.add_argument("--nats", default="", help="NATS URL for the decision log (kvtier.decisions.<model>); '' = off.")
    r.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds to.")
    r.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one, printed at start).")
    r.add_argument("--router-mode", choices=["kv", "load", "round-robin", "random"], default="kv",
                   help="kv: tier-aware scoring; load: booked load only (cache weights 0); round-robin / random: "
                        "baselines for A/B tests (the turn is shared by every replica; decisions still report "
                        "the scores and book load).")
    r.add_argument("--seed", type=int, default=None,
                   help="Seed the random draws that break ties (reproducible decisions, e.g. in replays).")
    r.add_argument("--shared-cache-type", choices=["none", "hicache"], default="none",
                   help="hicache: credit pages workers can fetch from the shared Mooncake pool.")
    r.add_argument("--mooncake-master", default="",
                   help="The Mooncake master's HTTP address (its metrics port, serving /batch_query_keys).")
    r.add_argument("--shared-cache-timeout-ms", type=positive_float, default=50.0,
                   help="Budget for the shared-pool query; past it the decision scores without it.")
    add_scoring_weight_arguments(r)
    r.add_argument("--predicted-pages", choices=["on", "off"], default="off",
                   help="Book each request's pages as predicted device pages on its worker until it completes, "
                        "visible to every replica (pages its events may not show yet). Pays off when requests "
                        "sharing a new context arrive together (fan-out); costs Redis memory per in-flight page "
                        "(BENCHMARKS.md).")
    r.add_argument("--state-source", choices=["mirror", "redis"], default="mirror",
                   help="Where decisions read tier overlaps. mirror: an in-memory index of every model, built from "
                        "Redis and kept current from its change feed (kvt:{model}:changes), so a decision costs "
                        "Redis only the liveness read and the booking; until a model's index is ready, decisions "
                        "walk in Redis and say so (degraded: index-not-ready). redis: the walk in Redis for every "
                        "decision (also what --predicted-pages on uses).")
    r.add_argument("--page-size", type=positive_int, default=None,
                   help="Expected worker page size; workers announcing another get no shared-pool credit "
                        "(default: trust each worker's announced size).")
    r.add_argument("--booking-ttl", type=positive_float, default=600.0, dest="booking_ttl_s",
                   help="Seconds a booking holds load if never released (a router died mid-request).")
    r.add_argument("--state-timeout-ms", type=positive_float, default=250.0,
                   help="Redis call budget; past it the decision routes by load/round robin.")
    r.add_argument("--max-request-tokens", type=positive_int, default=1 << 18,
                   help="Longest token_ids accepted (longer: 413). The overlap walk of a request grows with its "
                        "pages; a 10^6-token request takes ~0.6 s of Redis time here, past the default "
                        "--state-timeout-ms, and would send this replica to load-only routing for everyone: raise "
                        "both together for very long contexts.")
    r.add_argument("--max-body-bytes", type=positive_int, default=32 << 20, help="Largest request body (413).")
    r.add_argument("--max-new-tokens", type=positive_int, default=1 << 20,
                   help="Largest output budget accepted (max_tokens, max_completion_tokens, max_new_tokens; "
                        "larger: 400). A budget is booked as decode load, so an absurd one would push every "
                        "other request elsewhere.")
    r.add_argument("--max-prompt-bytes", type=positive_int, default=2 << 20,
                   help="With --proxy: largest text prompt tokenized here (UTF-8 bytes; a chat's messages "
                        "together), else 413, checked before tokenizing (~1 s of CPU per MB).")
    r.add_argument("--redis-max-connections", type=positive_int, default=256,
                   help="Redis connections of this replica; when all are busy a request waits for one (up to "
                        "--redis-pool-wait-ms) rather than routing without tier state.")
    r.add_argument("--redis-pool-wait-ms", type=positive_float, default=2000.0,
                   help="How long a request waits for a free Redis connection before the replica routes "
                        "without tier state.")
    r.add_argument("--upstream-connections-per-worker", type=positive_int, default=256,
                   help="With --proxy: connections kept open to each worker, a pool per worker (slow streams on "
                        "one never hold back another); past it a request waits up to --upstream-connect-timeout.")
    r.add_argument("--upstream-connect-timeout", type=positive_float, default=5.0, dest="upstream_connect_timeout_s",
                   help="With --proxy: seconds to reach a worker (a free connection included); past it the "
                        "request migrates to another worker.")
    r.add_argument("--upstream-idle-timeout", type=positive_float, default=600.0, dest="upstream_idle_timeout_s",
                   help="With --proxy: longest silence from a worker (no byte of its answer) before the request "
                        "fails (before the first byte: it migrates).")
    r.add_argument("--upstream-timeout", type=non_negative_float, default=0.0, dest="upstream_timeout_s",
                   help="With --proxy: longest whole proxied request in seconds; 0: no limit.")
    r.add_argument("--engine-api-key", default="",
                   help="With --proxy: sent to workers as 'Authorization: Bearer <key>' (SGLang's --api-key); "
                        "prefer the environment variable. The client's Authorization is never forwarded.")
    r.add_argument("--migration-limit", type=non_negative_int, default=2,
                   help="With --proxy: times a request whose worker refuses, times out or fails before the "
                        "first byte is routed again among the other candidates (0: never).")
    r.add_argument("--breaker-failures", type=positive_int, default=3,
                   help="A worker this replica failed to reach this many times in a row is left out of the "
                        "candidates for --breaker-backoff seconds (doubling while it keeps failing).")
    r.add_argument("--header-timeout", type=positive_float, default=10.0, dest="header_timeout_s",
                   help="Seconds a client has to send a whole request head (line and headers); past it the "
                        "connection is closed (408 if a head was begun): slowloris.")
    r.add_argument("--body-timeout", type=positive_float, default=30.0, dest="body_timeout_s",
                   help="Seconds a client has to send a request's body after its head; past it 408 and the "
                        "connection is closed (a body shorter than its Content-Length, an endless chunked one).")
    r.add_argument("--keepalive-timeout", type=positive_float, default=20.0, dest="keepalive_timeout_s",
                   help="Seconds an idle keep-alive connection stays open between requests (a load balancer in "
                        "front that pools connections must use a shorter idle timeout).")
    r.add_argument("--max-connections", type=non_negative_int, default=1024,
                   help="Client connections open at once (0: no cap; also kept under the descriptor limit less "
                        "128); past it a new one closes the longest-idle one, or is closed if none is idle.")
    r.add_argument("--busy-prefill-tokens", type=non_negative_int, default=0,
                   help="A worker with this many prompt tokens booked and not yet prefilled takes no new request "
                        "(0: no threshold); when every candidate is busy, requests wait in the queue. Changeable "
                        "at run time: PUT /v1/admission.")
    r.add_argument("--busy-decode-pages", type=non_negative_int, default=0,
                   help="A worker with this many KV pages booked for running requests (prompt + output budget) "
                        "takes no new request (0: no threshold).")
    r.add_argument("--queue-size", type=non_negative_int, default=256,
                   help="Requests that may wait for a worker under its thresholds; past it: 429 with Retry-After.")
    r.add_argument("--queue-timeout", type=non_negative_float, default=10.0, dest="queue_timeout_s",
                   help="Seconds a request may wait in the queue; past it: 503 with Retry-After.")
    r.add_argument("--drain-timeout", type=non_negative_float, default=30.0, dest="drain_timeout_s",
                   help="On SIGTERM: new requests get 503 + Retry-After while those in flight finish, for up to "
                        "this many seconds; then what is left is cut (its bookings released) and the router exits.")
    r.add_argument("--session-ttl", type=positive_float, default=600.0, dest="session_ttl_s",
                   help="Seconds a conversation's X-Session-Id keeps it on the worker that served it last.")
    r.add_argument("--breaker-backoff", type=positive_float, default=5.0, dest="breaker_backoff_s",
                   help="Seconds a worker is left out after --breaker-failures failures in a row.")
    r.add_argument("--proxy", action="store_true",
                   help="Also serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
                        "and SGLang's /generate: route, forward the body unchanged to the worker, stream the answer "
                        "back.")
    r.add_argument("--model", default="", help="Model of proxied requests that name none.")
    r.add_argument("--tokenizer", action="append", default=[], type=_model_and_path, metavar="MODEL=PATH",
                   help="With --proxy: the folder of MODEL's tokenizer files (tokenizer.json, tokenizer_config.json "
                        "with its chat template), read from disk only, e.g. a snapshot in the local Hugging Face "
                        "cache. The OpenAI API's text prompts and chats are tokenized with it exactly as SGLang "
                        "does, so the router finds the pages the engine holds. Repeat for each model.")
    r.add_argument("--router-id", default="", help="Name in the decision log (default: random).")
    r.add_argument("--auth-token", default="",
                   help="Require 'Authorization: Bearer <token>' on every path but /healthz (/v1/route, "
                        "/v1/release, /generate; /metrics with --protect-metrics), else 401; prefer the environment "
                        "variable or --auth-token-file. Empty: no auth.")
    r.add_argument("--auth-token-file", default="", metavar="FILE",
                   help="Read the --auth-token from this file (surrounding whitespace ignored).")
    r.add_argument("--protect-metrics", action="store_true",
                   help="With an auth token, /metrics requires it too (/healthz always stays open).")
    r.add_argument("--tokenizer-cache-mb", type=non_negative_float, default=256.0,
                   help="Per model, the ids of text pieces seen before (between the special tokens a chat "
                        "template writes) kept for the next request: a conversation's next turn encodes only "
                        "its new text (0: encode every prompt whole).")
    r.add_argument("--hand-over-token-ids", action="store_true",
                   help="With --proxy: send a text completion (/v1/completions) to the engine as the router's token "
                        "ids, so the engine does not tokenize it again (SGLang takes a prompt of ids as it is). Chats "
                        "go as they came (the OpenAI chat API takes no ids), and so does a completion with echo.")
    r.add_argument("--processes", type=positive_int, default=1,
                   help="Serve the port from this many processes (SO_REUSEPORT; each its own index and "
                        "copies, kept consistent by Redis as replicas are): one replica on as many cores. "
                        "/metrics and /healthz of the port describe every process.")
    add_common(r)
    r.set_defaults(run=run)


def run(args) -> None:
    from kvtier.router.processes import ProcessSlot, serve_on_processes

    if args.processes > 1 and ProcessSlot.from_env() is None:
        _auth_token(args)  # refused here once, not by each process
        raise SystemExit(serve_on_processes(args.processes, args.host, args.http_port))
    run_until_signal(lambda stop: _run_router(args, stop))


def _auth_token(args) -> str:
    """The router's bearer token, from --auth-token or --auth-token-file (not both)."""
    token = args.auth_token.strip()
    if args.auth_token_file:
        if token:
            raise SystemExit("kvtier router: give --auth-token or --auth-token-file, not both")
        try:
            with open(args.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"kvtier router: --auth-token-file: cannot read {args.auth_token_file!r} "
                             f"({exc.strerror or exc})") from None
        if not token:
            raise SystemExit(f"kvtier router: --auth-token-file {args.auth_token_file!r} is empty")
    if args.protect_metrics and not token:
        raise SystemExit("kvtier router: --protect-metrics needs --auth-token or --auth-token-file")
    return token


async def _run_router(args, stop) -> None:
    from kvtier.router.http_guard import HttpLimits
    from kvtier.router.service import RouterConfig, ServiceSettings, run_router
    from kvtier.schemas.routing import AdmissionSettings

    if args.shared_cache_type == "hicache" and not args.mooncake_master:
        raise SystemExit("kvtier router: --shared-cache-type hicache needs --mooncake-master http://HOST:PORT "
                         "(the master's HTTP port serving /batch_query_keys)")
    from kvtier.router.processes import ProcessSlot

    slot = ProcessSlot.from_env()
    router_id = args.router_id
    if slot is not None and router_id:
        router_id = f"{router_id}-p{slot.index}"  # one name per process in the decision log
    config = RouterConfig(
        redis_url=args.redis, nats_url=args.nats, host=args.host,
        http_port=slot.port if slot is not None else args.http_port,
        router_mode=args.router_mode, shared_cache_type=args.shared_cache_type, mooncake_master=args.mooncake_master,
        shared_cache_timeout_s=args.shared_cache_timeout_ms / 1000, page_size=args.page_size,
        booking_ttl_s=args.booking_ttl_s, state_timeout_s=args.state_timeout_ms / 1000, router_id=router_id,
        seed=args.seed if slot is None or args.seed is None else args.seed + slot.index,
        weights=scoring_weights_from(args),
        predicted_pages=args.predicted_pages == "on", state_source=args.state_source,
        redis_max_connections=args.redis_max_connections, redis_pool_wait_s=args.redis_pool_wait_ms / 1000,
        breaker_failures=args.breaker_failures,
        breaker_backoff_s=args.breaker_backoff_s, session_ttl_s=args.session_ttl_s,
        admission=AdmissionSettings(busy_prefill_tokens=args.busy_prefill_tokens,
                                    busy_decode_pages=args.busy_decode_pages, queue_size=args.queue_size,
                                    queue_timeout_s=args.queue_timeout_s),
        service=ServiceSettings(max_request_tokens=args.max_request_tokens, max_body_bytes=args.max_body_bytes,
                                proxy=args.proxy, default_model=args.model, auth_token=_auth_token(args),
                                tokenizers=dict(args.tokenizer),
                                tokenizer_cache_bytes=int(args.tokenizer_cache_mb * (1 << 20)),
                                hand_over_token_ids=args.hand_over_token_ids,
                                protect_metrics=args.protect_metrics, max_new_tokens=args.max_new_tokens,
                                max_prompt_bytes=args.max_prompt_bytes,
                                upstream_connections_per_worker=args.upstream_connections_per_worker,
                                upstream_connect_timeout_s=args.upstream_connect_timeout_s,
                                upstream_idle_timeout_s=args.upstream_idle_timeout_s,
                                upstream_timeout_s=args.upstream_timeout_s, engine_api_key=args.engine_api_key,
                                migration_limit=args.migration_limit, drain_timeout_s=args.drain_timeout_s,
                                process=slot,
                                http_limits=HttpLimits(header_timeout_s=args.header_timeout_s,
                                                       body_timeout_s=args.body_timeout_s,
                                                       keepalive_timeout_s=args.keepalive_timeout_s,
                                                       max_connections=args.max_connections)),
    )
    await run_router(config, stop, ready=lambda port: print(f"kvtier router listening on http://{args.host}:{port}",
                                                            flush=True))


def _model_and_path(value: str) -> tuple[str, str]:
    import argparse

    model, sep, path = value.partition("=")
    if not sep or not model or not path:
        raise argparse.ArgumentTypeError(f"expected MODEL=PATH, got {value!r}")
    return model, path
