"""`kvtier router`: a stateless routing replica over HTTP (router/service.py). Its flags are
RouterConfig's declarations (router/config.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

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
    from kvtier.router.service import STOP_MARGIN_S, run_router

    # The last resort of the promise that a router leaves within --drain-timeout + STOP_MARGIN_S
    # of SIGTERM: run_router bounds each step of its stop, and this ends the process should
    # one of them hang anyway (a thread, a socket the loop never hears from again).
    watchdog = asyncio.create_task(_exit_if_stuck(stop, config.drain_timeout_s + STOP_MARGIN_S - 0.1))
    try:
        await run_router(config, stop, ready=lambda port: print(
            f"kvtier router listening on http://{config.host}:{port}", flush=True))
    finally:
        watchdog.cancel()


async def _exit_if_stuck(stop: asyncio.Event, after_s: float) -> None:
    await stop.wait()
    timer = threading.Timer(after_s, _force_exit, (after_s,))
    timer.daemon = True
    timer.start()


def _force_exit(after_s: float) -> None:
    logging.getLogger("kvtier.router").error("the router was still stopping %.1f s after SIGTERM: exiting now", after_s)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(1)
