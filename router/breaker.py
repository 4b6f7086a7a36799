"""Which workers this replica has failed to reach lately, and for how long to leave them out.

A worker whose engine refuses connections, times out or drops the connection before the first
byte of its answer `failures_to_open` times in a row is left out of the candidates for
`backoff_s`; each failure after the backoff (the next request tried it again) doubles the
backoff up to `max_backoff_s`, and one answer that arrives closes the circuit. Pure: the clock
is passed in, and nothing here does I/O.

Why per replica and not in Redis: a replica learns of a dead engine from its own requests within
`failures_to_open` of them; the bridge's health-gated lease (producers/bridge.py) tells every
replica within a lease. The breaker covers the seconds between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.schemas.router_health import OpenCircuitHealth


@dataclass
class _Circuit:
    failures: int = 0
    backoff_s: float = 0.0
    open_until: float = 0.0


class CircuitBreaker:
    def __init__(self, failures_to_open: int = 3, backoff_s: float = 5.0, max_backoff_s: float = 60.0,
                 clock=time.monotonic) -> None:
        self.failures_to_open = failures_to_open
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._circuits: dict[tuple[str, str], _Circuit] = {}

    def failed(self, model: str, worker_id: str) -> bool:
        """Count one failure; True when this one opened (or re-opened) the circuit."""
        circuit = self._circuits.setdefault((model, worker_id), _Circuit())
        circuit.failures += 1
        if circuit.failures < self.failures_to_open:
            return False
        circuit.backoff_s = (self.backoff_s if circuit.backoff_s == 0
                             else min(circuit.backoff_s * 2, self.max_backoff_s))
        circuit.open_until = self._clock() + circuit.backoff_s
        return True

    def succeeded(self, model: str, worker_id: str) -> None:
        self._circuits.pop((model, worker_id), None)

    def left_out(self, model: str) -> frozenset[str]:
        """The workers of `model` whose circuit is open now."""
        if not self._circuits:
            return frozenset()
        now = self._clock()
        return frozenset(w for (m, w), c in self._circuits.items() if m == model and c.open_until > now)

    def open_circuits(self) -> list[OpenCircuitHealth]:
        now = self._clock()
        return sorted((OpenCircuitHealth(model=m, worker_id=w, failures=c.failures,
                                         reopens_in_s=round(c.open_until - now, 3))
                       for (m, w), c in self._circuits.items() if c.open_until > now),
                      key=lambda c: (c.model, c.worker_id))
