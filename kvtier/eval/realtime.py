"""`kvtier bench replay --realtime`: the trace replayed on the wall clock, through the live
pipeline, to measure the pipeline itself (decision latency, lag, degraded decisions).

Requests are sent at their trace times divided by `--time-scale` to a `kvtier sim-worker`
process (the simulated clock is the trace's, so TTFTs are in trace seconds); what each router
sees depends on how far the pipeline has got on this machine at that moment, so these figures
change with load. Routing quality is measured in lockstep (kvtier/eval/lockstep.py) instead.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.eval.policies import DEVICE_ONLY
from kvtier.eval.trace import TraceRequest, trace_tokens
from kvtier.schemas.routing import ReleaseStage, RouteOverrides, RouteRequest
from kvtier.schemas.sglang_server import GenerateMetaInfo, SamplingParams
from kvtier.schemas.sim import SimGenerateBody
from kvtier.sim.cost_model import COST_FLAGS
from kvtier.sim.sim_cluster import ClusterShape
from kvtier.testing import clients
from kvtier.testing.processes import (
    QUIET,
    KvtierSubprocess,
    start_bridge,
    start_router,
    start_sim_worker,
    wait_announced,
    wait_http,
)

ROUTED = {"least_load", "device_only", "tier_aware", "tier_aware_shared"}


def cost_flags(shape: ClusterShape) -> list[str]:
    return [str(part) for name, flag, _ in COST_FLAGS for part in (flag, getattr(shape.cost, name))]


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict = field(default_factory=lambda: {"device": 0, "host": 0, "l3": 0})
    ttft_s: list = field(default_factory=list)
    per_worker: dict = field(default_factory=dict)
    route_s: list = field(default_factory=list)
    wall_s: float = 0.0
    degraded: int = 0
    #: Requests that reached their worker after one with a later trace arrival: the simulated
    #: engine queues them behind it, so their TTFT grows by the gap (a wall-clock artefact).
    out_of_order: int = 0
    ttft_in_order_s: list = field(default_factory=list)
    #: Trace seconds between a request's arrival and when it reached its worker: how far the
    #: machine fell behind the trace (routing time included); large values mean the figures
    #: above describe this machine, not the policy.
    late_s: list = field(default_factory=list)

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s) or [0.0]
        counts = list(self.per_worker.values()) or [0]
        mean = statistics.fmean(counts) if counts else 0
        return {
            "requests": self.requests,
            "recomputed_tokens": self.recomputed_tokens,
            "reused_pct": (round(100 * (1 - self.recomputed_tokens / self.prompt_tokens), 2)
                           if self.prompt_tokens else 0.0),
            "hit_tokens": self.hit_tokens,
            "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
            "ttft_p99_ms": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1000, 1),
            "imbalance": round(max(counts) / mean, 3) if mean else None,
            "decisions_per_s": round(self.requests / self.wall_s, 1) if self.wall_s else None,
            "route_p50_ms": round(statistics.median(self.route_s) * 1000, 3) if self.route_s else None,
            "degraded_decisions": self.degraded,
            "out_of_order_requests": self.out_of_order,
            "reached_worker_late_p50_s": round(statistics.median(self.late_s), 3) if self.late_s else None,
            "reached_worker_late_p99_s": round(sorted(self.late_s)[min(len(self.late_s) - 1,
                                                                     int(0.99 * len(self.late_s)))], 3)
            if self.late_s else None,
            "ttft_p99_in_order_ms": round(sorted(self.ttft_in_order_s)[
                min(len(self.ttft_in_order_s) - 1, int(0.99 * len(self.ttft_in_order_s)))] * 1000, 1)
            if self.ttft_in_order_s else None,
        }


@dataclass(frozen=True)
class SimServed:
    """What a sim-worker's `meta_info` says of one request (it sends every field)."""

    prompt_tokens: int
    recomputed_tokens: int
    hit_tokens: dict[str, int]
    ttft_s: float
    e2e_latency: float
    arrived_behind_s: float

    @classmethod
    def of(cls, meta: GenerateMetaInfo) -> SimServed:
        details = meta.cached_tokens_details
        if (meta.prompt_tokens is None or meta.recomputed_tokens is None or meta.ttft_s is None
                or meta.e2e_latency is None or meta.arrived_behind_s is None or details is None):
            raise RuntimeError(f"not a kvtier sim-worker's meta_info: {meta}")
        return cls(meta.prompt_tokens, meta.recomputed_tokens,
                   {"device": details.device or 0, "host": details.host or 0, "l3": details.l3 or 0},
                   meta.ttft_s, meta.e2e_latency, meta.arrived_behind_s)


async def run_policy(policy: str, requests: list[TraceRequest], shape: ClusterShape, time_scale: float,
                     nats_url: str, redis_url: str, log_dir: str, seed: int,
                     progress: Callable[[str, int, int], None] | None = None) -> PolicyResult:
    import aiohttp
    import redis as redis_sync

    model = f"replay-{policy}"
    procs: list[KvtierSubprocess] = []
    result = PolicyResult(policy)
    rng = random.Random(seed)
    try:
        sim_flags = ["--device-pages", str(shape.device_pages), "--host-pages", str(shape.host_pages),
                     "--write-policy", shape.write_policy, "--dma-delay-ms", str(shape.dma_delay_s * 1000),
                     *cost_flags(shape), *QUIET]
        if shape.l3:
            sim_flags += ["--l3", "--l3-pages", str(shape.l3_capacity)]
        sim, ports = start_sim_worker(log_dir, f"{policy}-sim-worker", shape.page_size, sim_flags, ranks=shape.workers)
        procs.append(sim)
        sim_url = ports.url
        routers: list[str] = []
        if policy in ROUTED:
            procs.append(start_bridge(log_dir, f"{policy}-bridge", ports.endpoints(), "sim", model, shape.page_size,
                                      nats_url, ["--dp-size", str(shape.workers), "--hicache-storage-backend",
                                                 "mooncake", "--heartbeat", "1", *QUIET]))
            router_flags = ["--nats", nats_url, *QUIET]
            if policy == "least_load":
                router_flags += ["--router-mode", "load"]
            if policy == "tier_aware_shared":
                router_flags += ["--shared-cache-type", "hicache", "--mooncake-master", sim_url,
                                 "--shared-cache-timeout-ms", "200"]
            for r in range(2):
                router, url = start_router(log_dir, f"{policy}-router{r}", redis_url,
                                           ["--router-id", f"{policy}-{r}", *router_flags])
                procs.append(router)
                routers.append(url)
        # An overloaded machine makes requests late, not wrong (the simulated clock is the
        # trace's), so waits are generous rather than failures.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=300, sock_read=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as session:
            await wait_http(session, sim_url + "/healthz", procs)
            for url in routers:
                await wait_http(session, url + "/healthz", procs)
            if routers:
                client = redis_sync.Redis.from_url(redis_url)
                try:
                    await asyncio.to_thread(wait_announced, client, model, shape.workers, procs, 30,
                                            f"{policy}: workers")
                finally:
                    client.close()
            await _replay(policy, requests, shape, time_scale, session, sim_url, routers, rng, result, progress)
    finally:
        for p in reversed(procs):
            p.stop()
    return result


async def _replay(policy, requests, shape, time_scale, session, sim_url, routers, rng, result, progress):
    t0 = requests[0].timestamp / 1000.0
    loop = asyncio.get_running_loop()
    wall0 = loop.time()
    done = 0
    pending: set[asyncio.Task] = set()
    stop_ticker = asyncio.Event()

    def sim_now() -> float:
        return t0 + (loop.time() - wall0) * time_scale

    async def ticker():
        # device->host copies complete in simulated time even while no request arrives
        while not stop_ticker.is_set():
            try:
                await clients.advance(session, sim_url, sim_now())
            except Exception:  # noqa: BLE001 - best effort; the next request advances too
                pass
            await asyncio.sleep(0.02)

    async def release_later(router: str, request_id: str, owner: str, stage: ReleaseStage, delay_sim_s: float):
        await asyncio.sleep(delay_sim_s / time_scale)
        try:
            await clients.release(session, router, f"replay-{policy}", request_id, stage, owner=owner)
        except Exception:  # noqa: BLE001 - a lost release expires with its booking
            pass

    async def one(index: int, request: TraceRequest, arrival: float):
        nonlocal done
        tokens = trace_tokens(request)
        started = time.perf_counter()
        router = None
        request_id = f"req-{index}"
        if policy == "random":
            rank = rng.randrange(shape.workers)
        elif policy == "round_robin":
            rank = index % shape.workers
        else:
            router = routers[index % len(routers)]
            body = RouteRequest(model=f"replay-{policy}", token_ids=tokens, request_id=request_id,
                                max_new_tokens=request.output_length,
                                overrides=RouteOverrides(**DEVICE_ONLY) if policy == "device_only" else None)
            decision = await clients.route(session, router, body, f"{policy}: route failed")
            owner = decision.owner
            if decision.degraded:
                result.degraded += 1
            rank = int(decision.worker_id.rsplit("-dp", 1)[1])
        result.route_s.append(time.perf_counter() - started)
        result.late_s.append(max(0.0, sim_now() - arrival))
        meta = await clients.generate(
            session, f"{sim_url}/w/{rank}",
            SimGenerateBody(input_ids=tokens, now=arrival,
                            sampling_params=SamplingParams(max_new_tokens=request.output_length)),
            f"{policy}: sim-worker refused a request")
        served = SimServed.of(meta)
        result.requests += 1
        result.prompt_tokens += served.prompt_tokens
        result.recomputed_tokens += served.recomputed_tokens
        for tier, tokens_hit in served.hit_tokens.items():
            result.hit_tokens[tier] += tokens_hit
        result.ttft_s.append(served.ttft_s)
        if served.arrived_behind_s > 0:  # the engine had served a later arrival already
            result.out_of_order += 1
        else:
            result.ttft_in_order_s.append(served.ttft_s)
        result.per_worker[rank] = result.per_worker.get(rank, 0) + 1
        if router is not None:
            pending.add(asyncio.ensure_future(release_later(router, request_id, owner, ReleaseStage.FIRST_TOKEN,
                                                            served.ttft_s)))
            pending.add(asyncio.ensure_future(release_later(router, request_id, owner, ReleaseStage.COMPLETE,
                                                            served.e2e_latency)))
        done += 1
        if progress:
            progress(policy, done, len(requests))

    for p in range(shape.workers):
        result.per_worker[p] = 0
    tick = asyncio.ensure_future(ticker())
    tasks = []
    for index, request in enumerate(requests):
        arrival = request.timestamp / 1000.0
        delay = (arrival - t0) / time_scale - (loop.time() - wall0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, request, arrival)))
    await asyncio.gather(*tasks)
    result.wall_s = loop.time() - wall0
    stop_ticker.set()
    await tick
    for task in pending:
        task.cancel()


async def replay_all(requests, shape, time_scale, policies, nats_url, redis_url, log_dir, seed, progress=None):
    results = {}
    for policy in policies:
        result = await run_policy(policy, requests, shape, time_scale, nats_url, redis_url, log_dir, seed, progress)
        results[policy] = result
    return results


def run_realtime(requests, shape, time_scale, policies, seed, progress=None, log_dir=None):
    """Embedded nats-server + Redis + one processor, then every policy in turn."""
    import tempfile

    from kvtier.harness.embedded import NatsServer, RedisServer

    log_dir = log_dir or tempfile.mkdtemp(prefix="kvtier-replay-")
    with NatsServer() as nats_server, RedisServer() as redis_server:
        processor = KvtierSubprocess(["processor", "--nats", nats_server.url, "--redis", redis_server.url,
                                      "--partitions", "auto", "--log-level", "WARNING"], log_dir, "processor")
        try:
            import uvloop

            return uvloop.run(replay_all(requests, shape, time_scale, policies, nats_server.url,
                                         redis_server.url, log_dir, seed, progress)), log_dir
        finally:
            processor.stop()


