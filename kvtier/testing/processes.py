"""kvtier subcommands that a bench, the evaluation or a test starts beside itself, each in its own
process: started (a processor, a router, a sim-worker, a bridge, each on free ports), waited for,
and stopped or killed by PID; a process's memory; a scratch folder kept when a run fails."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

#: The flags that keep a started process's log to its warnings.
QUIET = ("--log-level", "WARNING")


class KvtierSubprocess:
    """A kvtier subcommand in its own process, output to a log file, stopped by PID. `module`:
    the module run (`python -m`), kvtier's command line unless told; `log_dir` None: a log file
    of its own in the temporary folder; `prefix`: a command that runs it (`prlimit ...`); `python`:
    the interpreter, this one unless told (a peer's own venv)."""

    def __init__(self, args: Sequence[str], log_dir: str | None, name: str, module: str = "kvtier.cli",
                 env: dict[str, str] | None = None, prefix: Sequence[str] = (), python: str | None = None):
        if log_dir is None:
            handle, self.log_path = tempfile.mkstemp(prefix=f"kvtier-{name}-", suffix=".log")
            os.close(handle)
        else:
            self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.args = [*prefix, python or sys.executable, "-m", module, *args]
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env} if env else None, start_new_session=True)
        self.name = name

    def tail(self, n: int | None = 2000) -> str:
        """The last `n` characters of its output (None: all of it)."""
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        return text if n is None else text[-n:]

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

    def stop(self, timeout: float = 15.0, strict: bool = False) -> int | None:
        """SIGTERM by PID, SIGKILL after `timeout`; its exit code. `strict`: a process that ignored
        SIGTERM is an error (AssertionError, with its output), once it has been killed."""
        ignored = False
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                ignored = True
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        if ignored and strict:
            raise AssertionError(f"{self.args} ignored SIGTERM for {timeout}s:\n{self.tail(3000)}")
        return self.proc.returncode


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


@dataclass(frozen=True)
class SimWorkerPorts:
    """A sim-worker's ports: the first of its ranks' ZMQ PUB and replay ports, and its HTTP port."""

    zmq: int
    replay: int
    http: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def endpoints(self, rank: int = 0) -> tuple[str, str]:
        """A rank's PUB and replay endpoints, as a bridge's --endpoint and --replay-endpoint."""
        return f"tcp://127.0.0.1:{self.zmq + rank}", f"tcp://127.0.0.1:{self.replay + rank}"


def start_processor(log_dir: str, nats_url: str, redis_url: str, flags: Iterable[str] = (),
                    name: str = "processor") -> KvtierSubprocess:
    """`kvtier processor` from `nats_url` to `redis_url`."""
    return KvtierSubprocess(["processor", "--nats", nats_url, "--redis", redis_url, *flags], log_dir, name)


def start_router(log_dir: str, name: str, redis_url: str, flags: Iterable[str] = ()) -> tuple[KvtierSubprocess, str]:
    """`kvtier router` on a free port: the process and its base URL."""
    from kvtier.harness.embedded import free_port

    port = free_port()
    proc = KvtierSubprocess(["router", "--redis", redis_url, "--http-port", str(port), *flags], log_dir, name)
    return proc, f"http://127.0.0.1:{port}"


def start_bare_http(log_dir: str, upstreams: Iterable[str] = ()) -> tuple[KvtierSubprocess, str]:
    """kvtier/testing/bare_http.py's server (the router's bodies, no routing; with `upstreams`,
    a bare relay to them in turn) on a free port: the process and its base URL."""
    from kvtier.harness.embedded import free_port

    port = free_port()
    relayed = [flag for url in upstreams for flag in ("--upstream", url)]
    proc = KvtierSubprocess(["--port", str(port), *relayed], log_dir, "bare_http", module="kvtier.testing.bare_http")
    return proc, f"http://127.0.0.1:{port}"


def start_sim_worker(log_dir: str, name: str, page_size: int, flags: Iterable[str] = (),
                     ranks: int = 1) -> tuple[KvtierSubprocess, SimWorkerPorts]:
    """`kvtier sim-worker` of `ranks` simulated ranks on free ports."""
    from kvtier.harness.embedded import free_port
    from kvtier.sim.sim_worker import free_port_block

    ports = SimWorkerPorts(free_port_block(ranks), free_port_block(ranks), free_port())
    proc = KvtierSubprocess(["sim-worker", "--ranks", str(ranks), "--port", str(ports.zmq), "--replay-port",
                             str(ports.replay), "--http-port", str(ports.http), "--page-size", str(page_size),
                             *flags], log_dir, name)
    return proc, ports


def start_bridge(log_dir: str, name: str, endpoints: tuple[str, str], worker_id: str, model: str, page_size: int,
                 nats_url: str, flags: Iterable[str] = ()) -> KvtierSubprocess:
    """`kvtier bridge` from an engine's (PUB, replay) `endpoints` to NATS."""
    endpoint, replay = endpoints
    return KvtierSubprocess(["bridge", "--endpoint", endpoint, "--replay-endpoint", replay, "--worker-id", worker_id,
                             "--model", model, "--page-size", str(page_size), "--nats", nats_url, *flags],
                            log_dir, name)


def start_sim_workers(count: int, work: str, nats_url: str, model: str, page_size: int, tokenizer: str,
                      sim_flags: Iterable[str] = (), bridge_flags: Iterable[str] = ()
                      ) -> tuple[list[str], list[KvtierSubprocess], list[KvtierSubprocess]]:
    """`count` sim-workers serving the OpenAI API with `tokenizer`, each with its bridge (worker
    ids w0, w1, ...): (their URLs as a bridge's --worker-url, the sim-workers, the bridges)."""
    sim_flags, bridge_flags = list(sim_flags), list(bridge_flags)
    urls, sims, bridges = [], [], []
    for i in range(count):
        sim, ports = start_sim_worker(work, f"sim-worker-{i}", page_size, [
            "--tokenizer", tokenizer, "--model", model, "--dma-delay-ms", "0", *sim_flags, *QUIET])
        sims.append(sim)
        url = f"{ports.url}/w/0"
        bridges.append(start_bridge(work, f"bridge-{i}", ports.endpoints(), f"w{i}", model, page_size, nats_url,
                                    ["--worker-url", url, *bridge_flags, *QUIET]))
        urls.append(url)
    return urls, sims, bridges


async def wait_index_ready(session, router: str, model_token: str, procs: Iterable[KvtierSubprocess],
                           timeout: float = 80.0) -> None:
    """Until `router` answers /healthz and, when it reads an in-memory index (`--state-source
    mirror`), says its index of `model_token` is ready; failing at once with its log if one of
    `procs` exits meanwhile."""
    from kvtier.schemas.router_health import decode_router_health

    procs = list(procs)
    deadline = time.monotonic() + timeout
    await wait_http(session, router + "/healthz", procs, timeout=timeout, interval=0.05)
    while True:
        async with session.get(router + "/healthz", timeout=1) as r:
            health = decode_router_health(await r.read())
        if not health.reads_index or any(i.model == model_token and i.ready for i in health.indexes):
            return
        for p in procs:
            p.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{router}: the index of {model_token} was not ready within {timeout:.0f}s")
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def work_folder(prefix: str, what: str) -> Iterator[str]:
    """A scratch folder for a run's files and its processes' logs: removed when the run ends
    well, kept when it fails (and `what` failed is said, with where the logs are)."""
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        yield work
    except BaseException:
        print(f"{what} failed; the processes' logs are in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
