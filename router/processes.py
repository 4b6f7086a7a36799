"""One router replica on several processes (`kvtier router --processes N`): one port, every
process bound to it with SO_REUSEPORT (the kernel spreads new connections over them), each
with its own Router, index and copies of the roster; Redis keeps them consistent as it keeps
replicas consistent (bookings are atomic there).

The supervisor (the command's own process) serves nothing: it starts N children of the same
command line, told by KVTIER_ROUTER_PROCESS which slot each fills, forwards SIGTERM/SIGINT to
them (each drains), and if one dies, stops the others and exits non-zero (crash-only: what
runs it restarts the replica whole). The children share a folder: prometheus_client's
multiprocess files (so /metrics of any of them counts the whole replica, router/metrics.py)
and one file per child naming its private loopback port, where siblings ask each other
(/healthz lists every process; PUT /v1/admission reaches every process)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvtier.router")

#: The environment variable a child finds its slot in (JSON: index, count, port, dir).
SLOT_ENV = "KVTIER_ROUTER_PROCESS"
#: How long a sibling has to answer another's question (seconds).
SIBLING_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ProcessSlot:
    index: int
    count: int
    port: int  # the replica's port, which every process binds
    dir: str  # the shared folder

    @classmethod
    def from_env(cls) -> ProcessSlot | None:
        raw = os.environ.get(SLOT_ENV)
        if not raw:
            return None
        value = json.loads(raw)
        return cls(int(value["index"]), int(value["count"]), int(value["port"]), str(value["dir"]))

    def to_env(self) -> str:
        return json.dumps({"index": self.index, "count": self.count, "port": self.port, "dir": self.dir})

    def register(self, private_port: int) -> None:
        """Say where this process answers its siblings (written whole, then renamed into place)."""
        path = Path(self.dir) / f"process-{self.index}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"index": self.index, "pid": os.getpid(), "port": private_port}))
        tmp.replace(path)

    def siblings(self) -> list[dict]:
        """The other processes that have registered: [{index, pid, port}], by index."""
        found = []
        for path in sorted(Path(self.dir).glob("process-*.json")):
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if entry.get("index") != self.index:
                found.append(entry)
        return sorted(found, key=lambda e: e["index"])


def _die_with_parent() -> None:
    """In a child, before it runs: the kernel kills it if the supervisor dies (even by SIGKILL),
    so no process of a replica outlives it (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_reuse_port(host: str) -> socket.socket:
    """A port for the replica, held (bound with SO_REUSEPORT, never listening) until the
    children have bound it too, so no other program takes it meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, 0))
    return sock


def serve_on_processes(count: int, host: str, port: int, ready_timeout_s: float = 120.0) -> int:
    """Run `count` children of this command line on one port; the exit status."""
    if not hasattr(socket, "SO_REUSEPORT"):
        print("kvtier router: --processes needs SO_REUSEPORT (Linux, BSD, macOS)", file=sys.stderr)
        return 2
    shared = tempfile.mkdtemp(prefix="kvtier-router-")
    metrics_dir = Path(shared) / "metrics"
    metrics_dir.mkdir()
    holder = _free_reuse_port(host) if port == 0 else None
    port = holder.getsockname()[1] if holder is not None else port
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(signum=None, frame=None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(count):
            env = {**os.environ, SLOT_ENV: ProcessSlot(index, count, port, shared).to_env(),
                   "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
            children.append(subprocess.Popen([sys.executable, "-m", "kvtier.cli", *sys.argv[1:]], env=env,
                                             preexec_fn=_die_with_parent if sys.platform == "linux" else None))
        deadline = time.monotonic() + ready_timeout_s
        while len(list(Path(shared).glob("process-*.json"))) < count and not stopping:
            if any(child.poll() is not None for child in children) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if holder is not None:
            holder.close()
        if not stopping and len(list(Path(shared).glob("process-*.json"))) == count:
            print(f"router replica serving on http://{host}:{port} with {count} processes", file=sys.stderr,
                  flush=True)
        # Crash-only: one child gone (but on a stop) stops the replica.
        while all(child.poll() is None for child in children):
            time.sleep(0.1)
        crashed = not stopping
        if crashed:
            dead = [c for c in children if c.poll() is not None]
            log.error("router process %d exited with %s; stopping the replica", dead[0].pid, dead[0].returncode)
            stop()
        codes = [child.wait() for child in children]
        return 1 if crashed or any(codes) else 0
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(shared, ignore_errors=True)
