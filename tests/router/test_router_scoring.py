"""The scoring formula (router/scoring.py) as a pure function, its in-Redis twin
(select_and_book.lua) against it, and request hashing / Mooncake key layouts."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.router import rates, scoring
from kvtier.router.booking import LoadBook
from kvtier.router.hashing import RequestPages
from kvtier.router.shared_pool import SharedPages
from kvtier.schemas.hashes import PageDigest, page_key
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.rates import RateFit
from kvtier.schemas.routing import RouteOverrides, ScoringWeights, TierOverlap
from kvtier.schemas.worker import AttentionKind, MooncakeLayout

DEFAULTS = ScoringWeights()
#: The HiCache guide's weights (its worked example's): kvtier's defaults but prefill_load_scale 1.
GUIDE = ScoringWeights(prefill_load_scale=1.0)


def test_worked_example_from_the_hicache_guide():
    # 4 pages, page size 1, the shared pool holds pages 0-3, multiplier 0.5, credit 1.0, no load.
    shared = SharedPages.of([True, True, True, True])
    w0 = scoring.CandidateInputs("W0", TierOverlap(device=2, shared_beyond=shared.beyond(2)))
    w1 = scoring.CandidateInputs("W1", TierOverlap(device=0, shared_beyond=shared.beyond(0)))
    result = scoring.score(4, [w0, w1], GUIDE, u=0.99)
    assert result.logits == [1.0, 2.0]
    assert result.chosen == 0


def test_each_term_of_the_formula():
    weights = ScoringWeights(overlap_score_credit=1.0, host_cache_hit_weight=0.75, disk_cache_hit_weight=0.25,
                             shared_cache_multiplier=0.5, prefill_load_scale=2.0)
    c = scoring.CandidateInputs("w", TierOverlap(device=1, host=2, disk=4, shared_beyond=2),
                                prefill_load=3, decode_load=5)
    # adjusted = max(10 + 3 - 1 - 1.5 - 1 - 1, 0) = 8.5; logit = 2 * 8.5 + 5
    assert scoring.logits(10, [c], weights) == [22.0]
    # the credit never takes the prefill term below zero
    big = scoring.CandidateInputs("w", TierOverlap(device=50), prefill_load=0, decode_load=7)
    assert scoring.logits(10, [big], weights) == [7.0]


def test_ties_are_broken_by_the_draw_and_temperature_samples():
    equal = [scoring.CandidateInputs(f"w{i}", TierOverlap()) for i in range(4)]
    picks = {scoring.score(8, equal, DEFAULTS, u).chosen for u in (0.0, 0.3, 0.6, 0.99)}
    assert picks == {0, 1, 2, 3}
    hot = ScoringWeights(temperature=1.0)
    uneven = [scoring.CandidateInputs("a", TierOverlap(device=8)), scoring.CandidateInputs("b", TierOverlap())]
    draws = [scoring.score(8, uneven, hot, i / 1000).chosen for i in range(1000)]
    # softmax over normalised logits [0, 1] at T=1: P(a) = 1 / (1 + e^-1) ~ 0.731
    assert 700 <= draws.count(0) <= 760
    cold = [scoring.score(8, uneven, DEFAULTS, i / 100).chosen for i in range(100)]
    assert set(cold) == {0}


def test_overrides_replace_only_what_they_name():
    merged = RouteOverrides(shared_cache_multiplier=0.0, temperature=0.5).applied_to(DEFAULTS)
    assert merged.shared_cache_multiplier == 0.0 and merged.temperature == 0.5
    assert merged.host_cache_hit_weight == DEFAULTS.host_cache_hit_weight
    assert RouteOverrides().applied_to(DEFAULTS) is DEFAULTS


overlaps = st.builds(TierOverlap, device=st.integers(0, 64), host=st.integers(0, 64), disk=st.integers(0, 64),
                     shared_beyond=st.integers(0, 64))
weight_sets = st.builds(ScoringWeights, overlap_score_credit=st.floats(0, 2), host_cache_hit_weight=st.floats(0, 1),
                        disk_cache_hit_weight=st.floats(0, 1), shared_cache_multiplier=st.floats(0, 1),
                        prefill_load_scale=st.floats(0.1, 4))


@given(overlap=overlaps, extra=st.integers(1, 32), pages=st.integers(1, 128), weights=weight_sets,
       prefill=st.integers(0, 500), decode=st.integers(0, 500))
def test_more_device_overlap_never_hurts(overlap, extra, pages, weights, prefill, decode):
    before = scoring.CandidateInputs("w", overlap, prefill, decode)
    more = TierOverlap(device=overlap.device + extra, host=overlap.host, disk=overlap.disk,
                       shared_beyond=overlap.shared_beyond)
    after = scoring.CandidateInputs("w", more, prefill, decode)
    assert scoring.logits(pages, [after], weights)[0] <= scoring.logits(pages, [before], weights)[0]


@given(candidates=st.lists(st.tuples(overlaps, st.integers(0, 100), st.integers(0, 100)), min_size=1, max_size=8),
       pages=st.integers(1, 128), u=st.floats(0, 1, exclude_max=True))
def test_multiplier_zero_equals_no_shared_cache(candidates, pages, u):
    weights = ScoringWeights(shared_cache_multiplier=0.0)
    with_pool = [scoring.CandidateInputs(f"w{i}", o, p, d) for i, (o, p, d) in enumerate(candidates)]
    without = [scoring.CandidateInputs(f"w{i}", TierOverlap(device=o.device, host=o.host, disk=o.disk), p, d)
               for i, (o, p, d) in enumerate(candidates)]
    assert scoring.score(pages, with_pool, weights, u) == scoring.score(pages, without, weights, u)


def test_request_pages_use_sglangs_hash_chain():
    pages = RequestPages.of(list(range(100, 116)) + [7, 7], 4)  # the trailing partial page is not hashed
    assert list(pages.hashes) == [-7118152853857507680, -5037572900866013165, -8052603281837994718,
                                  5043830065565855565]
    assert list(pages.keys) == [page_key(h) for h in pages.hashes]


def test_mooncake_object_keys_follow_sglangs_layouts():
    digest = PageDigest(bytes(range(32)))
    hx = digest.hex()
    assert mooncake_object_keys(digest, MooncakeLayout()) == [f"{hx}_0_k", f"{hx}_0_v"]
    assert mooncake_object_keys(digest, MooncakeLayout(tp_size=2)) == [f"{hx}_0_k", f"{hx}_0_v",
                                                                        f"{hx}_1_k", f"{hx}_1_v"]
    assert mooncake_object_keys(digest, MooncakeLayout(tp_size=2, pp_size=2)) == [
        f"{hx}_0_0_k", f"{hx}_0_0_v", f"{hx}_0_1_k", f"{hx}_0_1_v",
        f"{hx}_1_0_k", f"{hx}_1_0_v", f"{hx}_1_1_k", f"{hx}_1_1_v"]
    assert mooncake_object_keys(digest, MooncakeLayout(attention=AttentionKind.MLA, tp_size=8)) == [f"{hx}__k"]
    assert mooncake_object_keys(digest, MooncakeLayout(attention=AttentionKind.MLA, pp_size=2)) == [
        f"{hx}_0_k", f"{hx}_1_k"]
    assert mooncake_object_keys(digest, MooncakeLayout(key_prefix="tenant1")) == [f"tenant1_{hx}_0_k",
                                                                                  f"tenant1_{hx}_0_v"]


def test_hits_beyond_counts_pool_pages_at_or_after_a_position():
    shared = SharedPages.of([True, False, True, True, False])
    assert [shared.beyond(n) for n in range(7)] == [3, 2, 2, 1, 0, 0, 0]
    assert shared.hits == 3


# --- select_and_book.lua against router/scoring.py ------------------------------------------
@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_selection_in_redis_matches_the_pure_function(redis_server, data):
    candidates = data.draw(st.lists(st.tuples(overlaps, st.integers(0, 300), st.integers(0, 300)),
                                    min_size=1, max_size=6))
    weights = data.draw(weight_sets)
    temperature = data.draw(st.sampled_from([0.0, 0.0, 0.3, 1.0, 5.0]))
    weights = ScoringWeights(**{**{f: getattr(weights, f) for f in weights.__struct_fields__},
                                "temperature": temperature})
    pages = data.draw(st.integers(1, 128))
    u = data.draw(st.floats(0, 1, exclude_max=True))

    async def select():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.flushall()
            for i, (_, prefill, decode) in enumerate(candidates):
                if prefill:
                    await client.hset("kvt:{m}:load:prefill", f"w{i}", prefill)
                if decode:
                    await client.hset("kvt:{m}:load:decode", f"w{i}", decode)
            inputs = [scoring.CandidateInputs(f"w{i}", o, p, d) for i, (o, p, d) in enumerate(candidates)]
            book = LoadBook(client)
            selection = await book.select_and_book(
                "m", "r", pages, pages, [(c.worker_id, scoring.cache_credit(c.overlap, weights), c.overlap.device)
                                         for c in inputs], weights.prefill_load_scale, weights.temperature, u,
                book=False)
            return inputs, selection
        finally:
            await client.aclose()

    inputs, selection = asyncio.run(select())
    assert selection.prefill_loads == [p for _, p, _ in candidates]
    expected = scoring.score(pages, inputs, weights, u)
    assert selection.chosen == expected.chosen, (expected.logits, u)


def test_the_faster_pick_in_redis_is_the_pure_one(redis_server):
    """--router-mode predicted-ttft's full read: select_and_book.lua, given the candidates'
    predicted first-token columns, chooses as router/rates.py's formula-then-override does at
    the loads it reads, overrides in some of the cases (so the twin's override is exercised),
    and keeps the chosen one's predicted work (its booked prefill ahead added) for its first
    token to teach."""
    rng = random.Random(11)

    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        overrides = 0
        try:
            for case in range(250):
                n = rng.randint(1, 6)
                ids = [f"w{i}" for i in range(n)]
                inputs = [scoring.CandidateInputs(w, TierOverlap(device=rng.choice([0, rng.randint(0, 40)]),
                                                                 host=rng.choice([0, rng.randint(0, 40)]),
                                                                 shared_beyond=rng.choice([0, rng.randint(0, 40)])),
                                                  rng.randint(0, 300), rng.randint(0, 300)) for w in ids]
                # half the cases: workers 1.5 or 2 times as fast as others, with fits 5-15% off, where
                # the fits' errors (within max_error) decide whether one is clearly faster at compute;
                # a queued page costs as much as a computed one, or 0.5-1.0 of it, so the two prices
                # of the queue (faster_than_formula) agree in some cases and not in others
                speeds = [rng.choice([1.0, 1.5, 2.0]) for _ in ids] if rng.random() < 0.5 else None
                computes = [speeds[i] if speeds else rng.uniform(0.3, 4) for i in range(n)]
                fits = [None if rng.random() < 0.03 else
                        RateFit(multipliers=(computes[i], rng.uniform(0.3, 4), rng.uniform(0.3, 4),
                                             computes[i] * rng.choice([1.0, rng.uniform(0.5, 1.0)])),
                                samples=rng.choice([rates.FASTER_PICK.min_samples, 200]),
                                relative_error=rng.choice([0.0, rng.uniform(0.05, 0.15), rng.uniform(0.05, 0.15)]))
                        for i in range(n)]
                weights = ScoringWeights(prefill_load_scale=rng.uniform(0.1, 4),
                                         temperature=rng.choice([0.0, 0.0, 0.3]))
                pages, u = rng.randint(1, 128), rng.random()
                n_tokens, decode_pages = pages * 16 - 3, rng.randint(1, 200)
                credits = [scoring.cache_credit(c.overlap, weights) for c in inputs]
                columns = rates.ttft_columns(n_tokens, [c.overlap for c in inputs], [16] * n, fits, rates.RATE_PRIOR)
                await client.flushall()
                for c in inputs:
                    if c.prefill_load:
                        await client.hset("kvt:{m}:load:prefill", c.worker_id, c.prefill_load)
                    if c.decode_load:
                        await client.hset("kvt:{m}:load:decode", c.worker_id, c.decode_load)
                works = [(rates.predicted_work(n_tokens, c.overlap, 0, 16), 16) for c in inputs]
                selection = await LoadBook(client).select_and_book(
                    "m", f"r{case}", pages, decode_pages,
                    [(c.worker_id, credit, c.overlap.device) for c, credit in zip(inputs, credits)],
                    weights.prefill_load_scale, weights.temperature, u, faster=columns, works=works)
                formula = scoring.score(pages, inputs, weights, u).chosen
                expected = rates.faster_than_formula(formula, range(n), columns, [c.prefill_load for c in inputs],
                                                     [c.decode_load for c in inputs])
                assert selection.chosen == expected, (case, formula, columns)
                overrides += expected != formula
                chosen = inputs[selection.chosen]
                kept = rates.predicted_work(n_tokens, chosen.overlap, chosen.prefill_load, 16)
                work = await client.hget(f"kvt:{{m}}:bk:r{case}", "work")
                assert [float(x) for x in work.split()] == [kept.compute_tokens, kept.host_tokens, kept.l3_tokens,
                                                            kept.queued_tokens]
        finally:
            await client.aclose()
        return overrides

    overrides = asyncio.run(scenario())
    assert 10 <= overrides <= 240, overrides


def test_in_redis_a_worker_faster_only_within_the_fits_errors_is_not_taken(redis_server):
    """1.5 times as fast, five prefill pages queued ahead, the same decode load: with exact fits
    select_and_book.lua moves the request to it; with fits 10% off each way it is not clearly
    faster (1.0 x 1.1 is not under 0.8 x 1.5 x 0.9), and the formula's worker keeps it."""
    async def chosen_with(error: float) -> int:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            await client.flushall()
            await client.hset("kvt:{m}:load:prefill", "w1", 5)
            await client.hset("kvt:{m}:load:decode", mapping={"w0": 10, "w1": 10})
            fits = [RateFit(multipliers=(m, m, m, m), samples=50, relative_error=error) for m in (1.5, 1.0)]
            columns = rates.ttft_columns(64 * 16, [TierOverlap()] * 2, [16, 16], fits, rates.RATE_PRIOR)
            selection = await LoadBook(client).select_and_book(
                "m", f"r{error}", 64, 70, [("w0", 0.0, 0), ("w1", 0.0, 0)], 16.0, 0.0, 0.5, faster=columns)
            inputs = [scoring.CandidateInputs(w, TierOverlap(), p, 10) for w, p in (("w0", 0), ("w1", 5))]
            assert scoring.score(64, inputs, ScoringWeights(), 0.5).chosen == 0  # the formula's: w0
            assert selection.chosen == rates.formula_then_faster(64, inputs, ScoringWeights(), 0.5, columns).chosen
            return selection.chosen
        finally:
            await client.aclose()

    assert asyncio.run(chosen_with(0.0)) == 1
    assert asyncio.run(chosen_with(0.1)) == 0


def test_booking_is_atomic_with_selection_and_released_by_stage(redis_server):
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            book = LoadBook(client, booking_ttl_s=600)
            cands = [("a", 0.0, 0), ("b", 0.0, 0)]
            first = await book.select_and_book("m", "r1", 10, 12, cands, 1.0, 0.0, 0.0)
            second = await book.select_and_book("m", "r2", 10, 12, cands, 1.0, 0.0, 0.0)
            assert {first.chosen, second.chosen} == {0, 1}  # the second saw the first's booking
            assert second.prefill_loads[first.chosen] == 10 and second.decode_loads[first.chosen] == 12
            with pytest.raises(Exception, match="already holds a booking"):
                await book.select_and_book("m", "r1", 10, 12, cands, 1.0, 0.0, 0.0)
            from kvtier.schemas.routing import ReleaseStage

            r = await book.release("m", "r1", ReleaseStage.FIRST_TOKEN)
            assert (r.found, r.prefill_pages, r.decode_pages) == (True, 10, 0)
            r = await book.release("m", "r1", ReleaseStage.COMPLETE)
            assert (r.found, r.prefill_pages, r.decode_pages) == (True, 0, 12)
            assert not (await book.release("m", "r1", ReleaseStage.COMPLETE)).found
            loads = await client.hgetall("kvt:{m}:load:prefill"), await client.hgetall("kvt:{m}:load:decode")
            winner = "ab"[second.chosen].encode()
            assert loads == ({winner: b"10"}, {winner: b"12"})
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_bookings_of_a_dead_router_expire(redis_server):
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            short = LoadBook(client, booking_ttl_s=0.2)
            await short.select_and_book("m", "lost", 10, 10, [("a", 0.0, 0)], 1.0, 0.0, 0.0)
            assert await client.hget("kvt:{m}:load:prefill", "a") == b"10"
            await asyncio.sleep(0.35)
            await LoadBook(client).sweep("m")
            assert await client.hgetall("kvt:{m}:load:prefill") == {}
            assert await client.hgetall("kvt:{m}:load:decode") == {}
            assert await client.zcard("kvt:{m}:bookings") == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())


#: What a router script may build from the key base (its header says why): keys that only the
#: script learns, the hashes of bookings the bookings zset names, the pages sets and
#: predicted pages of workers another key names, and a client's sample count for the worker
#: a booking names (release.lua).
BUILT_FROM_THE_BASE = {":bk:", ":w:", ":rs:"}


def test_router_scripts_are_given_every_key_their_caller_knows():
    from importlib import resources

    built: dict[str, set[str]] = {}
    for item in resources.files("kvtier.router").iterdir():
        if item.name.endswith(".lua"):
            for suffix in re.findall(r"base \.\. '([^']*)'", item.read_text()):
                built.setdefault(suffix, set()).add(item.name)
    assert built and set(built) <= BUILT_FROM_THE_BASE, built


def test_draws_are_reproducible():
    rng = random.Random(7)
    equal = [scoring.CandidateInputs(f"w{i}", TierOverlap()) for i in range(3)]
    u = rng.random()
    assert scoring.score(4, equal, DEFAULTS, u) == scoring.score(4, equal, DEFAULTS, u)
