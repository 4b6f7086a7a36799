"""kvtier subcommands that a bench starts beside itself, each in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable


class KvtierSubprocess:
    """A kvtier subcommand in its own process, output to a log file, stopped by PID."""

    def __init__(self, args: list[str], log_dir: str, name: str):
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.name = name

    def tail(self, n: int = 2000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")

    @property
    def live_pid(self) -> int | None:
        """The PID while the process runs, else None."""
        return self.proc.pid if self.proc.poll() is None else None

    def kill(self) -> None:
        """A crash: SIGKILL by PID, no chance to clean up."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


async def wait_http(session, url: str, procs: Iterable[KvtierSubprocess], timeout: float = 30.0,
                    interval: float = 0.1) -> None:
    """Until `url` answers 200 (an aiohttp session), failing at once with its log if one of
    `procs` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.check()
        try:
            async with session.get(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:.0f}s")
        await asyncio.sleep(interval)


def wait_announced(client, model: str, workers: int, procs: Iterable[KvtierSubprocess], timeout: float,
                   what: str = "workers") -> None:
    """Until `workers` workers of `model` hold a lease in Redis (a sync redis client), failing
    at once with its log if one of `procs` exits meanwhile."""
    from kvtier.schemas.state_keys import ModelKeys

    leases = ModelKeys.for_model(model).leases
    deadline = time.monotonic() + timeout
    while client.zcard(leases) < workers:
        for p in procs:
            p.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not announce within {timeout:.0f}s")
        time.sleep(0.1)


def rss_mb(pid: int | None) -> float | None:
    """A process's resident memory in MB (None: no such process)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 2)
    except OSError:
        return None
    return None


def start_sim_workers(count: int, work: str, nats_url: str, model: str, page_size: int, tokenizer: str,
                      sim_flags: Iterable[str] = (), bridge_flags: Iterable[str] = ()
                      ) -> tuple[list[str], list[KvtierSubprocess], list[KvtierSubprocess]]:
    """`count` sim-workers serving the OpenAI API with `tokenizer`, each with its bridge (worker
    ids w0, w1, ...): (their URLs as a bridge's --worker-url, the sim-workers, the bridges)."""
    from kvtier.harness.embedded import free_port
    from kvtier.sim.sim_worker import free_port_block

    quiet = ["--log-level", "WARNING"]
    urls, sims, bridges = [], [], []
    for i in range(count):
        zmq, replay, port = free_port_block(1), free_port_block(1), free_port()
        sims.append(KvtierSubprocess(
            ["sim-worker", "--port", str(zmq), "--replay-port", str(replay), "--http-port", str(port),
             "--page-size", str(page_size), "--tokenizer", tokenizer, "--model", model, "--dma-delay-ms", "0",
             *sim_flags, *quiet], work, f"sim-worker-{i}"))
        url = f"http://127.0.0.1:{port}/w/0"
        bridges.append(KvtierSubprocess(
            ["bridge", "--endpoint", f"tcp://127.0.0.1:{zmq}", "--replay-endpoint", f"tcp://127.0.0.1:{replay}",
             "--worker-id", f"w{i}", "--model", model, "--page-size", str(page_size), "--nats", nats_url,
             "--worker-url", url, *bridge_flags, *quiet], work, f"bridge-{i}"))
        urls.append(url)
    return urls, sims, bridges
