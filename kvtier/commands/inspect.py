"""`kvtier inspect` (kvtier/tools/inspect.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common


def register(sub) -> None:
    i = sub.add_parser("inspect", help="Show each worker's tier state in Redis: pages per tier, epoch, seq, lease.",
                       description="Read what the processors keep in Redis: per worker, pages on each tier, the "
                                   "applied (epoch, seq), how long ago it was applied, its lease, and whether it is "
                                   "stale.")
    i.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    i.add_argument("--model", default=None, help="Only this model (default: every model).")
    i.add_argument("--worker", default=None, help="Only this worker.")
    i.add_argument("--json", action="store_true", help="Print one JSON array instead of a table.")
    add_common(i)
    i.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.inspect import run_inspect

    return run_inspect(args)
