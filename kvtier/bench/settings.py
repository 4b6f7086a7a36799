"""What each `kvtier bench ...` is told (RouteBench: `kvtier bench route`, kvtier/bench/route.py; and so on), each
setting declared once with its flag (kvtier/plumbing/settings.py): kvtier/commands/bench.py puts
these flags on the bench's parser and hands the bench the typed object. Light to import: the
command's parser is built from it. (`replay` and `synth-trace` are the evaluation's:
kvtier/eval/settings.py.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

from kvtier.plumbing.settings import (
    FLAG,
    Flag,
    SettingsError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    setting,
    switch,
    text_choice,
)

_JSON = "Print one JSON object as the last line."


def _int_choice(default: int, choices: tuple[int, ...], *, flag: str, help: str) -> Any:
    """A number among `choices`: `setting` takes no choices, `text_choice` reads no type."""
    spec = Flag(name=flag, help=help, parse=int, choices=cast(tuple[str, ...], choices), text_default=default)
    return dataclasses.field(default=default, metadata={FLAG: spec})


@dataclass(frozen=True, kw_only=True)
class IngestBench:
    transitions: int = setting(2_000_000, flag="--transitions", parse=positive_int,
                               help="Transitions in the throughput phase.")
    workers: int = setting(16, flag="--workers", parse=positive_int, help="Simulated workers.")
    pages_per_event: int = setting(16, flag="--pages-per-event", parse=positive_int,
                                   help="Hashes per stored/removed event.")
    events_per_message: int = setting(32, flag="--events-per-message", parse=positive_int,
                                      help="Events per NATS message (the bridge's batching).")
    lag_seconds: float = setting(10.0, flag="--lag-seconds", parse=positive_float, help="Duration of the lag phase.")
    lag_rate: float | None = setting(None, flag="--lag-rate", parse=positive_float,
                                     help="Transitions/s in the lag phase (default: half the measured throughput).")
    no_token_ids: bool = switch(
        flag="--no-token-ids",
        help="Messages without token ids (as from `kvtier bridge --drop-token-ids`): ~4x smaller.")
    hash_check: str = text_choice("on", choices=("on", "off"), flag="--hash-check",
                                  help="The processor's hash-scheme check (see `kvtier processor --hash-check`).")
    hash_check_budget: float = setting(
        50_000.0, flag="--hash-check-budget", parse=non_negative_float,
        help="Its pages/s budget (see `kvtier processor --hash-check-budget`; 0: no limit).")
    dynamo: bool = switch(flag="--dynamo",
                          help="Also time Dynamo's RadixTree.apply_event on the device-tier events of the same "
                               "messages (needs: pip install -e '.[bench-dynamo]').")
    trace: bool = switch(
        flag="--trace", help="Also print lag p50/max per quarter second of the lag phase (to see bursts).")
    json: bool = switch(flag="--json", help=_JSON)


@dataclass(frozen=True, kw_only=True)
class RouteBench:
    workers: int = setting(64, flag="--workers", parse=positive_int, help="Live workers with tier state.")
    request_pages: int = setting(128, flag="--request-pages", parse=positive_int, help="Pages per request.")
    page_size: int = setting(64, flag="--page-size", parse=positive_int, help="Tokens per page.")
    conversations: int = setting(256, flag="--conversations", parse=positive_int, help="Distinct 128-page prefixes.")
    conversations_per_worker: int = setting(24, flag="--conversations-per-worker", parse=positive_int,
                                            help="Prefixes each worker caches (random device/host/disk split).")
    noise_pages: int = setting(2000, flag="--noise-pages", parse=int, help="Unrelated pages per worker and tier.")
    decisions: int = setting(3000, flag="--decisions", parse=positive_int, help="Decisions per measurement.")
    concurrency: int = setting(16, flag="--concurrency", parse=positive_int, help="Concurrent in-process decisions.")
    http_concurrency: int = setting(32, flag="--http-concurrency", parse=positive_int, help="Concurrent HTTP clients.")
    http_processes: int = setting(2, flag="--http-processes", parse=non_negative_int,
                                  help="Also over HTTP to a router started with --processes N (0 or 1: skip).")
    shared_pool: bool = switch(flag="--shared-pool",
                               help="Also measure with a real Mooncake master (needs a private network namespace).")
    no_http: bool = switch(flag="--no-http", help="Skip the decisions over HTTP.")
    replicas: int = setting(
        1, flag="--replicas", parse=positive_int,
        help="Above 1: also run this many router processes (each its own index, decisions booked and released "
             "concurrently) against the same Redis: aggregate decisions/s and Redis CPU per decision.")
    replica_seconds: float = setting(5.0, flag="--replica-seconds", parse=positive_float,
                                     help="How long each of the --replicas processes decides.")
    scale_entries: int = setting(
        1_000_000, flag="--scale-entries", parse=int,
        help="(page, tier) entries of the at-scale state (HiCache-like shape over --workers): the index's bytes "
             "per entry (tracemalloc), and a router's bootstrap from Redis holding it (0: skip both).")
    lag_rate: float = setting(100_000.0, flag="--lag-rate", parse=non_negative_float,
                              help="Page transitions/s a writer process applies (128-page store/remove batches) while "
                                   "an index follows the change feed: index lag p50/p99 (0: skip).")
    lag_seconds: float = setting(5.0, flag="--lag-seconds", parse=positive_float, help="Duration of the lag phase.")
    seed: int = setting(1, flag="--seed", parse=int, help="")
    json: bool = switch(flag="--json", help=_JSON)


@dataclass(frozen=True, kw_only=True)
class ProxyBench:
    workloads: str = setting(
        "fresh,multi_turn,shared_system", flag="--workloads",
        help="Comma-separated, measured in this order: fresh (a new text prompt each), multi_turn (chats growing "
             "a turn at a time), shared_system (one system prompt, a new question each).")
    prompt_tokens: int = setting(8192, flag="--prompt-tokens", parse=positive_int,
                                 help="Tokens per fresh prompt, and per prompt of the rate phase.")
    conversations: int = setting(32, flag="--conversations", parse=positive_int,
                                 help="multi_turn: chats taken in turn.")
    turn_tokens: int = setting(
        200, flag="--turn-tokens", parse=positive_int,
        help="multi_turn: tokens of each new user turn and of a chat's system prompt (an answer: a quarter of it).")
    conversation_tokens: int = setting(
        8192, flag="--conversation-tokens", parse=positive_int,
        help="multi_turn: a chat that would grow past this starts again with a new system prompt.")
    system_tokens: int = setting(4096, flag="--system-tokens", parse=positive_int,
                                 help="shared_system: tokens of the system prompt every request shares.")
    question_tokens: int = setting(1024, flag="--question-tokens", parse=positive_int,
                                   help="shared_system: tokens of each request's new user question.")
    requests: int = setting(200, flag="--requests", parse=positive_int, help="Measured request pairs per workload.")
    warm_up: int = setting(20, flag="--warm-up", parse=int,
                           help="Unmeasured request pairs first, per workload (multi_turn: at least one per chat).")
    workers: int = setting(2, flag="--workers", parse=positive_int, help="sim-worker processes.")
    replicas: int = setting(1, flag="--replicas", parse=positive_int, help="Router replicas.")
    hand_over_token_ids: bool = switch(flag="--hand-over-token-ids",
                                       help="Start the routers with --hand-over-token-ids (text completions reach the "
                                            "engine as the router's token ids).")
    concurrency: int = setting(8, flag="--concurrency", parse=positive_int,
                               help="Concurrent clients in the rate phase.")
    seconds: float = setting(5.0, flag="--seconds", parse=positive_float, help="Length of each rate measurement.")
    seed: int = setting(1, flag="--seed", parse=int, help="")
    json: bool = switch(flag="--json", help=_JSON)


@dataclass(frozen=True, kw_only=True)
class PeersBench:
    front_doors: str = setting(
        "direct,bare-relay,smg-round_robin,smg-cache_aware,smg-prefix_hash,smg-power_of_two,kvtier,kvtier-2,"
        "kvtier-predicted-ttft,kvtier-ids", flag="--front-doors",
        help="Comma-separated, measured in this order on the same cluster: direct (the client straight to the "
             "workers), bare-relay (a bare Python relay, round robin: the floor of a Python proxy), smg-<policy> "
             "(SGLang's model gateway: round_robin, cache_aware, prefix_hash, power_of_two), "
             "kvtier (one replica), kvtier-2 (two, requests alternating), kvtier-predicted-ttft, kvtier-ids "
             "(one replica with --hand-over-token-ids).")
    l3_front_doors: str = setting(
        "direct,smg-cache_aware,kvtier", flag="--l3-front-doors",
        help="Measured again on a cluster whose workers share one Mooncake pool as their L3 tier (needs a private "
             "network namespace: unshare -n); empty: no L3 pass.")
    ramp_front_doors: str = setting(
        "direct,smg-cache_aware,kvtier", flag="--ramp-front-doors",
        help="Each ramped (without L3): --ramp-requests at --time-scale, then twice as fast, and so on, until "
             "TTFT p99 passes twice its first step's or a request fails; empty: no ramp.")
    ramp_requests: int = setting(100, flag="--ramp-requests", parse=positive_int,
                                 help="The trace's first N requests, sent at each step of a ramp.")
    trace: str = setting("synthetic", flag="--trace",
                         help="synthetic[:SEED] (kvtier's), conversation (the shipped Mooncake sample), or a "
                              "Mooncake JSONL.")
    requests: int = setting(200, flag="--requests", parse=positive_int, help="The trace's first N requests.")
    time_scale: float = setting(2.0, flag="--time-scale", parse=positive_float,
                                help="Trace time / wall time (2: twice the trace's rate).")
    block_tokens: int = setting(64, flag="--block-tokens", parse=positive_int,
                                help="Tokens of prose per 512-token trace block (a prompt's length scales with it).")
    max_blocks: int = setting(64, flag="--max-blocks", parse=positive_int, help="Trace blocks per prompt, at most.")
    max_tokens: int = setting(16, flag="--max-tokens", parse=positive_int,
                              help="Output tokens per request, at most (the trace's own where fewer).")
    workers: int = setting(8, flag="--workers", parse=positive_int, help="Paced sim-worker processes.")
    device_pages: int = setting(512, flag="--device-pages", parse=positive_int,
                                help="Each worker's GPU pool in pages (its host pool is twice as large).")
    settle_seconds: float = setting(2.0, flag="--settle-seconds", parse=positive_float,
                                    help="After each flush: for paced work to end and cleared caches to reach kvtier.")
    no_dynamo: bool = switch(
        flag="--no-dynamo", help="Leave out Dynamo's side (its frontend and KV router over its own mocker engines, "
                                 "beside a client straight to them; installed into a venv of its own on first use).")
    json: bool = switch(flag="--json", help=_JSON)


@dataclass(frozen=True, kw_only=True)
class OverloadBench:
    workers: int = setting(4, flag="--workers", parse=positive_int, help="sim-worker processes.")
    prompt_tokens: int = setting(2048, flag="--prompt-tokens", parse=positive_int,
                                 help="Tokens per prompt (BOS included).")
    max_tokens: int = setting(8, flag="--max-tokens", parse=positive_int, help="Output tokens per request.")
    capacity_seconds: float = setting(8.0, flag="--capacity-seconds", parse=positive_float,
                                      help="Length of the capacity measurement.")
    low_seconds: float = setting(20.0, flag="--low-seconds", parse=positive_float, help="Length of the 0.8x phase.")
    seconds: float = setting(60.0, flag="--seconds", parse=positive_float, help="Length of the 2x phase.")
    device_pages: int = setting(
        1024, flag="--device-pages", parse=positive_int,
        help="Each sim-worker's GPU pool in pages (its host pool twice that): small enough to fill during the 0.8x "
             "phase, so the routers' indexes are full when memory is first measured.")
    tokenizer_cache_mb: float = setting(
        4.0, flag="--tokenizer-cache-mb", parse=positive_float,
        help="The routers' --tokenizer-cache-mb: small enough to be full by the end of the 0.8x phase (every "
             "prompt is new text, kept whole), so what the RSS does at 2x is not a cache filling to its bound.")
    busy_prefill_tokens: int = setting(
        4096, flag="--busy-prefill-tokens", parse=positive_int,
        help="The routers' --busy-prefill-tokens (default: 2 prompts queued per worker).")
    queue_timeout: float = setting(0.25, flag="--queue-timeout", parse=positive_float,
                                   help="The routers' --queue-timeout.")
    max_prompt_bytes: int = setting(1 << 20, flag="--max-prompt-bytes", parse=positive_int,
                                    help="The routers' --max-prompt-bytes.")
    idle_sockets: int = setting(200, flag="--idle-sockets", parse=int, help="Idle sockets opened to a replica at 2x.")
    request_timeout: float = setting(30.0, flag="--request-timeout", parse=positive_float,
                                     help="Seconds a client waits for a whole answer before counting it lost.")
    seed: int = setting(1, flag="--seed", parse=int, help="")
    json: bool = switch(flag="--json", help=_JSON)


#: (phase, share of the run) of `kvtier bench soak`; the die phase must outlast a lease (SoakRun).
SOAK_PHASES: tuple[tuple[str, float], ...] = (("steady", 0.40), ("evict", 0.12), ("refill", 0.14), ("die", 0.16),
                                              ("tail", 0.18))
MIN_MINUTES, MAX_MINUTES = 0.5, 15.0


@dataclass(kw_only=True)
class SoakRun:
    """What `kvtier bench soak`'s flags set of a soak (kvtier/bench/soak.py's SoakConfig adds the
    run's own settings), and its bounds."""

    minutes: float = setting(10.0, flag="--minutes", parse=positive_float, help="Length of the load (0.5 to 15).")
    sample_s: float | None = setting(None, flag="--sample-s", parse=positive_float,
                                     help="Seconds between samples (default: the run / 120, within 1..10).")
    rate: float = setting(10.0, flag="--rate", parse=positive_float, help="Requests per second (at most 50).")
    #: the processes' bounded caches fill here (the processor's hash-check cache: ~190k fresh
    #: pages to its final size)
    warm_up_s: float = setting(
        60.0, flag="--warm-up-s", parse=non_negative_float,
        help="Seconds of trace load before the measured run (not counted in --minutes): the processes' bounded "
             "caches fill; then every rank is flushed and Redis's baseline taken.")
    #: the last `die` of them die in the die phase
    sim_workers: int = setting(2, flag="--sim-workers", parse=positive_int,
                               help="sim-worker processes, each with its own bridge.")
    ranks: int = setting(2, flag="--ranks", parse=positive_int, help="Simulated workers per sim-worker.")
    die: int = setting(1, flag="--die", parse=positive_int,
                       help="sim-workers (and their bridges) killed in the die phase.")
    routers: int = setting(2, flag="--routers", parse=positive_int, help="Router replicas (1 to 4).")
    #: 16-token pages: 4x the page churn of 64-token ones per request, so the processor's
    #: bounded hash-check cache (100k digests) reaches its final size within the warm-up
    #: (~190k fresh pages, ~2 min here; ~8 min with 64-token pages)
    page_size: int = setting(16, flag="--page-size", parse=positive_int, help="Tokens per KV page.")
    device_pages: int = setting(1024, flag="--device-pages", parse=positive_int, help="GPU pool per rank, in pages.")
    host_pages: int = setting(4096, flag="--host-pages", parse=positive_int, help="Host pool per rank, in pages.")
    max_prompt_tokens: int = setting(8192, flag="--max-prompt-tokens", parse=positive_int,
                                     help="Trace prompts cut to this.")
    lease_ttl_s: float = setting(5.0, flag="--lease-ttl", dest="lease_ttl", parse=positive_float,
                                 help="The bridges' --lease-ttl.")
    #: JetStream refuses a max age below the events stream's duplicate window (120 s,
    #: kvtier/plumbing/streams.py)
    stream_max_age_s: float = setting(120.0, flag="--stream-max-age", dest="stream_max_age", parse=positive_float,
                                      help="Retention of the events and decisions streams in seconds (JetStream's "
                                           "minimum for the events stream: its 120 s duplicate window).")
    trace: str = setting("", flag="--trace", help="Mooncake-format trace (default: the sample shipped in kvtier/data).")
    seed: int = setting(1, flag="--seed", parse=int, help="")

    @property
    def total_s(self) -> float:
        return self.minutes * 60

    def validate(self) -> None:
        if not MIN_MINUTES <= self.minutes <= MAX_MINUTES:
            raise SettingsError(f"--minutes must be within {MIN_MINUTES:g}..{MAX_MINUTES:g}, got {self.minutes:g}")
        if not 1 <= self.die < self.sim_workers:
            raise SettingsError(f"--die must leave a survivor: 1 <= die < sim-workers ({self.sim_workers}), "
                                f"got {self.die}")
        if not 1 <= self.routers <= 4:
            raise SettingsError(f"--routers must be 1..4, got {self.routers}")
        if not 0 <= self.warm_up_s <= 300:
            raise SettingsError(f"--warm-up-s must be within 0..300, got {self.warm_up_s:g}")
        if not 0 < self.rate <= 50:
            raise SettingsError(f"--rate must be within (0, 50] requests/s (loopback load stays bounded), "
                                f"got {self.rate}")
        die_s = self.total_s * dict(SOAK_PHASES)["die"]
        if die_s < self.lease_ttl_s + 3:
            raise SettingsError(f"the die phase ({die_s:.0f}s) must outlast a lease ({self.lease_ttl_s:g}s) by 3s: "
                                "raise --minutes or lower --lease-ttl")


@dataclass(kw_only=True)
class SoakBench(SoakRun):
    plot: str = setting("", flag="--plot", help="Write a PNG of the series here.")
    json: bool = switch(flag="--json", help=_JSON)


@dataclass(frozen=True, kw_only=True)
class FaultsBench:
    faults: int = setting(24, flag="--faults", parse=positive_int, help="Faults to inject (>= 11 covers every kind).")
    lease: float = setting(5.0, flag="--lease", parse=positive_float,
                           help="The workers' lease in seconds (bridges announce every quarter of it); the long faults "
                                "(processor, all processors, NATS down) last twice as long.")
    seed: int = setting(1, flag="--seed", parse=int, help="Seed of the schedule, the targets and the workload.")
    duration: float = setting(150.0, flag="--duration", parse=positive_float,
                              help="Seconds of event stream the faults are spread over.")
    workers: int = setting(4, flag="--workers", parse=positive_int, help="Simulated engines, one bridge each.")
    processors: int = _int_choice(2, (1, 2), flag="--processors",
                                  help="Processors, each owning half of the partitions.")
    rate: float = setting(40.0, flag="--rate", parse=positive_float, help="Requests per second per engine.")
    log_dir: str = setting("", flag="--log-dir", help="Copy every process's log here.")
    json: bool = switch(flag="--json", help=_JSON)

    def validate(self) -> None:
        if self.faults < 1:
            raise SettingsError("--faults must be at least 1")


@dataclass(frozen=True, kw_only=True)
class FuzzBench:
    cases: int = setting(100_000, flag="--cases", parse=positive_int,
                         help="In-process decoder cases in total, shared among the decoders.")
    seed: int = setting(1, flag="--seed", parse=int, help="Hypothesis seed (one run is reproducible).")
    mutants: int = setting(15, flag="--mutants", parse=int,
                           help="Quick byte mutants checked beside each input hypothesis draws (0: none).")
    process_cases: int | None = setting(
        None, flag="--process-cases", parse=int,
        help="Requests through the real router; a 25th of it is the number of examples (of about 6 inputs each) "
             "through the real bridge, and through the real processor (default: cases/50, 100..2000).")
    json: bool = switch(flag="--json", help=_JSON)
