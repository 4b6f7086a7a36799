"""The apply function against a real Redis-protocol server: order, atomicity, tiers, leases."""

import time

from kvtier.consumers.apply import (
    ApplyMode,
    ApplyStatus,
    TierStateWriter,
    read_page_holders,
    read_worker_pages,
    read_worker_state,
)
from kvtier.schemas.events import BridgeCursor, WorkerAnnounce
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata

from ..helpers import HiCacheWorkload, ReferenceModel, kvtier_batch

M = "model/x.y"  # unsafe characters on purpose: keys and subjects use its safe token


def store(hashes, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=4, medium=medium)


def test_tiers_accumulate_and_leave_per_tier(redis_client):
    writer = TierStateWriter(redis_client)
    r = writer.apply(kvtier_batch(M, "w", 1, 1, [store([1, 2, 3]), store([2, 3], "CPU_PINNED"),
                                                 BlockRemoved(block_hashes=[3], medium="GPU"),
                                                 store([4], "DISK")]))
    assert r.status == ApplyStatus.APPLIED and r.transitions == 7
    assert read_worker_pages(redis_client, M, "w") == {1: {Tier.DEVICE}, 2: {Tier.DEVICE, Tier.HOST},
                                                       3: {Tier.HOST}, 4: {Tier.DISK}}
    assert read_page_holders(redis_client, M, ["w"], [1, 2, 3, 4, 5]) == [{"w": 1}, {"w": 3}, {"w": 2}, {"w": 4}, {}]


def test_seq_order_is_enforced_by_the_script(redis_client):
    writer = TierStateWriter(redis_client)
    b1 = kvtier_batch(M, "w", 5, 1, [store([1])])
    b2 = kvtier_batch(M, "w", 5, 2, [BlockRemoved(block_hashes=[1], medium="GPU")])
    b3 = kvtier_batch(M, "w", 5, 3, [store([9])])
    assert writer.apply(b2).status == ApplyStatus.AHEAD
    assert writer.apply(b1).status == ApplyStatus.APPLIED
    assert writer.apply(b3).status == ApplyStatus.AHEAD
    assert writer.apply(b2).status == ApplyStatus.APPLIED
    assert writer.apply(b1).status == ApplyStatus.DUPLICATE  # redelivered: applying it again would add page 1
    assert writer.apply(b3).status == ApplyStatus.APPLIED
    assert read_worker_pages(redis_client, M, "w") == {9: {Tier.DEVICE}}
    assert writer.apply(kvtier_batch(M, "w", 4, 9, [store([1])])).status == ApplyStatus.OLD_EPOCH
    state = read_worker_state(redis_client, M, "w")
    assert (state["epoch"], state["seq"]) == ("5", "3")


def test_new_epoch_clears_the_old_state_atomically_with_its_first_batch(redis_client):
    writer = TierStateWriter(redis_client)
    writer.apply(kvtier_batch(M, "w", 1, 1, [store([1, 2])]))
    writer.apply(kvtier_batch(M, "other", 1, 1, [store([1])]))
    assert writer.apply(kvtier_batch(M, "w", 2, 2, [store([3])])).status == ApplyStatus.AHEAD  # seq 1 first
    r = writer.apply(kvtier_batch(M, "w", 2, 1, [store([3])], reason="publisher_restart"))
    assert r.status == ApplyStatus.APPLIED
    assert read_worker_pages(redis_client, M, "w") == {3: {Tier.DEVICE}}
    # another worker's copy is untouched
    assert read_page_holders(redis_client, M, ["w", "other"], [1])[0] == {"other": 1}
    assert read_worker_state(redis_client, M, "w")["last_epoch_reason"] == "publisher_restart"


def test_all_blocks_cleared_and_rebase(redis_client):
    writer = TierStateWriter(redis_client)
    writer.apply(kvtier_batch(M, "w", 1, 1, [store([1, 2]), AllBlocksCleared(), store([5])]))
    assert set(read_worker_pages(redis_client, M, "w")) == {5}
    r = writer.apply(kvtier_batch(M, "w", 1, 7, [store([6])]), ApplyMode.REBASE)
    assert r.status == ApplyStatus.APPLIED and r.stale
    assert set(read_worker_pages(redis_client, M, "w")) == {6}
    state = read_worker_state(redis_client, M, "w")
    assert state["stale"] == "1" and state["gaps"] == "1" and state["seq"] == "7"
    r = writer.apply(kvtier_batch(M, "w", 2, 1, [store([7])], reason="resync_requested"))
    assert not r.stale and read_worker_state(redis_client, M, "w")["stale"] == "0"


def test_random_workload_equals_reference_even_with_every_batch_applied_twice(redis_client):
    writer = TierStateWriter(redis_client)
    workload, reference = HiCacheWorkload(seed=42), ReferenceModel()
    batches = []
    for seq in range(1, 301):
        events = workload.next_batch()
        reference.apply(events)
        batches.append(kvtier_batch(M, "w", 1, seq, events))
    doubled = [b for batch in batches for b in (batch, batch)]
    results = writer.apply_many(doubled)
    assert [r.status for r in results] == [ApplyStatus.APPLIED, ApplyStatus.DUPLICATE] * 300
    assert read_worker_pages(redis_client, M, "w") == reference.pages


def test_lease_expiry_clears_only_expired_workers(redis_client):
    writer = TierStateWriter(redis_client)
    for worker, ttl in (("dead", 0.2), ("alive", 60)):
        writer.apply(kvtier_batch(M, worker, 1, 1, [store([1, 2])]))
        writer.announce(WorkerAnnounce(metadata=WorkerMetadata(worker_id=worker, model=M, page_size=4), ts=time.time(),
                                       lease_ttl_s=ttl, cursor=BridgeCursor(epoch=1, seq=1)))
    removed = writer.expire_dead_workers(now=time.time() + 1)
    assert [(w, n) for _, w, n in removed] == [("dead", 2)]
    assert read_worker_pages(redis_client, M, "dead") == {}
    assert read_page_holders(redis_client, M, ["dead", "alive"], [1])[0] == {"alive": 1}
    assert read_worker_state(redis_client, M, "dead")["stale_reason"] == "lease_expired"
    assert writer.count_stale_workers() == 1


def test_page_counts_per_tier_follow_stores_removes_and_clears(redis_client):
    writer = TierStateWriter(redis_client)
    writer.apply(kvtier_batch(M, "w", 1, 1, [store([1, 2, 3]), store([1, 2], "CPU_PINNED"),
                                             store([3], "GPU"),  # already there: not counted twice
                                             BlockRemoved(block_hashes=[2, 9], medium="GPU")]))
    state = read_worker_state(redis_client, M, "w")
    assert (state.get("n1"), state.get("n2"), state.get("n4")) == ("2", "2", None)
    # a clear in the middle of a batch: only what follows it is counted
    writer.apply(kvtier_batch(M, "w", 1, 2, [store([5], "DISK"), AllBlocksCleared(), store([7, 8]),
                                             store([7], "CPU_PINNED")]))
    state = read_worker_state(redis_client, M, "w")
    assert (state.get("n1"), state.get("n2"), state.get("n4")) == ("2", "1", None)
    assert read_worker_pages(redis_client, M, "w") == {7: {Tier.DEVICE, Tier.HOST}, 8: {Tier.DEVICE}}
