"""`kvtier router`: a stateless routing replica over HTTP (router/service.py). Its flags are
RouterConfig's declarations (router/config.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.router.config import RouterConfig


def register(sub) -> None:
    r = sub.add_parser("router", help="Serve tier-aware routing decisions over HTTP (a stateless replica).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(r, RouterConfig)
    add_common(r)
    r.set_defaults(run=run)


def run(args) -> None:
    from kvtier.router.processes import ProcessSlot, serve_on_processes

    config = read_settings(RouterConfig, args)  # refused here once, not by each process
    slot = ProcessSlot.from_env()
    if config.processes > 1 and slot is None:
        raise SystemExit(serve_on_processes(config.processes, config.host, config.http_port))
    run_until_signal(lambda stop: _serve(config.for_process(slot), stop))


async def _serve(config: RouterConfig, stop) -> None:
    from kvtier.router.service import run_router

    await run_router(config, stop, ready=lambda port: print(f"kvtier router listening on http://{config.host}:{port}",
                                                            flush=True))
