"""The stack `kvtier bench soak` runs (kvtier/bench/soak.py), every part a process on embedded
loopback servers: one `kvtier processor`, sim-workers of several simulated HiCache ranks each
with one `kvtier bridge --dp-size <ranks>` apiece (worker ids soak-a-dp0, soak-a-dp1, ...,
soak-b-dp0, ...), and router replicas; started (the decision log first, with the soak's
retention), waited for, flushed, their clocks moved, killed a sim-worker at a time (SIGKILL, by
PID) and stopped."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvtier.testing import clients
from kvtier.testing.processes import (
    QUIET,
    KvtierSubprocess,
    start_bridge,
    start_processor,
    start_router,
    start_sim_worker,
    wait_http,
)
from kvtier.testing.samplers import redis_state


@dataclass
class SimWorker:
    """One sim-worker process: its name (a, b, ...), base URL and worker id prefix."""

    name: str
    url: str
    prefix: str
    alive: bool = True


@dataclass
class SoakStack:
    log_dir: str
    model: str
    sim_workers: int
    ranks: int  # simulated ranks per sim-worker
    routers: int
    page_size: int
    device_pages: int
    host_pages: int
    heartbeat_s: float
    lease_ttl_s: float
    stream_max_age_s: float

    def __post_init__(self) -> None:
        self.procs: dict[str, KvtierSubprocess] = {}
        self.sims: list[SimWorker] = []
        self.router_urls: list[str] = []
        self.killed: set[str] = set()  # names of the processes killed

    def start(self, nats_url: str, redis_url: str) -> None:
        asyncio.run(_create_decisions_stream(nats_url, self.stream_max_age_s))
        stream = ["--stream-max-age", str(self.stream_max_age_s)]
        self.procs["processor"] = start_processor(self.log_dir, nats_url, redis_url,
                                                  ["--reap-interval", "1", *stream, *QUIET])
        for i in range(self.sim_workers):
            name = chr(ord("a") + i)
            sim, ports = start_sim_worker(self.log_dir, f"sim_{name}", self.page_size, [
                "--device-pages", str(self.device_pages), "--host-pages", str(self.host_pages), *QUIET],
                ranks=self.ranks)
            self.procs[f"sim_{name}"] = sim
            self.procs[f"bridge_{name}"] = start_bridge(
                self.log_dir, f"bridge_{name}", ports.endpoints(), f"soak-{name}", self.model, self.page_size,
                nats_url, ["--dp-size", str(self.ranks), "--heartbeat", str(self.heartbeat_s), "--lease-ttl",
                           str(self.lease_ttl_s), "--hicache", "on", *stream, *QUIET])
            prefix = f"soak-{name}" + ("-dp" if self.ranks > 1 else "")
            self.sims.append(SimWorker(name, ports.url, prefix))
        for r in range(self.routers):
            self.procs[f"router{r}"], url = start_router(self.log_dir, f"router{r}", redis_url, [
                "--nats", nats_url, "--router-id", f"soak-{r}", *QUIET])
            self.router_urls.append(url)

    def worker_ids(self, sim: SimWorker) -> list[str]:
        if self.ranks == 1:
            return [sim.prefix]
        return [f"{sim.prefix}{r}" for r in range(self.ranks)]

    def sim_of(self, worker_id: str) -> tuple[SimWorker, int]:
        """The sim-worker serving a worker id, and the worker's rank in it."""
        for sim in self.sims:
            if self.ranks == 1 and worker_id == sim.prefix:
                return sim, 0
            if self.ranks > 1 and worker_id.startswith(sim.prefix):
                return sim, int(worker_id[len(sim.prefix):])
        raise KeyError(worker_id)

    def pids(self) -> dict[str, int | None]:
        """Every process's PID by name, None once it is gone."""
        return {name: proc.live_pid for name, proc in self.procs.items()}

    async def wait_up(self, session, client, timeout: float = 90.0) -> None:
        """Until every sim-worker and router answers /healthz and every rank holds a lease."""
        total_ranks = self.sim_workers * self.ranks
        deadline = time.monotonic() + timeout
        for url in [s.url + "/healthz" for s in self.sims] + [r + "/healthz" for r in self.router_urls]:
            await wait_http(session, url, self.procs.values(), timeout=max(0.0, deadline - time.monotonic()),
                            interval=0.2)
        while redis_state(client, self.model)["live_workers"] < total_ranks:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {total_ranks} simulated workers did not announce within {timeout:.0f}s")
            await asyncio.sleep(0.2)

    def check_alive(self) -> None:
        """Raises with its log if a process exited that was not killed on purpose."""
        for name, proc in self.procs.items():
            if name not in self.killed:
                proc.check()

    async def flush(self, session) -> None:
        """`POST /flush_cache` to every live sim-worker: every rank drops its pools (SGLang's
        AllBlocksCleared)."""
        for sim in self.sims:
            if sim.alive:
                async with session.post(sim.url + "/flush_cache") as r:
                    if r.status != 200:
                        raise RuntimeError(f"{sim.url}/flush_cache: {r.status} {await r.text()}")

    async def advance(self, session, now: float) -> None:
        """Every live sim-worker's simulated clock to `now` (best effort): device->host copies
        land in simulated time even on ranks no request reaches."""
        for sim in self.sims:
            if sim.alive:
                try:
                    await clients.advance(session, sim.url, now)
                except Exception:  # noqa: BLE001 - the next tick tries again
                    pass

    def kill(self, sim: SimWorker) -> list[str]:
        """SIGKILL a sim-worker and its bridge, as a machine lost; the worker ids it served."""
        sim.alive = False
        for name in (f"bridge_{sim.name}", f"sim_{sim.name}"):
            self.procs[name].kill()
            self.killed.add(name)
        return self.worker_ids(sim)

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            try:
                proc.stop()
            except Exception:  # noqa: BLE001 - stop the others regardless
                pass


async def _create_decisions_stream(nats_url: str, max_age_s: float) -> None:
    """The routers' decision log with the soak's retention (routers keep an existing stream)."""
    import nats

    from kvtier.plumbing.streams import ensure_decisions_stream

    nc = await nats.connect(nats_url)
    try:
        await ensure_decisions_stream(nc.jetstream(), max_age_s=max_age_s)
    finally:
        await nc.close()
