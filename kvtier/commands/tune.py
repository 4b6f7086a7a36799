"""`kvtier tune` (kvtier/eval/tune.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_cluster_arguments, add_common, non_negative_float, positive_int


def register(sub) -> None:
    t = sub.add_parser("tune", help="Search the scoring weights on a lockstep trace replay; print the best settings "
                                    "for TTFT p50, TTFT p99 and recomputed tokens beside the defaults and the oracle.",
                       description="Each trial replays kvtier's router (in process, lockstep) on the trace "
                                   "(kvtier/eval/tune.py).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cluster_arguments(t)
    t.set_defaults(requests=2000)
    t.add_argument("--budget", type=positive_int, default=24, help="Settings to try (the defaults included).")
    t.add_argument("--holdout", type=float, default=0.3,
                   help="Share of the trace (its end) kept out of the search, to check the best settings on.")
    t.add_argument("--visibility-lag-ms", type=non_negative_float, default=5.0,
                   help="Trace milliseconds between an engine event and routers seeing it.")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    add_common(t)
    t.set_defaults(run=run)


def run(args) -> int:
    from kvtier.eval.tune import run_tune

    return run_tune(args)
