"""`kvtier replay` and `kvtier replay explain` (kvtier/tools/replay.py, explain.py). Their flags
are ReplaySettings' and ExplainSettings' declarations (kvtier/tools/settings.py)."""

from __future__ import annotations

from kvtier.commands.flags import EnvDefaults, add_common, add_flags, read_settings
from kvtier.tools.settings import ExplainSettings, ReplaySettings


def register(sub) -> None:
    rp = sub.add_parser(
        "replay", help="Rebuild tier state as it was at a stream seq or a time, compare it with the live state, "
                       "or explain a routing decision.",
        description="Read KVTIER_EVENTS from its first retained message up to --at-seq / --at-time (default: its last "
                    "message now) and apply it with the processor's own apply code into a scratch namespace (keys "
                    "<NAMESPACE>:{model}:..., expiring after --ttl; `--drop NAMESPACE` removes them), or into another "
                    "Redis database with --into-db (not on Redis Cluster). --diff compares the result with the live "
                    "state page by page and exits 1 if any page diverges. The stream only reaches back as far as its "
                    "retention (--stream-max-age/--stream-max-bytes of processor and bridge): an older point is "
                    "refused. `kvtier replay explain REQUEST_ID --nats URL --redis URL` re-derives a logged routing "
                    "decision. Exit codes: 0 ok, 1 diverged / not reproduced, 2 refused or not found.")
    add_flags(rp, ReplaySettings)
    add_common(rp)
    rsub = rp.add_subparsers(dest="replay_command", required=False, parser_class=EnvDefaults)
    ex = rsub.add_parser(
        "explain", help="Why a router chose the worker it chose: re-derive a logged decision from the event stream.",
        description="Find the decision for REQUEST_ID in KVTIER_DECISIONS, rebuild its model's tier state as of the "
                    "decision's time, read each candidate's tiered overlap from it with the router's own reader, "
                    "re-score with the recorded weights, loads and random draw, and print every term of the formula "
                    "per candidate. Flags every difference from the record (overlap per tier, logit, winner, "
                    "candidates) and exits 1 if there is one; 2 if the decision is not found. Shared-pool hits are "
                    "taken as recorded (Mooncake's state cannot be replayed).")
    add_flags(ex, ExplainSettings)
    rp.set_defaults(run=run)
    ex.set_defaults(run=run_explain)


def run(args) -> int:
    from kvtier.tools.replay import run_replay

    return run_replay(read_settings(ReplaySettings, args))


def run_explain(args) -> int:
    from kvtier.tools import explain

    return explain.run_explain(read_settings(ExplainSettings, args))
