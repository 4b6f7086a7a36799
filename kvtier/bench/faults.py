"""`kvtier bench faults`: a seeded schedule of crashes and outages during a sustained event
stream, then a page-for-page check that the tier state came out exact.

The pipeline is the real one, every part in its own process (kvtier/testing/fault_cluster.py):
simulated HiCache engines publishing SGLang's ZMQ wire format from this process, one `kvtier
bridge` per worker to a real nats-server (JetStream on file storage), one or two `kvtier
processor`s (static partition halves) applying them to a real Redis-protocol server (AOF on,
except once). Faults (kvtier/testing/fault_injector.py says each: processors killed, paused or
down past a lease, a bridge killed, nats-server and Redis killed or down, Redis restarted empty,
an engine restarted, a delivery lost), one at a time, each followed by a wait for recovery.

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
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

from kvtier.bench.settings import FaultsBench
from kvtier.schemas.state_keys import DEFAULT_ROOT
from kvtier.schemas.subjects import subject_token
from kvtier.testing.fault_cluster import MODEL, Cluster, Pump, count_in_logs
from kvtier.testing.fault_injector import KINDS, Injector, schedule

__all__ = ["KINDS", "run_faults", "print_report", "run_fault_bench"]

RECOVERY_TIMEOUT_S = 60.0


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
def run_faults(bench: FaultsBench, say=print) -> dict:
    """The whole bench; returns the result (the JSON object). `bench.lease`: the workers' lease
    (their bridges announce every quarter of it); the long faults last twice as long."""
    faults, seed, duration, workers, processors, rate = (bench.faults, bench.seed, bench.duration, bench.workers,
                                                         bench.processors, bench.rate)
    workdir = tempfile.mkdtemp(prefix="kvtier-faults-")
    cluster = Cluster(workdir, workers, processors, rate, duration, seed, say, bench.lease)
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
            if bench.log_dir:
                shutil.copytree(cluster.logs, bench.log_dir, dirs_exist_ok=True)
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
        "lease_s": bench.lease, "expired_live_workers": expired_live, "rebases": rebases,
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


def run_fault_bench(bench: FaultsBench) -> int:
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if bench.json else (lambda *a: print(*a, flush=True))
    result = run_faults(bench, say)
    print_report(result, say)
    if bench.json:
        print(json.dumps(result))
    clean = (result["divergences"] == 0 and result["not_recovered"] == 0 and result["expired_live_workers"] == 0
             and result["rebases"] == 0)
    return 0 if clean else 1
