"""Correct under restarts and lag (RELIABILITY.md): leases on stream time, no needless
rebases, in-order announces, honest partial state, load that cannot leak, a bounded
fallback, dead workers that leave nothing behind, dedupe ids per model. Real servers:
nats-server with JetStream, a Redis-protocol server, the real processor, bridge and router."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import nats
import pytest

from kvtier.consumers.apply import ApplyMode, ApplyStatus, TierStateWriter
from kvtier.plumbing.streams import StreamSettings, ensure_streams
from kvtier.schemas.events import (
    BridgeCursor,
    EpochReason,
    EventBatch,
    PagesRemoved,
    PagesStored,
    WorkerAnnounce,
    encode_message,
)
from kvtier.schemas.sglang import AllBlocksCleared, BlockStored
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import EVENTS_STREAM, control_subject, events_subject
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import bridge_process, processor_process, stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens

MODEL = "lag-model"


def batch(seq: int, epoch: int = 1, events=(), model: str = MODEL, worker: str = "w0", reason=None,
          from_start: bool = False) -> EventBatch:
    return EventBatch(worker_id=worker, model=model, epoch=epoch, seq=seq, ts=time.time(), source_ts=time.time(),
                      epoch_reason=reason, epoch_from_start=from_start, events=list(events))


def stored(*hashes: int, tier: Tier = Tier.DEVICE) -> PagesStored:
    return PagesStored(tier=tier, hashes=list(hashes))


def announce(worker: str = "w0", lease_s: float = 60.0, model: str = MODEL) -> WorkerAnnounce:
    return WorkerAnnounce(metadata=WorkerMetadata(worker_id=worker, model=model, page_size=4), ts=time.time(),
                          lease_ttl_s=lease_s, cursor=BridgeCursor(epoch=1, seq=0))


def state(client, worker: str = "w0", model: str = MODEL) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(ModelKeys.for_model(model).state(worker)).items()}


def pages(client, worker: str = "w0", model: str = MODEL) -> int:
    return client.scard(ModelKeys.for_model(model).pages(worker))


# --- defect 3: a rebase is decided again inside the script ------------------------------------
def test_a_rebase_is_decided_again_atomically_in_the_script(redis_client):
    writer = TierStateWriter(redis_client)
    writer.announce(announce())
    for seq in range(1, 6):
        assert writer.apply(batch(seq, events=[stored(seq)], from_start=seq == 1)).status == ApplyStatus.APPLIED
    late = batch(7, events=[stored(7)])
    assert writer.apply(late).status == ApplyStatus.AHEAD
    # the worker moved to a new epoch meanwhile: the timed-out batch of epoch 1 is superseded
    assert writer.apply(batch(1, epoch=2, events=[stored(21)], reason=EpochReason.RESYNC_REQUESTED)).status == \
        ApplyStatus.APPLIED
    result = writer.apply(late, ApplyMode.REBASE)
    assert result.status == ApplyStatus.OLD_EPOCH and not result.rebased
    s = state(redis_client)
    assert (s["epoch"], s["seq"], s["stale"]) == ("2", "1", "0")  # not set back to epoch 1

    # the gap filled meanwhile: the "rebase" applies the batch as the next one
    writer.apply(batch(2, epoch=2))
    ahead = batch(4, epoch=2, events=[stored(24)])
    assert writer.apply(ahead).status == ApplyStatus.AHEAD
    writer.apply(batch(3, epoch=2))
    result = writer.apply(ahead, ApplyMode.REBASE)
    assert result.status == ApplyStatus.APPLIED and not result.rebased and not result.stale
    # ... and a batch applied already is a duplicate, not a rebase
    result = writer.apply(ahead, ApplyMode.REBASE)
    assert result.status == ApplyStatus.DUPLICATE and state(redis_client)["stale"] == "0"
    # still ahead: now it rebases (cleared, stale, counted)
    result = writer.apply(batch(9, epoch=2, events=[stored(29)]), ApplyMode.REBASE)
    assert result.status == ApplyStatus.APPLIED and result.rebased and result.stale
    assert state(redis_client)["gaps"] == "1" and pages(redis_client) == 1


# --- defect 8: a dead worker's late batches, and forgetting the dead --------------------------
def test_late_batches_of_an_expired_worker_change_nothing_and_the_dead_are_forgotten(redis_client):
    writer = TierStateWriter(redis_client)
    writer.announce(announce("dead", lease_s=1.0))
    writer.announce(announce("alive", lease_s=600.0))
    assert writer.apply(batch(1, worker="dead", events=[stored(1, 2)], from_start=True)).status == ApplyStatus.APPLIED
    removed = writer.expire_dead_workers(now=time.time() + 2.0)
    assert [(w, n) for _, w, n in removed] == [("dead", 2)]
    keys = ModelKeys.for_model(MODEL)
    ttl = redis_client.ttl(keys.state("dead"))
    assert 0 < ttl <= 86400
    # a late batch of it (a backlog applied after it died): refused, nothing re-created, TTL kept
    result = writer.apply(batch(2, worker="dead", events=[stored(3)]))
    assert result.status == ApplyStatus.GONE
    assert not redis_client.exists(keys.pages("dead")) and redis_client.ttl(keys.state("dead")) > 0
    # it announces again (it was only cut off): revived, its batches apply
    writer.announce(announce("dead", lease_s=600.0))
    assert writer.apply(batch(2, worker="dead", events=[stored(3)])).status == ApplyStatus.APPLIED
    writer.expire_dead_workers(now=time.time() + 700.0)  # now both are past their lease ...
    # ... but only workers gone longer than the retention are forgotten, every trace of them
    assert writer.forget_dead_workers(retention_s=3600.0) == []
    forgotten = writer.forget_dead_workers(retention_s=0.0, now=time.time() + 800.0)
    assert sorted(w for _, w in forgotten) == ["alive", "dead"]
    left = [k.decode() for k in redis_client.scan_iter(match=f"{keys.base}:*")]
    assert not [k for k in left if ":w:" in k], left
    for key in (keys.workers, keys.stale_workers, keys.partial_workers):
        assert not redis_client.smembers(key)
    for key in (keys.page_sizes, keys.hash_check):
        assert not redis_client.hkeys(key)


def test_a_worker_listed_before_any_time_is_known_is_not_forgotten(redis_client):
    """A worker a rebuild (or a first batch) has listed, whose announce is not applied yet, has
    no lease and no time in its state: that says nothing about when it went. The fault suite's
    processor forgot such a worker on start, right after a rebuild."""
    writer = TierStateWriter(redis_client)
    keys = ModelKeys.for_model(MODEL + "-listed")
    redis_client.sadd(writer.models_key, keys.model_token)
    redis_client.sadd(keys.workers, "just-listed")
    redis_client.hset(keys.state("just-listed"), mapping={"epoch": 5, "seq": 3})
    assert writer.forget_dead_workers(retention_s=0.0, now=time.time() + 10_000.0) == []
    assert redis_client.sismember(keys.workers, "just-listed") and redis_client.exists(keys.state("just-listed"))


# --- defect 7: the fallback's in-flight map -------------------------------------------------
def test_the_fallback_in_flight_map_is_bounded_and_expires():
    from kvtier.router.core import _Fallback

    now = [0.0]
    fallback = _Fallback(ttl_s=10.0, max_entries=3, clock=lambda: now[0])
    for i in range(5):
        fallback.book(f"r{i}", fallback.choose(["a", "b"]))
    assert list(fallback.in_flight) == ["r2", "r3", "r4"]  # the oldest went when newer ones came
    now[0] = 11.0
    fallback.book("r5", "a")
    assert list(fallback.in_flight) == ["r5"]  # the rest were older than the TTL
    assert fallback.release("r5") and not fallback.release("r5")


@pytest.mark.slow
def test_a_router_without_redis_tracks_booked_fallback_decisions_only(redis_client, redis_server):
    tokens = request_tokens(4, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 4, tokens, device=4)
    seeder.worker("b", 4)
    router = RouterProcess(redis_server.url, "--state-timeout-ms", "200")
    try:
        assert router.route(MODEL, tokens, book=False)[0] == 200
        redis_server.stop()
        for i in range(6):
            assert router.route(MODEL, tokens, request_id=f"dry-{i}", book=False)[0] == 200
        for i in range(3):
            assert router.route(MODEL, tokens, request_id=f"booked-{i}")[0] == 200
        assert "router_fallback_in_flight 3.0" in router.metrics()
        assert router.release(MODEL, "booked-0")[0] == 200
        assert "router_fallback_in_flight 2.0" in router.metrics()
    finally:
        stop_all(router)


# --- defect 6: booked load recoverable from the bookings -----------------------------------------
@pytest.mark.slow
def test_booked_load_comes_back_with_every_router_down_past_the_booking(redis_client, redis_server):
    tokens = request_tokens(6, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 4)
    keys = ModelKeys.for_model(MODEL)
    router = RouterProcess(redis_server.url, "--booking-ttl", "1")
    status, body, _ = router.route(MODEL, tokens, request_id="orphan", max_new_tokens=40)
    assert status == 200 and redis_client.hget(keys.prefill_load, "a") == b"6"
    router.kill()  # every router gone: nobody sweeps the booking when it expires
    wait_until(lambda: not redis_client.exists(f"{keys.base}:bk:orphan"), timeout=10,
               what="the booking's hash to expire unswept")
    assert redis_client.hget(keys.prefill_load, "a") == b"6"  # the load is still counted ...
    fresh = RouterProcess(redis_server.url)
    try:
        # ... until a router comes back: it recomputes every model's load from the live bookings
        wait_until(lambda: not redis_client.hgetall(keys.prefill_load) and not redis_client.hgetall(keys.decode_load),
                   timeout=10, what="the leaked load to be recomputed away")
        assert "router_load_reconciled_total 1.0" in fresh.metrics()
    finally:
        stop_all(fresh)


# --- processor-level: a stand-in bridge publishing straight into the stream ------------------------
class Feed:
    """Publishes a worker's announces and batches into KVTIER_EVENTS as its bridge would."""

    def __init__(self, nats_url: str, model: str = MODEL, worker: str = "w0"):
        self.nats_url, self.model, self.worker = nats_url, model, worker

    async def _publish(self, messages) -> None:
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            await ensure_streams(js, StreamSettings())
            for message in messages:
                headers = {"Nats-Msg-Id": message.msg_id} if isinstance(message, EventBatch) else None
                await js.publish(events_subject(self.model, self.worker), encode_message(message), headers=headers)
        finally:
            await nc.close()

    def send(self, *messages) -> None:
        asyncio.run(self._publish(messages))

    def announce(self, lease_s: float) -> WorkerAnnounce:
        return announce(self.worker, lease_s, self.model)


def control_requests(nats_url: str, model: str, worker: str):
    """Start collecting the resync requests sent to a worker's bridge; returns (list, stop)."""
    import threading

    got: list[bytes] = []
    ready, done = threading.Event(), threading.Event()

    def run():
        async def main():
            nc = await nats.connect(nats_url)
            async def collect(msg):
                got.append(msg.data)

            await nc.subscribe(control_subject(model, worker), cb=collect)
            await nc.flush()
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)
            await nc.close()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)

    def stop():
        done.set()
        thread.join(10)

    return got, stop


# --- defect 4: announces in stream order --------------------------------------------------------
@pytest.mark.slow
def test_an_announce_is_applied_after_the_batches_before_it(nats_server, redis_server, redis_client):
    feed = Feed(nats_server.url)
    writer = TierStateWriter(redis_client)
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        feed.send(feed.announce(600), batch(1, events=[stored(1)], from_start=True))
        wait_until(lambda: state(redis_client).get("seq") == "1", timeout=30, what=processor.output)
    finally:
        stop_all(processor)
    writer.apply(batch(5, events=[stored(5)]), ApplyMode.REBASE)  # a gap given up on: stale
    assert state(redis_client)["stale"] == "1"
    # the bridge's new epoch, then its heartbeat: both land in one fetch of the restarted processor
    feed.send(batch(1, epoch=2, events=[stored(9)], reason=EpochReason.RESYNC_REQUESTED, from_start=True),
              feed.announce(600))
    requests, stop = control_requests(nats_server.url, MODEL, "w0")
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: state(redis_client).get("epoch") == "2", timeout=30, what=processor.output)
        time.sleep(1.0)
        assert state(redis_client)["stale"] == "0"
        assert requests == [], requests  # the announce saw the new epoch: no second resync
    finally:
        stop()
        stop_all(processor)


# --- defect 1: leases on stream time; a processor outage expires nobody ---------------------------
@pytest.mark.slow
def test_a_processor_outage_longer_than_the_lease_expires_no_live_worker(nats_server, redis_server, redis_client):
    import threading

    lease = 1.0
    feed = Feed(nats_server.url)
    feed.send(feed.announce(lease), batch(1, events=[stored(1, 2, 3)], from_start=True))
    beating, dead = threading.Event(), threading.Event()
    beating.set()

    def heartbeat():  # the bridge keeps announcing every lease / 4, as long as the worker lives
        while not dead.is_set():
            if beating.is_set():
                feed.send(feed.announce(lease))
            time.sleep(lease / 4)

    pump = threading.Thread(target=heartbeat, daemon=True)
    pump.start()
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: pages(redis_client) == 3, timeout=30, what=processor.output)
        stop_all(processor)
        time.sleep(3 * lease)  # the processor is down for 3 leases while the worker lives on
        processor = processor_process(nats_server.url, redis_server.url)
        wait_until(lambda: float(redis_client.zscore(ModelKeys.for_model(MODEL).leases, "w0") or 0) / 1000
                   > time.time(), timeout=30, what="the lease renewed from the backlog")
        time.sleep(2 * lease)
        assert pages(redis_client) == 3 and state(redis_client)["stale"] == "0"
        assert "lease expired" not in processor.output(), processor.output()[-2000:]
        # the worker really dies: expired within its lease and a bounded delay
        beating.clear()
        died = time.monotonic()
        wait_until(lambda: pages(redis_client) == 0, timeout=10, what=processor.output)
        assert time.monotonic() - died < lease + 3.0
        assert state(redis_client)["stale_reason"] == "lease_expired"
    finally:
        dead.set()
        pump.join(5)
        stop_all(processor)


@pytest.mark.slow
def test_a_backlog_gives_a_dead_worker_no_fresh_lease(nats_server, redis_server, redis_client):
    feed = Feed(nats_server.url)
    sent = time.time()
    feed.send(feed.announce(1.0), batch(1, events=[stored(1)], from_start=True))
    time.sleep(2.0)  # the worker died before any processor ran: its lease ran out in the stream
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        leases = ModelKeys.for_model(MODEL).leases
        wait_until(lambda: redis_client.exists(ModelKeys.for_model(MODEL).meta("w0")), timeout=30,
                   what=processor.output)
        lease = redis_client.zscore(leases, "w0")
        # the lease runs from when the announce entered the stream, not from when it was applied
        assert lease is None or lease / 1000 <= sent + 1.0 + 0.5, (lease / 1000 - sent)
        wait_until(lambda: state(redis_client).get("stale_reason") == "lease_expired", timeout=30,
                   what=processor.output)
        assert pages(redis_client) == 0
    finally:
        stop_all(processor)


@pytest.mark.slow
def test_a_dead_workers_processor_dying_too_still_expires_it(nats_server, redis_server, redis_client):
    """Two processors sharing the partitions; the one owning the worker's partition is killed
    with it: the survivor takes the partition over and expires the worker."""
    from kvtier.consumers.ownership import partition_key
    from kvtier.schemas.subjects import partition_of

    feed = Feed(nats_server.url)
    feed.send(feed.announce(1.0), batch(1, events=[stored(1, 2)], from_start=True))
    extra = ("--partitions", "auto", "--partition-lease", "1.5")
    first, second = (processor_process(nats_server.url, redis_server.url, *extra) for _ in range(2))
    try:
        wait_until(lambda: pages(redis_client) == 2, timeout=30, what=first.output)
        partition = partition_of(MODEL, "w0", 8)
        wait_until(lambda: redis_client.get(partition_key(partition)) is not None, timeout=15)
        owner = redis_client.get(partition_key(partition)).decode()
        victim = first if f":{first.pid}:" in owner else second
        survivor = second if victim is first else first
        victim.kill()
        killed = time.monotonic()
        wait_until(lambda: pages(redis_client) == 0, timeout=20, what=survivor.output)
        # lease 1 s + partition lease 1.5 s + a sweep: well within a few seconds
        assert time.monotonic() - killed < 8.0
    finally:
        stop_all(first, second)


# --- at-least-once delivery: an older announce delivered again renews nothing -------------------
def test_an_older_announce_delivered_again_moves_no_lease_back(redis_client):
    writer = TierStateWriter(redis_client)
    leases, meta = ModelKeys.for_model(MODEL).leases, ModelKeys.for_model(MODEL).meta("w0")
    now = time.time()
    newer = WorkerAnnounce(metadata=WorkerMetadata(worker_id="w0", model=MODEL, page_size=16), ts=now,
                           lease_ttl_s=4.0, cursor=BridgeCursor(epoch=2, seq=0))
    older = announce(lease_s=4.0)  # page size 4: what the worker was before it restarted
    writer.announce(newer, at=now)
    writer.announce(older, at=now - 30.0)  # its ack was lost: it comes back 30 s late
    assert redis_client.zscore(leases, "w0") == int((now + 4.0) * 1000)
    assert json.loads(redis_client.get(meta))["page_size"] == 16
    assert redis_client.hget(ModelKeys.for_model(MODEL).page_sizes, "w0") == b"16"
    # the next announce renews it as usual
    writer.announce(newer, at=now + 1.0)
    assert redis_client.zscore(leases, "w0") == int((now + 5.0) * 1000)


@pytest.mark.slow
def test_a_live_worker_outlives_an_old_announce_redelivered_after_newer_ones(nats_server, redis_server,
                                                                            redis_client):
    """The fault suite's failure: an announce whose delivery was lost comes back (here after the
    ack wait) when newer announces have been applied. Before announce.lua it set the lease back
    to its own stream time, and the worker, alive and announcing, was expired at once."""
    from kvtier.schemas.subjects import partition_of

    lease = 6.0
    feed = Feed(nats_server.url)
    feed.send(feed.announce(lease), batch(1, events=[stored(1, 2)], from_start=True))
    processor = processor_process(nats_server.url, redis_server.url, "--ack-wait", "7")
    leases = ModelKeys.for_model(MODEL).leases
    try:
        wait_until(lambda: pages(redis_client) == 2, timeout=30, what=processor.output)
        durable = f"kvtier-processor-p{partition_of(MODEL, 'w0', 8)}"
        os.kill(processor.pid, signal.SIGSTOP)  # the processor's pulls wait ...
        try:
            time.sleep(5.5)  # ... until the server lets them expire (5 s): only ours will be served
            feed.send(feed.announce(lease))
            asyncio.run(steal_one_delivery(nats_server.url, durable))  # back after the 7 s ack wait
            stolen_at = time.time()
            time.sleep(4.0)
            feed.send(feed.announce(lease))  # the newer announce, applied first
            newest = time.time()
        finally:
            os.kill(processor.pid, signal.SIGCONT)
        wait_until(lambda: float(redis_client.zscore(leases, "w0") or 0) / 1000 > newest + lease - 1.0,
                   timeout=10, what=processor.output)
        # past the stolen announce's redelivery (7 s) and its own lease's end (6 s) ...
        time.sleep(max(0.0, stolen_at + 8.5 - time.time()))
        # ... and before the newest one's: the worker is live, its lease the newest announce's
        assert time.time() < newest + lease
        assert pages(redis_client) == 2 and state(redis_client)["stale"] == "0", processor.output()[-2000:]
        assert float(redis_client.zscore(leases, "w0")) / 1000 > newest + lease - 1.0
        assert "lease expired" not in processor.output()
    finally:
        stop_all(processor)


# --- defect 2: deliveries lost with a pull come back before the gap timeout --------------------------
@pytest.mark.slow
def test_lost_deliveries_come_back_without_a_rebase(nats_server, redis_server, redis_client):
    feed = Feed(nats_server.url)
    feed.send(feed.announce(600), batch(1, events=[stored(1)], from_start=True))
    processor = processor_process(nats_server.url, redis_server.url, "--gap-timeout", "4", "--ack-wait", "30",
                                  "--lost-delivery-after", "0.5")
    try:
        wait_until(lambda: state(redis_client).get("seq") == "1", timeout=30, what=processor.output)
        from kvtier.schemas.subjects import partition_of

        durable = f"kvtier-processor-p{partition_of(MODEL, 'w0', 8)}"
        os.kill(processor.pid, signal.SIGSTOP)  # the processor's pulls wait ...
        try:
            time.sleep(5.5)  # ... until the server lets them expire (5 s): only ours will be served
            feed.send(batch(2, events=[stored(2)]))
            asyncio.run(steal_one_delivery(nats_server.url, durable))  # delivered to a pull that is gone
            feed.send(batch(3, events=[stored(3)]), batch(4, events=[stored(4)]))
        finally:
            os.kill(processor.pid, signal.SIGCONT)
        started = time.monotonic()
        wait_until(lambda: state(redis_client).get("seq") == "4", timeout=30, what=processor.output)
        assert time.monotonic() - started < 4.0  # well before the gap timeout (and the 30 s ack wait)
        s = state(redis_client)
        assert s["stale"] == "0" and s.get("gaps", "0") == "0" and pages(redis_client) == 4
        assert "rewinding the consumer to its ack floor" in processor.output()
    finally:
        stop_all(processor)


async def steal_one_delivery(nats_url: str, durable: str) -> None:
    """Pull one message from the processor's consumer and never ack it: what a pull whose
    connection broke leaves behind (the message waits out its ack wait)."""
    nc = await nats.connect(nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.{durable}",
                         json.dumps({"batch": 1, "expires": 2_000_000_000}).encode(), reply=inbox)
        msg = await sub.next_msg(timeout=5)
        assert not (msg.headers or {}).get("Status"), msg.headers
    finally:
        await nc.close()


# --- defect 5: partial workers ---------------------------------------------------------------
def engine_batches(publisher: SglangEventPublisher, first: int, count: int, page: int = 4) -> None:
    for i in range(first, first + count):
        tokens = list(range(i * 100, i * 100 + page))
        from kvtier.schemas.hashes import sglang_block_hashes

        publisher.publish([BlockStored(block_hashes=sglang_block_hashes(tokens, page), parent_block_hash=None,
                                       token_ids=tokens, block_size=page, medium="GPU")])


@pytest.mark.slow
def test_a_bridge_that_joins_late_makes_a_partial_worker_until_a_flush(nats_server, redis_server, redis_client):
    publisher = SglangEventPublisher(buffer_size=3)
    engine_batches(publisher, 0, 6)  # the engine ran before its bridge: its buffer holds batches 3..5 only
    bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
    processor = processor_process(nats_server.url, redis_server.url)
    router = None
    try:
        wait_until(lambda: pages(redis_client) == 3, timeout=30, what=lambda: bridge.output() + processor.output())
        assert state(redis_client)["partial"] == "1"
        keys = ModelKeys.for_model(MODEL)
        assert redis_client.smembers(keys.partial_workers) == {b"w0"}
        router = RouterProcess(redis_server.url)
        health = http("GET", router.url + "/healthz")[1]
        assert health["partial_workers"] == [{"model": "lag-model", "worker_id": "w0"}]
        status, body, _ = router.route(MODEL, request_tokens(2, 4), book=False)
        assert status == 200 and body["worker_id"] == "w0"  # still routed to
        assert "router_partial_workers" in router.metrics()
        inspect = asyncio.run(_inspect(redis_server.url))
        assert "PARTIAL" in inspect
        # the engine flushes its cache: nothing unreported can be left, the worker is whole
        publisher.publish([AllBlocksCleared()])
        wait_until(lambda: state(redis_client).get("partial") == "0", timeout=30, what=processor.output)
        assert not redis_client.smembers(ModelKeys.for_model(MODEL).partial_workers)
    finally:
        stop_all(*(p for p in (router, bridge, processor) if p is not None))
        publisher.close()


@pytest.mark.slow
def test_a_starting_bridge_asks_a_slow_engine_for_its_replay_again(nats_server, redis_server, redis_client):
    """An engine too busy to answer the first replay request in time (seen in the fault suite
    on a loaded machine): the bridge asks again instead of beginning an epoch without the
    engine's history, which would leave the worker partial and missing pages it holds."""
    publisher = SglangEventPublisher(buffer_size=100)
    engine_batches(publisher, 0, 5)  # held by the engine before its bridge starts
    publisher.ignore_replay_requests(2)
    bridge = bridge_process(publisher, nats_server.url, "w0", MODEL, 4, "--replay-timeout", "0.5")
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: pages(redis_client) == 5, timeout=30, what=lambda: bridge.output() + processor.output())
        assert state(redis_client)["partial"] == "0", bridge.output()
        assert "asking again (try 3 of 3)" in bridge.output()
    finally:
        stop_all(bridge, processor)
        publisher.close()


async def _inspect(redis_url: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtier.cli", "inspect", "--redis", redis_url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return out.decode()


@pytest.mark.slow
def test_a_bridge_there_from_the_start_is_whole_and_turnover_ends_partial(nats_server, redis_server, redis_client):
    publisher = SglangEventPublisher(buffer_size=100)
    bridge = bridge_process(publisher, nats_server.url, "w0", MODEL)
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: redis_client.zscore(ModelKeys.for_model(MODEL).leases, "w0") is not None, timeout=30,
                   what=bridge.output)
        engine_batches(publisher, 0, 3)
        wait_until(lambda: pages(redis_client) == 3, timeout=30, what=processor.output)
        assert state(redis_client)["partial"] == "0"  # the epoch began at the engine's first batch
    finally:
        stop_all(bridge, processor)
        publisher.close()
    # the writer alone: a partial epoch ends once the engine has removed as many device pages
    # as the worker held (a full turnover of what it reported)
    writer = TierStateWriter(redis_client)
    other = dict(worker="w1")
    writer.apply(batch(1, epoch=7, events=[stored(1, 2, 3)], reason=EpochReason.UNRECOVERED_GAP, **other))
    assert state(redis_client, "w1")["partial"] == "1"
    writer.apply(batch(2, epoch=7, events=[PagesRemoved(tier=Tier.DEVICE, hashes=[1, 2])], **other))
    assert state(redis_client, "w1")["partial"] == "1"
    writer.apply(batch(3, epoch=7, events=[PagesRemoved(tier=Tier.DEVICE, hashes=[3])], **other))
    assert state(redis_client, "w1")["partial"] == "0"


# --- defect 10: dedupe ids per model, duplicates that were not retries --------------------------------
@pytest.mark.slow
def test_two_models_with_one_worker_name_and_epoch_both_apply(nats_server, redis_server, redis_client):
    a, b = Feed(nats_server.url, model="model-a"), Feed(nats_server.url, model="model-b")
    a.send(a.announce(600), batch(1, epoch=42, model="model-a", events=[stored(1)], from_start=True))
    b.send(b.announce(600), batch(1, epoch=42, model="model-b", events=[stored(2), stored(3)], from_start=True))
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: pages(redis_client, model="model-a") == 1 and pages(redis_client, model="model-b") == 2,
                   timeout=30, what=processor.output)
    finally:
        stop_all(processor)


def test_a_duplicate_that_was_not_a_retry_is_an_error(nats_server):
    from kvtier.producers.bridge import RankBridge
    from kvtier.producers.bridge_metrics import DUPLICATES

    async def main():
        nc = await nats.connect(nats_server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js, StreamSettings())
            bridge = RankBridge.__new__(RankBridge)  # only its publish path, on a real stream
            bridge.js, bridge._label, bridge.stopping = js, "dup-test", asyncio.Event()
            subject = events_subject(MODEL, "w0")
            data = encode_message(batch(1))
            before = DUPLICATES.labels("dup-test")._value.get()
            await bridge._publish(subject, data, {"Nats-Msg-Id": "same-id"})
            assert DUPLICATES.labels("dup-test")._value.get() == before
            await bridge._publish(subject, data, {"Nats-Msg-Id": "same-id"})  # someone else's
            assert DUPLICATES.labels("dup-test")._value.get() == before + 1
        finally:
            await nc.close()

    asyncio.run(main())


def test_doctor_names_a_partial_worker_and_what_it_costs():
    from kvtier.tools.doctor.judge import check_workers
    from kvtier.tools.doctor.views import RedisView, Status, WorkerRecord

    view = RedisView(url="redis://x", reachable=True, models=[MODEL], workers=[
        WorkerRecord(model=MODEL, worker="w0", lease_left_s=5.0, partial=True),
        WorkerRecord(model=MODEL, worker="w1", lease_left_s=5.0)])
    findings = [f for f in check_workers(view) if f.subject == f"{MODEL}/w0"]
    assert len(findings) == 1 and findings[0].status is Status.WARN
    assert "partial" in findings[0].finding and "credit it for fewer pages" in findings[0].finding
    assert not [f for f in check_workers(view) if f.subject == f"{MODEL}/w1"]
