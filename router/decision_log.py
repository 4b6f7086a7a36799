"""Publishes every decision to JetStream (`kvtier.decisions.<model>`) for replay and
analytics, off the decision path: decisions queue in memory (bounded) and a background task
publishes them with acks. NATS being down never delays or stops routing; what cannot be
queued is counted as dropped."""

from __future__ import annotations

import asyncio
import logging

from kvtier.schemas.routing import RouteDecision, encode_decision
from kvtier.schemas.subjects import decisions_subject

log = logging.getLogger("kvtier.router.decisions")


class DecisionLog:
    def __init__(self, nats_url: str | None, max_queue: int = 10_000, on_published=None, on_dropped=None):
        self._url = nats_url
        self._queue: asyncio.Queue[RouteDecision] = asyncio.Queue(max_queue)
        self._on_published = on_published or (lambda n: None)
        self._on_dropped = on_dropped or (lambda n: None)
        self._nc = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def start(self) -> None:
        if self._url:
            self._task = asyncio.create_task(self._run(), name="decision-log")

    def submit(self, decision: RouteDecision) -> None:
        if not self._url:
            return
        try:
            self._queue.put_nowait(decision)
        except asyncio.QueueFull:
            self._on_dropped(1)

    async def _run(self) -> None:
        from kvtier.plumbing.streams import connect_nats, ensure_decisions_stream

        # start() runs this only when there is a URL
        self._nc = await connect_nats(self._url, "kvtier-router-decisions", stop=self._stop)  # type: ignore[arg-type]
        if self._nc is None:
            return
        js = self._nc.jetstream()
        while not self._stop.is_set():
            try:
                await ensure_decisions_stream(js)
                break
            except Exception as exc:  # noqa: BLE001 - retried; routing does not wait for it
                log.warning("cannot create the decisions stream yet (%s); retrying", exc)
                await asyncio.sleep(1.0)
        while True:
            first = await self._queue.get()
            batch = [first]
            while len(batch) < 256 and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            results = await asyncio.gather(
                *(js.publish(decisions_subject(d.model), encode_decision(d), timeout=5.0) for d in batch),
                return_exceptions=True)
            failed = sum(1 for r in results if isinstance(r, Exception))
            if failed:
                log.warning("%d of %d decisions could not be published (%s)", failed, len(batch),
                            next(r for r in results if isinstance(r, Exception)))
                self._on_dropped(failed)
            self._on_published(len(batch) - failed)

    async def close(self, drain_s: float = 2.0) -> None:
        self._stop.set()
        if self._task is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_s
            while not self._queue.empty() and self.connected and loop.time() < deadline:
                await asyncio.sleep(0.01)
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self._nc is not None:
            try:
                await self._nc.close()
            except Exception:  # noqa: BLE001 - shutting down
                pass
