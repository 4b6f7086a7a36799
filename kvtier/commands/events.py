"""`kvtier events tail` (kvtier/tools/events_tail.py). Its flags are EventsTailSettings'
declarations (kvtier/tools/settings.py)."""

from __future__ import annotations

from kvtier.commands.flags import EnvDefaults, add_common, add_flags, read_settings
from kvtier.tools.settings import EventsTailSettings


def register(sub) -> None:
    ev = sub.add_parser("events", help="Look at the events stream (KVTIER_EVENTS).")
    evsub = ev.add_subparsers(dest="events_command", required=True, parser_class=EnvDefaults)
    tail = evsub.add_parser(
        "tail", help="Print decoded tier events, filtered: time, stream seq, worker, epoch:seq, kind, tier, pages.",
        description="One line per tier event or announcement. Default: the last 10 matching events; --since TIME "
                    "prints from a time on; --follow keeps printing new ones until Ctrl-C/SIGTERM.")
    add_flags(tail, EventsTailSettings)
    add_common(tail)
    tail.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.events_tail import run_events

    return run_events(read_settings(EventsTailSettings, args))
