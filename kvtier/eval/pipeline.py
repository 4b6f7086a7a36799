"""A routing policy that goes through the real pipeline, in lockstep with the trace clock.

The simulated ranks' KV events leave through SGLang's wire format (one ZMQ PUB and replay
socket per rank, here in the driver), and everything after that is the real thing: `kvtier
bridge --dp-size N` -> JetStream -> `kvtier processor` -> Redis -> two `kvtier router`
replicas answering `/v1/route` over HTTP. For `tier_aware_shared` the driver also answers the
routers' Mooncake existence queries from the simulated L3 pool.

Before each decision at trace time t:
  1. the bookings whose simulated first token or completion is due by t are released;
  2. every event batch due by t - visibility lag is published, and the driver waits until
     each rank's state in Redis has applied it (`source_seq`, the engine seq the processor
     last applied), so the routers see exactly that much: no more, no less, however slow
     the machine;
  3. the next router replica (round robin over the two) is asked.
The routers are seeded (`--seed`), so their tie-breaking draws are the same in every run.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.eval.policies import CandidateView, Decision, worker_id
from kvtier.eval.trace import PreparedRequest
from kvtier.schemas.router_health import decode_router_health
from kvtier.schemas.routing import ReleaseStage, RouteOverrides, RouteRequest
from kvtier.schemas.state_keys import ModelKeys
from kvtier.sim.sim_cluster import SimCluster
from kvtier.testing import clients
from kvtier.testing.processes import QUIET, KvtierSubprocess, start_bridge, start_processor, start_router, wait_http

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from kvtier.harness.embedded import NatsServer, RedisServer
    from kvtier.sim.sglang_publisher import SglangEventPublisher

#: How long the driver waits for the pipeline to apply a batch before calling it broken.
CATCH_UP_TIMEOUT_S = 60.0


@dataclass
class PipelineStack:
    """The servers every routed policy shares: nats-server, Redis, one processor."""

    nats_url: str
    redis_url: str
    log_dir: str


@dataclass(order=True)
class _Release:
    at: float
    seq: int
    request_id: str = field(compare=False)
    stage: str = field(compare=False)
    ttft_ms: float | None = field(compare=False, default=None)  # a first token's, as the client measured it


class PipelinePolicy:
    needs_events = True
    needs_tokens = True

    def __init__(self, name: str, stack: PipelineStack, workers: int, page_size: int, visibility_lag_s: float,
                 seed: int, router_args: Sequence[str] = (), overrides: dict | None = None, shared: bool = False,
                 replicas: int = 2, prices_pool: bool = False):
        """`shared`: the routers credit the simulated L3 pool's pages (`--shared-cache-type
        hicache`); `prices_pool`: they are given the pool only to price its pages in the work their
        rates learn from (`--mooncake-master` alone), as PredictedTtftModel is."""
        self.name = name
        self.model = f"replay-{name}"
        self.stack = stack
        self.workers = workers
        self.page_size = page_size
        self.lag = visibility_lag_s
        self.seed = seed
        self.router_args = list(router_args)
        self.overrides = overrides
        self.shared = shared
        self.prices_pool = prices_pool
        self.replicas = replicas
        self.procs: list[KvtierSubprocess] = []
        self.publishers: list[SglangEventPublisher] = []
        self.routers: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        self._token = secrets.token_urlsafe(16)
        self._redis: Any = None  # redis_async_client's: a redis.asyncio Redis or RedisCluster
        self._pool_runner: web.AppRunner | None = None
        self._releases: list[_Release] = []
        self._owners: dict[str, str] = {}  # request id -> the owner secret its /v1/route answer named
        self._seq = itertools.count()
        self._published = [-1] * workers  # last engine seq published per rank
        self._state_keys = [ModelKeys.for_model(self.model).state(worker_id(r)) for r in range(workers)]

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, cluster: SimCluster) -> None:
        import aiohttp
        from aiohttp import web

        from kvtier.harness.embedded import free_port
        from kvtier.plumbing.connections import redis_async_client
        from kvtier.sim.sglang_publisher import SglangEventPublisher
        from kvtier.sim.sim_worker import free_port_block, pool_query_response

        zmq_base, replay_base = free_port_block(self.workers), free_port_block(self.workers)
        self.publishers = [SglangEventPublisher(f"tcp://127.0.0.1:{zmq_base + r}",
                                                f"tcp://127.0.0.1:{replay_base + r}", attn_dp_rank=r)
                           for r in range(self.workers)]
        log_dir = self.stack.log_dir
        # The replay is the operator's own client: with the routers' token its first tokens
        # (simulated times, released whenever the replay gets to them) teach in full, as a
        # trusted client's do (router/rates.py ClientSamples bounds the others).
        router_args = ["--nats", self.stack.nats_url, *QUIET, "--booking-ttl", "86400", "--state-timeout-ms", "30000",
                       "--auth-token", self._token, *self.router_args]
        if self.shared or (self.prices_pool and cluster.pool is not None):
            app = web.Application()
            async def query(request):
                return pool_query_response(cluster.pool, request)

            app.router.add_get("/batch_query_keys", query)
            self._pool_runner = runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            pool_port = free_port()
            await web.TCPSite(runner, "127.0.0.1", pool_port).start()
            router_args += [*(["--shared-cache-type", "hicache"] if self.shared else []),
                            "--mooncake-master", f"http://127.0.0.1:{pool_port}", "--shared-cache-timeout-ms", "30000"]
        self.procs.append(start_bridge(
            log_dir, f"{self.name}-bridge", (f"tcp://127.0.0.1:{zmq_base}", f"tcp://127.0.0.1:{replay_base}"), "sim",
            self.model, self.page_size, self.stack.nats_url,
            ["--dp-size", str(self.workers), "--hicache-storage-backend", "mooncake", "--heartbeat", "1", *QUIET]))
        for r in range(self.replicas):
            router, url = start_router(log_dir, f"{self.name}-router{r}", self.stack.redis_url,
                                       ["--router-id", f"{self.name}-{r}", "--seed", str(self.seed + r), *router_args])
            self.procs.append(router)
            self.routers.append(url)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=120, sock_read=120)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), timeout=timeout,
                                              headers={"Authorization": f"Bearer {self._token}"})
        for url in self.routers:
            await wait_http(self.session, url + "/healthz", self.procs, timeout=60)
        self._redis = redis_async_client(self.stack.redis_url)
        keys = ModelKeys.for_model(self.model)
        deadline = time.monotonic() + 60
        # Every worker announced and the model's state ready (a first model in a fresh store is
        # set up by the processor first; routers would answer "state-store-rebuilding" meanwhile).
        while not await self._ready(keys):
            self._check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the bridge's {self.workers} workers did not announce, or the "
                                   f"model's state was not ready, within 60s (logs in {log_dir})")
            await asyncio.sleep(0.05)

    async def _ready(self, keys: ModelKeys) -> bool:
        marker = await self.redis.hgetall(keys.incarnation)
        if not (await self.redis.zcard(keys.leases) >= self.workers and marker.get(b"ready") == b"1"
                and marker.get(b"rebuilding") != b"1"):
            return False
        # ... and every router's in-memory index of the model built (else its first decisions
        # walk in Redis, said as degraded: index-not-ready).
        for url in self.routers:
            async with self.session.get(url + "/healthz") as response:
                health = decode_router_health(await response.read())
            if health.reads_index and not any(i.model == keys.model_token and i.ready
                                                           for i in health.indexes):
                return False
        return True

    async def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for publisher in self.publishers:
            publisher.close()
        if self._session is not None:
            await self._session.close()
        if self._redis is not None:
            await self._redis.aclose()
        if self._pool_runner is not None:
            await self._pool_runner.cleanup()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"{self.name}: not started")
        return self._session

    @property
    def redis(self) -> Any:
        if self._redis is None:
            raise RuntimeError(f"{self.name}: not started")
        return self._redis

    def _check(self) -> None:
        for p in self.procs:
            p.check()

    # --- one decision ----------------------------------------------------------------------
    async def _release_due(self, now: float) -> None:
        """Every release due by `now`. First tokens that teach the workers' rates go one at a
        time in their order (a worker's fit depends on the order of its samples), before the
        rest; the rest together, a completion standing for its first token too."""
        due: dict[str, str] = {}
        teaching: list[_Release] = []
        while self._releases and self._releases[0].at <= now:
            r = heapq.heappop(self._releases)
            if r.ttft_ms is not None:
                teaching.append(r)
            elif due.get(r.request_id) != "complete":  # completion gives back everything, first token included
                due[r.request_id] = r.stage
        for r in teaching:
            await self._release(r.request_id, r.stage, r.ttft_ms)
        if due:
            await asyncio.gather(*(self._release(request_id, stage) for request_id, stage in due.items()))

    async def _release(self, request_id: str, stage: str, ttft_ms: float | None = None) -> None:
        owner = self._owners.pop(request_id, "") if stage == "complete" else self._owners.get(request_id, "")
        status = await clients.release(self.session, self.routers[0], self.model, request_id, ReleaseStage(stage),
                                       ttft_ms, owner=owner)
        if status != 200:
            raise RuntimeError(f"{self.name}: {self.routers[0]}/v1/release of {request_id} ({stage}) answered {status}")

    async def _publish_and_catch_up(self, cluster: SimCluster, now: float) -> None:
        for rank, publisher in enumerate(self.publishers):
            for events in cluster.events_until(rank, now - self.lag):
                self._published[rank] = publisher.publish(events)
        waiting = [r for r in range(self.workers) if self._published[r] >= 0]
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while waiting:
            pipe = self.redis.pipeline(transaction=False)
            for rank in waiting:
                pipe.hget(self._state_keys[rank], "source_seq")
            applied = await pipe.execute()
            waiting = [r for r, seq in zip(waiting, applied) if seq is None or int(seq) < self._published[r]]
            if not waiting:
                return
            if time.monotonic() > deadline:
                self._check()
                raise RuntimeError(f"{self.name}: the pipeline did not apply ranks {waiting} within "
                                   f"{CATCH_UP_TIMEOUT_S:.0f}s (logs in {self.stack.log_dir})")
            await asyncio.sleep(0.0005)

    async def decide(self, request: PreparedRequest, now: float, cluster: SimCluster, truth,
                     tokens: list[int] | None = None) -> Decision:
        await self._release_due(now)
        await self._publish_and_catch_up(cluster, now)
        if tokens is None:
            raise ValueError(f"{self.name}: a pipeline policy routes by the request's tokens (needs_tokens)")
        body = RouteRequest(model=self.model, token_ids=tokens, request_id=f"req-{request.index}",
                            max_new_tokens=request.output_tokens,
                            overrides=RouteOverrides(**self.overrides) if self.overrides else None)
        router = self.routers[request.index % len(self.routers)]
        answer = await clients.route(self.session, router, body, f"{self.name}: {router}/v1/route answered")
        self._owners[body.request_id or ""] = answer.owner
        seen = [CandidateView(rank_of(c.worker_id), c.overlap, c.prefill_load, c.decode_load, c.logit)
                for c in answer.candidates]
        return Decision(rank_of(answer.worker_id), seen, list(answer.degraded))

    def served(self, request: PreparedRequest, decision: Decision, result, now: float) -> None:
        request_id = f"req-{request.index}"
        # the client's TTFT, simulated (the time since booking, which a router takes by default,
        # is wall time and means nothing here): every router learns rates from it
        heapq.heappush(self._releases, _Release(now + result.ttft_s, next(self._seq), request_id, "first_token",
                                                result.ttft_s * 1000))
        heapq.heappush(self._releases, _Release(result.complete_at, next(self._seq), request_id, "complete"))


def rank_of(worker: str) -> int:
    return int(worker.rsplit("-dp", 1)[1])


class running_stack:
    """`with running_stack(log_dir) as stack:` embedded nats-server and Redis and one
    `kvtier processor`, stopped (by PID) on exit."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._servers: list[NatsServer | RedisServer] = []
        self._processor: KvtierSubprocess | None = None

    def __enter__(self) -> PipelineStack:
        from kvtier.harness.embedded import NatsServer, RedisServer

        try:
            nats_server = NatsServer()
            self._servers.append(nats_server.__enter__())
            redis_server = RedisServer()
            self._servers.append(redis_server.__enter__())
            self._processor = start_processor(self.log_dir, nats_server.url, redis_server.url,
                                              ["--partitions", "auto", *QUIET])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return PipelineStack(nats_server.url, redis_server.url, self.log_dir)

    def __exit__(self, *exc) -> None:
        if self._processor is not None:
            self._processor.stop()
        for server in reversed(self._servers):
            server.__exit__(None, None, None)
