"""Predicted pages, shared across router replicas through the atomic booking, and the baseline
router modes (round-robin, random) that a deployment A/Bs against: real Redis, real router
processes."""

from __future__ import annotations

import collections

import pytest

from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.tiers import Tier

from ..helpers import stop_all
from ..router_helpers import GUIDE_LOAD_SCALE, RouterProcess, StateSeeder, request_tokens

MODEL = "org/predicted"
PAGE = 4


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def overlap_of(body: dict, worker: str) -> dict:
    return next(c["overlap"] for c in body["candidates"] if c["worker_id"] == worker)


def test_a_booked_request_is_predicted_on_its_worker_for_every_replica(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL)
    for w in ("w0", "w1", "w2"):
        seeder.worker(w, PAGE)  # all cold: nothing any events have shown yet
    tokens = request_tokens(8, PAGE, seed=3)
    a = RouterProcess(redis_server.url, "--seed", "1", "--predicted-pages", "on", *GUIDE_LOAD_SCALE)
    b = RouterProcess(redis_server.url, "--seed", "2", "--predicted-pages", "on", *GUIDE_LOAD_SCALE)
    try:
        status, first, _ = a.route(MODEL, tokens, request_id="first")
        assert status == 200, first
        chosen = first["worker_id"]
        assert first["overlap"]["predicted"] == 0  # nothing was booked before it
        # the other replica: the same prefix plus more, before the worker has published anything
        status, second, _ = b.route(MODEL, tokens + request_tokens(2, PAGE, seed=9), request_id="second",
                                    book=False)
        assert status == 200, second
        assert overlap_of(second, chosen) == {"device": 0, "host": 0, "disk": 0, "shared_beyond": 0, "predicted": 8}
        # 10 pages + 8 booked prefill - 8 predicted, + 8 booked decode pages
        assert next(c["logit"] for c in second["candidates"] if c["worker_id"] == chosen) == 18
        # the booking holds the prediction: 8 page keys, one booking each
        keys = ModelKeys.for_model(MODEL)
        held = redis_client.hgetall(keys.predicted(chosen))
        assert len(held) == 8 and set(held.values()) == {b"1"}
        # the first token does not end it (the pages stay on device while the request decodes)
        assert a.release(MODEL, "first", "first_token")[0] == 200
        assert overlap_of(b.route(MODEL, tokens, book=False)[1], chosen)["predicted"] == 8
        # completion does
        assert b.release(MODEL, "first", "complete")[0] == 200
        assert overlap_of(a.route(MODEL, tokens, book=False)[1], chosen)["predicted"] == 0
        assert not redis_client.exists(keys.predicted(chosen))
        # once the worker's events show the pages on device, they count as device pages, once
        hashes = sglang_block_hashes(tokens, PAGE)
        seeder.store(chosen, Tier.DEVICE, hashes[:5])
        assert a.route(MODEL, tokens, request_id="third")[0] == 200
        got = overlap_of(b.route(MODEL, tokens, book=False)[1], chosen)
        assert (got["device"], got["predicted"]) == (5, 3)  # pages 5-7 predicted past the device prefix
    finally:
        stop_all(a, b)


def test_two_bookings_of_one_prefix_each_hold_it(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL + "-2")
    seeder.worker("w0", PAGE)
    tokens = request_tokens(4, PAGE, seed=5)
    router = RouterProcess(redis_server.url, "--predicted-pages", "on")
    try:
        assert router.route(MODEL + "-2", tokens, request_id="x")[0] == 200
        assert router.route(MODEL + "-2", tokens, request_id="y")[0] == 200
        assert router.release(MODEL + "-2", "x")[0] == 200
        assert overlap_of(router.route(MODEL + "-2", tokens, book=False)[1], "w0")["predicted"] == 4
        assert router.release(MODEL + "-2", "y")[0] == 200
        assert overlap_of(router.route(MODEL + "-2", tokens, book=False)[1], "w0")["predicted"] == 0
    finally:
        stop_all(router)


def test_predicted_pages_are_off_by_default(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL + "-3")
    for w in ("w0", "w1"):
        seeder.worker(w, PAGE)
    tokens = request_tokens(6, PAGE, seed=7)
    router = RouterProcess(redis_server.url)
    try:
        status, body, _ = router.route(MODEL + "-3", tokens, request_id="a")
        assert status == 200
        again = router.route(MODEL + "-3", tokens, book=False)[1]
        assert all(c["overlap"]["predicted"] == 0 for c in again["candidates"])
        keys = ModelKeys.for_model(MODEL + "-3")
        assert not any(redis_client.exists(keys.predicted(w)) for w in ("w0", "w1"))
    finally:
        stop_all(router)


def test_predicted_page_weight_is_a_per_request_override(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL + "-4")
    seeder.worker("w0", PAGE)
    seeder.worker("w1", PAGE)
    tokens = request_tokens(8, PAGE, seed=11)
    router = RouterProcess(redis_server.url, "--predicted-pages", "on", *GUIDE_LOAD_SCALE)
    try:
        chosen = router.route(MODEL + "-4", tokens, request_id="a")[1]["worker_id"]
        status, body, _ = router.route(MODEL + "-4", tokens, book=False,
                                       overrides={"predicted_page_weight": 0.5})
        assert status == 200
        logit = next(c["logit"] for c in body["candidates"] if c["worker_id"] == chosen)
        # 8 pages + 8 booked prefill - 0.5 * 8 predicted, + 8 booked decode pages
        assert logit == 8 + 8 - 4 + 8
    finally:
        stop_all(router)


def test_round_robin_mode_takes_turns_across_replicas_and_books(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL + "-rr")
    tokens = request_tokens(4, PAGE, seed=1)
    for w in ("w0", "w1", "w2"):
        seeder.worker(w, PAGE, tokens, device=4 if w == "w2" else 0)  # kv mode would always pick w2
    a = RouterProcess(redis_server.url, "--router-mode", "round-robin")
    b = RouterProcess(redis_server.url, "--router-mode", "round-robin")
    try:
        chosen = [(a if i % 2 else b).route(MODEL + "-rr", tokens, request_id=f"r{i}")[1]["worker_id"]
                  for i in range(9)]
        assert collections.Counter(chosen) == {"w0": 3, "w1": 3, "w2": 3}
        assert chosen[:3] == ["w0", "w1", "w2"] and chosen[3:6] == chosen[:3]  # one turn for both replicas
        keys = ModelKeys.for_model(MODEL + "-rr")
        assert redis_client.zcard(keys.bookings) == 9  # booked like any decision
        assert "router_decisions_total{mode=\"round-robin\"}" in a.metrics()
    finally:
        stop_all(a, b)


def test_random_mode_spreads_and_reports_scores(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL + "-rand")
    tokens = request_tokens(4, PAGE, seed=2)
    for w in ("w0", "w1", "w2", "w3"):
        seeder.worker(w, PAGE, tokens, device=4 if w == "w3" else 0)
    router = RouterProcess(redis_server.url, "--router-mode", "random", "--seed", "4")
    try:
        bodies = [router.route(MODEL + "-rand", tokens, request_id=f"q{i}")[1] for i in range(40)]
        counts = collections.Counter(b["worker_id"] for b in bodies)
        assert set(counts) == {"w0", "w1", "w2", "w3"} and max(counts.values()) < 25
        # the answer still carries the formula's view, so an A/B log shows what kv would have picked
        assert overlap_of(bodies[0], "w3")["device"] == 4
    finally:
        stop_all(router)


def test_a_dead_workers_predictions_go_with_its_pages(redis_client, redis_server):
    """Lease expiry removes the worker's predicted pages with its pages; the booking's later
    release finds nothing to give back and leaves nothing behind."""
    import time

    from kvtier.consumers.apply import TierStateWriter

    seeder = StateSeeder(redis_client, MODEL + "-dead")
    # a lease long enough to outlive a slow router start; expiry is then forced by the clock
    seeder.announce("w0", PAGE, lease_ttl_s=120.0)
    tokens = request_tokens(5, PAGE, seed=13)
    router = RouterProcess(redis_server.url, "--predicted-pages", "on")
    try:
        assert router.route(MODEL + "-dead", tokens, request_id="doomed")[0] == 200
        keys = ModelKeys.for_model(MODEL + "-dead")
        assert redis_client.hlen(keys.predicted("w0")) == 5
        removed = TierStateWriter(redis_client).expire_dead_workers(now=time.time() + 240.0)
        assert [(w, n) for _, w, n in removed] == [("w0", 0)]
        assert not redis_client.exists(keys.predicted("w0"))
        assert router.release(MODEL + "-dead", "doomed")[0] == 200
        assert not redis_client.exists(keys.predicted("w0"))
    finally:
        stop_all(router)
