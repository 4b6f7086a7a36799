"""Faults: crashes, duplicates, redelivery, engine restarts, lost batches, unrecoverable gaps,
dependencies that are down."""

import asyncio
import re
import time
import urllib.request

import msgspec
import nats
import pytest
import redis as redis_lib

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.harness.embedded import NatsServer, RedisServer, free_port
from kvtier.schemas.sglang import BlockRemoved, BlockStored
from kvtier.schemas.subjects import control_subject
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import (
    HiCacheWorkload,
    ReferenceModel,
    RunningPipeline,
    kvtier_batch,
    processor_process,
    publish_batches,
    wait_until,
    worker_announced,
)

MODEL = "m-faults"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def test_processor_sigkill_mid_stream_then_restart(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=3), ReferenceModel()
        for _ in range(6):
            run.publish(workload, reference, 100)
            time.sleep(0.02)
        wait_until(lambda: int(run.state().get("seq", 0)) > 0)
        run.processor.kill()  # SIGKILL: no chance to ack what it holds
        run.publish(workload, reference, 300)
        run.start_processor()
        run.publish(workload, reference, 100)
        run.converge(reference)
        assert run.state()["stale"] == "0"


def test_duplicate_publishes_and_redelivered_seqs_apply_once(nats_server, redis_server, redis_client):
    h = -42
    store = kvtier_batch(MODEL, "dup", 1, 1, [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[],
                                                          block_size=4, medium="GPU")])
    remove = kvtier_batch(MODEL, "dup", 1, 2, [BlockRemoved(block_hashes=[h], medium="GPU")])
    later = kvtier_batch(MODEL, "dup", 1, 3, [BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[],
                                                          block_size=4, medium="CPU_PINNED")])
    # seq 1 again: once with the same Nats-Msg-Id (the broker drops it) and once with a fresh id
    # (as after the broker's duplicate window): only the processor's seq check stops it.
    asyncio.run(publish_batches(nats_server.url, [store, store, remove, store, later],
                                msg_ids=[store.msg_id, store.msg_id, remove.msg_id, "fresh-id", later.msg_id]))
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: read_worker_state(redis_client, MODEL, "dup").get("seq") == "3")
        pages = read_worker_pages(redis_client, MODEL, "dup")
        assert h not in pages  # re-applying the old store would have brought it back
        assert 7 in pages
    finally:
        processor.stop()


def test_publisher_restart_starts_a_new_epoch(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=4), ReferenceModel()
        run.publish(workload, reference, 100)
        run.converge(reference)
        epoch_before = int(run.state()["epoch"])
        run.publisher.restart()  # a new engine process: empty cache, seq from 0
        workload, reference = HiCacheWorkload(seed=5), ReferenceModel()
        run.publish(workload, reference, 80)
        run.converge(reference)
        assert int(run.state()["epoch"]) > epoch_before
        assert run.state()["last_epoch_reason"] == "publisher_restart"


@pytest.mark.parametrize("topic_frame", [True, False], ids=["replay>=0.5.22", "replay<0.5.22"])
def test_dropped_zmq_batch_is_recovered_from_the_replay_socket(nats_server, redis_server, topic_frame):
    publisher = SglangEventPublisher(replay_topic_frame=topic_frame)
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=publisher) as run:
        workload, reference = HiCacheWorkload(seed=6), ReferenceModel()
        run.publish(workload, reference, 50)
        run.publish(workload, reference, 3, deliver=False)  # lost on the PUB path
        run.publish(workload, reference, 50)
        run.converge(reference)
        state = run.state()
        assert state["epochs"] == "1" and state["last_epoch_reason"] == "bridge_start"
        assert "recovered from replay" in run.bridge.output()


def test_a_batch_with_a_nan_timestamp_seen_again_in_a_replay_is_no_engine_restart(nats_server, redis_server):
    """Before: the bridge compared engine timestamps with ==, and NaN != NaN, so the batch
    before a gap, fetched again from the replay socket, looked like a restarted engine: a new
    epoch, and everything in the buffer forwarded (and its bad events dead-lettered) again."""
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=9), ReferenceModel()
        run.publish(workload, reference, 20)
        events = workload.next_batch()
        run.publisher.publish(events, ts=float("nan"))  # the engine's clock gave NaN once
        reference.apply(events)
        run.publish(workload, reference, 2, deliver=False)  # lost on the PUB path: a gap
        run.publish(workload, reference, 20)
        run.converge(reference)
        state = run.state()
        assert state["epochs"] == "1" and state["last_epoch_reason"] == "bridge_start", run.bridge.output()[-2000:]
        assert "recovered from replay" in run.bridge.output()


def test_a_lost_batch_with_nothing_after_it_is_fetched_once_the_engine_is_quiet(nats_server, redis_server):
    """Before: a batch lost on the PUB path was noticed only as a gap when the next one came.
    The engine's last batches before a quiet spell (sent before a bridge's SUB had connected, a
    reconnect) stayed missing for as long as the engine stayed quiet: the seed-dependent
    failure of the simulated cluster's end-to-end test. Now the bridge asks the replay socket
    after --catch-up-interval of silence."""
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=14), ReferenceModel()
        run.publish(workload, reference, 20)
        run.converge(reference)
        run.publish(workload, reference, 3, deliver=False)  # lost, and nothing follows
        run.converge(reference, timeout=15)
        state = run.state()
        assert state["epochs"] == "1" and state["last_epoch_reason"] == "bridge_start"
        assert "missed on the live path, fetched from replay" in run.bridge.output()


def test_gap_beyond_the_replay_buffer_starts_a_new_epoch(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=8), ReferenceModel()
        run.publish(workload, reference, 40)
        run.converge(reference)
        lost = run.publisher.publish(workload.next_batch(), deliver=False)
        run.publisher.forget_before(lost + 1)  # gone from the ring buffer too
        rebuilt = ReferenceModel()  # what kvtier can still know: the buffer after the loss
        run.publish(workload, rebuilt, 30)
        run.converge(rebuilt)
        state = run.state()
        assert state["last_epoch_reason"] == "unrecovered_gap"
        assert state["stale"] == "0"


def test_unrecoverable_processor_gap_marks_stale_counts_and_rebuilds(nats_server, redis_server, redis_client):
    """A batch that never reaches the stream: the worker is cleared, marked stale, counted,
    and its bridge is asked to resync; the resync's new epoch rebuilds it and clears stale."""
    metrics_port = free_port()
    events = [[BlockStored(block_hashes=[100 + i], parent_block_hash=None, token_ids=[], block_size=4, medium="GPU")]
              for i in range(4)]
    batches = [kvtier_batch(MODEL, "gappy", 1, seq, events[seq - 1]) for seq in (1, 2, 4)]

    async def scenario():
        nc = await nats.connect(nats_server.url)
        requests = []

        async def on_request(msg):
            requests.append(msgspec.json.decode(msg.data))

        await nc.subscribe(control_subject(MODEL, "gappy"), cb=on_request)
        await publish_batches(nats_server.url, batches)
        processor = processor_process(nats_server.url, redis_server.url, "--gap-timeout", "1",
                                      "--metrics-port", str(metrics_port))
        try:
            deadline = time.monotonic() + 20
            while not requests and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert requests and requests[0]["request"] == "resync", processor.output()
            state = read_worker_state(redis_client, MODEL, "gappy")
            assert state["stale"] == "1" and state["gaps"] == "1" and state["seq"] == "4"
            assert set(read_worker_pages(redis_client, MODEL, "gappy")) == {103}  # only what came after the gap
            def metrics():
                return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()

            assert re.search(r'kvtier_processor_gaps_total\{outcome="rebased"\} 1\.0', metrics())
            wait_until(lambda: re.search(r"kvtier_processor_stale_workers 1\.0", metrics()), timeout=10)
            # the bridge answers with a new epoch holding the engine's whole state
            resync = kvtier_batch(MODEL, "gappy", 2, 1, [e for ev in events for e in ev], reason="resync_requested")
            await publish_batches(nats_server.url, [resync])
            wait_until(lambda: read_worker_state(redis_client, MODEL, "gappy").get("stale") == "0")
            assert set(read_worker_pages(redis_client, MODEL, "gappy")) == {100, 101, 102, 103}
        finally:
            processor.stop()
            await nc.close()

    asyncio.run(scenario())


def test_bridge_answers_a_resync_request_with_a_rebuilt_epoch(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=9), ReferenceModel()
        run.publish(workload, reference, 60)
        run.converge(reference)

        async def ask():
            nc = await nats.connect(nats_server.url)
            await nc.publish(control_subject(MODEL, "w0"), b'{"request":"resync","reason":"test"}')
            await nc.flush()
            await nc.close()

        asyncio.run(ask())
        wait_until(lambda: run.state().get("last_epoch_reason") == "resync_requested")
        run.converge(reference)  # the replay buffer held everything: fully rebuilt


def test_restarted_bridge_resumes_its_epoch(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=10), ReferenceModel()
        run.publish(workload, reference, 60)
        run.converge(reference)
        run.bridge.kill()
        seq_before = int(run.state()["seq"])
        run.publish(workload, reference, 40)  # emitted while no bridge listens
        run.start_bridge()
        run.publish(workload, reference, 20)
        run.converge(reference)
        assert run.state()["epochs"] == "1"  # no state was thrown away
        assert "resuming epoch" in run.bridge.output()
        # the 40 missed engine batches came back from the replay buffer as one NATS message
        assert int(run.state()["seq"]) <= seq_before + 1 + 20


def test_lease_expiry_removes_a_dead_workers_pages(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, bridge_args=("--lease-ttl", "1.5")) as run:
        workload, reference = HiCacheWorkload(seed=11), ReferenceModel()
        run.publish(workload, reference, 30)
        run.converge(reference)
        run.bridge.kill()
        wait_until(lambda: not read_worker_pages(run.client, MODEL, "w0"), timeout=15,
                   what=lambda: run.processor.output()[-2000:])
        state = run.state()
        assert state["stale"] == "1" and state["stale_reason"] == "lease_expired"
        assert not worker_announced(run.client, MODEL, "w0")


def test_services_started_before_their_dependencies_wait_say_so_and_recover():
    """Processor before Redis and NATS, bridge before NATS: each says what it cannot reach,
    keeps trying, and works once the dependency is up."""
    nats_port, redis_port = free_port(), free_port()
    nats_url, redis_url = f"nats://127.0.0.1:{nats_port}", f"redis://127.0.0.1:{redis_port}/0"
    with RunningPipeline(nats_url, redis_url, MODEL, wait_announced=False) as run:
        wait_until(lambda: "cannot reach Redis at redis://127.0.0.1" in run.processor.output(), timeout=15)
        wait_until(lambda: "cannot reach NATS at nats://127.0.0.1" in run.bridge.output(), timeout=15)
        assert run.processor.alive() and run.bridge.alive()
        with RedisServer(port=redis_port), NatsServer(port=nats_port):
            wait_until(lambda: worker_announced(run.client, MODEL, "w0"), timeout=30,
                       what=lambda: run.processor.output()[-1500:] + run.bridge.output()[-1500:])
            workload, reference = HiCacheWorkload(seed=12), ReferenceModel()
            run.publish(workload, reference, 30)
            run.converge(reference)
            assert run.bridge.stop() == 0 and run.processor.stop() == 0


def test_redis_outage_mid_stream_is_ridden_out(nats_server):
    """Redis stops (clean shutdown, AOF on) while events keep coming: the processor hands
    its messages back, says Redis is unavailable, and catches up once Redis is back."""
    redis_server = RedisServer(appendonly=True).start()
    try:
        with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
            workload, reference = HiCacheWorkload(seed=13), ReferenceModel()
            run.publish(workload, reference, 40)
            run.converge(reference)
            redis_server.stop()
            run.publish(workload, reference, 40)
            wait_until(lambda: "Redis unavailable" in run.processor.output(), timeout=20)
            redis_server.start()
            client = redis_lib.Redis.from_url(redis_server.url)
            run.converge(reference, client=client)
            state = run.state(client)
            assert state["epochs"] == "1" and state["stale"] == "0"  # nothing had to be rebuilt
            assert run.processor.alive()
    finally:
        redis_server.cleanup()


def test_nats_restart_mid_stream_loses_nothing(redis_server):
    """nats-server (JetStream on file storage) stops and comes back on the same port and
    store while the engine keeps emitting: bridge and processor reconnect, state is exact."""
    nats_server = NatsServer().start()
    try:
        with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
            workload, reference = HiCacheWorkload(seed=14), ReferenceModel()
            run.publish(workload, reference, 40)
            run.converge(reference)
            nats_server.stop()
            run.publish(workload, reference, 40)  # the bridge cannot publish these yet
            time.sleep(1.0)
            nats_server.start()
            run.publish(workload, reference, 20)
            run.converge(reference, timeout=45)
            state = run.state()
            assert state["stale"] == "0" and state["epochs"] == "1"
    finally:
        nats_server.cleanup()


def test_batches_sent_before_the_bridge_subscribed_are_fetched_from_replay(nats_server, redis_server):
    """The engine's first batches can go out before the bridge's SUB is live (ZMQ's slow
    joiner): the bridge knows an engine starts at seq 0 and fetches them from replay."""
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        workload, reference = HiCacheWorkload(seed=12), ReferenceModel()
        run.publish(workload, reference, 3, deliver=False)  # as if sent before the subscription
        run.publish(workload, reference, 5)
        run.converge(reference)
        assert "recovered from replay" in run.bridge.output()
        assert run.state()["epochs"] == "1"
