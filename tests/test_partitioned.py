"""Two processors split the partitions; every worker's events still apply in order."""

import asyncio

import nats

from kvtier.consumers.apply import read_worker_state
from kvtier.schemas.subjects import EVENTS_STREAM

from .helpers import (
    HiCacheWorkload,
    ReferenceModel,
    describe_diff,
    kvtier_batch,
    processor_process,
    publish_batches,
    state_matches,
    stop_all,
    wait_until,
)

MODEL = "m-part"
WORKERS = [f"w{i}" for i in range(16)]


def test_two_processors_share_partitions_and_keep_per_worker_order(nats_server, redis_server, redis_client):
    workloads = {w: HiCacheWorkload(seed=200 + i) for i, w in enumerate(WORKERS)}
    references = {w: ReferenceModel() for w in WORKERS}
    batches = []
    for seq in range(1, 61):  # interleaved across workers, as the stream sees them
        for w in WORKERS:
            events = workloads[w].next_batch()
            references[w].apply(events)
            batches.append(kvtier_batch(MODEL, w, 1, seq, events))
    first = processor_process(nats_server.url, redis_server.url, "--partitions", "0-3", "--fetch-batch", "32")
    second = processor_process(nats_server.url, redis_server.url, "--partitions", "4-7", "--fetch-batch", "32")
    try:
        asyncio.run(publish_batches(nats_server.url, batches))
        for w in WORKERS:
            wait_until(lambda w=w: state_matches(redis_client, MODEL, w, references[w]), timeout=30,
                       what=lambda w=w: describe_diff(redis_client, MODEL, w, references[w]))
            assert read_worker_state(redis_client, MODEL, w)["seq"] == "60"
        delivered = asyncio.run(_delivered_per_partition(nats_server.url))
        assert sum(delivered[p] for p in range(4)) > 0 and sum(delivered[p] for p in range(4, 8)) > 0, delivered
        assert sum(delivered.values()) >= len(batches)
    finally:
        assert stop_all(first, second) == [0, 0], first.output() + second.output()


async def _delivered_per_partition(url):
    nc = await nats.connect(url)
    js = nc.jetstream()
    out = {}
    for p in range(8):
        info = await js.consumer_info(EVENTS_STREAM, f"kvtier-processor-p{p}")
        out[p] = info.delivered.consumer_seq or 0
    await nc.close()
    return out


def test_auto_partitions_split_fairly_and_survive_a_processor_death(nats_server, redis_server, redis_client):
    from kvtier.consumers.ownership import PartitionLeases

    workloads = {w: HiCacheWorkload(seed=300 + i) for i, w in enumerate(WORKERS)}
    references = {w: ReferenceModel() for w in WORKERS}
    seqs = {w: 0 for w in WORKERS}

    def burst(rounds):
        batches = []
        for _ in range(rounds):
            for w in WORKERS:
                events = workloads[w].next_batch()
                references[w].apply(events)
                seqs[w] += 1
                batches.append(kvtier_batch(MODEL, w, 1, seqs[w], events))
        asyncio.run(publish_batches(nats_server.url, batches))

    def converged():
        for w in WORKERS:
            wait_until(lambda w=w: state_matches(redis_client, MODEL, w, references[w]), timeout=40,
                       what=lambda w=w: describe_diff(redis_client, MODEL, w, references[w]))

    leases = PartitionLeases(redis_client, "test-observer", 8)
    args = ("--partitions", "auto", "--fetch-batch", "32")
    first = processor_process(nats_server.url, redis_server.url, *args)
    second = processor_process(nats_server.url, redis_server.url, *args)
    try:
        def split_evenly():
            owners = leases.owners()
            counts = {}
            for owner in owners.values():
                counts[owner] = counts.get(owner, 0) + 1
            return None not in counts and sorted(counts.values()) == [4, 4]

        wait_until(split_evenly, timeout=30, what=lambda: f"{leases.owners()}\n{first.output()[-1500:]}")
        burst(20)
        converged()
        first.kill()  # its leases run out (5 s) and the survivor takes every partition
        burst(20)
        wait_until(lambda: len(set(leases.owners().values())) == 1 and None not in leases.owners().values(),
                   timeout=30, what=lambda: f"{leases.owners()}\n{second.output()[-1500:]}")
        converged()
        assert all(read_worker_state(redis_client, MODEL, w)["seq"] == str(seqs[w]) for w in WORKERS)
    finally:
        stop_all(first, second)
