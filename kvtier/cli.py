"""The `kvtier` command. Each subcommand registers its own flags and its run function in a
small module of kvtier/commands/ (README.md there); this only puts them together. Every flag
can also be set by an environment variable KVTIER_<FLAG> (e.g. --nats -> KVTIER_NATS,
--page-size -> KVTIER_PAGE_SIZE); a flag on the command line wins over the environment."""

from __future__ import annotations

import argparse
import sys
import textwrap

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

#: The commands by role, in the order `kvtier --help` lists them.
ROLES = (
    ("services", (bridge, processor, router, analytics)),
    ("operator tools", (doctor, inspect, replay, events, report, probe)),
    ("lab", (demo, bench, tune, sim_worker, servers)),
)
COMMANDS = tuple(command for _, commands in ROLES for command in commands)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaults(prog="kvtier", description="Tier-aware KV-cache routing for SGLang HiCache clusters.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvDefaults, metavar="COMMAND",
                                help="one of the commands below, by role")
    groups = []
    for role, commands in ROLES:
        before = len(sub._choices_actions)
        for command in commands:
            command.register(sub)
        groups.append((role, sub._choices_actions[before:]))
    # one list per role instead of argparse's single one (its entries are the same pseudo-actions)
    sub._choices_actions = []
    width = max(len(action.dest) for _, actions in groups for action in actions)
    indent = " " * (width + 4)

    def line(action) -> str:
        return textwrap.fill(f"  {action.dest:<{width}}  {action.help}", 100, subsequent_indent=indent)

    parser.epilog = "\n\n".join(f"{role}:\n" + "\n".join(line(action) for action in actions)
                                for role, actions in groups) + "\n\n`kvtier COMMAND --help` explains each one."
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
