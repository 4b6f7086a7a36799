"""`kvtier events tail` (kvtier/tools/events_tail.py)."""

from __future__ import annotations

from kvtier.commands.flags import EnvDefaults, add_common, positive_int


def register(sub) -> None:
    ev = sub.add_parser("events", help="Look at the events stream (KVTIER_EVENTS).")
    evsub = ev.add_subparsers(dest="events_command", required=True, parser_class=EnvDefaults)
    tail = evsub.add_parser(
        "tail", help="Print decoded tier events, filtered: time, stream seq, worker, epoch:seq, kind, tier, pages.",
        description="One line per tier event or announcement. Default: the last 10 matching events; --since TIME "
                    "prints from a time on; --follow keeps printing new ones until Ctrl-C/SIGTERM.")
    tail.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    tail.add_argument("--model", default=None, help="Only this model.")
    tail.add_argument("--worker", default=None, help="Only this worker.")
    tail.add_argument("--tier", choices=["device", "host", "disk", "external"], default=None,
                      help="Only stores/removes on this tier.")
    tail.add_argument("--kind", choices=["stored", "removed", "cleared", "announce", "expired"], default=None,
                      help="Only this kind of event.")
    when = tail.add_mutually_exclusive_group()
    when.add_argument("--since", default=None,
                      help="From this time on: ISO 8601, unix seconds, or a duration ago (90s, 5m, 2h).")
    when.add_argument("--last", type=positive_int, default=None, help="The last N matching events (default 10).")
    tail.add_argument("--follow", action="store_true", help="Keep printing new events as they arrive.")
    tail.add_argument("--json", action="store_true", help="One JSON object per line instead of text.")
    add_common(tail)
    tail.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.events_tail import run_events

    return run_events(args)
