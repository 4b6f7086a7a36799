"""The `kvtier` command. Each subcommand registers its own flags and its run function in a
small module of kvtier/commands/ (README.md there); this only puts them together. Every flag
can also be set by an environment variable KVTIER_<FLAG> (e.g. --nats -> KVTIER_NATS,
--page-size -> KVTIER_PAGE_SIZE); a flag on the command line wins over the environment."""

from __future__ import annotations

import argparse
import sys

from kvtier.commands import (
    analytics,
    bench,
    bridge,
    demo,
    doctor,
    events,
    inspect,
    probe,
    processor,
    replay,
    report,
    router,
    servers,
    sim_worker,
    tune,
)
from kvtier.commands.flags import EnvDefaults, setup

#: In the order `kvtier --help` lists them.
COMMANDS = (bridge, processor, router, sim_worker, servers, inspect, doctor, replay, events, probe, analytics, report,
            demo, tune, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaults(prog="kvtier", description="Tier-aware KV-cache routing for SGLang HiCache clusters.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvDefaults)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup(args)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a CLI reports errors as one clear line
        from kvtier.commands.errors import user_facing

        message = user_facing(exc)
        if message is None:
            raise
        print(f"kvtier {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
