"""`kvtier report`: PNGs and summary.md of a window of the streams (kvtier/tools/report.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, non_negative_float, positive_int


def register(sub) -> None:
    rep = sub.add_parser("report", help="PNG plots and summary.md of a time window of the event and decision "
                                        "streams.",
                         description="Reads KVTIER_EVENTS (from its first retained message, to rebuild the tier "
                                     "state, counting only the window) and KVTIER_DECISIONS for the window, and "
                                     "writes resident pages per tier over time, transitions per kind over time, "
                                     "lifetime distributions per tier, decisions per worker and predicted hit tokens "
                                     "by tier as PNGs, plus summary.md.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    rep.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    rep.add_argument("--since", required=True,
                     help="Window start: ISO 8601 (UTC without an offset), unix seconds, or a duration ago (30m).")
    rep.add_argument("--until", default="", help="Window end, same forms (default: now).")
    rep.add_argument("--model", default="", help="Only this model (default: every model).")
    rep.add_argument("--out", default="kvtier-report", help="Folder for the PNGs and summary.md.")
    rep.add_argument("--bins", type=positive_int, default=60, help="Time steps of the plots over time.")
    rep.add_argument("--writeback-window", type=non_negative_float, default=2.0,
                     help="Seconds a page removed from its last tier may wait for its write-back store on a lower "
                          "tier (then a demotion, else an eviction), as in `kvtier analytics`.")
    rep.add_argument("--json", action="store_true", help="Print one JSON object (the summary) as the last line.")
    add_common(rep)
    rep.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.report import run_report

    return run_report(args)
