"""The proxy's releases, each in a task of its own that this module holds until it ends, so no
way out of a handler loses one: a handler cancelled (its client gone, the drain) while its
release waits for Redis or the roster's lock leaves the release running, and the stop waits
for every one of them (`settle`) before the Redis client closes. /v1/release's releases are
held the same way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvtier.schemas.routing import ReleaseStage

from .core import Router

log = logging.getLogger("kvtier.router.http")
T = TypeVar("T")


class Releases:
    def __init__(self, router: Router, on_released: Callable[[], None]) -> None:
        """`on_released`: capacity may have come back (the admission queue's head tries again)."""
        self.router = router
        self._on_released = on_released
        self._held: set[asyncio.Task] = set()

    def hold(self, release: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """`release` in a task held until it ends (the event loop keeps only weak references)
        and waited for by `settle`."""
        task = asyncio.get_running_loop().create_task(release)
        self._held.add(task)
        task.add_done_callback(self._held.discard)
        return task

    def later(self, model: str, request_id: str, stage: ReleaseStage, ttft_ms: float | None = None,
              after: asyncio.Future | None = None) -> asyncio.Task:
        """The router's own release of a proxied booking, held. A failure is logged and
        counted (router_releases_lost_total): the booking expires after --booking-ttl.
        `after`: a release that must land first (the first token's, before the end's)."""
        return self.hold(self._release(model, request_id, stage, ttft_ms, after))

    async def awaited(self, model: str, request_id: str, stage: ReleaseStage, ttft_ms: float | None = None,
                      after: asyncio.Future | None = None) -> None:
        """`later`, awaited; a cancellation of the caller leaves the release running."""
        await asyncio.shield(self.later(model, request_id, stage, ttft_ms, after))

    async def _release(self, model: str, request_id: str, stage: ReleaseStage, ttft_ms: float | None,
                       after: asyncio.Future | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        try:
            await self.router.release(model, request_id, stage, ttft_ms)
            self._on_released()
        except Exception as exc:  # noqa: BLE001 - a lost release only delays expiry
            self.router.metrics.releases_lost.inc()
            log.warning("could not release %s (%s) of request %s: %s", stage.value, model, request_id, exc)

    async def settle(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the releases under way (before the Redis client closes);
        the number still unfinished (their bookings expire after --booking-ttl)."""
        pending = set(self._held)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        if pending:
            log.warning("%d releases did not finish before the stop; their bookings expire after --booking-ttl",
                        len(pending))
        return len(pending)
