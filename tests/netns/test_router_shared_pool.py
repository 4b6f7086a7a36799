"""The router against a real Mooncake master: pages written with SGLang HiCache's key layout
through MooncakeDistributedStore are credited as `shared_beyond` exactly as docs/DESIGN.md's
formula says; a page counts only if all its keys exist; a dead master or a page-size
mismatch degrades the decision instead of failing it."""

from __future__ import annotations

import pytest
import redis

from kvtier.harness.embedded import RedisServer
from kvtier.router.hashing import RequestPages
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.worker import AttentionKind, MooncakeLayout

from ..helpers import stop_all
from ..router_helpers import RouterProcess, StateSeeder, request_tokens

MODEL = "mooncake-model"


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def put_pages(writer, tokens, page_size, layout, positions, skip_keys=()):
    pages = RequestPages.of(tokens, page_size)
    keys = [k for i in positions for k in mooncake_object_keys(pages.digests[i], layout) if k not in skip_keys]
    writer.put_many(keys, b"kv")
    return pages


def candidates(body):
    return {c["worker_id"]: c for c in body["candidates"]}


def test_worked_example_with_a_real_shared_pool(redis_server, mooncake_master, shared_pool_writer):
    """4 pages, page size 1, the pool holds pages 0-3, multiplier 0.5: W0 with 2 device pages
    scores 1.0 and wins, cold W1 scores 2.0 (the HiCache guide's example)."""
    layout = MooncakeLayout()
    tokens = request_tokens(4, 1, seed=11)
    put_pages(shared_pool_writer, tokens, 1, layout, range(4))
    client = redis.Redis.from_url(redis_server.url)
    seeder = StateSeeder(client, MODEL)
    seeder.worker("W0", 1, tokens, device=2, layout=layout)
    seeder.worker("W1", 1, layout=layout)
    router = RouterProcess(redis_server.url, "--prefill-load-scale", "1", "--shared-cache-type", "hicache",
                           "--shared-cache-multiplier", "0.5",
                           "--mooncake-master", mooncake_master.http_url)
    try:
        status, body, headers = router.route(MODEL, tokens, book=False)
        assert status == 200 and "X-Kvtier-Degraded" not in headers, body
        got = candidates(body)
        assert got["W0"]["overlap"] == {"device": 2, "host": 0, "disk": 0, "shared_beyond": 2, "predicted": 0}
        assert got["W1"]["overlap"] == {"device": 0, "host": 0, "disk": 0, "shared_beyond": 4, "predicted": 0}
        assert (got["W0"]["logit"], got["W1"]["logit"]) == (1.0, 2.0)
        assert body["worker_id"] == "W0"
        # multiplier 0 queries the pool but ignores it: W0 = 4 - 2 = 2, W1 = 4
        _, body0, _ = router.route(MODEL, tokens, book=False, overrides={"shared_cache_multiplier": 0})
        assert [c["logit"] for c in body0["candidates"]] == [2.0, 4.0]
        metrics = router.metrics()
        assert "router_shared_cache_hit_rate_count 2.0" in metrics
        assert "router_shared_cache_hit_rate_sum 2.0" in metrics  # 4 of 4 pages, twice
        assert "router_shared_cache_beyond_blocks_sum 4.0" in metrics  # W0 chosen twice, 2 beyond each
    finally:
        stop_all(router)
        client.close()


def test_a_page_counts_only_if_all_its_keys_exist(redis_server, mooncake_master, shared_pool_writer):
    tp2 = MooncakeLayout(tp_size=2)
    mla = MooncakeLayout(attention=AttentionKind.MLA, key_prefix="tenant7")
    tokens = request_tokens(6, 2, seed=12)
    pages = RequestPages.of(tokens, 2)
    missing_v = mooncake_object_keys(pages.digests[2], tp2)[3]  # rank 1's V of page 2
    assert missing_v.endswith("_1_v")
    put_pages(shared_pool_writer, tokens, 2, tp2, range(6), skip_keys={missing_v})
    put_pages(shared_pool_writer, tokens, 2, mla, [0, 1, 4])
    client = redis.Redis.from_url(redis_server.url)
    seeder = StateSeeder(client, MODEL + "-b")
    seeder.worker("tp2", 2, tokens, device=1, layout=tp2)
    seeder.worker("mla", 2, layout=mla)
    seeder.worker("no-l3", 2)  # no Mooncake backend: no shared credit
    router = RouterProcess(redis_server.url, "--shared-cache-type", "hicache",
                           "--mooncake-master", mooncake_master.http_url)
    try:
        status, body, _ = router.route(MODEL + "-b", tokens, book=False)
        assert status == 200, body
        beyond = {w: c["overlap"]["shared_beyond"] for w, c in candidates(body).items()}
        # tp2: pages 1..5 are at/after its device prefix of 1; page 2 lacks a key -> 4
        # mla: pages 0, 1, 4 under its own prefixed keys -> 3
        assert beyond == {"tp2": 4, "mla": 3, "no-l3": 0}
    finally:
        stop_all(router)
        client.close()


def test_dead_master_and_page_size_mismatch_degrade_not_fail(redis_server, mooncake_master, shared_pool_writer):
    from kvtier.harness.embedded import free_port

    layout = MooncakeLayout()
    tokens = request_tokens(4, 1, seed=13)
    put_pages(shared_pool_writer, tokens, 1, layout, range(4))
    client = redis.Redis.from_url(redis_server.url)
    seeder = StateSeeder(client, MODEL + "-c")
    seeder.worker("W0", 1, tokens, device=1, layout=layout)
    seeder.worker("W1", 1, layout=layout)
    dead = RouterProcess(redis_server.url, "--shared-cache-type", "hicache",
                         "--mooncake-master", f"http://127.0.0.1:{free_port()}")
    mismatched = RouterProcess(redis_server.url, "--shared-cache-type", "hicache", "--page-size", "2",
                               "--mooncake-master", mooncake_master.http_url)
    try:
        status, body, headers = dead.route(MODEL + "-c", tokens, book=False)
        assert status == 200 and body["worker_id"] == "W0", body
        assert headers["X-Kvtier-Degraded"] == "shared-pool-unavailable"
        assert body["degraded"] == ["shared-pool-unavailable"]
        assert all(c["overlap"]["shared_beyond"] == 0 for c in body["candidates"])
        assert 'router_shared_pool_errors_total{reason="error"} 1.0' in dead.metrics()
        assert "Shared cache query failed" in dead.output()

        status, body, headers = mismatched.route(MODEL + "-c", tokens, book=False)
        assert status == 200 and "X-Kvtier-Degraded" not in headers, body
        assert all(c["overlap"]["shared_beyond"] == 0 for c in body["candidates"])
        assert candidates(body)["W0"]["overlap"]["device"] == 1  # its own tiers still count
        assert "router_page_size_mismatch_total 2.0" in mismatched.metrics()
        assert "page size 1 but the router's --page-size is 2" in mismatched.output()
    finally:
        stop_all(dead, mismatched)
        client.close()


def test_a_pool_that_is_not_credited_is_still_priced_in_the_work_the_rates_learn_from(
        redis_server, mooncake_master, shared_pool_writer):
    """--mooncake-master without --shared-cache-type hicache: the formula credits nothing of the
    pool (the worked example's logits without it), but the booking's work, which the worker's
    rates learn from, prices the pool's pages as L3 loads, not as tokens to recompute; with
    --learn-rates off the pool is not asked at all."""
    from kvtier.schemas.state_keys import ModelKeys

    from ..router_helpers import http

    layout = MooncakeLayout()
    tokens = request_tokens(4, 1, seed=14)
    put_pages(shared_pool_writer, tokens, 1, layout, range(4))
    client = redis.Redis.from_url(redis_server.url)
    seeder = StateSeeder(client, MODEL + "-d")
    seeder.worker("W0", 1, tokens, device=2, layout=layout)
    seeder.worker("W1", 1, layout=layout)
    priced = RouterProcess(redis_server.url, "--prefill-load-scale", "1", "--mooncake-master", mooncake_master.http_url)
    blind = RouterProcess(redis_server.url, "--prefill-load-scale", "1", "--learn-rates", "off",
                          "--mooncake-master", mooncake_master.http_url)
    try:
        status, body, headers = priced.route(MODEL + "-d", tokens, request_id="p1")
        assert status == 200 and "X-Kvtier-Degraded" not in headers, body
        got = candidates(body)
        assert [got[w]["overlap"]["shared_beyond"] for w in ("W0", "W1")] == [0, 0]
        assert (got["W0"]["logit"], got["W1"]["logit"]) == (2.0, 4.0) and body["worker_id"] == "W0"
        work = client.hget(ModelKeys.for_model(MODEL + "-d").booking("p1"), "work").decode().split()
        # W0 holds pages 0-1 on its GPU; pages 2-3 come from the pool: nothing to recompute
        assert [float(v) for v in work[:4]] == [0.0, 0.0, 2.0, 0.0], work
        assert http("GET", f"{priced.url}/healthz")[1]["shared_pool"] == {"enabled": True, "credited": False,
                                                                      "last_error": ""}

        status, body, _ = blind.route(MODEL + "-d", tokens, book=False)  # W0 now holds p1's load
        assert status == 200 and all(c["overlap"]["shared_beyond"] == 0 for c in body["candidates"]), body
        assert http("GET", f"{blind.url}/healthz")[1]["shared_pool"]["enabled"] is False
    finally:
        stop_all(priced, blind)
        client.close()
