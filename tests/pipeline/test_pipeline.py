"""End to end: SGLang-format ZMQ publisher -> kvtier bridge -> JetStream -> processor -> Redis."""

import time

import pytest

from kvtier.consumers.apply import read_page_holders, read_worker_pages
from kvtier.schemas.tiers import tiers_of_bits
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import (
    HiCacheWorkload,
    KvtierProcess,
    ReferenceModel,
    RunningPipeline,
    describe_diff,
    processor_process,
    state_matches,
    stop_all,
    wait_until,
    worker_announced,
)

MODEL = "meta-llama/Llama-3.1-8B"


@pytest.mark.slow
@pytest.mark.parametrize("array_encoding", [False, True], ids=["map-events", "array-events"])
def test_round_trip_matches_reference(nats_server, redis_server, array_encoding):
    publisher = SglangEventPublisher(array_encoding=array_encoding)
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=publisher) as run:
        workload, reference = HiCacheWorkload(seed=1), ReferenceModel()
        run.publish(workload, reference, 300)
        run.converge(reference)
        assert len(reference.pages) > 50
        # the tier bits a router reads for a request's pages say the same
        holders = read_page_holders(run.client, MODEL, ["w0"], list(reference.pages))
        assert [set(tiers_of_bits(h["w0"])) for h in holders] == list(reference.pages.values())
        state = run.state()
        assert state["stale"] == "0"
        assert state["last_epoch_reason"] == "bridge_start"


@pytest.mark.slow
def test_store_before_remove_never_invisible(nats_server, redis_server):
    """A concurrent reader never sees a page vanish from every tier before its final removal."""
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=7), ReferenceModel()
        watcher = VanishWatcher()
        for i in range(400):
            run.publish(workload, reference, 1)
            if i % 4 == 0:
                watcher.observe(read_worker_pages(run.client, MODEL, "w0"))
        deadline = time.monotonic() + 30
        while not state_matches(run.client, MODEL, "w0", reference) and time.monotonic() < deadline:
            watcher.observe(read_worker_pages(run.client, MODEL, "w0"))
        run.converge(reference)
        assert watcher.polls > 50
        assert watcher.vanished_then_back == set()
        # every page that left the state for good was finally removed by the worker
        assert watcher.gone <= workload.finally_removed
        assert len(watcher.gone) > 0


class VanishWatcher:
    """Flags a page that disappears from all tiers and later reappears: in a write-through
    workload with fresh hashes per prefill, that can only be a transient invisibility."""

    def __init__(self):
        self.seen: set = set()
        self.gone: set = set()
        self.vanished_then_back: set = set()
        self.polls = 0

    def observe(self, pages: dict) -> None:
        self.polls += 1
        present = set(pages)
        self.vanished_then_back |= present & self.gone
        self.gone |= self.seen - present
        self.seen |= present


def test_vanish_watcher_detects_a_transient_vanish():
    watcher = VanishWatcher()
    watcher.observe({1: {"device"}})
    watcher.observe({})  # remove(GPU) applied before store(host)
    watcher.observe({1: {"host"}})
    assert watcher.vanished_then_back == {1}


@pytest.mark.slow
def test_dp_ranks_publish_on_port_base_plus_rank(nats_server, redis_server, redis_client):
    import zmq

    from kvtier.harness.embedded import free_port

    base = None
    for _ in range(20):  # two consecutive free ports for the two ranks
        candidate = free_port()
        try:
            publishers = [SglangEventPublisher(endpoint=f"tcp://127.0.0.1:{candidate + r}", replay_endpoint=None,
                                               attn_dp_rank=r) for r in range(2)]
            base = candidate
            break
        except zmq.ZMQError:
            continue
    assert base is not None
    processor = processor_process(nats_server.url, redis_server.url)
    bridge = KvtierProcess("bridge", "--endpoint", f"tcp://127.0.0.1:{base}", "--worker-id", "engine7", "--model",
                           MODEL, "--page-size", "4", "--nats", nats_server.url, "--dp-size", "2", "--heartbeat", "0.5")
    try:
        for r in range(2):
            wait_until(lambda r=r: worker_announced(redis_client, MODEL, f"engine7-dp{r}"), what=f"rank {r} announced")
        references = [ReferenceModel(), ReferenceModel()]
        workloads = [HiCacheWorkload(seed=100 + r) for r in range(2)]
        for _ in range(60):
            for r in range(2):
                events = workloads[r].next_batch()
                publishers[r].publish(events)
                references[r].apply(events)
        for r in range(2):
            wait_until(lambda r=r: state_matches(redis_client, MODEL, f"engine7-dp{r}", references[r]),
                       what=lambda r=r: describe_diff(redis_client, MODEL, f"engine7-dp{r}", references[r]))
        import json

        from kvtier.schemas.state_keys import ModelKeys

        meta = json.loads(redis_client.get(ModelKeys.for_model(MODEL).meta("engine7-dp1")))
        assert meta["engine_worker_id"] == "engine7" and meta["dp_rank"] == 1 and meta["dp_size"] == 2
    finally:
        for p in publishers:
            p.close()
        stop_all(bridge, processor)


@pytest.mark.slow
def test_inspect_shows_what_redis_holds_per_tier(nats_server, redis_server):
    import json
    import subprocess
    import sys

    from kvtier.schemas.tiers import Tier

    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=21), ReferenceModel()
        run.publish(workload, reference, 80)
        run.converge(reference)
        cli = [sys.executable, "-m", "kvtier.cli", "inspect", "--redis", redis_server.url, "--model", MODEL]
        rows = json.loads(subprocess.run([*cli, "--json"], capture_output=True, text=True, check=True).stdout)
        assert len(rows) == 1 and rows[0]["worker"] == "w0" and not rows[0]["stale"]
        assert rows[0]["lease_left_s"] > 0
        expected = {tier.value: sum(1 for tiers in reference.pages.values() if tier in tiers) for tier in Tier}
        assert rows[0]["pages"] == expected
        table = subprocess.run(cli, capture_output=True, text=True, check=True).stdout
        assert "w0" in table and f"{expected['device']:>8}" in table and "ok" in table
