"""`kvtier tune` (kvtier/eval/tune.py); its flags are TuneSettings' (kvtier/eval/settings.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, add_flags, read_settings
from kvtier.eval.settings import TuneSettings


def register(sub) -> None:
    t = sub.add_parser("tune", help="Search the scoring weights on a lockstep trace replay; print the best settings "
                                    "for TTFT p50, TTFT p99 and recomputed tokens beside the defaults and the oracle.",
                       description="Each trial replays kvtier's router (in process, lockstep) on the trace "
                                   "(kvtier/eval/tune.py).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(t, TuneSettings)
    t.set_defaults(requests=2000)
    add_common(t)
    t.set_defaults(run=run)


def run(args) -> int:
    from kvtier.eval.tune import run_tune

    return run_tune(read_settings(TuneSettings, args))
