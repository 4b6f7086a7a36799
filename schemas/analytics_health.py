"""`kvtier analytics`' `GET /healthz` body (consumers/analytics.py), read by operators and probes.

Always answered 200: "degraded" says the analytics lost NATS (its counts stop moving), not that
the process should be restarted.
"""

from __future__ import annotations

import msgspec


class AnalyticsHealth(msgspec.Struct, frozen=True, kw_only=True):
    #: "ok", or "degraded" while the NATS connection is down.
    status: str
    #: Connected to NATS.
    nats: bool
    #: At start, rebuilding its tier sets from the events stream up to what it had already
    #: counted, without counting them again (skipped with --no-rebuild).
    rebuilding: bool
    #: Workers the analytics knows of.
    workers: int
