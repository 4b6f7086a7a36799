"""`kvtier bench ...`: the benchmarks (kvtier/bench/; figures and commands in BENCHMARKS.md)."""

from __future__ import annotations

import argparse

from kvtier.bench.settings import (
    FaultsBench,
    FuzzBench,
    IngestBench,
    OverloadBench,
    PeersBench,
    ProxyBench,
    RouteBench,
    SoakBench,
)
from kvtier.commands.flags import EnvDefaults, add_common, add_flags, read_settings
from kvtier.eval.settings import ReplayBench, SynthTraceSettings


def register(sub) -> None:
    bench = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=EnvDefaults)
    ingest = bench_sub.add_parser("ingest", help="Processor ingest: transitions/s NATS->Redis and event->visible lag.",
                                  description="Publishes pre-built kvtier batches to an embedded JetStream, runs one "
                                              "processor process, and measures block transitions applied per second "
                                              "end to end, then event->visible lag at half that rate.")
    add_flags(ingest, IngestBench)
    add_common(ingest)
    route = bench_sub.add_parser("route", help="Router decision latency and throughput (64 workers, 128-page "
                                               "requests), beside Dynamo's find_matches.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(route, RouteBench)
    add_common(route)
    px = bench_sub.add_parser(
        "proxy", help="What the OpenAI-compatible proxy adds to TTFT (fresh 8k-token prompts, multi-turn chats, a "
                      "shared system prompt; DeepSeek-V4's tokenizer), and requests/s per replica, against requests "
                      "straight to the same workers in the same run.",
        description="sim-workers, bridges, NATS, a processor, Redis and router replicas with --proxy as processes "
                    "on embedded loopback servers; per workload, request pairs (one direct, one through a router, "
                    "twins of the same size) alternate, so the added latency is measured pair by pair.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(px, ProxyBench)
    add_common(px)
    peers = bench_sub.add_parser(
        "peers", help="kvtier beside SGLang's model gateway (smg: round_robin, cache_aware, prefix_hash, "
                      "power_of_two) and the client straight to the workers, on one paced cluster, one trace, in "
                      "real time: TTFT, TPOT, reuse by tier, the front door's CPU and RSS.",
        description="Paced sim-workers with their bridges, NATS, a processor, Redis and router replicas as processes "
                    "on embedded loopback servers; smg launched from its PyPI wheel over the same worker URLs; every "
                    "cache flushed between front doors (kvtier/bench/peers.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(peers, PeersBench)
    add_common(peers)
    ov = bench_sub.add_parser(
        "overload", help="The front door at 2x the cluster's capacity, a sim-worker killed and a replica stopped "
                         "mid-run, idle sockets and oversized prompts: every request accounted for.",
        description="Paced sim-workers (answers in wall time), their bridges, NATS, a processor, Redis and two router "
                    "replicas in proxy mode with busy thresholds, as processes on embedded loopback servers. The "
                    "cluster's capacity is measured straight to the workers, then Poisson arrivals at 0.8x and 2x "
                    "of it go through the replicas.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(ov, OverloadBench)
    add_common(ov)
    rp = bench_sub.add_parser("replay", help="Replay a Mooncake-format trace on a simulated HiCache cluster, "
                                             "once per routing policy, beside the oracle and the bounds.",
                              description="Lockstep by default: the trace clock moves only when the pipeline has "
                                          "caught up, so the same trace and seed give the same figures on any "
                                          "machine (kvtier/eval/replay.py).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(rp, ReplayBench)
    add_common(rp)
    st = bench_sub.add_parser("synth-trace", help="Write the synthetic high-reuse trace (Mooncake format).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(st, SynthTraceSettings)
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
    add_flags(fz, FuzzBench)
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
    add_flags(fp, FaultsBench)
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
    add_flags(sk, SoakBench)
    add_common(sk)


def _run_replay(args) -> int:
    settings = read_settings(ReplayBench, args)
    if settings.suite:
        from kvtier.eval.suite import run_suite_bench

        return run_suite_bench(settings)
    from kvtier.eval.replay import run_replay_bench

    return run_replay_bench(settings)


def _run_route(args) -> int:
    from kvtier.bench.route import run_route_bench

    return run_route_bench(read_settings(RouteBench, args))


def _run_proxy(args) -> int:
    from kvtier.bench.proxy import run_proxy_bench

    return run_proxy_bench(read_settings(ProxyBench, args))


def _run_peers(args) -> int:
    from kvtier.bench.peers import run_peers_bench

    return run_peers_bench(read_settings(PeersBench, args))


def _run_overload(args) -> int:
    from kvtier.bench.overload import run_overload_bench

    return run_overload_bench(read_settings(OverloadBench, args))


def _run_ingest(args) -> int:
    from kvtier.bench.ingest import run_ingest_bench

    return run_ingest_bench(read_settings(IngestBench, args))


def _run_soak(args) -> int:
    from kvtier.bench.soak import run_soak_bench

    return run_soak_bench(read_settings(SoakBench, args))


def _run_faults(args) -> int:
    from kvtier.bench.faults import run_fault_bench

    return run_fault_bench(read_settings(FaultsBench, args))


def _run_synth_trace(args) -> int:
    from kvtier.eval.synth_trace import SynthParams, run_synth_trace

    settings = read_settings(SynthTraceSettings, args)
    return run_synth_trace(SynthParams(requests=settings.requests, duration_s=settings.duration), settings.seed,
                           settings.out)


def _run_fuzz(args) -> int:
    from kvtier.bench.fuzz import run_fuzz_bench

    return run_fuzz_bench(read_settings(FuzzBench, args))


RUNS = {
    "replay": _run_replay,
    "route": _run_route,
    "proxy": _run_proxy,
    "peers": _run_peers,
    "overload": _run_overload,
    "ingest": _run_ingest,
    "soak": _run_soak,
    "faults": _run_faults,
    "synth-trace": _run_synth_trace,
    "fuzz": _run_fuzz,
}
