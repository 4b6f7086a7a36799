"""A log that a flood of bad requests cannot grow without bound.

Each kind of record (its logger and message template) may pass `per_window` times per
`window_s`; past that, records of that kind are counted, not written, and the first one of the
next window says how many were left out. Kinds are few (templates, not formatted lines), and a
kind unseen for a window is forgotten, so the table stays small whatever clients send.
"""

from __future__ import annotations

import logging
import time


class RateLimitFilter(logging.Filter):
    def __init__(self, per_window: int = 20, window_s: float = 60.0, clock=time.monotonic) -> None:
        super().__init__()
        self.per_window = per_window
        self.window_s = window_s
        self._clock = clock
        # kind -> [window start, records passed in it, records left out in it]
        self._kinds: dict[tuple[str, object], list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        kind = (record.name, record.msg)
        seen = self._kinds.get(kind)
        if seen is None or now - seen[0] >= self.window_s:
            left_out = seen[2] if seen is not None else 0
            if len(self._kinds) > 1000:
                self._forget(now)
            self._kinds[kind] = [now, 1, 0]
            if left_out:
                record.msg = f"{record.msg} [{left_out} more like this left out of the log in the last " \
                             f"{self.window_s:.0f} s]"
            return True
        if seen[1] < self.per_window:
            seen[1] += 1
            return True
        seen[2] += 1
        return False

    def _forget(self, now: float) -> None:
        for kind in [k for k, v in self._kinds.items() if now - v[0] >= self.window_s]:
            del self._kinds[kind]


def limit_log_rate(per_window: int, window_s: float = 60.0) -> None:
    """Put the filter on every handler of the root logger (where basicConfig writes)."""
    if per_window <= 0:
        return
    limit = RateLimitFilter(per_window, window_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
