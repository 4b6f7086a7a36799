"""Router replicas that each keep an in-memory index, as processes against a real Redis while
tier state keeps changing: once the feed settles they answer alike, and alike with a replica
that walks in Redis; a replica killed mid-stream and started again routes like a survivor as
soon as its index is built."""

from __future__ import annotations

import random
import time

import pytest

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, http
from .test_tier_state import MODEL, TOKEN, BackgroundWriter

WORKERS = [f"bw{i}" for i in range(8)]


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def candidates(router: RouterProcess, tokens: list[int]) -> list[dict]:
    status, body, _ = router.route(MODEL, tokens, book=False)
    assert status == 200, body
    assert body["degraded"] == [], body
    return [{k: c[k] for k in ("worker_id", "overlap", "logit")} for c in body["candidates"]]


def seed_requests(client, n: int, rng: random.Random) -> list[list[int]]:
    """Requests whose pages some workers hold, on every tier: the writer's pages are made-up
    hashes, so the same hashes are written under the tokens of real requests here."""
    from kvtier.consumers.apply import TierStateWriter
    from kvtier.schemas.events import EventBatch, PagesStored
    from kvtier.schemas.hashes import sglang_block_hashes
    from kvtier.schemas.tiers import Tier

    writer = TierStateWriter(client)
    requests = []
    for _ in range(n):
        tokens = [rng.randrange(1, 30_000) for _ in range(4 * 12)]
        hashes = sglang_block_hashes(tokens, 4)
        requests.append(tokens)
        for worker in rng.sample(WORKERS, 3):
            epoch, seq = (int(x or 0) for x in client.hmget(f"kvt:{{{TOKEN}}}:w:{worker}:state", "epoch", "seq"))
            cut = sorted(rng.sample(range(13), 2))
            events = [PagesStored(tier=Tier.DEVICE, hashes=hashes[:cut[0]]),
                      PagesStored(tier=Tier.HOST, hashes=hashes[cut[0]:cut[1]]),
                      PagesStored(tier=Tier.DISK, hashes=hashes[cut[1]:])]
            assert writer.apply(EventBatch(worker_id=worker, model=MODEL, epoch=epoch, seq=seq + 1, ts=time.time(),
                                           source_ts=time.time(), events=events)).status == 0
    return requests


def test_replicas_answer_alike_once_the_feed_settles_and_alike_with_the_walk(redis_server, redis_client):
    writer = BackgroundWriter(redis_server.url)
    writer.start()
    wait_until(lambda: writer.batches > 50)
    replicas = [RouterProcess(redis_server.url) for _ in range(2)]
    walker = RouterProcess(redis_server.url, "--state-source", "redis")
    try:
        wait_until(lambda: writer.batches > 400, timeout=60)
        writer.halt.set()
        writer.join(10)  # the writer's workers keep their seq; requests below are written after it
        requests = seed_requests(redis_client, 12, random.Random(3))
        for r in replicas:
            r.wait_index_settled(redis_client, MODEL)
        assert http("GET", walker.url + "/healthz")[1]["state_source"] == "redis"
        for tokens in requests:
            want = candidates(walker, tokens)
            assert any(c["overlap"]["device"] or c["overlap"]["host"] or c["overlap"]["disk"] for c in want)
            for r in replicas:
                assert candidates(r, tokens) == want
    finally:
        writer.halt.set()
        stop_all(*replicas, walker)


def test_a_replica_killed_mid_stream_routes_like_a_survivor_once_its_index_is_built(redis_server, redis_client):
    writer = BackgroundWriter(redis_server.url)
    writer.start()
    survivor = RouterProcess(redis_server.url)
    doomed = RouterProcess(redis_server.url)
    newcomer = None
    try:
        wait_until(lambda: writer.batches > 200, timeout=60)
        doomed.kill()  # SIGKILL: no goodbye
        wait_until(lambda: writer.batches > 400, timeout=60)
        started = time.monotonic()
        newcomer = RouterProcess(redis_server.url)
        # while batches still land, its index is built from Redis and then follows the feed
        wait_until(lambda: any(i["ready"] for i in http("GET", newcomer.url + "/healthz")[1]["indexes"]),
                   timeout=20)
        built_in = time.monotonic() - started
        index = http("GET", newcomer.url + "/healthz")[1]["indexes"][0]
        assert index["model"] == TOKEN and index["bootstraps"] == 1 and index["last_bootstrap_reason"] == "start"
        assert built_in < 20
        wait_until(lambda: writer.batches > 600, timeout=60)
        writer.halt.set()
        writer.join(10)
        requests = seed_requests(redis_client, 10, random.Random(5))
        for r in (survivor, newcomer):
            r.wait_index_settled(redis_client, MODEL)
        for tokens in requests:
            assert candidates(newcomer, tokens) == candidates(survivor, tokens)
    finally:
        writer.halt.set()
        stop_all(*[p for p in (survivor, newcomer) if p is not None])
        doomed.kill()
