"""`kvtier demo` (kvtier/eval/demo.py); its flags are DemoSettings' (kvtier/eval/settings.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, add_flags, read_settings
from kvtier.eval.settings import DemoSettings


def register(sub) -> None:
    d = sub.add_parser("demo", help="Routing policies side by side on a simulated HiCache cluster, beside the "
                                    "oracle and the bounds, and a sweep of where tier awareness pays (embedded "
                                    "servers; kvtier/eval/demo.py).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(d, DemoSettings)
    d.set_defaults(trace="synthetic:1", requests=600, workers=4, device_pages=2048, host_pages=4096)
    add_common(d)
    d.set_defaults(run=run)


def run(args) -> int:
    from kvtier.eval.demo import run_demo

    return run_demo(read_settings(DemoSettings, args))
