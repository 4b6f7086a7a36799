"""`kvtier bench faults`: a seeded schedule of crashes and outages during a sustained event
stream, then a page-for-page check that the tier state came out exact.

The pipeline is the real one, every part in its own process: simulated HiCache engines
(`kvtier/sim/hicache_sim.py`, one per worker) publish SGLang's ZMQ wire format (PUB + replay
ROUTER, `kvtier/sim/sglang_publisher.py`) from this process; one `kvtier bridge` per worker
forwards them to a real nats-server (JetStream on file storage); one or two `kvtier
processor`s (static partition halves) apply them to a real Redis-protocol server (AOF on,
except once). Faults, one at a time, each followed by a wait for recovery:

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

Every worker stays alive throughout, so `expired_live_workers` (leases the processors
expired) and `rebases` (workers cleared and marked stale after a gap) must be 0.

Recovery time = from the repair (restart / SIGCONT) until every worker's applied state has
caught up with what its engine emitted since (the applied batch's engine timestamp is past
the repair), no worker is stale and no model is rebuilding. At the end the engines stop,
the state settles, and the live state is compared page for page with (a) a state rebuilt
from the stream by `kvtier replay`'s own rebuild (`kvtier/tools/replay.py`) and (b) each engine's
own view of its pages (`HiCacheSim.tiers()`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import redis

from kvtier.consumers.apply import read_worker_pages
from kvtier.harness.embedded import NatsServer, RedisServer
from kvtier.schemas.jetstream import PullRequest, encode_pull_request
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys
from kvtier.schemas.subjects import EVENTS_STREAM, partition_of, pull_next_subject, subject_token
from kvtier.sim.hicache_sim import HiCacheSim, SimConfig
from kvtier.sim.sglang_publisher import SglangEventPublisher
from kvtier.testing.processes import KvtierSubprocess

MODEL = "bench-faults"
KINDS = ("processor_kill", "processor_pause", "bridge_kill", "nats_kill", "redis_kill", "redis_loss",
         "processor_outage", "processors_outage", "nats_outage", "lost_delivery",
         "publisher_restart")
PARTITIONS = 8
PAGE_SIZE = 16
RECOVERY_TIMEOUT_S = 60.0


# --- the engines ---------------------------------------------------------------------------
class Engine:
    """One simulated SGLang worker: a HiCache simulator fed by a seeded conversation workload,
    publishing its KV events on SGLang's wire format. `restart()` is a new engine process on
    the same endpoints (empty cache, seq from 0)."""

    def __init__(self, worker: str, seed: int, buffer_size: int):
        self.worker = worker
        self.rng = random.Random(seed)
        self.buffer_size = buffer_size
        self.config = SimConfig(page_size=PAGE_SIZE, device_pages=512, host_pages=2048,
                                write_policy="write_through", dma_delay_s=0.003)
        self.sim = HiCacheSim(self.config)
        self.publisher = SglangEventPublisher(buffer_size=buffer_size)
        self.endpoint, self.replay_endpoint = self.publisher.endpoint, self.publisher.replay_endpoint
        self.conversations: list[list[int]] = [self._fresh() for _ in range(48)]
        self.lock = threading.Lock()
        self.batches = 0
        self.events = 0
        self.transitions = 0
        self.restarts = 0

    def _fresh(self) -> list[int]:
        return [self.rng.randrange(1, 50_000) for _ in range(PAGE_SIZE * self.rng.randint(2, 8))]

    def step(self, now: float) -> None:
        with self.lock:
            i = self.rng.randrange(len(self.conversations))
            tokens = self.conversations[i]
            tokens += [self.rng.randrange(1, 50_000) for _ in range(PAGE_SIZE * self.rng.randint(1, 3))]
            if len(tokens) > 40 * PAGE_SIZE:
                tokens = self.conversations[i] = self._fresh()
            self.sim.serve(tokens, now)
            events = self.sim.drain_events()
            if events:
                self.publisher.publish(events)
                self.batches += 1
                self.events += len(events)
                self.transitions += sum(len(getattr(e, "block_hashes", ())) or 1 for e in events)

    def restart(self) -> None:
        with self.lock:
            self.publisher.close()
            self.sim = HiCacheSim(self.config)
            deadline = time.monotonic() + 5
            while True:
                try:
                    self.publisher = SglangEventPublisher(self.endpoint, self.replay_endpoint,
                                                          buffer_size=self.buffer_size)
                    break
                except Exception:  # the old sockets may take a moment to let the ports go
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self.restarts += 1

    def view(self):
        with self.lock:
            return self.sim.tiers()

    def close(self) -> None:
        with self.lock:
            self.publisher.close()


class Pump(threading.Thread):
    """Drives every engine at `rate` requests/s each, on a simulated clock that follows the
    wall clock (so write-through copies land between requests)."""

    def __init__(self, engines: list[Engine], rate: float):
        super().__init__(name="engine-pump", daemon=True)
        self.engines, self.rate = engines, rate
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        start = time.monotonic()
        n = 0
        try:
            while not self.stop_flag.is_set():
                n += 1
                delay = start + n / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                now = time.monotonic() - start
                for engine in self.engines:
                    engine.step(now)
        except BaseException as exc:  # noqa: BLE001 - reported by the bench
            self.error = exc

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(10)


# --- the pipeline's processes --------------------------------------------------------------
def pick_workers(n: int, processors: int) -> tuple[list[str], list[list[int]]]:
    """Worker ids spread over partitions, and each processor's partitions: every processor
    owns about as many workers (so pausing one leaves part of the cluster behind)."""
    workers: list[str] = []
    per_partition: dict[int, int] = {}
    i = 0
    while len(workers) < n:
        name = f"fw{i}"
        i += 1
        p = partition_of(MODEL, name, PARTITIONS)
        if per_partition.get(p, 0) < max(1, -(-n // PARTITIONS)) or i > 400:
            workers.append(name)
            per_partition[p] = per_partition.get(p, 0) + 1
    occupied = sorted(per_partition, key=lambda p: (-per_partition[p], p))
    owned: list[list[int]] = [[] for _ in range(processors)]
    for k, p in enumerate(occupied):
        owned[k % processors].append(p)
    for k, p in enumerate(p for p in range(PARTITIONS) if p not in per_partition):
        owned[k % processors].append(p)
    return workers, [sorted(o) for o in owned]


class Cluster:
    def __init__(self, workdir: str, workers: int, processors: int, rate: float, duration: float, seed: int,
                 say=print, lease_s: float = 5.0):
        self.workdir = workdir
        self.say = say
        self.lease_s = lease_s
        self.logs = os.path.join(workdir, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.worker_ids, self.partitions = pick_workers(workers, processors)
        self.nats = NatsServer(workdir=os.path.join(workdir, "nats"))
        self.redis = RedisServer(workdir=os.path.join(workdir, "redis"), appendonly=True)
        os.makedirs(self.nats.workdir, exist_ok=True)
        os.makedirs(self.redis.workdir, exist_ok=True)
        buffer = int(rate * (duration + 120) * 1.2) + 1000  # the replay buffer holds the whole run
        self.engines = [Engine(w, seed * 1000 + k, buffer) for k, w in enumerate(self.worker_ids)]
        self.bridges: dict[str, KvtierSubprocess] = {}
        self.processors: list[KvtierSubprocess | None] = [None] * processors
        self.generation: dict[str, int] = {}
        self.paused: set[int] = set()
        self.client: redis.Redis | None = None

    # processes, each started and stopped by its PID
    def _spawn(self, name: str, args: list[str]) -> KvtierSubprocess:
        self.generation[name] = self.generation.get(name, 0) + 1
        return KvtierSubprocess(args, self.logs, f"{name}.{self.generation[name]}")

    def start_processor(self, i: int) -> None:
        self.processors[i] = self._spawn(f"processor{i}", [
            "processor", "--nats", self.nats.url, "--redis", self.redis.url,
            "--partitions", ",".join(map(str, self.partitions[i])), "--reap-interval", "0.5",
            "--log-level", "INFO"])

    def start_bridge(self, engine: Engine) -> None:
        self.bridges[engine.worker] = self._spawn(f"bridge-{engine.worker}", [
            "bridge", "--endpoint", engine.endpoint, "--replay-endpoint", engine.replay_endpoint,
            "--worker-id", engine.worker, "--model", MODEL, "--page-size", str(PAGE_SIZE), "--nats", self.nats.url,
            "--heartbeat", str(self.lease_s / 4), "--lease-ttl", str(self.lease_s), "--log-level", "INFO"])

    def start(self) -> None:
        self.nats.start()
        self.redis.start()
        self.client = redis.Redis.from_url(self.redis.url, socket_timeout=2, socket_connect_timeout=1)
        for i in range(len(self.processors)):
            self.start_processor(i)
        for engine in self.engines:
            self.start_bridge(engine)

    def check_alive(self) -> None:
        for i, p in enumerate(self.processors):
            if p is not None and i not in self.paused:
                p.check()
        for b in self.bridges.values():
            b.check()

    def stop(self) -> None:
        for i in list(self.paused):
            self.resume(i)
        for process in [*self.bridges.values(), *(p for p in self.processors if p is not None)]:
            try:
                process.stop()
            except Exception:  # noqa: BLE001 - stop the rest anyway
                process.kill()
        for engine in self.engines:
            engine.close()
        if self.client is not None:
            self.client.close()
        self.redis.stop()
        self.nats.stop()

    def pause(self, i: int) -> None:
        os.kill(self.processors[i].proc.pid, signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        os.kill(self.processors[i].proc.pid, signal.SIGCONT)
        self.paused.discard(i)

    # what the pipeline has reached
    def position(self) -> dict:
        """Per worker (source ts, stale, epoch, seq) and the model's marker; {} while Redis is down."""
        keys = ModelKeys.for_model(MODEL)
        try:
            pipe = self.client.pipeline(transaction=False)
            for w in self.worker_ids:
                pipe.hmget(keys.state(w), "source_ts", "stale", "epoch", "seq")
            pipe.hmget(keys.incarnation, "ready", "rebuilding")
            replies = pipe.execute()
        except (redis.RedisError, OSError):
            return {}
        workers = {}
        for w, (ts, stale, epoch, seq) in zip(self.worker_ids, replies[:-1]):
            workers[w] = (float(ts or 0), (stale or b"0") == b"1", int(epoch or 0), int(seq or 0))
        ready, rebuilding = replies[-1]
        return {"workers": workers, "ready": ready == b"1", "rebuilding": rebuilding == b"1"}

    def caught_up(self, since: float) -> bool:
        pos = self.position()
        if not pos or not pos["ready"] or pos["rebuilding"]:
            return False
        return all(ts >= since and not stale for ts, stale, _, _ in pos["workers"].values())

    def exact(self) -> bool:
        try:
            return all(read_worker_pages(self.client, MODEL, e.worker) == e.view() for e in self.engines)
        except (redis.RedisError, OSError):
            return False


async def _stream_last_seq(url: str) -> int:
    import nats

    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        info = await nc.jetstream().stream_info("KVTIER_EVENTS")
        return info.state.last_seq
    finally:
        await nc.close()


def stream_last_seq(url: str) -> int | None:
    try:
        return asyncio.run(_stream_last_seq(url))
    except Exception:  # noqa: BLE001 - a figure for the report only
        return None


# --- faults --------------------------------------------------------------------------------
@dataclass
class Fault:
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
            for p in c.processors:
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


def count_in_logs(folder: str, prefix: str, text: str) -> int:
    """Lines containing `text` in the logs of processes whose log name starts with `prefix`."""
    total = 0
    for name in os.listdir(folder):
        if name.startswith(prefix):
            with open(os.path.join(folder, name), errors="replace") as f:
                total += sum(text in line for line in f)
    return total


def _wait(predicate, timeout: float, interval: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    return None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_s": round(statistics.median(values), 3),
            "p99_s": round(_percentile(values, 0.99), 3), "max_s": round(max(values), 3)}


# --- the comparison ------------------------------------------------------------------------
def compare(cluster: Cluster) -> dict:
    """Live state vs a replay of the stream (kvtier/tools/replay.py) and vs each engine's view."""
    from kvtier.schemas.hashes import page_key
    from kvtier.schemas.state_keys import page_member
    from kvtier.tools.replay import diff_states, read_states, rebuild, scratch_target

    scratch = scratch_target(cluster.redis.url)
    try:
        started = time.monotonic()
        report = asyncio.run(rebuild(cluster.nats.url, scratch, model=MODEL))
        replay_s = time.monotonic() - started
        live = read_states(cluster.client, DEFAULT_ROOT, MODEL)
        replayed = read_states(scratch.client, scratch.root, MODEL)
    finally:
        scratch.drop()
    diffs = diff_states(live, replayed)
    replay_pages = sum(len((live[k].members if k in live else set())
                           | (replayed[k].members if k in replayed else set()))
                       for k in set(live) | set(replayed))
    token = subject_token(MODEL)
    engine_pages = engine_diverging = 0
    per_worker = []
    for engine in cluster.engines:
        expected = {page_member(t, page_key(h)) for h, tiers in engine.view().items() for t in tiers}
        state = live.get((token, engine.worker))
        members = state.members if state else set()
        engine_pages += len(members | expected)
        diverging = len(members ^ expected)
        engine_diverging += diverging
        per_worker.append({"worker": engine.worker, "page_tiers": len(expected), "vs_engine": diverging,
                           "position": f"{state.epoch}:{state.seq}" if state else "absent",
                           "stale": bool(state and state.stale)})
    return {
        "replay_s": round(replay_s, 3), "replay_messages": report.messages, "replay_rebased": len(report.rebased),
        "pages_vs_replay": replay_pages, "diverging_vs_replay": sum(d.pages for d in diffs),
        "positions_diverging": sum(1 for d in diffs if d.live != d.replay),
        "pages_vs_engines": engine_pages, "diverging_vs_engines": engine_diverging,
        "diffs": [asdict(d) | {"pages": d.pages} for d in diffs][:8], "workers": per_worker,
    }


# --- the run -------------------------------------------------------------------------------
def run_faults(faults: int = 24, seed: int = 1, duration: float = 150.0, workers: int = 4, processors: int = 2,
               rate: float = 40.0, log_dir: str | None = None, say=print, lease_s: float = 5.0) -> dict:
    """The whole bench; returns the result (the JSON object). `lease_s`: the workers' lease
    (their bridges announce every quarter of it); the long faults last twice as long."""
    workdir = tempfile.mkdtemp(prefix="kvtier-faults-")
    cluster = Cluster(workdir, workers, processors, rate, duration, seed, say, lease_s)
    plan = schedule(faults, duration, seed)
    injector = Injector(cluster, seed, say)
    pump = Pump(cluster.engines, rate)
    wall_start = time.monotonic()
    result: dict = {}
    try:
        say(f"starting nats-server, redis (AOF), {processors} processor(s) (partitions {cluster.partitions}), "
            f"{workers} bridges and engines ({', '.join(cluster.worker_ids)}) ...")
        cluster.start()
        pump.start()
        started = time.time()
        if _wait(lambda: cluster.caught_up(started), 90, 0.1) is None:
            cluster.check_alive()
            raise RuntimeError("the pipeline did not come up within 90s; logs in " + cluster.logs)
        say(f"pipeline up after {time.monotonic() - wall_start:.1f}s; {len(plan)} faults over {duration:.0f}s "
            f"(seed {seed}), {rate:g} requests/s per engine")
        phase_start = time.monotonic()
        for n, fault in enumerate(plan, 1):
            delay = phase_start + fault.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if pump.error:
                raise RuntimeError(f"engine pump failed: {pump.error!r}")
            fault.injected_s = round(time.monotonic() - phase_start, 2)
            t_inject = time.monotonic()
            repaired = injector.inject(fault)
            fault.outage_s = round(time.monotonic() - t_inject, 3)
            if fault.kind == "redis_loss":
                detected = _wait(lambda: (cluster.position() or {}).get("ready", False), RECOVERY_TIMEOUT_S, 0.02)
                fault.detail["marker_ready_s"] = round(detected, 3) if detected is not None else None
            recovered = _wait(lambda since=repaired: cluster.caught_up(since), RECOVERY_TIMEOUT_S)
            if fault.kind == "redis_loss" and recovered is not None:
                recovered += fault.detail.get("marker_ready_s") or 0.0
            fault.recovery_s = round(recovered, 3) if recovered is not None else None
            say(f"  [{n:2d}/{len(plan)}] t={fault.injected_s:6.1f}s {fault.kind:<17} {fault.target:<16} "
                f"outage {fault.outage_s:5.2f}s  recovered in "
                + (f"{fault.recovery_s:.2f}s" if fault.recovery_s is not None else "NOT WITHIN 60s")
                + (f"  {fault.detail}" if fault.detail else ""))
            if recovered is None:
                cluster.check_alive()
            injector.after_recovery(fault)
        remaining = phase_start + duration - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        pump.stop()
        if pump.error:
            raise RuntimeError(f"engine pump failed: {pump.error!r}")
        stream_s = time.monotonic() - phase_start
        settle = _wait(cluster.exact, 90, 0.1)
        say(f"engines stopped after {stream_s:.0f}s; live state "
            + (f"equal to every engine's view {settle:.2f}s later" if settle is not None else "NOT settled in 90s"))
        comparison = compare(cluster)
        cluster.check_alive()
        expired_live = count_in_logs(cluster.logs, "processor", "lease expired")
        rebases = count_in_logs(cluster.logs, "processor", "never arrived; state cleared")
    finally:
        pump.stop()
        try:
            cluster.stop()
        finally:
            if log_dir:
                shutil.copytree(cluster.logs, log_dir, dirs_exist_ok=True)
            shutil.rmtree(workdir, ignore_errors=True)

    by_kind: dict[str, dict] = {}
    for kind in KINDS:
        done = [f for f in plan if f.kind == kind]
        if done:
            by_kind[kind] = {"injected": len(done), "not_recovered": sum(f.recovery_s is None for f in done),
                             "recovery": _summary([f.recovery_s for f in done if f.recovery_s is not None])}
    recoveries = [f.recovery_s for f in plan if f.recovery_s is not None]
    divergences = (comparison["diverging_vs_replay"] + comparison["diverging_vs_engines"]
                   + comparison["positions_diverging"])
    result = {
        "bench": "faults", "seed": seed, "faults": len(plan), "faults_by_kind": {k: v["injected"] for k, v in
                                                                                   by_kind.items()},
        "not_recovered": sum(f.recovery_s is None for f in plan),
        "workers": workers, "processors": processors, "rate_per_engine": rate, "stream_s": round(stream_s, 1),
        "events": sum(e.events for e in cluster.engines), "engine_batches": sum(e.batches for e in cluster.engines),
        "page_transitions": sum(e.transitions for e in cluster.engines),
        "stream_messages": comparison["replay_messages"],
        "pages_compared": comparison["pages_vs_replay"] + comparison["pages_vs_engines"],
        "divergences": divergences, "settle_s": round(settle, 3) if settle is not None else None,
        "lease_s": lease_s, "expired_live_workers": expired_live, "rebases": rebases,
        "recovery": _summary(recoveries), "recovery_by_kind": {k: v["recovery"] for k, v in by_kind.items()},
        "comparison": comparison, "schedule": [asdict(f) for f in plan],
    }
    return result


def print_report(result: dict, say=print) -> None:
    c = result["comparison"]
    say(f"\n{result['faults']} faults ({result['not_recovered']} not recovered within {RECOVERY_TIMEOUT_S:.0f}s), "
        f"{result['events']} engine events in {result['engine_batches']} batches "
        f"({result['page_transitions']} page transitions), {result['stream_messages']} stream messages")
    say(f"{'fault':<18} {'n':>3} {'recovery median':>16} {'p99':>8} {'max':>8}")
    for kind, summary in result["recovery_by_kind"].items():
        n = result["faults_by_kind"][kind]
        if summary.get("n"):
            say(f"{kind:<18} {n:>3} {summary['median_s']:>15.2f}s {summary['p99_s']:>7.2f}s {summary['max_s']:>7.2f}s")
        else:
            say(f"{kind:<18} {n:>3} {'-':>16}")
    all_ = result["recovery"]
    if all_.get("n"):
        say(f"{'all':<18} {all_['n']:>3} {all_['median_s']:>15.2f}s {all_['p99_s']:>7.2f}s {all_['max_s']:>7.2f}s")
    say(f"compared {c['pages_vs_replay']} (page, tier) entries with a replay of the stream: "
        f"{c['diverging_vs_replay']} diverge, {c['positions_diverging']} worker positions differ; "
        f"{c['pages_vs_engines']} with the engines' own views: {c['diverging_vs_engines']} diverge")
    for w in c["workers"]:
        say(f"  {w['worker']}: {w['page_tiers']} page-tiers, epoch:seq {w['position']}"
            + (" STALE" if w["stale"] else "")
            + (f", {w['vs_engine']} differ from its engine" if w["vs_engine"] else ""))
    for d in c["diffs"]:
        say(f"  diverging {d['model']}/{d['worker']}: live {d['live']} replay {d['replay']}, {d['pages']} pages")
    say(f"divergences: {result['divergences']}; live workers expired: {result['expired_live_workers']}; "
        f"rebases: {result['rebases']}")


def run_fault_bench(args) -> int:
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if args.faults < 1:
        raise SystemExit("--faults must be at least 1")
    result = run_faults(faults=args.faults, seed=args.seed, duration=args.duration, workers=args.workers,
                        processors=args.processors, rate=args.rate, log_dir=args.log_dir, say=say, lease_s=args.lease)
    print_report(result, say)
    if args.json:
        print(json.dumps(result))
    clean = (result["divergences"] == 0 and result["not_recovered"] == 0 and result["expired_live_workers"] == 0
             and result["rebases"] == 0)
    return 0 if clean else 1
