"""`kvtier servers`: embedded nats-server and Redis-protocol servers (kvtier/harness/embedded.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.plumbing.settings import setting


@dataclass(kw_only=True)
class ServersSettings:
    nats_port: int = setting(0, flag="--nats-port", parse=int, help="NATS port (0: a free one).")
    redis_port: int = setting(0, flag="--redis-port", parse=int, help="Redis port (0: a free one).")


def register(sub) -> None:
    s = sub.add_parser("servers", help="Run embedded nats-server (JetStream) and Redis-protocol servers.",
                       description="Start nats-server with JetStream and a Redis-protocol server on loopback, print "
                                   "their URLs, and stop both on Ctrl-C/SIGTERM.")
    add_flags(s, ServersSettings)
    add_common(s)
    s.set_defaults(run=run)


def run(args) -> None:
    from kvtier.harness.embedded import NatsServer, RedisServer

    settings = read_settings(ServersSettings, args)

    async def serve(stop):
        with NatsServer(port=settings.nats_port) as nats_server, RedisServer(port=settings.redis_port) as redis_server:
            print(f"NATS  {nats_server.url}  (pid {nats_server.pid})")
            print(f"Redis {redis_server.url}  (pid {redis_server.pid})", flush=True)
            await stop.wait()

    run_until_signal(serve)
