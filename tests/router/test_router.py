"""`kvtier router` replicas against a real Redis-protocol server (and nats-server for the
decision log): the tiered walk, candidates, load booking across replicas, validation,
degradation when Redis dies, the decision log, metrics."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time

import msgspec
import pytest

from kvtier.harness.embedded import RedisServer
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.routing import RouteDecision
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.tiers import Tier

from ..helpers import stop_all, wait_until
from ..router_helpers import GUIDE_LOAD_SCALE, RouterProcess, StateSeeder, http, request_tokens

MODEL = "org/model-1"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def by_worker(body: dict) -> dict[str, dict]:
    return {c["worker_id"]: c for c in body["candidates"]}


def test_walk_counts_device_prefix_then_host_then_disk(redis_client, redis_server):
    tokens = request_tokens(10, 4)
    hashes = sglang_block_hashes(tokens, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("tiered", 4, tokens, device=3, host=2, disk=1)
    # device holds pages 0,1 and 3 (not 2); host holds 2,3,4; disk 6: the walk is
    # device 0-1, host 2-4 (page 3 counts once, at host), then disk stops at page 5.
    seeder.announce("gappy", 4)
    seeder.store("gappy", Tier.DEVICE, [hashes[0], hashes[1], hashes[3]])
    seeder.store("gappy", Tier.HOST, hashes[2:5])
    seeder.store("gappy", Tier.DISK, [hashes[6]])
    # host pages that do not start at the root do not count at all
    seeder.announce("orphan", 4)
    seeder.store("orphan", Tier.HOST, hashes[1:10])
    seeder.worker("cold", 4)
    router = RouterProcess(redis_server.url, *GUIDE_LOAD_SCALE)
    try:
        status, body, _ = router.route(MODEL, tokens, book=False)
        assert status == 200, body
        got = {w: c["overlap"] for w, c in by_worker(body).items()}
        assert got == {
            "tiered": {"device": 3, "host": 2, "disk": 1, "shared_beyond": 0, "predicted": 0},
            "gappy": {"device": 2, "host": 3, "disk": 0, "shared_beyond": 0, "predicted": 0},
            "orphan": {"device": 0, "host": 0, "disk": 0, "shared_beyond": 0, "predicted": 0},
            "cold": {"device": 0, "host": 0, "disk": 0, "shared_beyond": 0, "predicted": 0},
        }
        # 10 pages - (3 + 0.75*2 + 0.25*1) = 5.25 ; gappy 10 - (2 + 2.25) = 5.75
        assert body["worker_id"] == "tiered" and body["logit"] == 5.25
        assert by_worker(body)["gappy"]["logit"] == 5.75 and by_worker(body)["cold"]["logit"] == 10.0
        assert body["request_pages"] == 10 and body["page_size"] == 4 and body["booked"] is False
        # Without `explain` the answer names the winner only; the decision is the same.
        status, lean, _ = router.route(MODEL, tokens, book=False, explain=False)
        assert status == 200 and lean["candidates"] == [], lean
        same = ("worker_id", "logit", "overlap")
        assert [lean[k] for k in same] == [body[k] for k in same]
    finally:
        stop_all(router)


def test_only_live_fresh_workers_are_candidates(redis_client, redis_server):
    tokens = request_tokens(4, 2)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("fresh", 2, tokens, device=1)
    seeder.worker("best-but-stale", 2, tokens, device=4)
    seeder.worker("best-but-dead", 2, tokens, device=4)
    keys = ModelKeys.for_model(MODEL)
    seeder.mark_stale("best-but-stale")
    redis_client.zadd(keys.leases, {"best-but-dead": int(time.time() * 1000) - 1})
    router = RouterProcess(redis_server.url)
    try:
        status, body, _ = router.route(MODEL, tokens, book=False)
        assert status == 200, body
        assert [c["worker_id"] for c in body["candidates"]] == ["fresh"]
        # when nothing but stale workers is left, route among them by load and say so
        seeder.mark_stale("fresh")
        status, body, headers = router.route(MODEL, tokens, book=False)
        assert status == 200 and body["degraded"] == ["only-stale-workers"], body
        assert headers["X-Kvtier-Degraded"] == "only-stale-workers"
        assert all(c["overlap"]["device"] == 0 for c in body["candidates"])
        redis_client.zadd(keys.leases, {"fresh": 1, "best-but-stale": 1})
        status, body, _ = router.route(MODEL, tokens, book=False)
        assert status == 503 and "no live worker" in body["error"], body
    finally:
        stop_all(router)


def test_booking_shows_up_in_every_replica_and_releases(redis_client, redis_server):
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 4, tokens, device=8)
    seeder.worker("b", 4)
    first, second = (RouterProcess(redis_server.url, *GUIDE_LOAD_SCALE),
                     RouterProcess(redis_server.url, *GUIDE_LOAD_SCALE))
    try:
        status, body, _ = first.route(MODEL, tokens, request_id="req-1", max_new_tokens=8)
        assert status == 200 and body["worker_id"] == "a", body
        # the booking made through one replica is seen by the other: prefill 8 - 8 device pages = 0,
        # decode = (32 prompt + 8 new tokens) / 4 = 10 pages
        _, seen, _ = second.route(MODEL, tokens, book=False)
        assert by_worker(seen)["a"]["prefill_load"] == 0 and by_worker(seen)["a"]["decode_load"] == 10
        status, body, _ = second.route(MODEL, tokens, request_id="req-2")
        # a: max(8 + 0 - 8, 0) + 10 decode pages = 10; cold b: 8 pages to prefill = 8
        assert status == 200 and body["worker_id"] == "b", body
        status, dup, _ = first.route(MODEL, tokens, request_id="req-1")
        assert status == 409 and "already holds a booking" in dup["error"]
        status, rel, _ = second.release(MODEL, "req-1", "first_token")
        assert status == 200 and rel["worker_id"] == "a" and rel["decode_pages"] == 0
        assert first.release(MODEL, "req-1")[1]["decode_pages"] == 10
        assert first.release(MODEL, "req-1")[0] == 404
        assert second.release(MODEL, "req-2")[0] == 200
        _, after, _ = first.route(MODEL, tokens, book=False)
        assert all(c["prefill_load"] == 0 and c["decode_load"] == 0 for c in after["candidates"])
    finally:
        stop_all(first, second)


def test_replicas_agree_and_a_burst_spreads_evenly(redis_client, redis_server):
    """3 replicas, 300 identical concurrent requests, 4 equal workers: each decision sees
    every earlier booking, so the spread is exactly the 75/75/75/75 one router makes."""
    tokens = request_tokens(16, 4)
    seeder = StateSeeder(redis_client, MODEL)
    for w in ("w0", "w1", "w2", "w3"):
        seeder.worker(w, 4, tokens, device=2)
    replicas = [RouterProcess(redis_server.url) for _ in range(3)]
    try:
        dry = [r.route(MODEL, tokens, book=False)[1] for r in replicas]
        assert all(d["candidates"] == dry[0]["candidates"] for d in dry), dry

        def fire(i: int) -> str:
            status, body, _ = replicas[i % 3].route(MODEL, tokens, request_id=f"burst-{i}")
            assert status == 200, body
            return body["worker_id"]

        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            chosen = list(pool.map(fire, range(300)))
        assert collections.Counter(chosen) == {"w0": 75, "w1": 75, "w2": 75, "w3": 75}
    finally:
        stop_all(*replicas)


def test_bad_requests_get_a_clear_4xx(redis_client, redis_server):
    StateSeeder(redis_client, MODEL).worker("w", 4)
    router = RouterProcess(redis_server.url, "--max-request-tokens", "64", "--max-body-bytes", "65536")
    url = router.url + "/v1/route"
    try:
        cases = [
            (b"", 400, "empty body"),
            (b"{not json", 400, "invalid request body"),
            ({"token_ids": [1, 2]}, 400, "missing required field `model`"),
            ({"model": MODEL, "token_ids": []}, 400, "token_ids is empty"),
            ({"model": MODEL, "token_ids": list(range(65))}, 413, "at most 64"),
            ({"model": MODEL, "token_ids": [1, -2]}, 400, "$.token_ids[1]"),
            ({"model": MODEL, "token_ids": [1, 2**32]}, 400, "$.token_ids[1]"),
            ({"model": MODEL, "token_ids": ["a"]}, 400, "Expected `int`"),
            ({"model": MODEL, "token_ids": [1], "overrides": {"temprature": 1}}, 400, "unknown field `temprature`"),
            ({"model": MODEL, "token_ids": [1], "overrides": {"host_cache_hit_weight": -1}}, 400, ">= 0.0"),
            ({"model": MODEL, "token_ids": [1], "request_id": "has space"}, 400, "$.request_id"),
            ({"model": "no/such-model", "token_ids": [1]}, 404, "unknown model 'no/such-model'"),
            (b"[" + b"1," * 40000 + b"1]", 413, "larger than 65536 bytes"),
        ]
        for body, status, message in cases:
            got, answer, _ = http("POST", url, body)
            assert got == status and message in answer.get("error", ""), (body if len(str(body)) < 200 else "big",
                                                                          got, answer)
        got, answer, _ = http("POST", router.url + "/v1/release", {"model": MODEL, "request_id": "x", "stage": "half"})
        assert got == 400 and "$.stage" in answer["error"]
        metrics = router.metrics()
        assert 'router_bad_requests_total{status="400"}' in metrics
        assert 'router_bad_requests_total{status="413"}' in metrics
    finally:
        stop_all(router)


def test_redis_down_degrades_to_round_robin_and_recovers(redis_client, redis_server):
    tokens = request_tokens(4, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 4, tokens, device=4)
    seeder.worker("b", 4)
    router = RouterProcess(redis_server.url, "--state-timeout-ms", "200")
    port = redis_server.port
    try:
        assert router.route(MODEL, tokens, book=False)[1]["worker_id"] == "a"
        redis_server.stop()
        answers = [router.route(MODEL, tokens, request_id=f"down-{i}") for i in range(4)]
        assert all(s == 200 for s, _, _ in answers), answers
        assert all(h["X-Kvtier-Degraded"] == "state-store-unavailable" for _, _, h in answers)
        assert [b["worker_id"] for _, b, _ in answers] == ["a", "b", "a", "b"]
        status, health, _ = http("GET", router.url + "/healthz")
        assert status == 200 and health["status"] == "degraded" and not health["state_store"]["ok"]
        assert 'router_fallback_decisions_total{reason="state_store_unavailable"} 4.0' in router.metrics()
        assert router.release(MODEL, "down-0")[0] == 200  # a fallback decision is released locally

        with RedisServer(port=port) as restarted:  # back, but empty: the pipeline would rebuild it
            import redis as redis_sync

            client = redis_sync.Redis.from_url(restarted.url)
            reseeded = StateSeeder(client, MODEL)
            reseeded.worker("a", 4)
            reseeded.worker("b", 4, tokens, device=4)

            def tier_aware_again():
                status, body, headers = router.route(MODEL, tokens, book=False)
                return status == 200 and "X-Kvtier-Degraded" not in headers and body["worker_id"] == "b"

            wait_until(tier_aware_again, timeout=10, what="tier-aware routing after Redis came back")
            assert "router_state_store_up 1.0" in router.metrics()
            client.close()
    finally:
        stop_all(router)


def test_decisions_are_logged_to_jetstream(redis_client, redis_server, nats_server):
    tokens = request_tokens(6, 2)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 2, tokens, device=3, host=1)
    seeder.worker("b", 2)
    router = RouterProcess(redis_server.url, "--router-id", "replica-7", nats_url=nats_server.url)
    try:
        wait_until(lambda: http("GET", router.url + "/healthz")[1]["decision_log"]["connected"], timeout=10)
        status, body, _ = router.route(MODEL, tokens, request_id="logged-1",
                                       overrides={"host_cache_hit_weight": 0.5})
        assert status == 200

        async def read_one() -> RouteDecision:
            import nats

            nc = await nats.connect(nats_server.url)
            try:
                js = nc.jetstream()
                sub = await js.pull_subscribe("kvtier.decisions.>", durable=None, stream="KVTIER_DECISIONS")
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        msgs = await sub.fetch(1, timeout=1)
                    except asyncio.TimeoutError:
                        continue
                    assert msgs[0].subject == "kvtier.decisions.org_2fmodel-1"
                    return msgspec.msgpack.decode(msgs[0].data, type=RouteDecision)
                raise AssertionError("no decision in KVTIER_DECISIONS")
            finally:
                await nc.close()

        decision = asyncio.run(read_one())
        assert decision.request_id == "logged-1" and decision.router_id == "replica-7"
        assert decision.chosen == body["worker_id"] == "a"
        assert decision.weights.host_cache_hit_weight == 0.5
        assert decision.page_hashes == {2: sglang_block_hashes(tokens, 2)}
        assert [c.worker_id for c in decision.candidates] == ["a", "b"]
        assert decision.candidates[0].overlap.device == 3 and decision.candidates[0].overlap.host == 1
        assert 0 <= decision.random_draw < 1
    finally:
        stop_all(router)


def test_metrics_name_the_dynamo_guide_histograms(redis_client, redis_server):
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, MODEL).worker("a", 4, tokens, device=2)
    router = RouterProcess(redis_server.url)
    try:
        router.route(MODEL, tokens)
        metrics = router.metrics()
        for name in ("router_shared_cache_hit_rate_bucket", "router_shared_cache_beyond_blocks_bucket",
                     "router_decision_latency_seconds_bucket", 'router_decisions_total{mode="kv"} 1.0',
                     'router_chosen_overlap_pages_sum{tier="device"} 2.0', "router_fallback_decisions_total",
                     "router_shared_pool_errors_total"):
            assert name in metrics, name
    finally:
        stop_all(router)


@pytest.mark.parametrize("flag", [["--shared-cache-type", "hicache"], ["--temperature", "-1"]])
def test_router_refuses_bad_flags(flag, redis_server):
    from ..helpers import KvtierProcess

    proc = KvtierProcess("router", "--redis", redis_server.url, "--http-port", "0", *flag)
    assert proc.proc.wait(20) == 2 if flag[0] == "--temperature" else proc.proc.wait(20) != 0
    out = proc.output()
    assert ("--mooncake-master" in out) if flag[0] == "--shared-cache-type" else ("must be a finite number" in out)
