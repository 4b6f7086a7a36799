"""`kvtier bench overload`: the front door at twice what the cluster can serve, with a worker
and a replica lost on the way, and every request accounted for.

The whole path as processes on embedded loopback servers (kvtier/testing/proxy_stack.py):
`--workers` sim-workers that answer in wall time (`--pace`: the first byte after the simulated
TTFT, its engine queue included), their bridges (short leases, health-gated), NATS, a
processor, Redis and two router replicas in proxy mode with busy thresholds and a queue. First
the cluster's capacity is measured as the best possible answer: a closed loop straight to the
workers. Then Poisson arrivals at 0.8x that capacity for `--low-seconds`, then at 2x for
`--seconds`; during the 2x phase 200 idle sockets are opened to a replica, a few prompts larger
than --max-prompt-bytes are sent, one sim-worker is killed (SIGKILL) and one replica is stopped
(SIGTERM: it drains).

The client is what a load balancer in front of the replicas does: requests go to the replicas
in turn, and one whose connection is refused (a replica gone) goes to the other. Every request
ends as exactly one of: completed (the stream ended with [DONE]; `migrated` counts those that
went to another worker first), refused (429/503; with or without Retry-After), rejected (another
4xx, e.g. the oversized prompts' 413), failed_before_first_byte (a 5xx), failed_after_first_byte
(the stream ended with an error event), or lost (no answer, or a stream cut without an error
event).

Memory: each replica's RSS before any load, at the start of the 2x phase and at its end, beside
its index's entries. The sim-workers' pools are small (`--device-pages`) so they are full, and
evicting, by the end of the 0.8x phase, and so is each router's tokenizer piece cache
(`--tokenizer-cache-mb`: every prompt is new text, kept whole until the cache's bound evicts it;
at the routers' default of 256 MiB it alone would grow the RSS through the whole run): from
there on the pages the index mirrors and the ids the cache keeps stay level, and what the RSS
does is the router's own. The cache's bytes are reported beside the RSS.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.bench.settings import OverloadBench
from kvtier.testing.clients import closed_loop_rate, metric_sum, router_health

if TYPE_CHECKING:
    from kvtier.testing.proxy_stack import ProxyStack

MODEL = "bench/overload-model"
PAGE_SIZE = 64
#: The replicas' --drain-timeout: the stopped one must be gone within it + 2 s of its SIGTERM.
DRAIN_TIMEOUT_S = 10.0
#: How long after the run the booked load is read: every release has landed by then.
LEAK_WAIT_S = 5.0
OUTCOMES = ("completed", "refused", "rejected", "failed_before_first_byte", "failed_after_first_byte", "lost")


@dataclass
class Outcome:
    kind: str
    phase: str
    ttft_s: float | None = None
    retry_after: bool = False
    migrated: bool = False
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    failovers: int = 0

    def count(self, kind: str, phase: str | None = None) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind and (phase is None or o.phase == phase))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class _Balancer:
    """The replicas in turn; one that refuses connections, or says it is shutting down (a
    draining replica's 503), is left out for the rest of the run."""

    def __init__(self, routers: list[str]):
        self.routers = list(routers)
        self.down: set[str] = set()
        self._turn = 0

    def pick(self) -> str | None:
        up = [r for r in self.routers if r not in self.down]
        if not up:
            return None
        self._turn += 1
        return up[self._turn % len(up)]


async def _one(session, balancer: _Balancer, body: bytes, phase: str, tally: Tally, timeout_s: float) -> None:
    import aiohttp

    started = time.perf_counter()
    for _ in range(len(balancer.routers)):
        router = balancer.pick()
        if router is None:
            break
        try:
            async with session.post(router + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    body = await r.read()
                    retry = "Retry-After" in r.headers
                    if r.status == 503 and b"shutting down" in body:
                        balancer.down.add(router)  # as a load balancer's health check would
                    kind = ("refused" if r.status in (429, 503) else "rejected" if r.status < 500
                            else "failed_before_first_byte")
                    tally.outcomes.append(Outcome(kind, phase, retry_after=retry,
                                                  detail=f"{r.status} {r.headers.get('X-Kvtier-Tried', '')}"))
                    return
                first = None
                tail = b""
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    tail = (tail + chunk)[-2048:]
                migrated = "X-Kvtier-Tried" in r.headers
                if b'"error"' in tail:
                    tally.outcomes.append(Outcome("failed_after_first_byte", phase, migrated=migrated))
                elif tail.rstrip().endswith(b"data: [DONE]"):
                    tally.outcomes.append(Outcome("completed", phase, ttft_s=(first or started) - started,
                                                  migrated=migrated))
                else:
                    tally.outcomes.append(Outcome("lost", phase, detail="stream cut without an error event"))
                return
        except aiohttp.ClientConnectorError:
            balancer.down.add(router)  # the replica is gone: the balancer sends this one elsewhere
            tally.failovers += 1
            continue
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            tally.outcomes.append(Outcome("lost", phase, detail=f"{type(exc).__name__}: {exc}"))
            return
    tally.outcomes.append(Outcome("lost", phase, detail="no replica accepted the connection"))


def _body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()


async def _open_loop(session, balancer, prompts, rate: float, seconds: float, phase: str, tally: Tally,
                     rng: random.Random, timeout_s: float, events=()) -> None:
    """Poisson arrivals at `rate` for `seconds`; `events`: (at seconds, coroutine function) run on time."""
    tasks = []
    pending = sorted(events, key=lambda e: e[0])
    started = time.perf_counter()
    next_at = started
    while True:
        now = time.perf_counter()
        while pending and now - started >= pending[0][0]:
            tasks.append(asyncio.ensure_future(pending.pop(0)[1]()))
        if now - started >= seconds:
            break
        if now >= next_at:
            tasks.append(asyncio.ensure_future(_one(session, balancer, prompts(), phase, tally, timeout_s)))
            next_at += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, min(next_at - time.perf_counter(), 0.01)))
    await asyncio.gather(*tasks)


async def _index_entries(session, router: str) -> int | None:
    health = await router_health(session, router)
    return sum(index.entries for index in health.indexes) if health else None


async def _tokenizer_cache_mb(session, router: str) -> float | None:
    """The replica's router_tokenizer_cache_bytes (its models together), in MiB; None if it is gone."""
    try:
        async with session.get(router + "/metrics", timeout=2) as r:
            text = (await r.read()).decode()
    except Exception:  # noqa: BLE001 - a replica that is gone has no metrics
        return None
    return round(metric_sum(text, "router_tokenizer_cache_bytes") / (1 << 20), 2)


async def _drive(stack: ProxyStack, vocabulary: list[str], bench: OverloadBench) -> dict:
    import aiohttp

    from kvtier.testing.processes import rss_mb

    rng = random.Random(bench.seed)

    def prompts() -> bytes:
        return _body(" ".join(rng.choice(vocabulary) for _ in range(bench.prompt_tokens - 1)), bench.max_tokens)

    tally = Tally()
    balancer = _Balancer(stack.routers)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(8):  # warm: connections, code paths
            await _one(session, balancer, prompts(), "warm-up", tally, bench.request_timeout)
        # completed requests/s of a closed loop straight to the workers: the best the cluster can do
        capacity = await closed_loop_rate(session, stack.workers, "/v1/completions", prompts, 2 * len(stack.workers),
                                          bench.capacity_seconds)
        rss_before_load = [rss_mb(p.live_pid) for p in stack.router_procs]
        await _open_loop(session, balancer, prompts, 0.8 * capacity, bench.low_seconds, "0.8x", tally, rng,
                         bench.request_timeout)
        # Start: the 2x phase's, when the workers' pools are full (--device-pages), so each
        # replica's index holds as many pages as it will; before that its growth is the
        # cluster's cache filling, which it must mirror, not a leak.
        rss_start = [rss_mb(p.live_pid) for p in stack.router_procs]
        entries_start = await _index_entries(session, stack.routers[0])
        cache_start = await _tokenizer_cache_mb(session, stack.routers[0])
        rss_samples = [("2x at 0%", rss_start[0])]

        def sample(label: str):
            async def take() -> None:
                rss_samples.append((label, rss_mb(stack.router_procs[0].live_pid)))
            return take

        idle: list[socket.socket] = []
        peaks: list[int] = []

        async def open_idle_sockets() -> None:
            host, port = stack.routers[0].removeprefix("http://").split(":")
            for _ in range(bench.idle_sockets):
                try:
                    idle.append(socket.create_connection((host, int(port)), timeout=2))
                except OSError:
                    break

        async def oversized() -> None:
            huge = _body("w1 " * (bench.max_prompt_bytes // 3 + 10), 1)
            for _ in range(3):
                await _one(session, balancer, huge, "oversized", tally, bench.request_timeout)

        async def kill_worker() -> None:
            stack.sim_procs[0].kill()

        exit_s: list[float] = []  # the drained replica's, from its SIGTERM

        async def watch_exit(signalled: float) -> None:
            while stack.router_procs[1].proc.poll() is None:
                await asyncio.sleep(0.02)
            exit_s.append(time.monotonic() - signalled)

        watching: list[asyncio.Task] = []

        async def stop_replica() -> None:
            for router in stack.routers:
                health = await router_health(session, router)
                if health:
                    peaks.append(health.queue.peak)
            stack.router_procs[1].proc.terminate()  # SIGTERM: it drains
            watching.append(asyncio.create_task(watch_exit(time.monotonic())))

        await _open_loop(session, balancer, prompts, 2 * capacity, bench.seconds, "2x", tally, rng,
                         bench.request_timeout, events=[(0.0, open_idle_sockets), (1.0, oversized),
                                                       (bench.seconds * 0.35, kill_worker),
                                                       (bench.seconds * 0.6, stop_replica),
                                                       *((bench.seconds * f, sample(f"2x at {f:.0%}"))
                                                         for f in (0.25, 0.5, 0.75, 0.99))])
        for router in stack.routers:
            health = await router_health(session, router)
            if health:
                peaks.append(health.queue.peak)
        rss_end = [rss_mb(p.live_pid) for p in stack.router_procs]
        await asyncio.wait(watching, timeout=DRAIN_TIMEOUT_S + 10)
        # every request has its answer: what is still booked 5 s later was never given back
        await asyncio.sleep(LEAK_WAIT_S)
        leaked = _booked_pages(stack.redis_url)
        entries_end = await _index_entries(session, stack.routers[0])
        cache_end = await _tokenizer_cache_mb(session, stack.routers[0])
        closed_by_router = 0
        for s in idle:
            s.setblocking(False)
            try:
                closed_by_router += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed_by_router += 1
            s.close()

    measured = [o for o in tally.outcomes if o.phase in ("0.8x", "2x")]
    counts = {kind: sum(1 for o in measured if o.kind == kind) for kind in OUTCOMES}
    refusals = [o for o in measured if o.kind == "refused"]
    low = [o.ttft_s for o in measured if o.phase == "0.8x" and o.ttft_s is not None]
    high = [o.ttft_s for o in measured if o.phase == "2x" and o.ttft_s is not None]
    oversized_outcomes = [o for o in tally.outcomes if o.phase == "oversized"]
    lows = {"p50": _quantile(low, 0.5) * 1000, "p99": _quantile(low, 0.99) * 1000}
    highs = {"p50": _quantile(high, 0.5) * 1000, "p99": _quantile(high, 0.99) * 1000}
    survivor_start, survivor_end = rss_start[0], rss_end[0]
    rss_growth = (survivor_end / survivor_start - 1) if survivor_start and survivor_end else float("nan")
    lost_details = sorted({o.detail for o in measured if o.kind == "lost"})[:5]
    return {
        "workers": len(stack.workers), "replicas": len(stack.routers), "prompt_tokens": bench.prompt_tokens,
        "capacity_requests_per_s": capacity, "offered_low_per_s": 0.8 * capacity, "offered_high_per_s": 2 * capacity,
        "low_seconds": bench.low_seconds, "high_seconds": bench.seconds,
        "sent": len(measured), **counts,
        "refused_with_retry_after": sum(1 for o in refusals if o.retry_after),
        "migrated": sum(1 for o in measured if o.migrated and o.kind == "completed"),
        "client_failovers": tally.failovers,
        "completed_low": sum(1 for o in measured if o.phase == "0.8x" and o.kind == "completed"),
        "completed_high": sum(1 for o in measured if o.phase == "2x" and o.kind == "completed"),
        "ttft_low_p50_ms": lows["p50"], "ttft_low_p99_ms": lows["p99"],
        "ttft_high_p50_ms": highs["p50"], "ttft_high_p99_ms": highs["p99"],
        "queue_peak": max(peaks, default=0),
        "idle_sockets_opened": bench.idle_sockets, "idle_sockets_closed_by_router": closed_by_router,
        "oversized_sent": len(oversized_outcomes),
        "oversized_refused_413": sum(1 for o in oversized_outcomes if o.detail.startswith("413")),
        "rss_start_mb": rss_start, "rss_end_mb": rss_end, "survivor_rss_growth": rss_growth,
        "survivor_rss_samples_mb": rss_samples, "rss_before_load_mb": rss_before_load,
        "index_entries_start": entries_start, "index_entries_end": entries_end,
        "tokenizer_cache_mb_start": cache_start, "tokenizer_cache_mb_end": cache_end,
        "tokenizer_cache_bound_mb": bench.tokenizer_cache_mb,
        "lost_details": lost_details,
        "failed_before_first_byte_details": sorted({o.detail for o in measured
                                                    if o.kind == "failed_before_first_byte"})[:5],
        "leaked_bookings": leaked,
        "drained_replica_exit_s": exit_s[0] if exit_s else None, "drain_timeout_s": DRAIN_TIMEOUT_S,
        "target_lost_0": counts["lost"] == 0,
        "target_leaked_bookings_0": leaked == 0,
        "target_drained_exit_within_drain_timeout_plus_2s": bool(exit_s) and exit_s[0] <= DRAIN_TIMEOUT_S + 2,
        "target_every_refusal_has_retry_after": all(o.retry_after for o in refusals),
        "target_no_failure_before_first_byte": counts["failed_before_first_byte"] == 0,
        "target_ttft_p99_high_le_3x_low": highs["p99"] <= 3 * lows["p99"],
        "target_rss_within_10pct": abs(rss_growth) <= 0.10,
    }


def run_overload_bench(bench: OverloadBench) -> int:
    from kvtier.testing.model_tokenizers import write_tokenizer
    from kvtier.testing.processes import work_folder
    from kvtier.testing.proxy_stack import proxy_stack

    with work_folder("kvtier-bench-overload-", "kvtier bench overload") as work:
        tokenizer = os.path.join(work, "tokenizer")
        vocabulary = write_tokenizer(tokenizer)
        with proxy_stack(work, MODEL, PAGE_SIZE, tokenizer, bench.workers, 2, [
                "--busy-prefill-tokens", str(bench.busy_prefill_tokens), "--queue-timeout", str(bench.queue_timeout),
                "--max-prompt-bytes", str(bench.max_prompt_bytes), "--drain-timeout", str(DRAIN_TIMEOUT_S),
                "--tokenizer-cache-mb", str(bench.tokenizer_cache_mb)],
                sim_flags=["--device-pages", str(bench.device_pages), "--pace"],
                bridge_flags=["--heartbeat", "0.5", "--lease-ttl", "3", "--engine-health-timeout", "1"]) as stack:
            results = asyncio.run(_drive(stack, vocabulary, bench))
    _print(results)
    if bench.json:
        print(json.dumps(results))
    return 0


def _booked_pages(redis_url: str) -> int:
    """Prefill and decode pages the routers hold booked on the model's workers, in Redis."""
    import redis

    from kvtier.schemas.state_keys import ModelKeys

    keys = ModelKeys.for_model(MODEL)
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(int(v) for key in (keys.prefill_load, keys.decode_load) for v in client.hgetall(key).values())
    finally:
        client.close()


def _print(r: dict) -> None:
    print(f"{r['workers']} paced sim-workers, {r['replicas']} router replicas in proxy mode, "
          f"{r['prompt_tokens']}-token prompts; capacity (straight to the workers, closed loop) "
          f"{r['capacity_requests_per_s']:.1f} requests/s")
    print(f"  offered {r['offered_low_per_s']:.1f}/s for {r['low_seconds']:.0f} s, then "
          f"{r['offered_high_per_s']:.1f}/s "
          f"for {r['high_seconds']:.0f} s (a sim-worker killed, a replica stopped, {r['idle_sockets_opened']} idle "
          "sockets, 3 oversized prompts)")
    print(f"  sent {r['sent']}: completed {r['completed']} (migrated {r['migrated']}), refused {r['refused']} "
          f"({r['refused_with_retry_after']} with Retry-After), rejected {r['rejected']}, failed before the first "
          f"byte {r['failed_before_first_byte']}, after it {r['failed_after_first_byte']}, lost {r['lost']}; "
          f"{r['client_failovers']} resent by the balancer to the other replica")
    print(f"  TTFT of completed requests: at 0.8x p50 {r['ttft_low_p50_ms']:.0f} ms, "
          f"p99 {r['ttft_low_p99_ms']:.0f} ms; "
          f"at 2x p50 {r['ttft_high_p50_ms']:.0f} ms, p99 {r['ttft_high_p99_ms']:.0f} ms (target p99 <= 3x)")
    exit_s = r["drained_replica_exit_s"]
    print(f"  booked pages left 5 s after the run: {r['leaked_bookings']}; the drained replica exited "
          + (f"{exit_s:.1f} s" if exit_s is not None else "never") + f" after SIGTERM (--drain-timeout "
          f"{r['drain_timeout_s']:g})")
    print(f"  queue peak {r['queue_peak']}; idle sockets closed by the router {r['idle_sockets_closed_by_router']} "
          f"of {r['idle_sockets_opened']}; oversized prompts refused 413: {r['oversized_refused_413']} of "
          f"{r['oversized_sent']}")
    print(f"  router RSS MB before any load {r['rss_before_load_mb']}; at the start of 2x (index "
          f"{r['index_entries_start']} entries, tokenizer cache {r['tokenizer_cache_mb_start']} of "
          f"{r['tokenizer_cache_bound_mb']} MiB) {r['rss_start_mb']}, at the end ({r['index_entries_end']} entries, "
          f"cache {r['tokenizer_cache_mb_end']} MiB) "
          f"{r['rss_end_mb']} "
          f"(survivor {r['survivor_rss_growth'] * 100:+.1f}%); survivor through the run: "
          + ", ".join(f"{label} {mb:.1f}" for label, mb in r["survivor_rss_samples_mb"] if mb is not None))
    targets = [k for k in r if k.startswith("target_")]
    print("  targets: " + ", ".join(f"{k[7:]} {'met' if r[k] else 'MISSED'}" for k in targets))
