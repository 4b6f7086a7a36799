"""`kvtier bench ...`: the benchmarks (kvtier/bench/; figures and commands in BENCHMARKS.md)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import (
    EnvDefaults,
    add_cluster_arguments,
    add_common,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvtier.router.weight_flags import add_scoring_weight_arguments


def register(sub) -> None:
    bench = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=EnvDefaults)
    ingest = bench_sub.add_parser("ingest", help="Processor ingest: transitions/s NATS->Redis and event->visible lag.",
                                  description="Publishes pre-built kvtier batches to an embedded JetStream, runs one "
                                              "processor process, and measures block transitions applied per second "
                                              "end to end, then event->visible lag at half that rate.")
    ingest.add_argument("--transitions", type=positive_int, default=2_000_000,
                        help="Transitions in the throughput phase.")
    ingest.add_argument("--workers", type=positive_int, default=16, help="Simulated workers.")
    ingest.add_argument("--pages-per-event", type=positive_int, default=16, help="Hashes per stored/removed event.")
    ingest.add_argument("--events-per-message", type=positive_int, default=32,
                        help="Events per NATS message (the bridge's batching).")
    ingest.add_argument("--lag-seconds", type=positive_float, default=10.0, help="Duration of the lag phase.")
    ingest.add_argument("--lag-rate", type=positive_float, default=None,
                        help="Transitions/s in the lag phase (default: half the measured throughput).")
    ingest.add_argument("--no-token-ids", action="store_true",
                        help="Messages without token ids (as from `kvtier bridge --drop-token-ids`): ~4x smaller.")
    ingest.add_argument("--hash-check", choices=["on", "off"], default="on",
                        help="The processor's hash-scheme check (see `kvtier processor --hash-check`).")
    ingest.add_argument("--hash-check-budget", type=non_negative_float, default=50_000.0,
                        help="Its pages/s budget (see `kvtier processor --hash-check-budget`; 0: no limit).")
    ingest.add_argument("--dynamo", action="store_true",
                        help="Also time Dynamo's RadixTree.apply_event on the device-tier events of the same messages "
                             "(needs: pip install -e '.[bench-dynamo]').")
    ingest.add_argument("--trace", action="store_true",
                        help="Also print lag p50/max per quarter second of the lag phase (to see bursts).")
    ingest.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(ingest)
    route = bench_sub.add_parser("route", help="Router decision latency and throughput (64 workers, 128-page "
                                               "requests), beside Dynamo's find_matches.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    route.add_argument("--workers", type=positive_int, default=64, help="Live workers with tier state.")
    route.add_argument("--request-pages", type=positive_int, default=128, help="Pages per request.")
    route.add_argument("--page-size", type=positive_int, default=64, help="Tokens per page.")
    route.add_argument("--conversations", type=positive_int, default=256, help="Distinct 128-page prefixes.")
    route.add_argument("--conversations-per-worker", type=positive_int, default=24,
                       help="Prefixes each worker caches (random device/host/disk split).")
    route.add_argument("--noise-pages", type=int, default=2000, help="Unrelated pages per worker and tier.")
    route.add_argument("--decisions", type=positive_int, default=3000, help="Decisions per measurement.")
    route.add_argument("--concurrency", type=positive_int, default=16, help="Concurrent in-process decisions.")
    route.add_argument("--http-concurrency", type=positive_int, default=32, help="Concurrent HTTP clients.")
    route.add_argument("--http-processes", type=non_negative_int, default=2,
                       help="Also over HTTP to a router started with --processes N (0 or 1: skip).")
    route.add_argument("--shared-pool", action="store_true",
                       help="Also measure with a real Mooncake master (needs a private network namespace).")
    route.add_argument("--no-http", action="store_true", help="Skip the decisions over HTTP.")
    route.add_argument("--replicas", type=positive_int, default=1,
                       help="Above 1: also run this many router processes (each its own index, decisions booked "
                            "and released concurrently) against the same Redis: aggregate decisions/s and Redis "
                            "CPU per decision.")
    route.add_argument("--replica-seconds", type=positive_float, default=5.0,
                       help="How long each of the --replicas processes decides.")
    route.add_argument("--scale-entries", type=int, default=1_000_000,
                       help="(page, tier) entries of the at-scale state (HiCache-like shape over --workers): the "
                            "index's bytes per entry (tracemalloc), and a router's bootstrap from Redis holding it "
                            "(0: skip both).")
    route.add_argument("--lag-rate", type=non_negative_float, default=100_000.0,
                       help="Page transitions/s a writer process applies (128-page store/remove batches) while an "
                            "index follows the change feed: index lag p50/p99 (0: skip).")
    route.add_argument("--lag-seconds", type=positive_float, default=5.0, help="Duration of the lag phase.")
    route.add_argument("--seed", type=int, default=1)
    route.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(route)
    px = bench_sub.add_parser(
        "proxy", help="What the OpenAI-compatible proxy adds to TTFT (fresh 8k-token prompts, multi-turn chats, a "
                      "shared system prompt; DeepSeek-V4's tokenizer), and requests/s per replica, against requests "
                      "straight to the same workers in the same run.",
        description="sim-workers, bridges, NATS, a processor, Redis and router replicas with --proxy as processes "
                    "on embedded loopback servers; per workload, request pairs (one direct, one through a router, "
                    "twins of the same size) alternate, so the added latency is measured pair by pair.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    px.add_argument("--workloads", default="fresh,multi_turn,shared_system",
                    help="Comma-separated, measured in this order: fresh (a new text prompt each), multi_turn "
                         "(chats growing a turn at a time), shared_system (one system prompt, a new question each).")
    px.add_argument("--prompt-tokens", type=positive_int, default=8192,
                    help="Tokens per fresh prompt, and per prompt of the rate phase.")
    px.add_argument("--conversations", type=positive_int, default=32, help="multi_turn: chats taken in turn.")
    px.add_argument("--turn-tokens", type=positive_int, default=200,
                    help="multi_turn: tokens of each new user turn and of a chat's system prompt (an answer: a "
                         "quarter of it).")
    px.add_argument("--conversation-tokens", type=positive_int, default=8192,
                    help="multi_turn: a chat that would grow past this starts again with a new system prompt.")
    px.add_argument("--system-tokens", type=positive_int, default=4096,
                    help="shared_system: tokens of the system prompt every request shares.")
    px.add_argument("--question-tokens", type=positive_int, default=1024,
                    help="shared_system: tokens of each request's new user question.")
    px.add_argument("--requests", type=positive_int, default=200, help="Measured request pairs per workload.")
    px.add_argument("--warm-up", type=int, default=20,
                    help="Unmeasured request pairs first, per workload (multi_turn: at least one per chat).")
    px.add_argument("--workers", type=positive_int, default=2, help="sim-worker processes.")
    px.add_argument("--replicas", type=positive_int, default=1, help="Router replicas.")
    px.add_argument("--hand-over-token-ids", action="store_true",
                    help="Start the routers with --hand-over-token-ids (text completions reach the engine as the "
                         "router's token ids).")
    px.add_argument("--concurrency", type=positive_int, default=8, help="Concurrent clients in the rate phase.")
    px.add_argument("--seconds", type=positive_float, default=5.0, help="Length of each rate measurement.")
    px.add_argument("--seed", type=int, default=1)
    px.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(px)
    ov = bench_sub.add_parser(
        "overload", help="The front door at 2x the cluster's capacity, a sim-worker killed and a replica stopped "
                         "mid-run, idle sockets and oversized prompts: every request accounted for.",
        description="Paced sim-workers (answers in wall time), their bridges, NATS, a processor, Redis and two router "
                    "replicas in proxy mode with busy thresholds, as processes on embedded loopback servers. The "
                    "cluster's capacity is measured straight to the workers, then Poisson arrivals at 0.8x and 2x "
                    "of it go through the replicas.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ov.add_argument("--workers", type=positive_int, default=4, help="sim-worker processes.")
    ov.add_argument("--prompt-tokens", type=positive_int, default=2048, help="Tokens per prompt (BOS included).")
    ov.add_argument("--max-tokens", type=positive_int, default=8, help="Output tokens per request.")
    ov.add_argument("--capacity-seconds", type=positive_float, default=8.0, help="Length of the capacity measurement.")
    ov.add_argument("--low-seconds", type=positive_float, default=20.0, help="Length of the 0.8x phase.")
    ov.add_argument("--seconds", type=positive_float, default=60.0, help="Length of the 2x phase.")
    ov.add_argument("--device-pages", type=positive_int, default=1024,
                    help="Each sim-worker's GPU pool in pages (its host pool twice that): small enough to fill "
                         "during the 0.8x phase, so the routers' indexes are full when memory is first measured.")
    ov.add_argument("--tokenizer-cache-mb", type=positive_float, default=4.0,
                    help="The routers' --tokenizer-cache-mb: small enough to be full by the end of the 0.8x phase "
                         "(every prompt is new text, kept whole), so what the RSS does at 2x is not a cache filling "
                         "to its bound.")
    ov.add_argument("--busy-prefill-tokens", type=positive_int, default=4096,
                    help="The routers' --busy-prefill-tokens (default: 2 prompts queued per worker).")
    ov.add_argument("--queue-timeout", type=positive_float, default=0.25, help="The routers' --queue-timeout.")
    ov.add_argument("--max-prompt-bytes", type=positive_int, default=1 << 20, help="The routers' --max-prompt-bytes.")
    ov.add_argument("--idle-sockets", type=int, default=200, help="Idle sockets opened to a replica at 2x.")
    ov.add_argument("--request-timeout", type=positive_float, default=30.0,
                    help="Seconds a client waits for a whole answer before counting it lost.")
    ov.add_argument("--seed", type=int, default=1)
    ov.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(ov)
    rp = bench_sub.add_parser("replay", help="Replay a Mooncake-format trace on a simulated HiCache cluster, "
                                             "once per routing policy, beside the oracle and the bounds.",
                              description="Lockstep by default: the trace clock moves only when the pipeline has "
                                          "caught up, so the same trace and seed give the same figures on any "
                                          "machine (kvtier/eval/replay.py).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cluster_arguments(rp)
    rp.add_argument("--policies", default="", help="Comma-separated subset of: random, round_robin, least_load, "
                                                   "device_only, tier_aware, tier_aware_shared, oracle.")
    rp.add_argument("--via", choices=["pipeline", "model"], default="pipeline",
                    help="kvtier's policies through the real pipeline (bridge, JetStream, processor, Redis, two "
                         "routers) or through the router's decision computed in process on the same information.")
    rp.add_argument("--visibility-lag-ms", type=non_negative_float, default=5.0,
                    help="Trace milliseconds between an engine event and routers seeing it (0: the ideal).")
    rp.add_argument("--predicted-pages", choices=["on", "off"], default="off",
                    help="kvtier policies book predicted pages (the routers' --predicted-pages).")
    add_scoring_weight_arguments(rp)
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--seeds", default="", help="Comma-separated seeds: every figure is the median over them.")
    rp.add_argument("--plot", default="", metavar="PNG", help="Draw the policies beside the oracle and bounds.")
    rp.add_argument("--realtime", action="store_true",
                    help="Replay on the wall clock through the live pipeline (measures the machine, not the policy).")
    rp.add_argument("--time-scale", type=positive_float, default=30.0,
                    help="With --realtime: trace seconds per wall second.")
    rp.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(rp)
    st = bench_sub.add_parser("synth-trace", help="Write the synthetic high-reuse trace (Mooncake format).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--out", default="-", help="Output file ('-': standard output); its statistics go to stderr.")
    st.add_argument("--requests", type=positive_int, default=3993)
    st.add_argument("--duration", type=positive_float, default=1022.0, help="Trace span in seconds.")
    st.add_argument("--seed", type=int, default=1)
    add_common(st)
    _add_soak_parser(bench_sub)
    _add_faults_parser(bench_sub)
    _add_fuzz_parser(bench_sub)
    for name, parser in bench_sub.choices.items():
        parser.set_defaults(run=lambda args, name=name: RUNS[name](args))


def _add_fuzz_parser(bench_sub) -> None:
    """`kvtier bench fuzz` (kvtier/bench/fuzz.py)."""
    fz = bench_sub.add_parser(
        "fuzz", help="Fuzz every decoder of untrusted input (hypothesis), then the real router, bridge and "
                     "processor with bad input; reports cases per target and failures (target 0).",
        description="In process: each decoder (SGLang payloads/events/frames, kvtier stream and control messages, "
                    "worker metadata and hash checks from Redis, SGLang's and Mooncake's HTTP replies, the router's "
                    "request bodies) gets valid messages, perturbed ones (wrong types, NaN/inf, out-of-range ints, "
                    "unknown tiers, invalid UTF-8, deep nesting, huge arrays), byte mutations and random bytes; it "
                    "must return a typed value or raise its documented errors. Then, on embedded servers: fuzzed "
                    "HTTP requests against a real `kvtier router --proxy` (4xx naming the problem, never 5xx), "
                    "fuzzed engine payloads through a real bridge and processor, and fuzzed stream messages through "
                    "a real processor (each bad input dead-lettered with a reason, the good state exact). "
                    "Exit 0 when nothing failed, else 1. Needs hypothesis (pip install -e '.[test]').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fz.add_argument("--cases", type=positive_int, default=100_000,
                    help="In-process decoder cases in total, shared among the decoders.")
    fz.add_argument("--seed", type=int, default=1, help="Hypothesis seed (one run is reproducible).")
    fz.add_argument("--mutants", type=int, default=15,
                    help="Quick byte mutants checked beside each input hypothesis draws (0: none).")
    fz.add_argument("--process-cases", type=int, default=None,
                    help="Requests through the real router; a 25th of it is the number of examples (of "
                         "about 6 inputs each) through the real bridge, and through the real processor "
                         "(default: cases/50, 100..2000).")
    fz.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(fz)


def _add_faults_parser(bench_sub) -> None:
    """`kvtier bench faults` (kvtier/bench/faults.py)."""
    fp = bench_sub.add_parser(
        "faults", help="A seeded schedule of crashes and outages (processor, bridge, nats-server, Redis with AOF "
                       "and once without persistence, engine restart, paused processor) during a sustained event "
                       "stream; then the live state is compared page for page with a replay of the stream.",
        description="Simulated HiCache engines publish SGLang's wire format to real bridges, nats-server "
                    "(JetStream, file storage), processors and a Redis-protocol server, each in its own process. "
                    "Faults are injected one at a time and each recovery is timed (repair -> every worker caught "
                    "up, none stale, no model rebuilding). At the end the live state is compared with a replay of "
                    "the stream and with every engine's own view. Exit 0 when nothing diverges and every fault "
                    "recovered, else 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fp.add_argument("--faults", type=positive_int, default=24, help="Faults to inject (>= 11 covers every kind).")
    fp.add_argument("--lease", type=positive_float, default=5.0,
                    help="The workers' lease in seconds (bridges announce every quarter of it); the long faults "
                         "(processor, all processors, NATS down) last twice as long.")
    fp.add_argument("--seed", type=int, default=1, help="Seed of the schedule, the targets and the workload.")
    fp.add_argument("--duration", type=positive_float, default=150.0,
                    help="Seconds of event stream the faults are spread over.")
    fp.add_argument("--workers", type=positive_int, default=4, help="Simulated engines, one bridge each.")
    fp.add_argument("--processors", type=int, choices=[1, 2], default=2,
                    help="Processors, each owning half of the partitions.")
    fp.add_argument("--rate", type=positive_float, default=40.0, help="Requests per second per engine.")
    fp.add_argument("--log-dir", default="", help="Copy every process's log here.")
    fp.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(fp)


def _add_soak_parser(bench_sub) -> None:
    """`kvtier bench soak` (kvtier/bench/soak.py)."""
    sk = bench_sub.add_parser(
        "soak", help="Steady event and routing load through phases (steady, evict, refill, workers die, tail): "
                     "does memory (processor/router/bridge RSS, Redis, JetStream) track live pages?",
        description="The whole stack as processes on embedded loopback servers, a looping trace-shaped request "
                    "stream routed, served and released; samples RSS, Redis used_memory and keys, live page "
                    "entries per tier, bookings and JetStream bytes; prints per-phase medians and the verdicts. "
                    "Exit 0 when every verdict passes, else 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sk.add_argument("--minutes", type=positive_float, default=10.0, help="Length of the load (0.5 to 15).")
    sk.add_argument("--sample-s", type=positive_float, default=None,
                    help="Seconds between samples (default: the run / 120, within 1..10).")
    sk.add_argument("--rate", type=positive_float, default=10.0, help="Requests per second (at most 50).")
    sk.add_argument("--warm-up-s", type=non_negative_float, default=60.0,
                    help="Seconds of trace load before the measured run (not counted in --minutes): the processes' "
                         "bounded caches fill; then every rank is flushed and Redis's baseline taken.")
    sk.add_argument("--sim-workers", type=positive_int, default=2,
                    help="sim-worker processes, each with its own bridge.")
    sk.add_argument("--ranks", type=positive_int, default=2, help="Simulated workers per sim-worker.")
    sk.add_argument("--die", type=positive_int, default=1,
                    help="sim-workers (and their bridges) killed in the die phase.")
    sk.add_argument("--routers", type=positive_int, default=2, help="Router replicas (1 to 4).")
    sk.add_argument("--page-size", type=positive_int, default=16, help="Tokens per KV page.")
    sk.add_argument("--device-pages", type=positive_int, default=1024, help="GPU pool per rank, in pages.")
    sk.add_argument("--host-pages", type=positive_int, default=4096, help="Host pool per rank, in pages.")
    sk.add_argument("--max-prompt-tokens", type=positive_int, default=8192, help="Trace prompts cut to this.")
    sk.add_argument("--lease-ttl", type=positive_float, default=5.0, help="The bridges' --lease-ttl.")
    sk.add_argument("--stream-max-age", type=positive_float, default=120.0,
                    help="Retention of the events and decisions streams in seconds (JetStream's minimum for the "
                         "events stream: its 120 s duplicate window).")
    sk.add_argument("--trace", default="", help="Mooncake-format trace (default: the sample shipped in kvtier/data).")
    sk.add_argument("--seed", type=int, default=1)
    sk.add_argument("--plot", default="", help="Write a PNG of the series here.")
    sk.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(sk)


def _run_replay(args) -> int:
    from kvtier.eval.replay import run_replay_bench

    return run_replay_bench(args)


def _run_route(args) -> int:
    from kvtier.bench.route import run_route_bench

    return run_route_bench(args)


def _run_proxy(args) -> int:
    from kvtier.bench.proxy import run_proxy_bench

    return run_proxy_bench(args)


def _run_overload(args) -> int:
    from kvtier.bench.overload import run_overload_bench

    return run_overload_bench(args)


def _run_ingest(args) -> int:
    from kvtier.bench.ingest import run_ingest_bench

    return run_ingest_bench(args)


def _run_soak(args) -> int:
    from kvtier.bench.soak import run_soak_bench

    return run_soak_bench(args)


def _run_faults(args) -> int:
    from kvtier.bench.faults import run_fault_bench

    return run_fault_bench(args)


def _run_synth_trace(args) -> int:
    from kvtier.eval.synth_trace import run_synth_trace

    return run_synth_trace(args)


def _run_fuzz(args) -> int:
    from kvtier.bench.fuzz import run_fuzz_bench

    return run_fuzz_bench(args)


RUNS = {
    "replay": _run_replay,
    "route": _run_route,
    "proxy": _run_proxy,
    "overload": _run_overload,
    "ingest": _run_ingest,
    "soak": _run_soak,
    "faults": _run_faults,
    "synth-trace": _run_synth_trace,
    "fuzz": _run_fuzz,
}
