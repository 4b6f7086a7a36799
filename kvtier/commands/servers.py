"""`kvtier servers`: embedded nats-server and Redis-protocol servers (kvtier/harness/embedded.py)."""

from __future__ import annotations

from kvtier.commands.flags import add_common, run_until_signal


def register(sub) -> None:
    s = sub.add_parser("servers", help="Run embedded nats-server (JetStream) and Redis-protocol servers.",
                       description="Start nats-server with JetStream and a Redis-protocol server on loopback, print "
                                   "their URLs, and stop both on Ctrl-C/SIGTERM.")
    s.add_argument("--nats-port", type=int, default=0, help="NATS port (0: a free one).")
    s.add_argument("--redis-port", type=int, default=0, help="Redis port (0: a free one).")
    add_common(s)
    s.set_defaults(run=run)


def run(args) -> None:
    from kvtier.harness.embedded import NatsServer, RedisServer

    async def serve(stop):
        with NatsServer(port=args.nats_port) as nats_server, RedisServer(port=args.redis_port) as redis_server:
            print(f"NATS  {nats_server.url}  (pid {nats_server.pid})")
            print(f"Redis {redis_server.url}  (pid {redis_server.pid})", flush=True)
            await stop.wait()

    run_until_signal(serve)
