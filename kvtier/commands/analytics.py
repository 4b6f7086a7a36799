"""`kvtier analytics`: tier statistics on /metrics (consumers/analytics.py). Its flags are
AnalyticsConfig's declarations (consumers/analytics_config.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.consumers.analytics_config import AnalyticsConfig


def register(sub) -> None:
    a = sub.add_parser("analytics", help="Tier statistics from the event and decision streams on /metrics "
                                         "(a durable JetStream consumer of its own).",
                       description="Keeps every worker's pages per tier from KVTIER_EVENTS in memory and counts "
                                   "transitions (stored, removed, copies, promotions, demotions, evictions), page "
                                   "lifetimes per tier, and from KVTIER_DECISIONS the decisions per worker and the "
                                   "predicted hit tokens by tier; serves them as Prometheus metrics. Acks after "
                                   "counting, so a restart continues where it left off; the tier sets are rebuilt "
                                   "from the stream at start.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(a, AnalyticsConfig)
    add_common(a)
    a.set_defaults(run=run)


def run(args) -> None:
    config = read_settings(AnalyticsConfig, args)
    run_until_signal(lambda stop: _run_analytics(config, stop))


async def _run_analytics(config: AnalyticsConfig, stop) -> None:
    from kvtier.consumers.analytics import run_analytics

    await run_analytics(config, stop, ready=lambda port: print(
        f"kvtier analytics listening on http://{config.host}:{port}/metrics", flush=True))
