"""`kvtier bench ingest`: one processor process, NATS JetStream -> Redis.

Phase 1 (throughput): the stream is pre-loaded with kvtier batches from many workers (a
HiCache-like mix of stores and removes on device and host: kvtier/testing/ingest_workloads.py),
then one `kvtier processor` process drains it; transitions/s = transitions / (last batch
visible - first batch visible), both seen by a watcher process woken by Redis keyspace
notifications, so processor start-up is not counted.
Phase 2 (lag): batches are published at a steady rate (default half the measured one), each
stamped right before its publish; the watcher records when each (worker, seq) becomes
visible in Redis. Lag = visible - stamped, reported as p50/p99/max.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from kvtier.bench.settings import IngestBench
from kvtier.harness.embedded import NatsServer, RedisServer
from kvtier.plumbing.streams import StreamSettings, ensure_streams
from kvtier.schemas.subjects import events_subject
from kvtier.testing.ingest_workloads import IngestWorkload
from kvtier.testing.processes import QUIET, start_processor, work_folder
from kvtier.testing.samplers import cores_used, cpu_snapshot
from kvtier.testing.visibility import VisibilityWatcher

MODEL = "bench-model"


async def _publish(nats_url: str, messages: list[tuple[str, int, bytes, int]],
                   messages_per_s: float | None = None) -> dict[tuple[str, int], float]:
    """Publish pre-built messages: all at once into streams made first (256 in flight), or at a
    steady pace, each stamped right before its publish (building a message is not part of the
    pipeline's lag)."""
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    if messages_per_s is None:
        await ensure_streams(js, StreamSettings())
    stamps: dict[tuple[str, int], float] = {}
    pending = []
    start = time.monotonic()
    for n, (worker, seq, data, _) in enumerate(messages):
        publish = js.publish(events_subject(MODEL, worker), data, headers={"Nats-Msg-Id": f"{worker}:1:{seq}"})
        if messages_per_s is None:
            pending.append(publish)
            if len(pending) >= 256:
                await asyncio.gather(*pending)
                pending = []
            continue
        delay = start + n / messages_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        stamps[(worker, seq)] = time.time()
        await publish
    await asyncio.gather(*pending)
    await nc.close()
    return stamps


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_ingest_bench(bench: IngestBench) -> int:
    workload = IngestWorkload(MODEL, bench.workers, bench.pages_per_event, bench.events_per_message,
                              token_ids=not bench.no_token_ids)
    per_message = bench.pages_per_event * bench.events_per_message
    count = max(1, bench.transitions // per_message)
    say = (lambda *a: print(*a, file=sys.stderr)) if bench.json else print
    say(f"building {count} messages x {per_message} transitions ({bench.workers} workers) ...")
    payloads = [workload.message(0.0) for _ in range(count)]
    total = sum(p[3] for p in payloads)
    mean_bytes = statistics.mean(len(p[2]) for p in payloads)
    with (work_folder("kvtier-bench-ingest-", "kvtier bench ingest") as work, NatsServer() as nats_server,
          RedisServer() as redis_server):
        asyncio.run(_publish(nats_server.url, payloads))
        watcher = VisibilityWatcher(redis_server.url, MODEL, workload.workers)
        last = {w: s for w, s, _, _ in payloads}
        processor = start_processor(work, nats_server.url, redis_server.url, [
            *QUIET, "--hash-check", bench.hash_check, "--hash-check-budget", str(bench.hash_check_budget)])
        try:
            if not watcher.wait_for(last, 600, lambda: processor.proc.poll() is None):
                raise RuntimeError("processor did not finish the throughput phase")
            visible_at, first_change = watcher.finish()
            done = max(visible_at[(w, s)] for w, s in last.items())
            elapsed = done - (first_change or done)
            rate = total / elapsed if elapsed > 0 else float("inf")
            say(f"throughput: {total} transitions in {elapsed:.3f}s = {rate:,.0f} transitions/s")

            lag_transitions = bench.lag_rate or rate / 2
            lag_rate = lag_transitions / per_message
            say(f"lag phase: {lag_rate:.0f} messages/s ({lag_transitions:,.0f} transitions/s) "
                f"for {bench.lag_seconds}s ...")
            lag_messages = [workload.message(0.0) for _ in range(max(1, int(lag_rate * bench.lag_seconds)))]
            watcher = VisibilityWatcher(redis_server.url, MODEL, workload.workers)
            watcher.seen = {w: last.get(w, 0) for w in workload.workers}
            pids = {"processor": processor.proc.pid, "nats-server": nats_server.pid, "redis-server": redis_server.pid,
                    "watcher": watcher.process.pid}
            cpu_before, wall_before = cpu_snapshot(pids), time.monotonic()
            stamps = asyncio.run(_publish(nats_server.url, lag_messages, lag_rate))
            cpu = cores_used(cpu_before, cpu_snapshot(pids), time.monotonic() - wall_before)
            say(f"cores used in the lag phase: {cpu}")
            final = {w: s for w, s, _, _ in lag_messages}
            watcher.wait_for(final, 30, lambda: processor.proc.poll() is None)
            visible_at, _ = watcher.finish()
            lags = [(visible_at[k] - t) * 1000 for k, t in stamps.items() if k in visible_at]
            if bench.trace:
                t0 = min(stamps.values())
                series = sorted(((t - t0), (visible_at[k] - t) * 1000) for k, t in stamps.items() if k in visible_at)
                for w in range(int(bench.lag_seconds * 4)):
                    win = [lag for t, lag in series if w / 4 <= t < (w + 1) / 4]
                    if win:
                        say(f"  t={w / 4:5.2f}s n={len(win):4d} p50={statistics.median(win):7.2f} max={max(win):7.2f}")
            missing = len(stamps) - len(lags)
        finally:
            processor.stop()
    result = {
        "bench": "ingest", "transitions": total, "messages": count, "transitions_per_message": per_message,
        "mean_message_bytes": round(mean_bytes), "workers": bench.workers, "token_ids": not bench.no_token_ids,
        "seconds": round(elapsed, 4), "transitions_per_s": round(rate),
        "lag_rate_transitions_per_s": round(lag_transitions), "lag_samples": len(lags), "lag_missing": missing,
        "lag_p50_ms": round(statistics.median(lags), 2) if lags else None,
        "lag_p99_ms": round(_percentile(lags, 0.99), 2) if lags else None,
        "lag_max_ms": round(max(lags), 2) if lags else None,
        "lag_phase_cores": cpu,
    }
    if bench.dynamo:
        from kvtier.bench.dynamo_side import dynamo_apply_rate

        result.update(dynamo_apply_rate(payloads))
        say(f"Dynamo RadixTree.apply_event, device-tier events of the same messages, in process: "
            f"{result['dynamo_transitions_per_s']:,} transitions/s")
    say(f"lag: p50 {result['lag_p50_ms']} ms, p99 {result['lag_p99_ms']} ms, max {result['lag_max_ms']} ms "
        f"over {len(lags)} messages ({missing} not seen)")
    if bench.json:
        print(json.dumps(result))
    return 0
