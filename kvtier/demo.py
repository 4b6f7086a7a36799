"""`kvtier demo`: the pipeline end to end on embedded servers, no flags needed.

Starts nats-server (JetStream) and a Redis-protocol server on free loopback ports, a few
publishers speaking SGLang's ZMQ wire format with a seeded HiCache workload, one
`kvtier bridge` process per worker and one `kvtier processor`; then shows each worker's
pages per tier as Redis holds them and checks them against what the workers emitted.
(The simulated cluster, trace replay and routing comparison arrive with the simulator.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import redis

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.embedded import NatsServer, RedisServer
from kvtier.producers.sglang_publisher import SglangEventPublisher
from kvtier.producers.synthetic import HiCacheWorkload, ReferenceModel
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.tiers import Tier

MODEL = "demo-model"


def _spawn(log_dir: str, *args: str) -> subprocess.Popen:
    log = open(os.path.join(log_dir, f"{args[0]}-{len(os.listdir(log_dir))}.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *args, "--log-level", "WARNING"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log.name  # type: ignore[attr-defined]
    log.close()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _wait(predicate, timeout: float, what: str, children: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for child in children:
            if child.poll() is not None:
                with open(child.log_path, "rb") as f:  # type: ignore[attr-defined]
                    err = f.read().decode(errors="replace")
                raise RuntimeError(f"a kvtier process exited early while waiting for {what}:\n{err[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def run_demo(args) -> int:
    workers = [f"worker-{i}" for i in range(args.workers)]
    print(f"kvtier demo: {len(workers)} SGLang-format publishers -> bridges -> NATS JetStream -> processor -> Redis")
    children: list[subprocess.Popen] = []
    publishers: list[SglangEventPublisher] = []
    log_dir = tempfile.mkdtemp(prefix="kvtier-demo-")
    try:
        with NatsServer() as nats_server, RedisServer() as redis_server:
            print(f"  nats-server {nats_server.url} (pid {nats_server.pid}), redis {redis_server.url} "
                  f"(pid {redis_server.pid})")
            client = redis.Redis.from_url(redis_server.url)
            children.append(_spawn(log_dir, "processor", "--nats", nats_server.url, "--redis", redis_server.url))
            for worker in workers:
                publisher = SglangEventPublisher()
                publishers.append(publisher)
                children.append(_spawn(log_dir, "bridge", "--endpoint", publisher.endpoint, "--replay-endpoint",
                                       publisher.replay_endpoint, "--worker-id", worker, "--model", MODEL,
                                       "--page-size", "16", "--nats", nats_server.url))
            leases = ModelKeys.for_model(MODEL).leases
            _wait(lambda: client.zcard(leases) == len(workers), 60, "workers to announce themselves", children)

            references = {w: ReferenceModel() for w in workers}
            workloads = {w: HiCacheWorkload(seed=i, page_size=16) for i, w in enumerate(workers)}
            started = time.monotonic()
            emitted = 0
            for step in range(args.batches):
                for worker, publisher in zip(workers, publishers):
                    events = workloads[worker].next_batch()
                    publisher.publish(events)
                    references[worker].apply(events)
                    emitted += len(events)
                if (step + 1) % max(1, args.batches // 10) == 0 or step + 1 == args.batches:
                    done = (step + 1) / args.batches
                    print(f"\r  emitting [{'#' * int(done * 30):<30}] {done:4.0%}", end="", flush=True)
            print()
            _wait(lambda: all(read_worker_pages(client, MODEL, w) == references[w].pages for w in workers), 60,
                  "Redis to hold every worker's pages", children)
            converged = time.monotonic() - started

            print(f"\n  {'worker':<10} {'device':>7} {'host':>7} {'both':>6} {'epoch':>15} {'seq':>5} {'stale':>6}  exact")
            for worker in workers:
                pages = read_worker_pages(client, MODEL, worker)
                state = read_worker_state(client, MODEL, worker)
                device = sum(1 for t in pages.values() if Tier.DEVICE in t)
                host = sum(1 for t in pages.values() if Tier.HOST in t)
                both = sum(1 for t in pages.values() if {Tier.DEVICE, Tier.HOST} <= t)
                exact = "yes" if pages == references[worker].pages else "NO"
                print(f"  {worker:<10} {device:>7} {host:>7} {both:>6} {state['epoch']:>15} {state['seq']:>5} "
                      f"{state['stale']:>6}  {exact}")
            print(f"\n  {emitted} engine events from {len(workers)} workers applied and verified in {converged:.2f}s "
                  f"(emit to last page visible).")
            print("  Try: kvtier processor --help, kvtier bridge --help, kvtier bench ingest")
    except RuntimeError as exc:
        print(f"\nkvtier demo failed: {exc}\n(logs of the kvtier processes: {log_dir})", file=sys.stderr)
        return 1
    finally:
        for child in reversed(children):
            _stop(child)
        for publisher in publishers:
            publisher.close()
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0
