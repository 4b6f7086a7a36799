"""Scale-out on the brokers kvtier already uses, on loopback: a 3-node NATS cluster holding the
events stream at 3 replicas (one node killed mid-stream loses nothing), and a 3-master Redis
Cluster under the real processor, router, `kvtier inspect` and `kvtier replay`, with two
models sharded onto different masters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from kvtier.consumers.ownership import PartitionLeases, partition_key
from kvtier.plumbing.connections import redis_client
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.sglang import BlockStored
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import DLQ_STREAM, EVENTS_STREAM
from kvtier.schemas.tiers import Tier
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..cluster_helpers import NatsCluster, RedisCluster
from ..helpers import (
    HiCacheWorkload,
    ReferenceModel,
    RunningPipeline,
    bridge_process,
    describe_diff,
    processor_process,
    state_matches,
    stop_all,
    wait_until,
    worker_announced,
)
from ..router_helpers import RouterProcess

pytestmark = pytest.mark.timeout(120)


def kvtier(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=timeout)


# --- NATS cluster ----------------------------------------------------------------------------
async def _stream_view(urls: list[str]) -> dict:
    """Leader, replicas and message counts of the events stream, and the dead letters."""
    import nats

    nc = await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=2, reconnect_time_wait=0.2)
    try:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info(EVENTS_STREAM)
        try:
            dlq = (await js.stream_info(DLQ_STREAM)).state.messages
        except Exception:  # noqa: BLE001 - no DLQ stream: nothing dead-lettered
            dlq = 0
        return {"leader": info.cluster.leader if info.cluster else None, "replicas": info.config.num_replicas,
                "messages": info.state.messages, "dead_letters": dlq,
                "peers": [p.name for p in (info.cluster.replicas or [])] if info.cluster else []}
    finally:
        await nc.close()


def stream_view(urls: list[str]) -> dict:
    return asyncio.run(_stream_view(urls))


async def _step_down(urls: list[str], preferred: str) -> None:
    import nats

    nc = await nats.connect(urls, connect_timeout=2)
    try:
        await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{EVENTS_STREAM}",
                         json.dumps({"placement": {"preferred": preferred}}).encode(), timeout=5)
    finally:
        await nc.close()


def move_leader(cluster: NatsCluster, server_name: str) -> str:
    """Make `server_name` the events stream's leader (a leader step-down with a preferred
    successor); returns it."""
    urls = [n.url for n in cluster.nodes]
    if stream_view(urls)["leader"] != server_name:
        asyncio.run(_step_down(urls, server_name))
        wait_until(lambda: stream_view(urls)["leader"] == server_name, timeout=15,
                   what=f"stream leader moved to {server_name}")
    return server_name


@pytest.mark.slow
def test_nats_cluster_node_loss_loses_nothing(redis_server):
    started = time.monotonic()
    model = "org/cluster-model"
    with NatsCluster() as cluster:
        # more replicas than servers: refused in one line, nothing created
        too_many = kvtier("processor", "--nats", cluster.url, "--redis", redis_server.url, "--stream-replicas", "5",
                          timeout=30)
        assert too_many.returncode == 2 and "--stream-replicas must not exceed" in too_many.stderr, too_many.stderr
        replicas = ("--stream-replicas", "3")
        # the lease outlives a failover (election + the bridge's 5 s publish timeout) on a busy
        # 2-core box: this test is about what the stream keeps, not about lease timing
        with RunningPipeline(cluster.url, redis_server.url, model, bridge_args=(*replicas, "--lease-ttl", "30"),
                             processor_args=replicas) as run:
            view = stream_view([n.url for n in cluster.nodes])
            assert view["replicas"] == 3 and view["leader"] and len(view["peers"]) == 2, view
            workload, reference = HiCacheWorkload(seed=11), ReferenceModel()
            run.publish(workload, reference, 150)
            run.converge(reference)

            # SIGKILL the stream's leader while batches keep coming; the leader is moved first to
            # the node the bridge publishes through, so the loss hits both the stream (a new
            # leader is elected) and a client (the bridge fails over to another node)
            leader = cluster.node(move_leader(cluster, cluster.connected_to(f"kvtier-bridge-{run.worker}")))
            for i in range(150):
                run.publish(workload, reference, 1)
                if i == 20:
                    leader.kill()
                time.sleep(0.005)
            survivors = [n.url for n in cluster.nodes if n is not leader]
            run.converge(reference, timeout=45)

            after = wait_until(lambda: (v := stream_view(survivors))["leader"] not in (None, leader.server_name) and v,
                               timeout=20, what="a new stream leader")
            state = run.state()
            assert state["stale"] == "0" and state.get("gaps", "0") == "0", state
            assert state["epochs"] == "1", (state, run.bridge.output()[-3000:], run.processor.output()[-3000:])
            assert after["dead_letters"] == 0, after
            assert run.bridge.alive() and run.processor.alive()
            assert "disconnected from NATS" in run.bridge.output()  # the bridge did fail over
            # the whole history is still in the stream: a replay through the cluster (its URL list
            # still names the dead node) rebuilds exactly the live state
            replay = kvtier("replay", "--nats", cluster.url, "--redis", redis_server.url, "--diff", "--json")
            assert replay.returncode == 0, replay.stdout + replay.stderr
            assert json.loads(replay.stdout.strip().splitlines()[-1])["diff"]["diverging_pages"] == 0
            assert "rebased" not in run.processor.output()
    assert time.monotonic() - started < 90


def test_stream_replicas_beyond_the_cluster_are_refused(nats_server, redis_server):
    """A single server cannot hold 3 replicas: the processor says so in one line and exits."""
    result = kvtier("processor", "--nats", nats_server.url, "--redis", redis_server.url, "--stream-replicas", "3",
                    timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--stream-replicas must not exceed" in result.stderr and "3 replicas" in result.stderr, result.stderr


# --- Redis Cluster ---------------------------------------------------------------------------
def models_on_different_masters(cluster: RedisCluster, n: int = 2) -> list[str]:
    """The first model names (org/model-0, -1, ...) whose state lands on n different masters."""
    chosen, nodes = [], set()
    for i in range(64):
        model = f"org/model-{i}"
        port = cluster.node_of_key(ModelKeys.for_model(model).leases).port
        if port not in nodes:
            chosen.append(model)
            nodes.add(port)
            if len(chosen) == n:
                return chosen
    raise AssertionError("no model names on different masters")


def known_chain(publisher: SglangEventPublisher, reference: ReferenceModel, seed: int,
                device: int, host: int, page_size: int = 4) -> list[int]:
    """Publish a request's pages as the engine would: the first `device` pages on GPU, the next
    `host` pages on host only. Returns the request's tokens."""
    tokens = [seed * 100_000 + i for i in range((device + host) * page_size)]
    hashes = sglang_block_hashes(tokens, page_size)
    events = [
        BlockStored(block_hashes=hashes[:device], parent_block_hash=None, token_ids=tokens[:device * page_size],
                    block_size=page_size, medium="GPU"),
        BlockStored(block_hashes=hashes[device:], parent_block_hash=hashes[device - 1],
                    token_ids=tokens[device * page_size:], block_size=page_size, medium="CPU_PINNED"),
    ]
    publisher.publish(events)
    reference.apply(events)
    return tokens


@pytest.mark.slow
def test_redis_cluster_processor_and_router_work_unchanged(nats_server):
    started = time.monotonic()
    with RedisCluster() as cluster:
        models = models_on_different_masters(cluster)
        homes = [cluster.node_of_key(ModelKeys.for_model(m).leases) for m in models]
        assert homes[0].port != homes[1].port
        client = redis_client(cluster.url)
        publishers = [SglangEventPublisher() for _ in models]
        references = [ReferenceModel() for _ in models]
        # --partitions auto: the partition leases (kvt:partition:<k>, no hash tag) spread over the shards
        processor = processor_process(nats_server.url, cluster.url, "--partitions", "auto")
        bridges = [bridge_process(p, nats_server.url, "w0", m) for p, m in zip(publishers, models)]
        router = None
        try:
            for m in models:
                wait_until(lambda m=m: worker_announced(client, m, "w0"), timeout=30,
                           what=lambda: f"announced\n{processor.output()[-2000:]}")
            workloads = [HiCacheWorkload(seed=31 + i) for i in range(len(models))]
            for _ in range(120):
                for publisher, workload, reference in zip(publishers, workloads, references):
                    events = workload.next_batch()
                    publisher.publish(events)
                    reference.apply(events)
            tokens = [known_chain(p, r, seed=7 + i, device=5, host=3) for i, (p, r)
                      in enumerate(zip(publishers, references))]
            for m, reference in zip(models, references):
                wait_until(lambda m=m, r=reference: state_matches(client, m, "w0", r), timeout=30,
                           what=lambda m=m, r=reference: describe_diff(client, m, "w0", r)
                           + f"\nprocessor: {processor.output()[-2000:]}")
            # each model's state lives on its own master (the hash tag keeps it in one slot)
            for m, home in zip(models, homes):
                keys = ModelKeys.for_model(m)
                with home.client() as direct:
                    assert direct.exists(keys.leases, keys.pages("w0"), keys.state("w0")) == 3

            owners = PartitionLeases(client, "test-reader", 8).owners()
            assert len(owners) == 8 and len(set(owners.values())) == 1 and None not in owners.values(), owners
            lease_homes = {cluster.node_of_key(partition_key(p)).port for p in range(8)}
            assert len(lease_homes) > 1

            router = RouterProcess(cluster.url)
            for m in models:  # each model's index built from its own master, at the feed's head
                router.wait_index_settled(client, m)
            for i, (m, t) in enumerate(zip(models, tokens)):
                status, body, _ = router.route(m, t, request_id=f"req-{i}", max_new_tokens=8)
                assert status == 200, body
                assert body["worker_id"] == "w0" and body["booked"] is True, body
                assert body["overlap"] == {"device": 5, "host": 3, "disk": 0, "shared_beyond": 0, "predicted": 0}, body
                assert not body.get("degraded"), body
                _, seen, _ = router.route(m, t, book=False)
                # prefill booked = 8 pages - 5 on device; decode = (32 prompt + 8 new tokens) / 4
                assert seen["candidates"][0]["prefill_load"] == 3 and seen["candidates"][0]["decode_load"] == 10, seen
                with homes[i].client() as direct:
                    assert direct.hget(ModelKeys.for_model(m).decode_load, "w0") == b"10"
                status, released, _ = router.release(m, f"req-{i}")
                assert status == 200 and released["decode_pages"] == 10, released
            status, health, _ = _get(router.url + "/healthz")
            assert status == 200, health

            rows = json.loads(_ok(kvtier("inspect", "--redis", cluster.url, "--json")).stdout)
            by_model = {r["model"]: r for r in rows}
            for m, reference in zip(models, references):
                row = by_model[ModelKeys.for_model(m).model_token]
                expected = {tier.value: sum(1 for tiers in reference.pages.values() if tier in tiers) for tier in Tier}
                assert row["worker"] == "w0" and not row["stale"] and row["pages"] == expected, row

            replay = kvtier("replay", "--nats", nats_server.url, "--redis", cluster.url, "--into", "clusterreplay",
                            "--diff", "--json")
            assert replay.returncode == 0, replay.stdout + replay.stderr
            result = json.loads(replay.stdout.strip().splitlines()[-1])
            assert result["diff"] == {"diverging_pages": 0, "workers": []}, result["diff"]
            assert {w["model"] for w in result["workers"]} == {ModelKeys.for_model(m).model_token for m in models}
            dropped = _ok(kvtier("replay", "--redis", cluster.url, "--drop", "clusterreplay", "--json"))
            assert json.loads(dropped.stdout.strip().splitlines()[-1])["dropped"] > 0
            assert not list(client.scan_iter(match="clusterreplay:*"))
            refused = kvtier("replay", "--nats", nats_server.url, "--redis", cluster.url, "--into-db", "3")
            assert refused.returncode == 2 and "Redis Cluster" in refused.stderr, refused.stderr
            # nothing was refused by the cluster on the way (NATS-side notices are not this test's business)
            trouble = ("Traceback", "Redis unavailable", "leases unavailable", "CrossSlot", "Cluster", "slot")
            redis_trouble = [line for line in processor.output().splitlines() if any(t in line for t in trouble)]
            assert not redis_trouble, processor.output()[-3000:]
            assert "Traceback" not in router.output(), router.output()[-3000:]
        finally:
            stop_all(*bridges, processor, *([router] if router else []))
            for p in publishers:
                p.close()
            client.close()
    assert time.monotonic() - started < 90


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _get(url: str):
    from ..router_helpers import http

    return http("GET", url)
