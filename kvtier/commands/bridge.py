"""`kvtier bridge`: one SGLang worker's ZMQ KV events to NATS JetStream (producers/bridge.py).
Its flags are BridgeSettings' declarations (producers/bridge_settings.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.producers.bridge_settings import BridgeSettings


def register(sub) -> None:
    b = sub.add_parser("bridge", help="Forward one SGLang worker's ZMQ KV events to NATS JetStream.",
                       description="Subscribe to an SGLang worker's KV events (--kv-events-config publisher zmq) and "
                                   "publish them, in order and gap-free, to JetStream subject "
                                   "kvtier.events.<model>.<worker>. Recovers missed batches from the engine's replay "
                                   "socket and announces the worker (metadata + lease) every heartbeat while its "
                                   "engine answers its health endpoint.")
    add_flags(b, BridgeSettings)
    add_common(b)
    b.set_defaults(run=run)


def run(args) -> None:
    from kvtier.producers.bridge import run_bridge
    from kvtier.producers.bridge_config import BridgeConfig, worker_flags
    from kvtier.producers.sglang_discovery import resolve_worker

    settings = read_settings(BridgeSettings, args)  # checked before anything is contacted
    worker = resolve_worker(worker_flags(settings), sglang_url=settings.sglang_url, timeout_s=settings.sglang_timeout,
                            api_key=settings.sglang_api_key)
    config = BridgeConfig.resolved(settings, worker)
    run_until_signal(lambda stop: run_bridge(config, stop))
