"""The router's queue: requests that found every candidate busy wait here, in arrival order,
for a worker to come under its thresholds.

Only the head of the queue tries again, when this replica releases a booking (`notify`) or every
`poll_s` (other replicas' releases are not seen as events); once it is placed the next one tries
at once. A full queue refuses at once (QueueFull: 429), a request that waited `timeout_s` is
refused (QueueTimeout: 503), and a draining router refuses every waiter (Draining: 503); each
refusal carries the Retry-After to send. No I/O here: the decision is the caller's `attempt`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .core import Busy

T = TypeVar("T")

#: What a draining router answers every new request (and every request still queued).
SHUTTING_DOWN = "this router is shutting down: send the request to another replica"


class Refusal(Exception):
    status = 503
    reason = ""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFull(Refusal):
    status = 429
    reason = "queue_full"


class QueueTimeout(Refusal):
    reason = "queue_timeout"


class Draining(Refusal):
    reason = "draining"


class AdmissionQueue:
    def __init__(self, size: int = 256, timeout_s: float = 10.0, poll_s: float = 0.05,
                 on_depth: Callable[[int], None] = lambda depth: None,
                 on_wait: Callable[[float], None] = lambda seconds: None) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.peak = 0
        self._waiters: collections.deque[asyncio.Event] = collections.deque()
        self._closed = False
        self._on_depth, self._on_wait = on_depth, on_wait

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def retry_after_s(self) -> int:
        return max(1, math.ceil(min(self.timeout_s, 30.0)))

    async def admit(self, attempt: Callable[[], Awaitable[T]]) -> T:
        if self._closed:
            raise Draining(SHUTTING_DOWN, 1)
        if not self._waiters:  # nobody waits before this one: try at once
            try:
                return await attempt()
            except Busy:
                pass
        if len(self._waiters) >= self.size:
            raise QueueFull(f"every worker is busy and the router's queue is full ({self.size} waiting, "
                            "--queue-size)", 1)
        turn = asyncio.Event()
        self._waiters.append(turn)
        self._depth_changed()
        started = time.monotonic()
        deadline = started + self.timeout_s
        try:
            while True:
                if self._waiters[0] is turn:
                    try:
                        return await attempt()
                    except Busy:
                        pass
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueTimeout(f"every worker stayed busy for the {self.timeout_s:g} s a request may wait "
                                       "(--queue-timeout)", self.retry_after_s())
                turn.clear()
                try:
                    await asyncio.wait_for(turn.wait(), min(self.poll_s, left))
                except asyncio.TimeoutError:
                    pass
                if self._closed:
                    raise Draining(SHUTTING_DOWN, 1)
        finally:
            self._waiters.remove(turn)
            self._on_wait(time.monotonic() - started)
            self._depth_changed()
            self.notify()  # the next one's turn

    def notify(self) -> None:
        """Capacity may have come back (a booking released): the head tries again now."""
        if self._waiters:
            self._waiters[0].set()

    def close(self) -> None:
        """Refuse every waiter and every later request (the router drains)."""
        self._closed = True
        for turn in self._waiters:
            turn.set()

    def _depth_changed(self) -> None:
        self.peak = max(self.peak, len(self._waiters))
        self._on_depth(len(self._waiters))
