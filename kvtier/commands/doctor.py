"""`kvtier doctor` (kvtier/tools/doctor/). Its flags are DoctorSettings' declarations
(kvtier/tools/settings.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common, add_flags, read_settings
from kvtier.tools.settings import DoctorSettings


def register(sub) -> None:
    dr = sub.add_parser("doctor", help="Check a running deployment (NATS, Redis, workers, tiers, page sizes, Mooncake, "
                                       "routers, hash scheme, dead letters) and say what is wrong and how to fix it.",
                        description="Reads NATS, Redis, each router's /healthz and /metrics and the Mooncake master, "
                                    "and judges each check ok / warn / fail with a one-line finding and a fix. "
                                    "Exit 0 when nothing failed (warnings too fail with --strict), else 1.")
    add_flags(dr, DoctorSettings)
    add_common(dr)
    dr.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.doctor.report import run_doctor

    return run_doctor(read_settings(DoctorSettings, args))
