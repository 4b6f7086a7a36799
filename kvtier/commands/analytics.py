"""`kvtier analytics`: tier statistics on /metrics (consumers/analytics.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, non_negative_float, positive_float, positive_int, run_until_signal


def _model_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more model names (comma-separated)")
    return names



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
    a.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    a.add_argument("--durable", default="kvtier-analytics",
                   help="Durable consumer name prefix (<name>-events, <name>-decisions); two analytics with "
                        "different names count independently.")
    a.add_argument("--host", default="127.0.0.1", help="Address the HTTP server (/metrics, /healthz) binds to.")
    a.add_argument("--http-port", type=int, default=9464, help="HTTP port (0: a free one, printed at start).")
    a.add_argument("--models", type=_model_names, nargs="+", default=None,
                   help="Only these models (comma- or space-separated; default: every model).")
    a.add_argument("--writeback-window", type=non_negative_float, default=2.0,
                   help="Seconds a page removed from its last tier may wait for its write-back store on a lower "
                        "tier (then a demotion, else an eviction; 0: evictions at once).")
    a.add_argument("--fetch-batch", type=positive_int, default=256, help="Messages pulled at once.")
    a.add_argument("--ack-wait", type=positive_float, default=30.0, dest="ack_wait_s",
                   help="Ack wait of the durable consumers.")
    a.add_argument("--no-rebuild", action="store_true",
                   help="Do not rebuild the tier sets from the events stream at start (faster start on a long "
                        "stream; resident pages then count only what is stored from now on).")
    add_common(a)
    a.set_defaults(run=run)


def run(args) -> None:
    run_until_signal(lambda stop: _run_analytics(args, stop))


async def _run_analytics(args, stop) -> None:
    from kvtier.consumers.analytics import AnalyticsConfig, run_analytics

    models = None
    if args.models:
        models = [n for item in args.models for n in (item if isinstance(item, list) else [item])]
    config = AnalyticsConfig(nats_url=args.nats, durable=args.durable, host=args.host, http_port=args.http_port,
                             models=models, writeback_window_s=args.writeback_window, fetch_batch=args.fetch_batch,
                             ack_wait_s=args.ack_wait_s, rebuild=not args.no_rebuild)
    await run_analytics(config, stop, ready=lambda port: print(
        f"kvtier analytics listening on http://{args.host}:{port}/metrics", flush=True))
