"""`kvtier report`: PNGs and summary.md of a window of the streams (kvtier/tools/report.py). Its
flags are ReportSettings' declarations (kvtier/tools/settings.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, add_flags, read_settings
from kvtier.tools.settings import ReportSettings


def register(sub) -> None:
    rep = sub.add_parser("report", help="PNG plots and summary.md of a time window of the event and decision "
                                        "streams.",
                         description="Reads KVTIER_EVENTS (from its first retained message, to rebuild the tier "
                                     "state, counting only the window) and KVTIER_DECISIONS for the window, and "
                                     "writes resident pages per tier over time, transitions per kind over time, "
                                     "lifetime distributions per tier, decisions per worker and predicted hit tokens "
                                     "by tier as PNGs, plus summary.md.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(rep, ReportSettings)
    add_common(rep)
    rep.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.report import run_report

    return run_report(read_settings(ReportSettings, args))
