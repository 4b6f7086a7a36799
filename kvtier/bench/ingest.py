"""`kvtier bench ingest`: one processor process, NATS JetStream -> Redis.

Phase 1 (throughput): the stream is pre-loaded with kvtier batches from many workers (a
HiCache-like mix of stores and removes on device and host), then one `kvtier processor`
process drains it; transitions/s = transitions / (last batch visible - first batch visible),
both seen by a watcher process woken by Redis keyspace notifications, so processor
start-up is not counted.
Phase 2 (lag): batches are published at a steady rate (default half the measured one), each
stamped right before its publish; the watcher records when each (worker, seq) becomes
visible in Redis. Lag = visible - stamped, reported as p50/p99/max.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

from kvtier.harness.embedded import NatsServer, RedisServer
from kvtier.plumbing.streams import StreamSettings, ensure_streams
from kvtier.schemas.events import EventBatch, PagesRemoved, PagesStored, encode_message, pack_token_ids
from kvtier.schemas.subjects import events_subject
from kvtier.schemas.tiers import Tier
from kvtier.testing.processes import QUIET, start_processor, work_folder
from kvtier.testing.samplers import cores_used, cpu_snapshot
from kvtier.testing.visibility import VisibilityWatcher

MODEL = "bench-model"


class _WorkerStream:
    """A HiCache-like stream of tier events for one worker (write-through)."""

    def __init__(self, rng: random.Random, page_size: int, pages_per_event: int, token_ids: bool):
        self.rng = rng
        self.page_size = page_size
        self.k = pages_per_event
        self.token_ids = token_ids
        self.gpu_only: list[int] = []
        self.both: list[int] = []
        self.host_only: list[int] = []

    def _take(self, pool: list[int]) -> list[int]:
        n = min(self.k, len(pool))
        taken, pool[:] = pool[:n], pool[n:]
        return taken

    def event(self):
        r = self.rng.random()
        if r < 0.2 and len(self.gpu_only) >= self.k:
            pages = self._take(self.gpu_only)
            self.both += pages
            return PagesStored(tier=Tier.HOST, hashes=pages, page_size=self.page_size)
        if r < 0.4 and len(self.both) >= self.k:
            pages = self._take(self.both)
            self.host_only += pages
            return PagesRemoved(tier=Tier.DEVICE, hashes=pages)
        if r < 0.5 and len(self.host_only) >= self.k:
            pages = self._take(self.host_only)
            self.both += pages
            return PagesStored(tier=Tier.DEVICE, hashes=pages, page_size=self.page_size)
        if r < 0.6 and len(self.host_only) >= self.k:
            return PagesRemoved(tier=Tier.HOST, hashes=self._take(self.host_only))
        pages = [self.rng.randrange(-(1 << 63), 1 << 63) for _ in range(self.k)]
        self.gpu_only += pages
        tokens = [self.rng.randrange(0, 128_000) for _ in range(self.k * self.page_size)] if self.token_ids else []
        return PagesStored(tier=Tier.DEVICE, hashes=pages, page_size=self.page_size, token_ids=pack_token_ids(tokens))


class _Workload:
    def __init__(self, workers: int, pages_per_event: int, events_per_message: int, token_ids: bool, seed: int = 0):
        rng = random.Random(seed)
        self.workers = [f"bw{i}" for i in range(workers)]
        self.streams = {w: _WorkerStream(random.Random(rng.random()), 16, pages_per_event, token_ids)
                        for w in self.workers}
        self.seq = {w: 0 for w in self.workers}
        self.events_per_message = events_per_message
        self._next = 0

    def message(self, stamp: float | None = None) -> tuple[str, int, bytes, int]:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        self.seq[worker] += 1
        events = [self.streams[worker].event() for _ in range(self.events_per_message)]
        now = stamp if stamp is not None else time.time()
        batch = EventBatch(worker_id=worker, model=MODEL, epoch=1, seq=self.seq[worker], ts=now, source_ts=now,
                           events=events)
        return worker, batch.seq, encode_message(batch), sum(len(e.hashes) for e in events)


async def _preload(nats_url: str, payloads: list[tuple[str, int, bytes, int]]) -> None:
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, StreamSettings())
    window = 256
    pending = []
    for worker, seq, data, _ in payloads:
        pending.append(js.publish(events_subject(MODEL, worker), data, headers={"Nats-Msg-Id": f"{worker}:1:{seq}"}))
        if len(pending) >= window:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    await nc.close()


async def _paced(nats_url: str, messages: list[tuple[str, int, bytes, int]],
                 messages_per_s: float) -> dict[tuple[str, int], float]:
    """Publish pre-built messages at a steady pace; the stamp is taken right before each
    publish (building a message is not part of the pipeline's lag)."""
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stamps: dict[tuple[str, int], float] = {}
    start = time.monotonic()
    for n, (worker, seq, data, _) in enumerate(messages):
        delay = start + n / messages_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        stamps[(worker, seq)] = time.time()
        await js.publish(events_subject(MODEL, worker), data, headers={"Nats-Msg-Id": f"{worker}:1:{seq}"})
    await nc.close()
    return stamps


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_ingest_bench(args) -> int:
    workload = _Workload(args.workers, args.pages_per_event, args.events_per_message, token_ids=not args.no_token_ids)
    per_message = args.pages_per_event * args.events_per_message
    count = max(1, args.transitions // per_message)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say(f"building {count} messages x {per_message} transitions ({args.workers} workers) ...")
    payloads = [workload.message(0.0) for _ in range(count)]
    total = sum(p[3] for p in payloads)
    mean_bytes = statistics.mean(len(p[2]) for p in payloads)
    with (work_folder("kvtier-bench-ingest-", "kvtier bench ingest") as work, NatsServer() as nats_server,
          RedisServer() as redis_server):
        asyncio.run(_preload(nats_server.url, payloads))
        watcher = VisibilityWatcher(redis_server.url, MODEL, workload.workers)
        last = {w: s for w, s, _, _ in payloads}
        processor = start_processor(work, nats_server.url, redis_server.url, [
            *QUIET, "--hash-check", args.hash_check, "--hash-check-budget", str(args.hash_check_budget)])
        try:
            if not watcher.wait_for(last, 600, lambda: processor.proc.poll() is None):
                raise RuntimeError("processor did not finish the throughput phase")
            visible_at, first_change = watcher.finish()
            done = max(visible_at[(w, s)] for w, s in last.items())
            elapsed = done - (first_change or done)
            rate = total / elapsed if elapsed > 0 else float("inf")
            say(f"throughput: {total} transitions in {elapsed:.3f}s = {rate:,.0f} transitions/s")

            lag_transitions = args.lag_rate or rate / 2
            lag_rate = lag_transitions / per_message
            say(f"lag phase: {lag_rate:.0f} messages/s ({lag_transitions:,.0f} transitions/s) "
                f"for {args.lag_seconds}s ...")
            lag_messages = [workload.message(0.0) for _ in range(max(1, int(lag_rate * args.lag_seconds)))]
            watcher = VisibilityWatcher(redis_server.url, MODEL, workload.workers)
            watcher.seen = {w: last.get(w, 0) for w in workload.workers}
            pids = {"processor": processor.proc.pid, "nats-server": nats_server.pid, "redis-server": redis_server.pid,
                    "watcher": watcher.process.pid}
            cpu_before, wall_before = cpu_snapshot(pids), time.monotonic()
            stamps = asyncio.run(_paced(nats_server.url, lag_messages, lag_rate))
            cpu = cores_used(cpu_before, cpu_snapshot(pids), time.monotonic() - wall_before)
            say(f"cores used in the lag phase: {cpu}")
            final = {w: s for w, s, _, _ in lag_messages}
            watcher.wait_for(final, 30, lambda: processor.proc.poll() is None)
            visible_at, _ = watcher.finish()
            lags = [(visible_at[k] - t) * 1000 for k, t in stamps.items() if k in visible_at]
            if args.trace:
                t0 = min(stamps.values())
                series = sorted(((t - t0), (visible_at[k] - t) * 1000) for k, t in stamps.items() if k in visible_at)
                for w in range(int(args.lag_seconds * 4)):
                    win = [lag for t, lag in series if w / 4 <= t < (w + 1) / 4]
                    if win:
                        say(f"  t={w / 4:5.2f}s n={len(win):4d} p50={statistics.median(win):7.2f} max={max(win):7.2f}")
            missing = len(stamps) - len(lags)
        finally:
            processor.stop()
    result = {
        "bench": "ingest",
        "transitions": total,
        "messages": count,
        "transitions_per_message": per_message,
        "mean_message_bytes": round(mean_bytes),
        "workers": args.workers,
        "token_ids": not args.no_token_ids,
        "seconds": round(elapsed, 4),
        "transitions_per_s": round(rate),
        "lag_rate_transitions_per_s": round(lag_transitions),
        "lag_samples": len(lags),
        "lag_missing": missing,
        "lag_p50_ms": round(statistics.median(lags), 2) if lags else None,
        "lag_p99_ms": round(_percentile(lags, 0.99), 2) if lags else None,
        "lag_max_ms": round(max(lags), 2) if lags else None,
        "lag_phase_cores": cpu,
    }
    if args.dynamo:
        from kvtier.bench.dynamo_side import dynamo_apply_rate

        result.update(dynamo_apply_rate(payloads))
        say(f"Dynamo RadixTree.apply_event, device-tier events of the same messages, in process: "
            f"{result['dynamo_transitions_per_s']:,} transitions/s")
    say(f"lag: p50 {result['lag_p50_ms']} ms, p99 {result['lag_p99_ms']} ms, max {result['lag_max_ms']} ms "
        f"over {len(lags)} messages ({missing} not seen)")
    if args.json:
        print(json.dumps(result))
    return 0
