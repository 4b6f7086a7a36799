"""The proxy path as processes on embedded loopback servers (`kvtier bench proxy`, `kvtier bench
overload`): nats-server and Redis, a processor, sim-workers serving the OpenAI API with their
bridges, and router replicas in proxy mode tokenizing with one model folder."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtier.testing.processes import (
    QUIET,
    KvtierSubprocess,
    start_processor,
    start_router,
    start_sim_workers,
    wait_announced,
    wait_http,
)


@dataclass
class ProxyStack:
    #: each sim-worker's rank URL (its bridge's --worker-url), and each replica's base URL
    workers: list[str]
    routers: list[str]
    sim_procs: list[KvtierSubprocess]
    router_procs: list[KvtierSubprocess]
    #: the Redis the stack's state (and the routers' bookings) is in
    redis_url: str = ""


@contextlib.contextmanager
def proxy_stack(work: str, model: str, page_size: int, tokenizer: str, workers: int, replicas: int,
                router_flags: Iterable[str] = (), sim_flags: Iterable[str] = (),
                bridge_flags: Iterable[str] = ()) -> Iterator[ProxyStack]:
    """The stack up (every worker announced, every replica answering /healthz), its processes'
    logs in `work`; stopped, last started first, on the way out. The replicas run `--proxy
    --tokenizer <model>=<tokenizer>` and `router_flags`."""
    import redis

    from kvtier.harness.embedded import NatsServer, RedisServer

    processes: list[KvtierSubprocess] = []
    with NatsServer() as nats, RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        try:
            processes.append(start_processor(work, nats.url, server.url, QUIET))
            urls, sims, bridges = start_sim_workers(workers, work, nats.url, model, page_size, tokenizer,
                                                    sim_flags=sim_flags, bridge_flags=bridge_flags)
            processes += [*sims, *bridges]
            wait_announced(client, model, workers, processes, timeout=60)
            routers, router_procs = [], []
            for i in range(replicas):
                proc, url = start_router(work, f"router-{i}", server.url,
                                         ["--proxy", "--tokenizer", f"{model}={tokenizer}", *router_flags, *QUIET])
                processes.append(proc)
                router_procs.append(proc)
                routers.append(url)
            asyncio.run(wait_routers_up(routers, processes))
            yield ProxyStack(urls, routers, sims, router_procs, server.url)
        finally:
            for p in reversed(processes):
                p.stop()
            client.close()


async def wait_routers_up(routers: list[str], processes: list[KvtierSubprocess]) -> None:
    """Until every router answers /healthz, failing at once with its log if one of `processes` exits."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for router in routers:
            await wait_http(session, router + "/healthz", processes, timeout=60)
