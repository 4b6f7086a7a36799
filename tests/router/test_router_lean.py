"""The lean decision (router/core.py `_route_lean`): a replica chooses on its copies of the
model's roster and loads (router/roster.py) and books with book_checked.lua, which books only
while the copies are what Redis holds. In process, against a real Redis-protocol server: every
way a copy goes stale (another replica's booking, a worker joining, going stale or losing its
lease, pages stored a moment before, a session moved elsewhere) is seen by the next decision,
and concurrent replicas book exactly (no booking lost, none counted twice)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from kvtier.plumbing.connections import redis_async_client
from kvtier.router.core import DuplicateRequest, Router, RouterSettings
from kvtier.router.metrics import RouterMetrics
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.routing import ReleaseStage, RouteRequest
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.tiers import Tier

from ..router_helpers import StateSeeder, request_tokens

MODEL = "lean-model"
PAGE = 4


def full_reads(router: Router) -> float:
    return sum(s.value for metric in router.metrics.full_reads.collect() for s in metric.samples
               if s.name.endswith("_total"))


def full_read_reasons(router: Router) -> dict[str, float]:
    return {s.labels["reason"]: s.value for metric in router.metrics.full_reads.collect() for s in metric.samples
            if s.name.endswith("_total") and s.value}


async def ready(router: Router, model: str = MODEL) -> None:
    index = router.indexes.model(ModelKeys.for_model(model).model_token)
    deadline = time.monotonic() + 20
    while not index.ready:
        assert time.monotonic() < deadline, "the index was not ready"
        await asyncio.sleep(0.02)


def router_on(url: str, seed: int = 1, **settings) -> Router:
    client = redis_async_client(url, max_connections=64, pool_wait_s=10.0)  # as `kvtier router` builds it
    return Router(client, RouterSettings(**settings), RouterMetrics(), rng=random.Random(seed))


async def route(router: Router, tokens: list[int], **fields):
    return (await router.route(RouteRequest(model=MODEL, token_ids=tokens, explain=True, **fields))).response


def loads_in_redis(client) -> tuple[dict[str, int], dict[str, int]]:
    keys = ModelKeys.for_model(MODEL)
    as_map = lambda raw: {k.decode(): int(v) for k, v in raw.items()}  # noqa: E731
    return as_map(client.hgetall(keys.prefill_load)), as_map(client.hgetall(keys.decode_load))


def test_a_decision_reads_the_copies_and_agrees_with_the_walk(redis_client, redis_server):
    tokens = request_tokens(12, PAGE)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", PAGE, tokens, device=5, host=3, disk=2)
    seeder.worker("b", PAGE, tokens, device=7)
    seeder.worker("c", PAGE)

    async def main():
        lean, walk = router_on(redis_server.url), router_on(redis_server.url, state_source="redis")
        try:
            await ready(lean)
            for i in range(6):  # each booked afterwards, so the loads move between decisions
                got = await route(lean, tokens, book=False)
                want = await route(walk, tokens, book=False)
                assert (got.worker_id, got.logit, got.candidates, got.degraded) == (
                    want.worker_id, want.logit, want.candidates, want.degraded), (got, want)
                booked = await route(lean, tokens, request_id=f"lean-{i}", max_new_tokens=8)
                assert booked.worker_id == got.worker_id
                if i % 2:
                    await walk.release(MODEL, f"lean-{i}", ReleaseStage.COMPLETE)
            assert full_reads(lean) == 0  # every decision came from the copies
            # and without `explain` the same decision names the winner only
            dry = await lean.route(RouteRequest(model=MODEL, token_ids=tokens, book=False))
            explained = await route(lean, tokens, book=False)
            assert dry.response.candidates == [] and dry.response.worker_id == explained.worker_id
        finally:
            await lean.close()
            await walk.close()

    asyncio.run(main())


def test_the_answer_matches_the_walk_after_every_booking(redis_client, redis_server):
    """Loads moved by this replica's own bookings and releases, and by another's: each lean
    answer (dry) equals the walk's, field by field."""
    tokens = request_tokens(10, PAGE)
    seeder = StateSeeder(redis_client, MODEL)
    for w, device in (("a", 4), ("b", 6), ("c", 0), ("d", 2)):
        seeder.worker(w, PAGE, tokens, device=device)
    rng = random.Random(7)

    async def main():
        lean, other, walk = (router_on(redis_server.url), router_on(redis_server.url, seed=2),
                             router_on(redis_server.url, state_source="redis"))
        try:
            await ready(lean)
            await ready(other)
            booked: list[tuple[Router, str]] = []
            for i in range(40):
                writer = lean if rng.random() < 0.5 else other
                if booked and rng.random() < 0.4:
                    by, request_id = booked.pop(rng.randrange(len(booked)))
                    await (lean if rng.random() < 0.5 else other).release(
                        MODEL, request_id, rng.choice([ReleaseStage.FIRST_TOKEN, ReleaseStage.COMPLETE]))
                else:
                    await route(writer, tokens[:rng.randrange(4, 41)], request_id=f"r{i}",
                                max_new_tokens=rng.randrange(0, 64))
                    booked.append((writer, f"r{i}"))
                got, want = await route(lean, tokens, book=False), await route(walk, tokens, book=False)
                assert got.candidates == want.candidates, i
        finally:
            for r in (lean, other, walk):
                await r.close()

    asyncio.run(main())


def test_concurrent_replicas_book_exactly_and_spread_evenly(redis_client, redis_server):
    """Two replicas, 200 decisions at once on four cold workers: every decision sees every
    booking before it, so the spread is exactly even; then every release at once from either
    replica leaves nothing booked in Redis and each replica's copy (where it still has one)
    equal to Redis."""
    seeder = StateSeeder(redis_client, MODEL)
    for w in ("w0", "w1", "w2", "w3"):
        seeder.worker(w, PAGE)
    tokens = request_tokens(8, PAGE)

    async def main():
        replicas = [router_on(redis_server.url, seed=1), router_on(redis_server.url, seed=2)]
        try:
            for r in replicas:
                await ready(r)
            answers = await asyncio.gather(*(route(replicas[i % 2], tokens, request_id=f"burst-{i}")
                                             for i in range(200)))
            spread = Counter(a.worker_id for a in answers)
            assert sorted(spread.values()) == [50, 50, 50, 50], spread
            prefill, decode = loads_in_redis(redis_client)
            assert prefill == dict.fromkeys(spread, 50 * 8) and decode == dict.fromkeys(spread, 50 * 8)
            releases = await asyncio.gather(*(replicas[(i // 3) % 2].release(MODEL, f"burst-{i}", ReleaseStage.COMPLETE)
                                              for i in range(200)))
            assert all(r.released for r in releases)
            assert loads_in_redis(redis_client) == ({}, {})
            assert redis_client.zcard(ModelKeys.for_model(MODEL).bookings) == 0
            for r in replicas:
                copy = r.rosters.models[MODEL].roster
                assert copy is None or copy.load_version is None or (copy.prefill, copy.decode) == ({}, {})
            # Most decisions are lean; a replica that lost the compare-and-set LEAN_ATTEMPTS times
            # in a row to the other one's bookings (a loaded machine makes it likely) chose with
            # the full read instead, which books atomically in Redis: the spread above holds either way.
            reasons = [full_read_reasons(r) for r in replicas]
            assert sum(map(full_reads, replicas)) < 100 and all(set(r) <= {"state_kept_moving"} for r in reasons), \
                reasons
        finally:
            for r in replicas:
                await r.close()

    asyncio.run(main())


def test_a_worker_that_joins_goes_stale_or_loses_its_lease_is_seen_by_the_next_decision(redis_client, redis_server):
    tokens = request_tokens(8, PAGE)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("old", PAGE, tokens, device=2)

    async def main():
        router = router_on(redis_server.url)
        try:
            await ready(router)
            assert (await route(router, tokens, book=False)).worker_id == "old"  # the copy is read
            seeder.worker("new", PAGE, tokens, device=8)  # joins, holding the whole prefix
            got = await route(router, tokens, book=False)
            assert got.worker_id == "new" and got.overlap.device == 8, got
            seeder.mark_stale("new")
            got = await route(router, tokens, book=False)
            assert [c.worker_id for c in got.candidates] == ["old"], got
            # a lease that lapses: the copy's expiry for it passes, and the copy is read again
            seeder.announce("brief", PAGE, lease_ttl_s=0.5)
            seeder.store("brief", Tier.DEVICE, sglang_block_hashes(tokens, PAGE))
            assert (await route(router, tokens, book=False)).worker_id == "brief"
            await asyncio.sleep(0.7)
            got = await route(router, tokens, book=False)
            assert got.worker_id == "old" and "brief" not in [c.worker_id for c in got.candidates], got
        finally:
            await router.close()

    asyncio.run(main())


def test_pages_stored_just_before_a_decision_count(redis_client, redis_server):
    """The feed's few milliseconds: a store that Redis has when the decision starts is in it,
    even when the replica's index has not applied it yet."""
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", PAGE)
    seeder.worker("b", PAGE)

    async def main():
        router = router_on(redis_server.url)
        try:
            await ready(router)
            for n in range(1, 30):
                tokens = request_tokens(6, PAGE, seed=n)
                await route(router, tokens, book=False)  # the copy is current
                worker = "ab"[n % 2]
                seeder.store(worker, Tier.DEVICE, sglang_block_hashes(tokens, PAGE)[:n % 6 + 1])
                got = await route(router, tokens, book=False)
                assert got.worker_id == worker and got.overlap.device == n % 6 + 1, (n, got)
        finally:
            await router.close()

    asyncio.run(main())


def test_a_session_follows_the_worker_another_replica_booked_it_on(redis_client, redis_server):
    tokens = request_tokens(8, PAGE)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("warm", PAGE, tokens, device=8)
    seeder.worker("cold", PAGE)

    async def main():
        a, b = router_on(redis_server.url, seed=1), router_on(redis_server.url, seed=2)
        try:
            await ready(a)
            await ready(b)
            # The session starts on the cold worker (only it is a candidate then) ...
            first = (await a.route(RouteRequest(model=MODEL, token_ids=tokens, session_id="s1"),
                                   exclude=frozenset({"warm"}))).response
            assert first.worker_id == "cold"
            # ... and stays there through the other replica, which never saw it, over the formula
            second = await route(b, tokens, session_id="s1", request_id="s1-2")
            assert (second.worker_id, second.affinity) == ("cold", "overrode"), second
            # a dry run without the session goes by the formula
            assert (await route(b, tokens, book=False)).worker_id == "warm"
            with pytest.raises(DuplicateRequest):
                await route(a, tokens, request_id="s1-2")
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
