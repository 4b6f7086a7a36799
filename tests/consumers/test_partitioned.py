"""Two processors split the partitions; every worker's events still apply in order."""

import asyncio

import nats
import pytest

from kvtier.consumers.apply import read_worker_state
from kvtier.schemas.subjects import EVENTS_STREAM

from ..helpers import (
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


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


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


def test_a_processor_reports_the_backlog_of_the_partitions_it_owns_only(nats_server, redis_server, redis_client):
    """kvtier_processor_consumer_pending{partition} of a partition given up to another processor
    goes away: a frozen figure from its old owner would read as a backlog nobody drains."""
    import re
    import urllib.request

    from kvtier.consumers.ownership import PartitionLeases
    from kvtier.harness.embedded import free_port

    leases = PartitionLeases(redis_client, "test-observer", 8)
    workloads = {w: HiCacheWorkload(seed=500 + i) for i, w in enumerate(WORKERS)}
    seqs = {w: 0 for w in WORKERS}

    def burst():
        batches = []
        for w in WORKERS:
            seqs[w] += 1
            batches.append(kvtier_batch(MODEL, w, 1, seqs[w], workloads[w].next_batch()))
        asyncio.run(publish_batches(nats_server.url, batches))

    def reported(port: int) -> set[int]:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        return {int(p) for p in re.findall(r'^kvtier_processor_consumer_pending\{partition="(\d+)"\}', page, re.M)}

    def owned_by(process_id_part: str) -> set[int]:
        return {p for p, owner in leases.owners().items() if owner and process_id_part in owner}

    port = free_port()
    args = ("--partitions", "auto")
    first = processor_process(nats_server.url, redis_server.url, *args, "--metrics-port", str(port))
    second = None
    try:
        wait_until(lambda: None not in leases.owners().values(), timeout=30, what=lambda: first.output()[-1500:])
        burst()  # every partition's consumer exists once it has had messages
        wait_until(lambda: reported(port) == set(range(8)), timeout=30,
                   what=lambda: f"all 8 partitions reported; {reported(port)}")
        owner = next(iter(set(leases.owners().values())))
        second = processor_process(nats_server.url, redis_server.url, *args)
        wait_until(lambda: len(owned_by(owner)) == 4 and None not in leases.owners().values(), timeout=30,
                   what=lambda: f"an even split; {leases.owners()}")
        burst()
        wait_until(lambda: reported(port) == owned_by(owner), timeout=30,
                   what=lambda: f"only its own partitions {owned_by(owner)}; reported {reported(port)}")
    finally:
        stop_all(*(p for p in (first, second) if p is not None))
