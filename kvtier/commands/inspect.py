"""`kvtier inspect` (kvtier/tools/inspect.py). Its flags are InspectSettings' declarations
(kvtier/tools/settings.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common, add_flags, read_settings
from kvtier.tools.settings import InspectSettings


def register(sub) -> None:
    i = sub.add_parser("inspect", help="Show each worker's tier state in Redis: pages per tier, epoch, seq, lease.",
                       description="Read what the processors keep in Redis: per worker, pages on each tier, the "
                                   "applied (epoch, seq), how long ago it was applied, its lease, and whether it is "
                                   "stale.")
    add_flags(i, InspectSettings)
    add_common(i)
    i.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.inspect import run_inspect

    return run_inspect(read_settings(InspectSettings, args))
