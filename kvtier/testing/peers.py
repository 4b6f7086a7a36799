"""The gateways kvtier is measured beside, started as a user starts them, on loopback, stopped by
PID: SGLang's model gateway (`smg`, PyPI) in front of sim-worker ranks."""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from kvtier.harness.embedded import free_port
from kvtier.testing.processes import KvtierSubprocess


class SmgMissing(RuntimeError):
    pass


def start_smg(log_dir: str | None, name: str, worker_urls: Sequence[str], policy: str,
              flags: Sequence[str] = ()) -> tuple[KvtierSubprocess, str]:
    """`smg launch` with `policy` over `worker_urls`: its process and base URL. Its metrics
    listener (0.0.0.0 unless told) is bound to loopback on a free port."""
    if importlib.util.find_spec("smg") is None:
        raise SmgMissing("SGLang's model gateway is not installed: pip install smg==1.13.0")
    port = free_port()
    proc = KvtierSubprocess(
        ["launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--worker-urls", *worker_urls, "--policy", policy,
         "--shutdown-grace-period-secs", "0", "--log-level", "warn", *flags],
        log_dir, name, module="smg")
    return proc, f"http://127.0.0.1:{port}"


def smg_healthy_workers(url: str) -> int:
    """How many workers `smg` at `url` routes to now (its `/readiness`), 0 while it cannot answer."""
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=2) as reply:
            return int(json.loads(reply.read()).get("healthy_workers", 0))
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return int(json.loads(body).get("healthy_workers", 0)) if body.startswith(b"{") else 0
    except (OSError, ValueError):
        return 0


def wait_smg(url: str, workers: int, proc: KvtierSubprocess, timeout: float = 60.0) -> None:
    """Until `smg` has admitted all `workers`; its log in the error if it does not."""
    deadline = time.monotonic() + timeout
    while smg_healthy_workers(url) < workers:
        proc.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"smg at {url} admitted {smg_healthy_workers(url)} of {workers} workers "
                               f"in {timeout:.0f}s:\n{proc.tail()}")
        time.sleep(0.2)
