"""Routing without Redis: when to (StateStoreWatch), and who to send a request to then (Fallback)."""

from __future__ import annotations

import collections
import itertools
import logging
import time

from .metrics import RouterMetrics
from .settings import BOOKING_TTL_S, RouterSettings

log = logging.getLogger("kvtier.router")


class StateStoreWatch:
    """Whether decisions use the state store: after a failure, not for `state_retry_s`."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.down_until = 0.0
        self.last_error = ""  # the last failure ("" once the store answers again)

    def available(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, exc: Exception) -> None:
        if self.available():
            log.warning("state store unavailable (%s: %s); routing by load/round robin until it answers",
                        type(exc).__name__, exc)
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.down_until = time.monotonic() + self.settings.state_retry_s
        self.metrics.state_store_up.set(0)

    def answered(self) -> None:
        if self.last_error:
            log.warning("state store is answering again; tier-aware routing resumed")
            self.last_error = ""
        self.metrics.state_store_up.set(1)

class Fallback:
    """Routing without Redis: least in-flight on this replica, round robin among ties. The
    in-flight map is bounded: an entry leaves on its `complete` release, when it is older
    than `ttl_s` (a request whose release never came), or when `max_entries` newer ones
    came after it, so a long outage neither grows it nor skews the counts for good."""

    def __init__(self, ttl_s: float = BOOKING_TTL_S, max_entries: int = 100_000, clock=time.monotonic) -> None:
        self.in_flight: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._turn = itertools.count()

    def _prune(self) -> None:
        oldest = self._clock() - self.ttl_s
        while self.in_flight and (len(self.in_flight) > self.max_entries
                                  or next(iter(self.in_flight.values()))[1] < oldest):
            self.in_flight.popitem(last=False)

    def choose(self, workers: list[str]) -> str:
        self._prune()
        counts = {w: 0 for w in workers}
        for worker, _ in self.in_flight.values():
            if worker in counts:
                counts[worker] += 1
        low = min(counts.values())
        ties = [w for w in workers if counts[w] == low]
        return ties[next(self._turn) % len(ties)]

    def book(self, request_id: str, worker: str) -> None:
        self.in_flight[request_id] = (worker, self._clock())
        self.in_flight.move_to_end(request_id)
        self._prune()

    def release(self, request_id: str) -> bool:
        return self.in_flight.pop(request_id, None) is not None
