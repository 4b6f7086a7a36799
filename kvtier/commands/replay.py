"""`kvtier replay` and `kvtier replay explain` (kvtier/tools/replay.py, explain.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import EnvDefaults, add_common, positive_int


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
    rp.add_argument("--nats", default=None, help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    rp.add_argument("--redis", default=None, help="Redis URL of the live state; the scratch state goes there too.")
    rp.add_argument("--model", default=None, help="Only this model (default: every model).")
    rp.add_argument("--worker", default=None, help="Only this worker.")
    at = rp.add_mutually_exclusive_group()
    at.add_argument("--at-time", default=None,
                    help="The state as of this time: ISO 8601 (UTC unless an offset is given), unix seconds, or a "
                         "duration ago (90s, 5m, 2h, 1d).")
    at.add_argument("--at-seq", type=positive_int, default=None,
                    help="The state after the events stream's message with this sequence (see `kvtier events tail`).")
    into = rp.add_mutually_exclusive_group()
    into.add_argument("--into", default=None, metavar="NAMESPACE",
                      help="Scratch key root to rebuild under (default: a fresh kvtreplay-<hex>); must be empty.")
    into.add_argument("--into-db", type=int, default=None, metavar="N",
                      help="Rebuild under the usual kvt: root in Redis database N instead (not the live one; not "
                           "available on Redis Cluster).")
    rp.add_argument("--ttl", type=int, default=3600,
                    help="Seconds the scratch keys live (0: until `kvtier replay --drop`).")
    rp.add_argument("--diff", action="store_true",
                    help="Compare the rebuilt state with the live one per worker and tier; exit 1 if any page "
                         "diverges.")
    rp.add_argument("--drop", nargs="?", const="", default=None, metavar="NAMESPACE",
                    help="Delete a scratch namespace's keys (with --into-db N: the kvt keys of database N) and exit.")
    rp.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
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
    ex.add_argument("request_id", help="The request id the router logged (its /v1/route request_id).")
    suppress = argparse.SUPPRESS  # options given before `explain` (to `kvtier replay`) still count
    ex.add_argument("--nats", default=suppress, help="NATS URL holding KVTIER_DECISIONS and KVTIER_EVENTS.")
    ex.add_argument("--redis", default=suppress, help="Redis URL (the scratch state is rebuilt there, then dropped).")
    ex.add_argument("--model", default=suppress, help="Search only this model's decisions (faster).")
    ex.add_argument("--keep", action="store_true",
                    help="Keep the rebuilt state (its namespace is printed; it expires after --ttl).")
    ex.add_argument("--ttl", type=int, default=suppress, help="With --keep: seconds the kept keys live (0: forever).")
    ex.add_argument("--json", action="store_true", default=suppress, help="Also print one JSON object last.")
    rp.set_defaults(run=run)
    ex.set_defaults(run=run_explain)


def run(args) -> int:
    from kvtier.tools.replay import run_replay

    return run_replay(args)


def run_explain(args) -> int:
    from kvtier.tools import explain

    return explain.run_explain(args)
