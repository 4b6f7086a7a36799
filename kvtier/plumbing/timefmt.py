"""Moments in time as operators type them and as kvtier prints them (UTC, ISO 8601)."""

from __future__ import annotations

import datetime as dt
import re
import time

_RELATIVE_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class TimeFormatError(ValueError):
    """A moment kvtier cannot read; the message says which forms it accepts."""


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds from ISO 8601 (without an offset: UTC), unix seconds, or a duration ago
    ("90s", "5m", "2h", "1d")."""
    text = text.strip()
    match = _RELATIVE_RE.match(text)
    if match:
        return (now if now is not None else time.time()) - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise TimeFormatError(f"cannot read time {text!r}: give ISO 8601 (2025-06-01T12:00:00Z), unix seconds, "
                              "or a duration ago (90s, 5m, 2h, 1d)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    return moment.timestamp()


def iso(ts: float | None, timespec: str = "milliseconds") -> str:
    """`ts` (unix seconds) as ISO 8601 UTC with a Z; "-" for None."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec=timespec).replace("+00:00", "Z")
