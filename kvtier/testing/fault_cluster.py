"""The pipeline `kvtier bench faults` (kvtier/bench/faults.py) and tests/pipeline/test_fault_suite.py put
under faults (kvtier/testing/fault_injector.py), every part in its own process: simulated
HiCache engines (`kvtier/sim/hicache_sim.py`, one per worker) publishing SGLang's ZMQ wire
format (PUB + replay ROUTER, `kvtier/sim/sglang_publisher.py`) from this process, driven by a
pump thread; one `kvtier bridge` per worker to a real nats-server (JetStream on file storage);
one or two `kvtier processor`s (static partition halves) applying them to a real
Redis-protocol server (AOF on). What the pipeline has reached, per worker, read from Redis.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import redis

from kvtier.consumers.apply import read_worker_pages
from kvtier.harness.embedded import NatsServer, RedisServer
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import partition_of
from kvtier.sim.hicache_sim import HiCacheSim, SimConfig
from kvtier.sim.sglang_publisher import SglangEventPublisher
from kvtier.testing.processes import KvtierSubprocess, start_bridge, start_processor

MODEL = "bench-faults"
PARTITIONS = 8
PAGE_SIZE = 16


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
    """The pipeline's servers and processes (their logs in `workdir`/logs), the engines feeding
    it, and what Redis says it has reached."""

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
        #: processor i consumes partitions[i]
        self.processors: dict[int, KvtierSubprocess] = {}
        self.generation: dict[str, int] = {}
        self.paused: set[int] = set()
        self._client: redis.Redis | None = None

    @property
    def client(self) -> redis.Redis:
        """A client of the cluster's Redis (short timeouts: Redis is among what is killed)."""
        if self._client is None:
            raise RuntimeError("the cluster is not started")
        return self._client

    # processes, each started and stopped by its PID; a restart's log is a new file
    def _log_name(self, name: str) -> str:
        self.generation[name] = self.generation.get(name, 0) + 1
        return f"{name}.{self.generation[name]}"

    def start_processor(self, i: int) -> None:
        self.processors[i] = start_processor(
            self.logs, self.nats.url, self.redis.url,
            ["--partitions", ",".join(map(str, self.partitions[i])), "--reap-interval", "0.5", "--log-level", "INFO"],
            name=self._log_name(f"processor{i}"))

    def start_bridge(self, engine: Engine) -> None:
        self.bridges[engine.worker] = start_bridge(
            self.logs, self._log_name(f"bridge-{engine.worker}"), (engine.endpoint, engine.replay_endpoint),
            engine.worker, MODEL, PAGE_SIZE, self.nats.url,
            ["--heartbeat", str(self.lease_s / 4), "--lease-ttl", str(self.lease_s), "--log-level", "INFO"])

    def start(self) -> None:
        self.nats.start()
        self.redis.start()
        self._client = redis.Redis.from_url(self.redis.url, socket_timeout=2, socket_connect_timeout=1)
        for i in range(len(self.partitions)):
            self.start_processor(i)
        for engine in self.engines:
            self.start_bridge(engine)

    def check_alive(self) -> None:
        for i, p in self.processors.items():
            if i not in self.paused:
                p.check()
        for b in self.bridges.values():
            b.check()

    def stop(self) -> None:
        for i in list(self.paused):
            self.resume(i)
        for process in [*self.bridges.values(), *self.processors.values()]:
            try:
                process.stop()
            except Exception:  # noqa: BLE001 - stop the rest anyway
                process.kill()
        for engine in self.engines:
            engine.close()
        if self._client is not None:
            self._client.close()
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


def count_in_logs(folder: str, prefix: str, text: str) -> int:
    """Lines containing `text` in the logs of processes whose log name starts with `prefix`."""
    total = 0
    for name in os.listdir(folder):
        if name.startswith(prefix):
            with open(os.path.join(folder, name), errors="replace") as f:
                total += sum(text in line for line in f)
    return total
