"""`kvtier doctor` (kvtier/tools/doctor/)."""

from __future__ import annotations

from kvtier.commands.flags import UrlListAction, add_common, positive_float, url_list


def register(sub) -> None:
    dr = sub.add_parser("doctor", help="Check a running deployment (NATS, Redis, workers, tiers, page sizes, Mooncake, "
                                       "routers, hash scheme, dead letters) and say what is wrong and how to fix it.",
                        description="Reads NATS, Redis, each router's /healthz and /metrics and the Mooncake master, "
                                    "and judges each check ok / warn / fail with a one-line finding and a fix. "
                                    "Exit 0 when nothing failed (warnings too fail with --strict), else 1.")
    dr.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    dr.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    dr.add_argument("--router", type=url_list, action=UrlListAction, default=[],
                    help="A router's base URL, e.g. http://10.0.0.7:8000 (repeat, or comma-separate, for several).")
    dr.add_argument("--mooncake-master", default="",
                    help="The Mooncake master's HTTP (metrics) address, e.g. http://master:9003; probed with "
                         "/batch_query_keys (or GET exactly this URL when it has a path, e.g. .../metrics).")
    dr.add_argument("--model", default=None, help="Only this model (default: every model in Redis).")
    dr.add_argument("--events-window", type=positive_float, default=300.0,
                    help="Seconds within which a live worker's events should have been applied.")
    dr.add_argument("--timeout", type=positive_float, default=3.0, help="Seconds each probe may take.")
    dr.add_argument("--strict", action="store_true", help="Exit 1 on warnings too.")
    dr.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    add_common(dr)
    dr.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.doctor.report import run_doctor

    return run_doctor(args)
