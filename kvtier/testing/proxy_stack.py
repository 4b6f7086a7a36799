"""The proxy path as processes on embedded loopback servers (`kvtier bench proxy`, `kvtier bench
overload`, `kvtier bench peers`): nats-server and Redis, a processor, sim-workers serving the
OpenAI API with their bridges, and router replicas in proxy mode tokenizing with one model
folder; with `l3`, one real Mooncake master whose pool every sim-worker shares as its L3 tier
(HiCache's Mooncake backend) and every replica asks, so tier-aware scoring counts L3 pages."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtier.harness.mooncake import MooncakeMaster
from kvtier.testing.processes import (
    QUIET,
    KvtierSubprocess,
    start_processor,
    start_router,
    start_sim_workers,
    wait_announced,
    wait_http,
)

#: The replicas' budget for one shared-pool query (the router's default is 50 ms): the master
#: answers a request's keys in about 1 ms on loopback, but on a busy machine a slow answer would
#: drop the L3 credit of that decision (router_shared_pool_errors_total counts each).
L3_QUERY_TIMEOUT_MS = 200


def l3_router_flags(master: MooncakeMaster) -> list[str]:
    """What a router needs to count the pages in `master`'s pool (the workers' bridges announce
    their Mooncake layout with --hicache-storage-backend mooncake)."""
    return ["--shared-cache-type", "hicache", "--mooncake-master", master.http_url,
            "--shared-cache-timeout-ms", str(L3_QUERY_TIMEOUT_MS)]


@dataclass
class ProxyStack:
    #: each sim-worker's rank URL (its bridge's --worker-url), and each replica's base URL
    workers: list[str]
    routers: list[str]
    sim_procs: list[KvtierSubprocess]
    router_procs: list[KvtierSubprocess]
    #: the Redis the stack's state (and the routers' bookings) is in
    redis_url: str = ""
    #: with `l3`: the Mooncake master of the workers' shared L3 pool (`master.http_url` answers
    #: /batch_query_keys and /metrics), else None
    master: MooncakeMaster | None = None
    #: with `l3`: the flags every replica was given to see the L3 pool, for a router started on
    #: the stack later (`start_router(work, name, stack.redis_url, [..., *stack.l3_router_flags])`)
    l3_router_flags: list[str] = field(default_factory=list)


@contextlib.contextmanager
def proxy_stack(work: str, model: str, page_size: int, tokenizer: str, workers: int, replicas: int,
                router_flags: Iterable[str] = (), sim_flags: Iterable[str] = (),
                bridge_flags: Iterable[str] = (), l3: bool = False) -> Iterator[ProxyStack]:
    """The stack up (every worker announced, every replica answering /healthz), its processes'
    logs in `work`; stopped, last started first, on the way out. The replicas run `--proxy
    --tokenizer <model>=<tokenizer>` and `router_flags`. `l3`: the sim-workers run `--l3` on one
    Mooncake master (its pool is emptied only by `/flush_cache?storage=1`), which needs a
    private network namespace (kvtier/harness/mooncake.py says why)."""
    import redis

    from kvtier.harness.embedded import NatsServer, RedisServer
    from kvtier.harness.mooncake import require_private_netns

    if l3:
        require_private_netns("a proxy stack with an L3 tier")
    processes: list[KvtierSubprocess] = []
    pool: contextlib.AbstractContextManager[MooncakeMaster | None] = (
        MooncakeMaster() if l3 else contextlib.nullcontext())
    with NatsServer() as nats, RedisServer() as server, pool as master:
        client = redis.Redis.from_url(server.url)
        l3_flags = l3_router_flags(master) if master is not None else []
        if master is not None:
            sim_flags = [*sim_flags, "--l3", "--mooncake-rpc", master.rpc_address,
                         "--mooncake-metadata", master.metadata_url]
            bridge_flags = [*bridge_flags, "--hicache-storage-backend", "mooncake"]
        try:
            processes.append(start_processor(work, nats.url, server.url, QUIET))
            urls, sims, bridges = start_sim_workers(workers, work, nats.url, model, page_size, tokenizer,
                                                    sim_flags=sim_flags, bridge_flags=bridge_flags)
            processes += [*sims, *bridges]
            wait_announced(client, model, workers, processes, timeout=60)
            routers, router_procs = [], []
            for i in range(replicas):
                proc, url = start_router(work, f"router-{i}", server.url, [
                    "--proxy", "--tokenizer", f"{model}={tokenizer}", *router_flags, *l3_flags, *QUIET])
                processes.append(proc)
                router_procs.append(proc)
                routers.append(url)
            asyncio.run(wait_routers_up(routers, processes))
            yield ProxyStack(urls, routers, sims, router_procs, server.url, master, l3_flags)
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
