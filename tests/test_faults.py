"""Faults: crashes, duplicates, redelivery, engine restarts, lost batches, unrecoverable gaps."""

import asyncio
import re
import time
import urllib.request

import msgspec
import nats

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.embedded import free_port
from kvtier.producers.sglang_publisher import SglangEventPublisher
from kvtier.schemas.sglang import BlockRemoved, BlockStored
from kvtier.schemas.subjects import control_subject

from .helpers import (
    HiCacheWorkload,
    ReferenceModel,
    bridge_process,
    describe_diff,
    kvtier_batch,
    processor_process,
    publish_batches,
    state_matches,
    wait_until,
    worker_announced,
)

MODEL = "m-faults"


def _publish(publisher, workload, reference, n, deliver=True):
    for _ in range(n):
        events = workload.next_batch()
        publisher.publish(events, deliver=deliver)
        reference.apply(events)


def _converge(client, reference, worker="w0", timeout=30):
    wait_until(lambda: state_matches(client, MODEL, worker, reference), timeout=timeout,
               what=lambda: describe_diff(client, MODEL, worker, reference))


def test_processor_sigkill_mid_stream_then_restart(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=3), ReferenceModel()
            for _ in range(6):
                _publish(publisher, workload, reference, 100)
                time.sleep(0.02)
            wait_until(lambda: int(read_worker_state(redis_client, MODEL, "w0").get("seq", 0)) > 0)
            processor.kill()  # SIGKILL: no chance to ack what it holds
            _publish(publisher, workload, reference, 300)
            processor = processor_process(nats_server.url, redis_server.url)
            _publish(publisher, workload, reference, 100)
            _converge(redis_client, reference)
            assert read_worker_state(redis_client, MODEL, "w0")["stale"] == "0"
        finally:
            bridge.stop()
            processor.stop()


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


def test_publisher_restart_starts_a_new_epoch(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=4), ReferenceModel()
            _publish(publisher, workload, reference, 100)
            _converge(redis_client, reference)
            epoch_before = int(read_worker_state(redis_client, MODEL, "w0")["epoch"])
            publisher.restart()  # a new engine process: empty cache, seq from 0
            workload, reference = HiCacheWorkload(seed=5), ReferenceModel()
            _publish(publisher, workload, reference, 80)
            _converge(redis_client, reference)
            state = read_worker_state(redis_client, MODEL, "w0")
            assert int(state["epoch"]) > epoch_before
            assert state["last_epoch_reason"] == "publisher_restart"
        finally:
            bridge.stop()
            processor.stop()


def test_dropped_zmq_batch_is_recovered_from_the_replay_socket(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url, "--metrics-port", str(free_port()))
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=6), ReferenceModel()
            _publish(publisher, workload, reference, 50)
            _publish(publisher, workload, reference, 3, deliver=False)  # lost on the PUB path
            _publish(publisher, workload, reference, 50)
            _converge(redis_client, reference)
            state = read_worker_state(redis_client, MODEL, "w0")
            assert state["epochs"] == "1" and state["last_epoch_reason"] == "bridge_start"
        finally:
            bridge.stop()
            processor.stop()


def test_gap_beyond_the_replay_buffer_starts_a_new_epoch(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=8), ReferenceModel()
            _publish(publisher, workload, reference, 40)
            _converge(redis_client, reference)
            lost = publisher.publish(workload.next_batch(), deliver=False)
            publisher.forget_before(lost + 1)  # gone from the ring buffer too
            rebuilt = ReferenceModel()  # what the engine still holds but kvtier cannot know is lost
            _publish(publisher, workload, rebuilt, 30)
            _converge(redis_client, rebuilt)
            state = read_worker_state(redis_client, MODEL, "w0")
            assert state["last_epoch_reason"] == "unrecovered_gap"
            assert state["stale"] == "0"
        finally:
            bridge.stop()
            processor.stop()


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
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
            assert re.search(r'kvtier_processor_gaps_total\{outcome="rebased"\} 1\.0', metrics)
            # the bridge answers with a new epoch holding the engine's whole state
            resync = kvtier_batch(MODEL, "gappy", 2, 1, [e for ev in events for e in ev], reason="resync_requested")
            await publish_batches(nats_server.url, [resync])
            wait_until(lambda: read_worker_state(redis_client, MODEL, "gappy").get("stale") == "0")
            assert set(read_worker_pages(redis_client, MODEL, "gappy")) == {100, 101, 102, 103}
        finally:
            processor.stop()
            await nc.close()

    asyncio.run(scenario())


def test_bridge_answers_a_resync_request_with_a_rebuilt_epoch(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=9), ReferenceModel()
            _publish(publisher, workload, reference, 60)
            _converge(redis_client, reference)

            async def ask():
                nc = await nats.connect(nats_server.url)
                await nc.publish(control_subject(MODEL, "w0"), b'{"request":"resync","reason":"test"}')
                await nc.flush()
                await nc.close()

            asyncio.run(ask())
            wait_until(lambda: read_worker_state(redis_client, MODEL, "w0").get("last_epoch_reason") == "resync_requested")
            _converge(redis_client, reference)  # the replay buffer held everything: fully rebuilt
        finally:
            bridge.stop()
            processor.stop()


def test_restarted_bridge_resumes_its_epoch(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=10), ReferenceModel()
            _publish(publisher, workload, reference, 60)
            _converge(redis_client, reference)
            bridge.kill()
            _publish(publisher, workload, reference, 40)  # emitted while no bridge listens
            bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
            _publish(publisher, workload, reference, 20)
            _converge(redis_client, reference)
            state = read_worker_state(redis_client, MODEL, "w0")
            assert state["epochs"] == "1", state  # no state was thrown away
        finally:
            bridge.stop()
            processor.stop()


def test_lease_expiry_removes_a_dead_workers_pages(nats_server, redis_server, redis_client):
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_server.url, redis_server.url)
        bridge = bridge_process(publisher, nats_server.url, "w0", MODEL, 4, "--lease-ttl", "1.5")
        try:
            wait_until(lambda: worker_announced(redis_client, MODEL, "w0"))
            workload, reference = HiCacheWorkload(seed=11), ReferenceModel()
            _publish(publisher, workload, reference, 30)
            _converge(redis_client, reference)
            bridge.kill()
            wait_until(lambda: not read_worker_pages(redis_client, MODEL, "w0"), timeout=15,
                       what=lambda: processor.output()[-2000:])
            state = read_worker_state(redis_client, MODEL, "w0")
            assert state["stale"] == "1" and state["stale_reason"] == "lease_expired"
            assert not worker_announced(redis_client, MODEL, "w0")
        finally:
            bridge.stop()
            processor.stop()


def test_services_started_before_their_dependencies_wait_say_so_and_recover(tmp_path):
    """Processor before Redis and NATS, bridge before NATS: each says what it cannot reach,
    keeps trying, and works once the dependency is up."""
    from kvtier.embedded import NatsServer, RedisServer

    nats_port, redis_port = free_port(), free_port()
    nats_url, redis_url = f"nats://127.0.0.1:{nats_port}", f"redis://127.0.0.1:{redis_port}/0"
    with SglangEventPublisher() as publisher:
        processor = processor_process(nats_url, redis_url)
        bridge = bridge_process(publisher, nats_url, "w0", MODEL)
        try:
            wait_until(lambda: "cannot reach Redis at redis://127.0.0.1" in processor.output(), timeout=15)
            wait_until(lambda: "cannot reach NATS at nats://127.0.0.1" in bridge.output(), timeout=15)
            assert processor.alive() and bridge.alive()
            with RedisServer(port=redis_port) as redis_server, NatsServer(port=nats_port):
                import redis as redis_lib

                client = redis_lib.Redis.from_url(redis_server.url)
                wait_until(lambda: worker_announced(client, MODEL, "w0"), timeout=30,
                           what=lambda: processor.output()[-1500:] + bridge.output()[-1500:])
                workload, reference = HiCacheWorkload(seed=12), ReferenceModel()
                _publish(publisher, workload, reference, 30)
                _converge(client, reference)
                assert bridge.stop() == 0 and processor.stop() == 0
        finally:
            bridge.stop()
            processor.stop()


def test_redis_outage_mid_stream_is_ridden_out(nats_server):
    """Redis stops (clean shutdown, AOF on) while events keep coming: the processor hands
    its messages back, says Redis is unavailable, and catches up once Redis is back."""
    import redis as redis_lib

    from kvtier.embedded import RedisServer

    redis_server = RedisServer(appendonly=True).start()
    try:
        client = redis_lib.Redis.from_url(redis_server.url)
        with SglangEventPublisher() as publisher:
            processor = processor_process(nats_server.url, redis_server.url)
            bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
            try:
                wait_until(lambda: worker_announced(client, MODEL, "w0"))
                workload, reference = HiCacheWorkload(seed=13), ReferenceModel()
                _publish(publisher, workload, reference, 40)
                _converge(client, reference)
                redis_server.stop()
                _publish(publisher, workload, reference, 40)
                wait_until(lambda: "Redis unavailable" in processor.output(), timeout=20)
                redis_server.start()
                client = redis_lib.Redis.from_url(redis_server.url)
                _converge(client, reference)
                state = read_worker_state(client, MODEL, "w0")
                assert state["epochs"] == "1" and state["stale"] == "0"  # nothing had to be rebuilt
                assert processor.alive()
            finally:
                bridge.stop()
                processor.stop()
    finally:
        redis_server.cleanup()
