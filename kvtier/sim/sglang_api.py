"""What `kvtier sim-worker` answers, as SGLang 0.5.x does, to a gateway deciding whether to
admit a worker and how loaded it is: SGLang's model gateway (`smg`) asks a worker URL for
`/health`, `/v1/models` (and reads `owned_by` to tell SGLang from other engines),
`/server_info` or `/get_server_info`, `/model_info` or `/get_model_info`, and `/v1/loads`.

Every route is served per rank under `/w/<rank>` (each rank is one worker URL, one DP rank of
an SGLang server seen alone) and at the root for the whole process (all ranks, as an SGLang
server with attention DP answers). `/server_info`'s `kv_events` descriptor is where that rank's
KV events are published, so `kvtier bridge --sglang-url <rank URL>` discovers it as it
discovers SGLang. Bodies are schemas/sglang_server.py's types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Protocol

import msgspec
from aiohttp import web

from kvtier.schemas.sglang_server import (
    KvEventsDescriptor,
    LoadQueues,
    LoadsReply,
    ModelCard,
    ModelInfo,
    ModelList,
    RankLoad,
    ServerInfo,
    VersionReply,
)
from kvtier.sim.hicache_sim import HiCacheSim, SimConfig


class Served(Protocol):
    """What of a sim-worker process (sim_worker.py `SimWorkerConfig`) these answers report."""

    host: str
    port: int
    replay_port: int
    sim: SimConfig
    model: str
    tokenizer: str

#: The SGLang release whose HTTP API this imitates.
SGLANG_VERSION = "0.5.23"
#: What the simulated engine takes as its longest prompt and most running requests.
CONTEXT_LENGTH = 131072
MAX_RUNNING_REQUESTS = 256


class SglangApi:
    def __init__(self, config: Served, sims: Sequence[HiCacheSim], sim_now: Callable[[float], float]):
        """`sim_now(wall)`: the simulated time at a monotonic wall time."""
        self.config, self.sims, self.sim_now = config, sims, sim_now
        self.started = int(time.time())

    def _ranks(self, request: web.Request) -> list[int]:
        """The ranks a request asks about: its `/w/<rank>`, else all of them."""
        count = len(self.sims)
        rank = request.match_info.get("rank")
        if rank is None:
            return list(range(count))
        if not 0 <= int(rank) < count:
            raise web.HTTPNotFound(reason=f"no rank {rank}; this sim-worker has {count}")
        return [int(rank)]

    def _model(self) -> str:
        return self.config.model

    async def models(self, request: web.Request) -> web.Response:
        self._ranks(request)
        return _reply(ModelList(data=[ModelCard(id=self._model(), created=self.started, root=self._model(),
                                                max_model_len=CONTEXT_LENGTH)]))

    async def server_info(self, request: web.Request) -> web.Response:
        ranks = self._ranks(request)
        config = self.config
        sim = config.sim
        hicache = sim.host_pages > 0
        return _reply(ServerInfo(
            kv_events=KvEventsDescriptor(
                publisher="zmq", endpoint_host=config.host, endpoint_port_base=config.port + ranks[0],
                block_size=sim.page_size, dp_size=len(ranks),
                replay_endpoint_port_base=config.replay_port + ranks[0]),
            page_size=sim.page_size, dp_size=len(ranks), enable_hierarchical_cache=hicache,
            hicache_ratio=sim.host_pages / sim.device_pages if hicache and sim.device_pages else None,
            hicache_storage_backend=("mooncake" if sim.l3 else None) if hicache else None,
            hicache_write_policy=sim.write_policy if hicache else None,
            model_path=self._model(), served_model_name=self._model(), version=SGLANG_VERSION,
            context_length=CONTEXT_LENGTH, max_running_requests=MAX_RUNNING_REQUESTS))

    async def model_info(self, request: web.Request) -> web.Response:
        self._ranks(request)
        return _reply(ModelInfo(model_path=self._model(), served_model_name=self._model(),
                                tokenizer_path=self.config.tokenizer or None))

    async def version(self, request: web.Request) -> web.Response:
        self._ranks(request)
        return _reply(VersionReply(version=SGLANG_VERSION))

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang generates one token to answer; a simulated rank that is up always can."""
        self._ranks(request)
        return web.Response(status=200)

    async def loads(self, request: web.Request) -> web.Response:
        """`/v1/loads`: each rank's requests and device pool at the current simulated time."""
        ranks = self._ranks(request)
        now = self.sim_now(time.monotonic())
        page, capacity = self.config.sim.page_size, self.config.sim.device_pages
        loads = []
        for rank in ranks:
            sim = self.sims[rank]
            waiting, running = sim.engine.request_counts(now)
            used = sim.device_pages_used * page
            loads.append(RankLoad(
                dp_rank=rank, timestamp=time.time(), num_running_reqs=running, num_waiting_reqs=waiting,
                num_waiting_uncached_tokens=sim.engine.queued_prefill_pages(now) * page,
                num_used_tokens=used, num_total_tokens=used, max_total_num_tokens=capacity * page,
                max_running_requests=MAX_RUNNING_REQUESTS, token_usage=used / (capacity * page) if capacity else 0.0,
                queues=LoadQueues(waiting=waiting)))
        return _reply(LoadsReply(timestamp=datetime.now(timezone.utc).isoformat(), version=SGLANG_VERSION,
                                 loads=loads))

    def add_routes(self, app: web.Application) -> None:
        for prefix in ("", r"/w/{rank:\d+}"):
            app.router.add_get(prefix + "/v1/models", self.models)
            app.router.add_get(prefix + "/server_info", self.server_info)
            app.router.add_get(prefix + "/get_server_info", self.server_info)
            app.router.add_get(prefix + "/model_info", self.model_info)
            app.router.add_get(prefix + "/get_model_info", self.model_info)
            app.router.add_get(prefix + "/version", self.version)
            app.router.add_get(prefix + "/health_generate", self.health_generate)
            app.router.add_get(prefix + "/v1/loads", self.loads)


_json = msgspec.json.Encoder()


def _reply(body: msgspec.Struct) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")
