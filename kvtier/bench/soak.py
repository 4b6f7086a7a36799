"""`kvtier bench soak`: does memory track live pages, and come back down?

The whole stack as processes on embedded loopback servers (kvtier/testing/soak_stack.py;
nats-server with JetStream, a Redis-protocol server): `--sim-workers` `kvtier sim-worker`
processes of `--ranks` simulated HiCache ranks each, one `kvtier bridge --dp-size <ranks>` per
sim-worker, one `kvtier processor`, `--routers` `kvtier router` replicas. A looping request
stream, shaped by the Mooncake trace sample (its prompts, lengths and prefix sharing; fresh
token ids on every loop over the sample, so pages keep being created and evicted), is routed
(`POST /v1/route`), served by the chosen rank (`POST /w/<r>/generate`) and released
(`first_token` when served, `complete` after a simulated decode), at `--rate` requests/s. First
`--warm-up-s` of that load, not measured (the processes' bounded caches fill: the processor's
hash-check cache needs ~190k fresh pages to reach its final size), a lease left to expire and
every rank flushed, so that Redis's one-time costs (each script's first run) are paid; Redis's
baseline is taken then, with no page stored. Then five phases, each judged on its second half
(the first is the transition):

  steady  trace load on every worker; the pools fill and churn
  evict   every rank flushes its pools (`POST /flush_cache`: AllBlocksCleared, as SGLang's
          /flush_cache), then the load becomes a small fixed set of short prompts: few live pages
  refill  trace load again: the pools fill up again
  die     the last `--die` sim-workers and their bridges are killed (SIGKILL, by PID): their
          leases run out and the processor removes their pages; the survivors keep the load
  tail    a short steady tail on the survivors

Every `--sample-s` seconds it records (kvtier/testing/samplers.py `StackSampler`) the RSS
(VmRSS of /proc/<pid>/status) of every process, Redis `used_memory` (the change feed's memory
apart: bounded by its length, not by the live pages, it is left out of the per-entry figures)
and `INFO keyspace`, the live (page, tier) entries summed from every worker's state hash
(n1/n2/n4/n8), live workers, pending bookings (`kvt:{m}:bookings` zcard), the JetStream
streams' bytes and oldest-message age (the monitoring endpoint's /jsz), and decisions/s, and
the CPU each process used. Then `judge` gives the verdicts (see there): Redis bytes per live
entry within a band; Redis memory falling with the pages on the flush and on the deaths;
processor, router and surviving bridge RSS flat (window medians and least-squares slope);
bookings bounded and all given back after the drain; the dead workers' pages, leases and load
gone; Redis keys not growing; JetStream held by its retention; the load sustained.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields

from kvtier.bench.settings import SOAK_PHASES, SoakBench, SoakRun
from kvtier.eval.soak_verdicts import (
    Thresholds,
    format_table,
    format_verdicts,
    judge,
    phase_medians,
    rss_names,
    write_plot,
)
from kvtier.eval.trace import SAMPLE_TRACE, load_trace, trace_prompt
from kvtier.schemas.routing import ReleaseStage, RouteRequest
from kvtier.schemas.sim import SimGenerateBody
from kvtier.testing import clients
from kvtier.testing.samplers import StackSampler, after_drain, redis_state
from kvtier.testing.soak_stack import SoakStack

MODEL = "soak"
WARM_UP_WORKER = "soak-warm-up"


@dataclass(kw_only=True)
class SoakConfig(SoakRun):
    """One soak: what the flags set (SoakRun) and the run's own settings."""

    trace: str = str(SAMPLE_TRACE)
    decode_ms_per_token: float = 4.0  # a request's booking is completed after its simulated decode ...
    max_hold_s: float = 2.0  # ... at most this long after its first token
    max_inflight: int = 48
    evict_prompts: int = 32  # the evict phase's working set: this many prompts ...
    evict_prompt_pages: int = 8  # ... of this many pages
    heartbeat_s: float = 1.0
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        self.validate()
        if self.sample_s is None:
            self.sample_s = min(10.0, max(1.0, self.total_s / 120))

    @classmethod
    def of(cls, bench: SoakBench) -> SoakConfig:
        """The soak the flags ask for (--trace '': the sample shipped in kvtier/data)."""
        flagged = {f.name: getattr(bench, f.name) for f in fields(SoakRun)}
        return cls(**{**flagged, "trace": bench.trace or str(SAMPLE_TRACE)})

    def phase_bounds(self) -> list[tuple[str, float, float]]:
        bounds, t = [], 0.0
        for name, share in SOAK_PHASES:
            bounds.append((name, t, t + share * self.total_s))
            t += share * self.total_s
        return bounds


# --- the run ---------------------------------------------------------------------------------
@dataclass
class _Stats:
    requests: int = 0
    errors: int = 0
    error_examples: list = field(default_factory=list)
    routed_to_dead: int = 0
    routed_to_dead_late: int = 0
    decisions_since: int = 0


class Soak:
    def __init__(self, cfg: SoakConfig, log_dir: str, progress=None):
        self.cfg = cfg
        self.progress = progress or (lambda text: None)
        self.stack = SoakStack(log_dir, MODEL, cfg.sim_workers, cfg.ranks, cfg.routers, cfg.page_size,
                               cfg.device_pages, cfg.host_pages, cfg.heartbeat_s, cfg.lease_ttl_s,
                               cfg.stream_max_age_s)
        self.routers = self.stack.router_urls
        self.samples: list[dict] = []
        self.stats = _Stats()
        self.mode = "trace"
        self.kill_t: float | None = None
        self.dead_workers: list[str] = []  # killed
        self.dying_workers: set[str] = set()  # to be killed in the die phase
        self.baseline_used_memory = 0
        self._redis_pid: int | None = None

    def start_stack(self, nats_url: str, redis_url: str) -> None:
        self.stack.start(nats_url, redis_url)
        for sim in self.stack.sims[self.cfg.sim_workers - self.cfg.die:]:
            self.dying_workers.update(self.stack.worker_ids(sim))

    # -- load --
    async def _one(self, index: int) -> None:
        """One request: route, serve on the chosen rank, release at first token, and complete
        after its simulated decode (or at once when the chosen worker is dead)."""
        cfg, stats, session = self.cfg, self.stats, self.session
        if self.mode == "small":
            tokens, out_len = self.evict_set[index % len(self.evict_set)], 64
        else:
            request = self.trace[index % len(self.trace)]
            tokens = trace_prompt(request, index // len(self.trace), cfg.max_prompt_tokens)
            out_len = request.output_length
        router = self.routers[index % len(self.routers)]
        request_id = f"soak-{index}"
        sim, booked, decision = None, False, None
        try:
            decision = await clients.route(session, router, RouteRequest(
                model=MODEL, token_ids=tokens, request_id=request_id, max_new_tokens=out_len))
            stats.decisions_since += 1
            booked = True
            sim, rank = self.stack.sim_of(decision.worker_id)
            if not sim.alive:
                stats.routed_to_dead += 1
                if self.kill_t is not None and self.now() > self.kill_t + cfg.lease_ttl_s + 3:
                    stats.routed_to_dead_late += 1
                stats.requests += 1
                await self._release_later(router, request_id, decision.owner, 0)
                return
            await clients.generate(session, f"{sim.url}/w/{rank}",
                                   SimGenerateBody(input_ids=tokens, now=self.sim_now()))
            await clients.release(session, router, MODEL, request_id, ReleaseStage.FIRST_TOKEN, owner=decision.owner)
            stats.requests += 1
            hold = min(out_len * cfg.decode_ms_per_token / 1000, cfg.max_hold_s)
            task = asyncio.ensure_future(self._release_later(router, request_id, decision.owner, hold))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            stats.requests += 1
            if sim is not None and not sim.alive:
                stats.routed_to_dead += 1  # its worker died under it
            else:
                self._error(repr(exc))
            if booked and decision is not None:  # a client gives the booked load back when its request fails
                await self._release_later(router, request_id, decision.owner, 0)

    async def _release_later(self, router: str, request_id: str, owner: str, delay: float) -> None:
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            await clients.release(self.session, router, MODEL, request_id, ReleaseStage.COMPLETE, owner=owner)
        except Exception as exc:  # noqa: BLE001 - counted; the booking would expire
            self._error(f"release: {exc!r}")

    async def _load(self, stop: asyncio.Event) -> None:
        """Requests at --rate (jittered, never bursting to catch up), at most --max-inflight."""
        cfg, loop = self.cfg, asyncio.get_running_loop()
        inflight: set[asyncio.Task] = set()
        interval = 1.0 / cfg.rate
        next_at = loop.time()
        while not stop.is_set():
            next_at += self.rng.uniform(0.5, 1.5) * interval
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_at = loop.time()
            if len(inflight) >= cfg.max_inflight:
                await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.ensure_future(self._one(self.index))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            self.index += 1
        if inflight:
            await asyncio.wait(inflight)

    async def _ticker(self, stop: asyncio.Event) -> None:
        # device->host copies land in simulated time even on ranks no request reaches
        while not stop.is_set():
            await self.stack.advance(self.session, self.sim_now())
            await asyncio.sleep(0.1)

    def now(self) -> float:
        """Seconds since the measured load started."""
        return asyncio.get_running_loop().time() - self.t0

    def sim_now(self) -> float:
        """The simulated clock: seconds since the warm-up started."""
        return asyncio.get_running_loop().time() - self.clock0

    async def run(self, nats_server, redis_url: str) -> dict:
        import aiohttp
        import redis as redis_sync

        cfg = self.cfg
        self.trace = load_trace(cfg.trace)
        self.rng = random.Random(cfg.seed)
        self.index = 0
        self.pending: set[asyncio.Task] = set()
        self.evict_set = [trace_prompt(self.trace[i % len(self.trace)], -1, cfg.evict_prompt_pages * cfg.page_size)
                          for i in range(cfg.evict_prompts)]
        client = redis_sync.Redis.from_url(redis_url)
        servers = {"nats": nats_server.pid, "redis": self._redis_pid}
        loop = asyncio.get_running_loop()
        stats = self.stats
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as session:
            self.session = session
            self.clock0 = self.t0 = loop.time()
            await self.stack.wait_up(session, client)
            if cfg.warm_up_s > 0:
                self.progress(f"warm-up: {cfg.warm_up_s:g}s of trace load (not measured)")
                stop = asyncio.Event()
                tasks = [asyncio.ensure_future(self._load(stop)), asyncio.ensure_future(self._ticker(stop))]
                await asyncio.sleep(cfg.warm_up_s)
                stop.set()
                await asyncio.gather(*tasks)
                if self.pending:
                    await asyncio.wait(set(self.pending), timeout=cfg.max_hold_s + 30)
            await self._settle(client)
            self.stats = stats = _Stats()  # the warm-up is not counted
            self.progress(f"stack up ({len(self.stack.procs)} processes); Redis baseline "
                          f"{self.baseline_used_memory / 2**20:.2f} MB")

            self.t0 = loop.time()
            phases = cfg.phase_bounds()
            state = {"phase": phases[0][0]}
            stop = asyncio.Event()
            observer = StackSampler(client, MODEL, nats_server.monitor_port, self.dying_workers)

            async def sampler():
                last_t = self.now()
                while True:
                    t = self.now()
                    decisions, stats.decisions_since = stats.decisions_since, 0
                    sample = await asyncio.to_thread(observer.sample, t, state["phase"], self.stack.pids() | servers,
                                                     decisions, t - last_t)
                    last_t = t
                    self.samples.append(sample)
                    if stop.is_set():
                        return
                    await asyncio.sleep(max(0.0, cfg.sample_s - (self.now() - t)))

            tasks = [asyncio.ensure_future(self._load(stop)), asyncio.ensure_future(self._ticker(stop)),
                     asyncio.ensure_future(sampler())]
            try:
                for name, start, end in phases:
                    delay = start - self.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    state["phase"] = name
                    await self._enter_phase(name, session, self.now)
                    self.progress(f"{self.now():6.0f}s  phase {name}: {stats.requests:,} requests so far, "
                                  f"{stats.errors} errors")
                    while self.now() < end:
                        for task in tasks:
                            if task.done():
                                task.result()  # surface a crash of the driver itself
                        self.stack.check_alive()
                        await asyncio.sleep(min(1.0, max(0.0, end - self.now())))
                load_s = self.now()
                stop.set()
                await asyncio.gather(*tasks)
            finally:
                stop.set()
                for task in tasks:
                    task.cancel()
            # Drain: every outstanding release, then the booking checks.
            if self.pending:
                await asyncio.wait(set(self.pending), timeout=cfg.max_hold_s + 30)
        await asyncio.sleep(0.5)
        drained = after_drain(client, MODEL, self.dead_workers)
        client.close()
        return {"phases": phases, "load_s": load_s, "end": drained}

    async def _settle(self, client) -> None:
        """Take the baseline: pay Redis's one-time costs, flush every rank, measure."""
        await self._warm_up(self.session, client)
        base = []
        for _ in range(5):
            state0 = redis_state(client, MODEL)
            base.append(state0["used_memory"] - state0["mem_clients"] - state0["feed_bytes"])
            await asyncio.sleep(0.3)
        self.baseline_used_memory = int(statistics.median(base))

    async def _warm_up(self, session, client) -> None:
        """Pay Redis's one-time costs before the baseline: every script the processor and the
        routers run and the per-worker bookkeeping keys. A few one-page requests through each
        router, a lease expired, then every rank flushed: no page is left when the baseline
        is taken."""
        from kvtier.consumers.apply import TierStateWriter
        from kvtier.schemas.events import BridgeCursor, WorkerAnnounce
        from kvtier.schemas.state_keys import ModelKeys
        from kvtier.schemas.worker import WorkerMetadata

        for i in range(2 * len(self.routers)):
            router = self.routers[i % len(self.routers)]
            tokens = [60_000 + i] * self.cfg.page_size
            decision = await clients.route(session, router, RouteRequest(model=MODEL, token_ids=tokens,
                                                                          request_id=f"warm-{i}"),
                                           "warm-up route failed")
            sim, rank = self.stack.sim_of(decision.worker_id)
            await clients.post(session, f"{sim.url}/w/{rank}/generate",
                               SimGenerateBody(input_ids=tokens, now=self.sim_now()))
            for stage in (ReleaseStage.FIRST_TOKEN, ReleaseStage.COMPLETE):
                await clients.release(session, router, MODEL, f"warm-{i}", stage, owner=decision.owner)
        # A worker that announces itself once with a short lease: the processor's expiry
        # script runs for the first time now rather than when the die phase is measured
        # (a script's first run costs Redis ~90 KB, once).
        leases = ModelKeys.for_model(MODEL).leases
        TierStateWriter(client).announce(WorkerAnnounce(
            metadata=WorkerMetadata(worker_id=WARM_UP_WORKER, model=MODEL, page_size=self.cfg.page_size),
            ts=time.time(), lease_ttl_s=0.5, cursor=BridgeCursor(epoch=1, seq=0)))
        deadline = time.monotonic() + 20
        while client.zscore(leases, WARM_UP_WORKER) is not None:
            if time.monotonic() > deadline:
                raise RuntimeError("the processor did not expire the warm-up worker's lease within 20s")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        await self.stack.flush(session)
        deadline = time.monotonic() + 30
        while any(sum(c) for c in redis_state(client, MODEL)["per_worker"].values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up's pages were not cleared within 30s of /flush_cache")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)

    def _error(self, text: str) -> None:
        self.stats.errors += 1
        if len(self.stats.error_examples) < 5:
            self.stats.error_examples.append(text[:300])

    async def _enter_phase(self, name: str, session, now) -> None:
        cfg = self.cfg
        if name in ("steady", "refill"):
            self.mode = "trace"
        elif name == "evict":
            self.mode = "small"
            await self.stack.flush(session)
        elif name == "die":
            self.mode = "trace"
            for sim in self.stack.sims[cfg.sim_workers - cfg.die:]:
                self.dead_workers += self.stack.kill(sim)
            self.kill_t = now()


def run_soak(cfg: SoakConfig, progress=None) -> dict:
    from kvtier.harness.embedded import NatsServer, RedisServer

    log_dir = tempfile.mkdtemp(prefix="kvtier-soak-")
    soak = Soak(cfg, log_dir, progress)
    started = time.monotonic()
    with NatsServer() as nats_server, RedisServer() as redis_server:
        soak._redis_pid = redis_server.pid
        try:
            soak.start_stack(nats_server.url, redis_server.url)
            try:
                import uvloop

                result = uvloop.run(soak.run(nats_server, redis_server.url))
            except ImportError:
                result = asyncio.run(soak.run(nats_server, redis_server.url))
        finally:
            soak.stack.stop()
    phases = result["phases"]
    meta = {"rate": cfg.rate, "requests": soak.stats.requests, "errors": soak.stats.errors,
            "routed_to_dead": soak.stats.routed_to_dead, "routed_to_dead_late": soak.stats.routed_to_dead_late,
            "load_s": result["load_s"], "kill_t": soak.kill_t, "lease_ttl_s": cfg.lease_ttl_s,
            "sample_s": cfg.sample_s, "end": result["end"], "stream_max_age_s": cfg.stream_max_age_s,
            "max_hold_s": cfg.max_hold_s, "max_inflight": cfg.max_inflight,
            "survivors": [k for k in rss_names(soak.samples)
                          if k.startswith(("rss_processor", "rss_router", "rss_bridge"))
                          and not any(k == f"rss_{p}_mb" for p in soak.stack.killed)]}
    verdicts = judge(soak.samples, phases, soak.baseline_used_memory, meta, cfg.thresholds)
    cfg_dict = asdict(cfg)
    cfg_dict.pop("thresholds")
    return {
        "bench": "soak", "minutes": cfg.minutes, "sample_s": cfg.sample_s, "samples": len(soak.samples),
        "config": cfg_dict, "thresholds": asdict(cfg.thresholds),
        "phases": {name: {"start_s": round(start, 1), "end_s": round(end, 1), **medians}
                   for (name, start, end), medians in zip(phases, phase_medians(soak.samples, phases).values())},
        "baseline_used_memory": soak.baseline_used_memory,
        "load": {"requests": soak.stats.requests, "errors": soak.stats.errors,
                 "error_examples": soak.stats.error_examples, "routed_to_dead": soak.stats.routed_to_dead,
                 "routed_to_dead_late": soak.stats.routed_to_dead_late, "seconds": round(result["load_s"], 1)},
        "end": result["end"], "verdicts": verdicts, "ok": all(v["ok"] for v in verdicts),
        "series": soak.samples, "seconds": round(time.monotonic() - started, 1), "logs": log_dir,
        "_phase_bounds": phases,
    }


def run_soak_bench(bench: SoakBench) -> int:
    cfg = SoakConfig.of(bench)
    phases = cfg.phase_bounds()
    print(f"kvtier bench soak: {cfg.minutes:g} min at {cfg.rate:g} requests/s on {cfg.sim_workers} sim-workers x "
          f"{cfg.ranks} ranks ({cfg.device_pages} device + {cfg.host_pages} host pages "
          f"of {cfg.page_size} tokens each), "
          f"{cfg.routers} routers; phases " + ", ".join(f"{n} {e - s:.0f}s" for n, s, e in phases)
          + f" after a {cfg.warm_up_s:g}s warm-up; a sample every {cfg.sample_s:g}s", file=sys.stderr, flush=True)
    report = run_soak(cfg, progress=lambda text: print("  " + text, file=sys.stderr, flush=True))
    bounds = report.pop("_phase_bounds")
    medians = {name: {k: v for k, v in m.items() if k not in ("start_s", "end_s")}
               for name, m in report["phases"].items()}
    print(format_table(medians, bounds, report["baseline_used_memory"]))
    print()
    print(format_verdicts(report["verdicts"]))
    if report["load"]["error_examples"]:
        print("errors, e.g.: " + " | ".join(report["load"]["error_examples"]))
    print(f"{'PASS' if report['ok'] else 'FAIL'}: {sum(v['ok'] for v in report['verdicts'])}/{len(report['verdicts'])} "
          f"verdicts; {report['samples']} samples; took {report['seconds']:.0f}s; logs in {report['logs']}")
    if bench.plot and write_plot(report["series"], bounds, report["baseline_used_memory"], bench.plot):
        print(f"plot: {bench.plot}")
    if bench.json:
        print(json.dumps(report, separators=(",", ":")))
    return 0 if report["ok"] else 1
