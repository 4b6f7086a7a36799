"""The faults `kvtier bench faults` and tests/pipeline/test_fault_suite.py inject into the pipeline of
kvtier/testing/fault_cluster.py, one at a time, each followed by a wait for recovery:

  processor_kill     SIGKILL a processor, restart it after a short outage
  processor_pause    SIGSTOP a processor for seconds (it falls behind), then SIGCONT
  bridge_kill        SIGKILL a worker's bridge, restart it (the engine keeps publishing)
  nats_kill          SIGKILL nats-server, restart it on the same port and store dir
  redis_kill         SIGKILL the Redis server, restart it on the same AOF dir
  redis_loss         SIGKILL the Redis server, restart it empty WITHOUT persistence (once):
                     the loss must be detected and the state rebuilt from the stream
  publisher_restart  a new engine process on the same endpoints: empty cache, seq from 0
  processor_outage   SIGKILL a processor, restart it after twice the workers' lease
  processors_outage  every processor down for twice the lease (nothing consumes meanwhile)
  nats_outage        nats-server down for twice the lease (no bridge can renew a lease)
  lost_delivery      a processor's pulls expire while it is paused, one of its deliveries
                     is taken by a pull that never acks (as when a connection breaks): it
                     must come back before the gap timeout, not after the ack wait

`schedule` draws a seeded plan of them; `Injector.inject` injects one, holds the outage and
repairs it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from kvtier.schemas.jetstream import PullRequest, encode_pull_request
from kvtier.schemas.subjects import EVENTS_STREAM, partition_of, pull_next_subject
from kvtier.testing.fault_cluster import MODEL, PARTITIONS, Cluster, stream_last_seq

KINDS = ("processor_kill", "processor_pause", "bridge_kill", "nats_kill", "redis_kill", "redis_loss",
         "processor_outage", "processors_outage", "nats_outage", "lost_delivery",
         "publisher_restart")


@dataclass
class Fault:
    """One fault of a plan: when it is due, and what became of it."""

    kind: str
    at_s: float  # scheduled, from the start of the fault phase
    target: str = ""
    injected_s: float | None = None  # from the start of the fault phase
    outage_s: float = 0.0  # injection -> repair
    recovery_s: float | None = None  # repair -> caught up (None: not within the timeout)
    detail: dict = field(default_factory=dict)


def schedule(n: int, duration: float, seed: int) -> list[Fault]:
    """`n` faults over `duration` seconds: every kind at least once (redis_loss exactly once),
    the rest drawn at random, in a seeded random order, at jittered even spacing."""
    rng = random.Random(seed)
    kinds = list(KINDS[:n]) if n < len(KINDS) else list(KINDS)
    others = [k for k in KINDS if k != "redis_loss"]
    kinds += [rng.choice(others) for _ in range(n - len(kinds))]
    rng.shuffle(kinds)
    spacing = duration / max(1, n)
    return [Fault(kind, round(spacing * (i + 0.3 + 0.4 * rng.random()), 2)) for i, kind in enumerate(kinds)]


class Injector:
    """Injects faults into `cluster`, each on a target drawn from a seeded generator."""

    def __init__(self, cluster: Cluster, seed: int, say):
        self.c = cluster
        self.rng = random.Random(seed + 7)
        self.say = say

    def inject(self, fault: Fault) -> float:
        """Inject, hold the outage, repair; returns the wall time of the repair."""
        c, rng = self.c, self.rng
        kind = fault.kind
        if kind == "processor_kill":
            i = rng.randrange(len(c.processors))
            fault.target = f"processor{i}"
            c.processors[i].kill()
            time.sleep(rng.uniform(0.2, 1.5))
            c.start_processor(i)
        elif kind == "processor_pause":
            i = rng.randrange(len(c.processors))
            fault.target = f"processor{i}"
            before = stream_last_seq(c.nats.url)
            c.pause(i)
            time.sleep(rng.uniform(4.0, 9.0))
            after = stream_last_seq(c.nats.url)
            if before is not None and after is not None:
                fault.detail["stream_messages_while_paused"] = after - before
            c.resume(i)
        elif kind == "bridge_kill":
            engine = rng.choice(c.engines)
            fault.target = f"bridge-{engine.worker}"
            c.bridges[engine.worker].kill()
            time.sleep(rng.uniform(0.2, min(2.0, 0.25 * c.lease_s)))  # back well within its lease: not a death
            c.start_bridge(engine)
        elif kind == "nats_kill":
            fault.target = "nats-server"
            c.nats.kill()
            time.sleep(rng.uniform(0.5, 2.0))
            c.nats.start()
        elif kind in ("redis_kill", "redis_loss"):
            fault.target = "redis-server"
            c.redis.kill()
            time.sleep(rng.uniform(0.2, 1.5))
            if kind == "redis_loss":
                c.redis.appendonly = False  # starts empty: the AOF is not read
            c.redis.start()
            fault.detail["persistence"] = "aof" if kind == "redis_kill" else "none"
        elif kind == "publisher_restart":
            engine = rng.choice(c.engines)
            fault.target = f"engine-{engine.worker}"
            engine.restart()
        elif kind == "processor_outage":
            i = rng.randrange(len(c.processors))
            fault.target = f"processor{i}"
            c.processors[i].kill()
            time.sleep(2 * c.lease_s)
            c.start_processor(i)
        elif kind == "processors_outage":
            fault.target = "every processor"
            for p in list(c.processors.values()):
                p.kill()
            time.sleep(2 * c.lease_s)
            for i in range(len(c.processors)):
                c.start_processor(i)
        elif kind == "nats_outage":
            fault.target = "nats-server"
            c.nats.kill()
            time.sleep(2 * c.lease_s)
            c.nats.start()
        elif kind == "lost_delivery":
            i = rng.randrange(len(c.processors))
            engine = rng.choice([e for e in c.engines if partition_of(MODEL, e.worker, PARTITIONS) in c.partitions[i]])
            partition = partition_of(MODEL, engine.worker, PARTITIONS)
            fault.target = f"processor{i} p{partition}"
            c.pause(i)
            time.sleep(PULL_EXPIRES_S + 0.5)  # its pull requests expire: the next delivery is ours
            fault.detail["stolen"] = asyncio.run(steal_deliveries(c.nats.url, f"kvtier-processor-p{partition}"))
            c.resume(i)
        else:
            raise ValueError(kind)
        return time.time()

    def after_recovery(self, fault: Fault) -> None:
        if fault.kind == "redis_loss":
            # Back to AOF for the rest of the run: Redis writes the rebuilt state to a new AOF.
            c = self.c
            c.client.config_set("appendonly", "yes")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = c.client.info("persistence")
                if int(info.get("aof_enabled", 0)) and not int(info.get("aof_rewrite_in_progress", 0)) \
                        and not int(info.get("aof_rewrite_scheduled", 0)):
                    break
                time.sleep(0.1)
            c.redis.appendonly = True


#: How long a processor's pull request lives at the server (consumers/pull.py).
PULL_EXPIRES_S = 5.0


async def steal_deliveries(nats_url: str, durable: str, n: int = 1) -> int:
    """Take up to `n` deliveries from a consumer and never ack them: what a pull whose
    connection broke leaves behind. Returns how many were taken."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(pull_next_subject(EVENTS_STREAM, durable),
                         encode_pull_request(PullRequest(batch=n, expires=2_000_000_000)), reply=inbox)
        taken = 0
        while taken < n:
            try:
                msg = await sub.next_msg(timeout=3)
            except Exception:  # noqa: BLE001 - nothing more to take
                break
            if (msg.headers or {}).get("Status"):
                break
            taken += 1
        return taken
    finally:
        await nc.close()
