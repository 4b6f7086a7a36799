"""`kvtier demo` (kvtier/eval/demo.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_cluster_arguments, add_common


def register(sub) -> None:
    d = sub.add_parser("demo", help="Routing policies side by side on a simulated HiCache cluster, beside the "
                                    "oracle and the bounds, and a sweep of where tier awareness pays (embedded "
                                    "servers; kvtier/eval/demo.py).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cluster_arguments(d)
    d.set_defaults(trace="synthetic:1", requests=600, workers=4, device_pages=2048, host_pages=4096)
    d.add_argument("--no-sweep", action="store_true", help="Skip the host-pool / L3 sweep.")
    d.add_argument("--out", default="kvtier-demo", help="Folder for report.json and policies.png.")
    d.add_argument("--seed", type=int, default=1)
    add_common(d)
    d.set_defaults(run=run)


def run(args) -> int:
    from kvtier.eval.demo import run_demo

    return run_demo(args)
