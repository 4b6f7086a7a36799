"""Engine liveness for `kvtier bridge`: a worker's lease is renewed only while its engine answers.

`EngineHealthCheck` says what to ask (a GET that must answer 2xx in time); `EngineProbe` asks it
once for all the engine's DP ranks and logs an outage when it begins and when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client import Counter, Gauge

from kvtier.producers.engine_queue import engine_queue
from kvtier.schemas.events import EngineQueue

# The bridge's own logger: these lines are the bridge's, whichever module writes them.
log = logging.getLogger("kvtier.bridge")

ENGINE_UP = Gauge("kvtier_bridge_engine_up",
                  "1 while the engine answers its health endpoint, 0 while it does not (its workers' leases are "
                  "then not renewed)", ["worker"])
ENGINE_HEALTH_FAILURES = Counter("kvtier_bridge_engine_health_failures_total",
                                 "Engine health checks that failed (reason: unreachable, timeout, status)",
                                 ["worker", "reason"])


@dataclass(frozen=True)
class EngineHealthCheck:
    """GET `url` must answer 2xx within `timeout_s` for the worker's lease to be renewed.
    `metrics_url`, when set, is read after each answer for the engine's own queue."""

    url: str
    timeout_s: float
    metrics_url: str = ""


class EngineProbe:
    """Whether the engine answers its health endpoint, shared by all its DP ranks: one GET serves
    every rank asking within half a heartbeat of it, so no rank renews its lease on an answer
    older than that, and an outage is logged once, when it begins, and once when it ends."""

    def __init__(self, check: EngineHealthCheck, label: str, reuse_s: float):
        self.check = check
        self.label = label
        self.reuse_s = reuse_s
        self._session: aiohttp.ClientSession | None = None
        self._asking: asyncio.Task[bool] | None = None
        self._answered_at = float("-inf")
        self._up: bool | None = None  # None: not asked yet
        self._metrics_text = ""  # the engine's last /metrics answer ('' when it gave none)
        self._metrics_read_ts = 0.0
        self._reading_metrics: asyncio.Task[None] | None = None

    async def answers(self) -> bool:
        fresh = time.monotonic() - self._answered_at < self.reuse_s
        if self._asking is None or (self._asking.done() and not fresh):
            self._asking = asyncio.create_task(self._ask())
        # shielded: a rank stopping must not cancel the answer the other ranks wait for
        return await asyncio.shield(self._asking)

    async def _ask(self) -> bool:
        if self._session is None:
            # trust_env off: the engine is never behind a proxy (as for --sglang-url discovery)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.check.timeout_s))
        failure, reason = "", ""
        try:
            async with self._session.get(self.check.url, allow_redirects=False) as reply:
                await reply.read()
                if not 200 <= reply.status < 300:
                    failure, reason = f"HTTP {reply.status}", "status"
        except TimeoutError:  # before ClientError: aiohttp's timeouts are both
            failure, reason = f"no answer within {self.check.timeout_s:g}s", "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            failure, reason = str(exc) or type(exc).__name__, "unreachable"
        self._answered_at = time.monotonic()
        ENGINE_UP.labels(self.label).set(0 if failure else 1)
        if failure:
            ENGINE_HEALTH_FAILURES.labels(self.label, reason).inc()
            if self._up is not False:
                log.warning("%s: the engine does not answer GET %s (%s); its lease is not renewed until it does "
                            "(routers stop choosing it once the lease runs out)", self.label, self.check.url, failure)
        elif self._up is False:
            log.warning("%s: the engine answers GET %s again; renewing its lease", self.label, self.check.url)
        self._up = not failure
        if not failure and self.check.metrics_url and (self._reading_metrics is None or self._reading_metrics.done()):
            # beside the answer, not in front of it: a slow /metrics never delays a lease renewal
            self._reading_metrics = asyncio.create_task(self._read_metrics())
        return not failure

    def queue(self, dp_rank: int, dp_size: int) -> EngineQueue | None:
        """The DP rank's share of the engine's queue at the last /metrics read, None where
        that read told nothing (see engine_queue)."""
        counts = engine_queue(self._metrics_text, dp_rank, dp_size) if self._metrics_text else None
        return None if counts is None else EngineQueue(waiting=counts[0], running=counts[1],
                                                       read_ts=self._metrics_read_ts)

    async def _read_metrics(self) -> None:
        """The engine's Prometheus text, for its queue. None is no outage: SGLang serves it only
        with --enable-metrics."""
        assert self._session is not None
        text = ""
        try:
            async with self._session.get(self.check.metrics_url, allow_redirects=False) as reply:
                if reply.status == 200:
                    text = (await reply.read()).decode("utf-8", "replace")
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
        self._metrics_text, self._metrics_read_ts = text, time.time()

    async def close(self) -> None:
        for task in (self._asking, self._reading_metrics):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
