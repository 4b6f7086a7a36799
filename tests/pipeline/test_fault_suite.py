"""The fault suite (`kvtier bench faults`) at CI size, and Redis data loss: detected, routing
degraded meanwhile, the state rebuilt exactly from the stream (or, where the stream no longer
holds an epoch's start, marked stale until the bridge's resync)."""

import asyncio
import json
import time

import nats
import pytest

from kvtier.bench.faults import KINDS, run_faults
from kvtier.bench.settings import FaultsBench
from kvtier.consumers.apply import read_worker_pages
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.sglang import BlockStored
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys
from kvtier.schemas.subjects import EVENTS_STREAM
from kvtier.schemas.tiers import Tier
from kvtier.tools.replay import diff_states, read_states, rebuild, scratch_target

from ..helpers import HiCacheWorkload, ReferenceModel, RunningPipeline, wait_until
from ..router_helpers import RouterProcess

MODEL = "m-loss"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def test_fault_suite_every_kind_ends_exact(tmp_path):
    """Twelve faults, every kind once (Redis data loss and the long outages included) plus one
    more, during a sustained stream: every one recovers, no live worker is expired or rebased,
    and the state ends equal, page for page, to a replay of the stream and to each engine's
    own view."""
    started = time.monotonic()
    said: list[str] = []
    result = run_faults(FaultsBench(faults=12, seed=3, duration=60, workers=2, processors=2, rate=30, lease=4.0,
                                    log_dir=str(tmp_path)), say=lambda *a: said.append(" ".join(map(str, a))))
    assert set(result["faults_by_kind"]) == set(KINDS)
    assert result["faults_by_kind"]["redis_loss"] == 1
    assert result["not_recovered"] == 0, result["schedule"]
    assert result["pages_compared"] > 1000
    # the long faults (processors and NATS down for twice the lease) expire and rebase nobody
    if (result["expired_live_workers"], result["rebases"]) != (0, 0):
        # which worker, when, next to the faults' timeline: enough to tell the cause from CI's output
        lines = [f"{p.name}: {line}" for p in sorted(tmp_path.glob("*.log"))
                 for line in p.read_text(errors="replace").splitlines()
                 if "lease expired" in line or "rebased" in line or "new epoch" in line]
        raise AssertionError(f"expired live workers {result['expired_live_workers']}, rebases {result['rebases']}\n"
                             + "\n".join(said) + "\n" + "\n".join(lines[-40:]))
    if result["divergences"]:
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(tmp_path.glob("*.log")))
        raise AssertionError(f"{result['divergences']} divergences\n" + "\n".join(said) + "\n"
                             + json.dumps(result["comparison"])[:4000] + "\n" + logs)
    assert time.monotonic() - started < 200


def _marker(client) -> dict:
    raw = client.hgetall(ModelKeys.for_model(MODEL).incarnation)
    return {k.decode(): v.decode() for k, v in raw.items()}


def _walk(pages: dict, tokens: list[int]) -> dict:
    """docs/DESIGN.md's walk over a worker's pages: device prefix, then host, then disk."""
    counts = {"device": 0, "host": 0, "disk": 0}
    hashes = sglang_block_hashes(tokens, 4)
    i = 0
    for tier, name in ((Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.DISK, "disk")):
        while i < len(hashes) and tier in pages.get(hashes[i], ()):
            counts[name] += 1
            i += 1
    return counts


def _overlap(answer: dict) -> dict:
    return {k: answer["overlap"][k] for k in ("device", "host", "disk")}


def _replay_diff(nats_url: str, redis_url: str, client) -> list:
    scratch = scratch_target(redis_url)
    try:
        asyncio.run(rebuild(nats_url, scratch, model=MODEL))
        return diff_states(read_states(client, DEFAULT_ROOT, MODEL), read_states(scratch.client, scratch.root, MODEL))
    finally:
        scratch.drop()


def test_redis_data_loss_is_detected_routing_degrades_and_the_state_is_rebuilt(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=21), ReferenceModel()
        run.publish(workload, reference, 150)
        run.converge(reference)
        router = RouterProcess(redis_server.url)
        try:
            tokens = list(range(7_000_000, 7_000_000 + 4 * 8))  # a prefill of 8 pages, then a host copy of 3
            prefill = [BlockStored(block_hashes=sglang_block_hashes(tokens, 4), parent_block_hash=None,
                                   token_ids=tokens, block_size=4, medium="GPU"),
                       BlockStored(block_hashes=sglang_block_hashes(tokens, 4)[:3], parent_block_hash=None,
                                   token_ids=[], block_size=4, medium="CPU_PINNED")]
            run.publisher.publish(prefill)
            reference.apply(prefill)
            run.converge(reference)
            router.wait_index_settled(run.client, MODEL)
            status, before, _ = router.route(MODEL, tokens, book=False)
            assert status == 200 and before["degraded"] == [], before
            assert _overlap(before) == _walk(reference.pages, tokens) == {"device": 8, "host": 0, "disk": 0}
            assert _marker(run.client)["ready"] == "1"

            # The store restarts empty while no processor runs: the router must not trust it.
            run.processor.stop()
            run.client.flushall()
            status, during, headers = router.route(MODEL, tokens, book=False)
            assert status == 200, during
            assert during["degraded"] == ["state-store-rebuilding"]
            assert during["worker_id"] == "w0" and during["overlap"]["device"] == 0
            assert headers.get("X-Kvtier-Degraded") == "state-store-rebuilding"

            # Events go on; a processor finds the marker missing and rebuilds from the stream.
            run.publish(workload, reference, 50)
            run.start_processor()
            wait_until(lambda: _marker(run.client).get("rebuilding") == "0", timeout=30,
                       what=lambda: f"the rebuild to finish: {_marker(run.client)}\n{run.processor.output()[-2000:]}")
            run.converge(reference)
            assert _marker(run.client)["reason"] == "lost"
            state = run.state()
            assert state["stale"] == "0" and state["epochs"] == "1"  # rebuilt, not resynced
            assert "acknowledged batches were lost" in run.processor.output()
            # The replica's index notices the new marker and builds itself from the rebuilt state.
            router.wait_index_settled(run.client, MODEL)
            status, after, _ = router.route(MODEL, tokens, book=False)
            assert status == 200 and after["degraded"] == []
            assert _overlap(after) == _walk(reference.pages, tokens)
            assert not _replay_diff(nats_server.url, redis_server.url, run.client)
        finally:
            router.stop()


def test_lost_state_whose_epoch_start_left_the_stream_is_stale_until_the_bridge_resyncs(nats_server, redis_server):
    """Where retention no longer holds the start of a worker's epoch, the rebuild cannot be
    exact from the stream: the worker is marked stale and its bridge is asked to resync; the
    new epoch (from the engine's replay buffer) makes it exact again."""
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=22), ReferenceModel()
        for _ in range(4):
            run.publish(workload, reference, 40)
            time.sleep(0.2)  # several stream messages
        run.converge(reference)
        run.processor.stop()

        async def purge():
            nc = await nats.connect(nats_server.url)
            js = nc.jetstream()
            last = (await js.stream_info(EVENTS_STREAM)).state.last_seq
            await js.purge_stream(EVENTS_STREAM, seq=last - 2)  # keep the last few messages only
            await nc.close()

        asyncio.run(purge())
        run.client.flushall()
        run.start_processor()
        wait_until(lambda: "asking its bridge to resync" in run.processor.output(), timeout=30,
                   what=lambda: run.processor.output()[-2000:])
        wait_until(lambda: run.state().get("last_epoch_reason") == "resync_requested", timeout=30,
                   what=lambda: f"{run.state()}\n{run.bridge.output()[-2000:]}")
        run.publish(workload, reference, 10)
        run.converge(reference)
        assert run.state()["stale"] == "0"
        assert _marker(run.client)["ready"] == "1"
        wait_until(lambda: _marker(run.client).get("rebuilding") == "0", timeout=10)
        assert read_worker_pages(run.client, MODEL, "w0") == reference.pages
