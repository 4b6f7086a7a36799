"""The learned worker rates (router/rates.py), as pure functions: the fit finds a worker's true
multipliers, follows a slowdown, shrugs off outliers and stays bounded; the priced formula is
the plain formula on equal workers and weighs a slow worker's work more."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvtier.router import scoring
from kvtier.router.rates import (
    CLIENT_SAMPLES,
    FitSettings,
    Pricing,
    Work,
    fit_arguments,
    observe,
    predict_s,
    priced_logits,
    relative_pricing,
)
from kvtier.schemas.rates import RateFit, RatePrior
from kvtier.schemas.routing import ScoringWeights, TierOverlap

PRIOR = RatePrior()
SETTINGS = FitSettings()


def random_work(rng: random.Random) -> Work:
    return Work(compute_tokens=rng.uniform(0, 8000), host_tokens=rng.choice([0, rng.uniform(0, 30000)]),
                l3_tokens=rng.choice([0, 0, rng.uniform(0, 30000)]))


def truth_s(multipliers, work: Work) -> float:
    return sum(m * x for m, x in zip(multipliers, work.nominal_s(PRIOR)))


def learn(fit: RateFit, multipliers, n: int, rng: random.Random, noise: float = 0.0) -> RateFit:
    for _ in range(n):
        work = random_work(rng)
        fit = observe(fit, PRIOR, work, truth_s(multipliers, work) * (1 + rng.uniform(-noise, noise)), SETTINGS)
    return fit


def close(a, b, rel: float) -> bool:
    return all(abs(x - y) <= rel * y for x, y in zip(a, b))


def test_the_fit_finds_a_workers_true_multipliers():
    rng = random.Random(1)
    fit = learn(SETTINGS.first_fit(), (2.0, 1.5, 3.0), 200, rng, noise=0.02)
    # compute, which most of a first token's time is, exactly; the loads, a tenth of it, closely
    assert abs(fit.multipliers[0] - 2.0) < 0.03 * 2.0, fit.multipliers
    assert close(fit.multipliers[1:], (1.5, 3.0), 0.10), fit.multipliers
    assert fit.samples == 200 and fit.relative_error > 0
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    assert abs(predict_s(fit, PRIOR, work) - 2.0 * 4000 / PRIOR.compute_tokens_per_s) < 0.02


def test_a_slowdown_is_followed_within_tens_of_requests():
    rng = random.Random(2)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0), 300, rng)
    fit = learn(fit, (2.0, 2.0, 2.0), 60, rng)
    assert close(fit.multipliers, (2.0, 2.0, 2.0), 0.10), fit.multipliers


def test_what_is_learned_of_compute_carries_over_to_loads_not_seen_yet():
    rng = random.Random(3)
    fit = SETTINGS.first_fit()
    for _ in range(100):  # only compute work: nothing says how fast this worker loads
        work = Work(compute_tokens=rng.uniform(100, 8000), host_tokens=0, l3_tokens=0)
        fit = observe(fit, PRIOR, work, truth_s((2.0, 2.0, 2.0), work), SETTINGS)
    assert abs(fit.multipliers[0] - 2.0) < 0.05
    assert fit.multipliers[1] > 1.7 and fit.multipliers[2] > 1.7  # the prior: a slow card loads slowly too
    assert RateFit().multipliers == (1.0, 1.0, 1.0)


def test_one_stalled_request_barely_moves_a_warm_fit():
    rng = random.Random(4)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0), 100, rng, noise=0.05)
    work = Work(compute_tokens=2000, host_tokens=0, l3_tokens=0)
    stalled = observe(fit, PRIOR, work, 30.0, SETTINGS)  # 300x what the work takes
    assert abs(stalled.multipliers[0] - fit.multipliers[0]) < 0.05
    uncut = observe(fit, PRIOR, work, 30.0, FitSettings(outlier_errors=1e12))
    assert uncut.multipliers[0] > stalled.multipliers[0] + 0.5  # what cutting it saved


@given(samples=st.lists(st.tuples(st.floats(0, 1e7), st.floats(0, 1e7), st.floats(0, 1e7),
                                  st.floats(-10, 1e6, allow_nan=False)), max_size=40))
def test_the_fit_stays_bounded_whatever_it_is_told(samples):
    fit = SETTINGS.first_fit()
    low, high = SETTINGS.bounds
    for compute, host, l3, ttft in samples:
        fit = observe(fit, PRIOR, Work(compute, host, l3), ttft, SETTINGS)
        assert all(low <= m <= high for m in fit.multipliers)
        trace = fit.covariance[0] + fit.covariance[4] + fit.covariance[8]
        assert trace <= SETTINGS.max_uncertainty * (1 + 1e-9)


def test_a_sample_that_says_nothing_leaves_the_fit():
    fit = SETTINGS.first_fit()
    assert observe(fit, PRIOR, Work(0, 0, 0), 0.5, SETTINGS) is fit
    assert observe(fit, PRIOR, Work(100, 0, 0), 0.0, SETTINGS) is fit
    assert observe(fit, PRIOR, Work(100, 0, 0), float("nan"), SETTINGS) is fit


overlaps = st.builds(TierOverlap, device=st.integers(0, 64), host=st.integers(0, 64), disk=st.integers(0, 64),
                     shared_beyond=st.integers(0, 64), predicted=st.integers(0, 8))
candidate_lists = st.lists(st.tuples(overlaps, st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=8)
multipliers = st.tuples(st.floats(0.05, 50), st.floats(0.05, 50), st.floats(0.05, 50))


#: Weights as `kvtier tune` searches them: host and pool credit may exceed one page.
tuned_weights = st.builds(ScoringWeights, host_cache_hit_weight=st.floats(0, 1.5),
                          shared_cache_multiplier=st.floats(0, 1.5), prefill_load_scale=st.floats(0.25, 64))


@given(candidates=candidate_lists, pages=st.integers(1, 128), shared=multipliers, weights=tuned_weights)
def test_on_equal_workers_the_priced_formula_is_the_formula(candidates, pages, shared, weights):
    inputs = [scoring.CandidateInputs(f"w{i}", o, p, d) for i, (o, p, d) in enumerate(candidates)]
    fits = [RateFit(multipliers=shared) for _ in inputs]  # all alike, whatever the prior got wrong
    pricing = relative_pricing(fits)
    assert priced_logits(pages, inputs, weights, pricing) == scoring.logits(pages, inputs, weights)
    assert relative_pricing([None] * len(inputs)) == [Pricing()] * len(inputs)


def test_a_slow_worker_weighs_its_work_and_its_slow_loads_more():
    same = scoring.CandidateInputs("w", TierOverlap(device=10, host=40), prefill_load=20, decode_load=30)
    fast, slow, slow_links = RateFit(), RateFit(multipliers=(2.0, 2.0, 2.0)), RateFit(multipliers=(1.0, 4.0, 1.0))
    pricing = relative_pricing([fast, fast, slow, slow_links])
    assert pricing[2].compute == 2.0 and pricing[2].host_load == 1.0  # slow at everything alike
    assert pricing[3].compute == 1.0 and pricing[3].host_load == 4.0  # computes well, loads slowly
    values = priced_logits(64, [same] * 4, ScoringWeights(), pricing)
    assert values[0] == values[1] == scoring.logits(64, [same], ScoringWeights())[0]
    assert values[2] > values[0] and values[3] > values[0]
    # the host credit of a worker whose loads are 4x slower: 1 - 0.25 * 4 = 0, none at all
    no_host = scoring.CandidateInputs("w", TierOverlap(device=10), prefill_load=20, decode_load=30)
    assert values[3] == scoring.logits(64, [no_host], ScoringWeights())[0]


# --- learn_rates.lua against observe() ---------------------------------------------------------
#: learn_rates.lua's function called alone (release.lua calls it at a first token's release).
LEARN_ONE = """
return learn_rate(KEYS[1], ARGV[1], {tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}, tonumber(ARGV[5]),
                  {unpack(ARGV, 6, 18)}, tonumber(ARGV[19]))
"""


def lua_arguments(worker: str, work: Work, ttft_s: float, max_step: float = 0.0) -> list:
    return [worker, repr(work.compute_tokens), repr(work.host_tokens), repr(work.l3_tokens), repr(ttft_s),
            *fit_arguments(PRIOR, SETTINGS), repr(max_step)]


def test_the_fit_in_redis_is_the_pure_fit(redis_server):
    """A random history per worker (slowdowns, stalls, empty samples, samples bounded as a
    client's are) through the Redis twin and through observe(): the same fit after every
    sample, to the last bit."""
    import redis as sync_redis

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.schemas.rates import decode_fit, encode_fit
    from kvtier.schemas.state_keys import ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    learn = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + LEARN_ONE)
    key = ModelKeys.for_model("m").rates
    rng = random.Random(7)
    fits = {w: SETTINGS.first_fit() for w in ("w0", "w1", "w2")}
    truth = dict.fromkeys(fits, 1.0)
    for step in range(600):
        worker = rng.choice(sorted(fits))
        if rng.random() < 0.01:
            truth[worker] *= rng.choice([0.5, 2.0])
        work = random_work(rng) if rng.random() > 0.03 else Work(0, 0, 0)
        ttft = truth_s((truth[worker],) * 3, work) * rng.uniform(0.9, 1.1)
        ttft = rng.choice([ttft, ttft, ttft, 50.0, 0.0, -1.0]) if rng.random() < 0.05 else ttft
        max_step = rng.choice([0.0, CLIENT_SAMPLES.max_step, 0.2])  # the router's own, or a client's
        fits[worker] = observe(fits[worker], PRIOR, work, ttft, SETTINGS, max_step)
        answer = learn(keys=[key], args=lua_arguments(worker, work, ttft, max_step))
        assert decode_fit(answer) == fits[worker], f"step {step}"
        assert answer == encode_fit(fits[worker])
    assert {k.decode(): decode_fit(v) for k, v in client.hgetall(key).items()} == fits
    assert all(f.samples > 100 for f in fits.values())


def test_errors_beyond_the_bound_in_a_row_are_a_change_not_outliers():
    rng = random.Random(5)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0), 200, rng, noise=0.01)  # a tight fit: a small bound
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    slow = truth_s((3.0, 3.0, 3.0), work)
    after = [fit]
    for _ in range(SETTINGS.change_after):
        after.append(observe(after[-1], PRIOR, work, slow, SETTINGS))
    assert [f.streak for f in after[1:]] == list(range(1, SETTINGS.change_after + 1))
    cut = after[-2].multipliers[0] - fit.multipliers[0]
    taken = after[-1].multipliers[0] - after[-2].multipliers[0]
    assert taken > 5 * cut  # the run's last error counts in full
    within = observe(after[-1], PRIOR, work, truth_s(after[-1].multipliers, work), SETTINGS)
    assert within.streak == 0


# --- the roster copy's rates ---------------------------------------------------------------------
def test_a_roster_copy_reads_rates_with_its_loads_and_follows_its_own_releases():
    from kvtier.router.roster import Roster, fits_of
    from kvtier.schemas.rates import encode_fit

    fit = RateFit(multipliers=(2.0, 1.5, 1.0), samples=3)
    # an unreadable field is left out: that worker is priced as the typical one
    assert fits_of([b"w0", encode_fit(fit), b"w1", b"not a fit"]) == {"w0": fit}
    roster = Roster(read_at=0.0, live={"w0": (64, 1 << 40)}, lease_count=1, stale=frozenset(), marker_id="m",
                    ready=True, rebuilding=False, change=0, next_expiry_ms=1 << 40, load_version=None)
    roster.set_loads(7, [b"w0", b"3"], [], [b"w0", encode_fit(fit)])
    assert roster.rates == {"w0": fit} and roster.load_version == 7
    taught = RateFit(multipliers=(2.5, 1.5, 1.0), samples=4)
    roster.add("w0", -3, 0, 8, taught)  # this replica's release, the version right after the copy's
    assert roster.rates["w0"] == taught and roster.prefill == {}
    roster.add("w0", 0, 0, 10, RateFit())  # another replica wrote in between: nothing is trusted
    assert roster.load_version is None and roster.rates["w0"] == taught
    roster.set_loads(10, [], [])  # loads without rates (a replica that does not price) keep them
    assert roster.rates["w0"] == taught


def test_a_roster_copy_prices_at_the_rates_it_holds_now():
    """The priced weights a copy keeps between decisions follow every change of its rates."""
    from kvtier.router.rates import pricing_by_worker, weights_by_worker
    from kvtier.router.roster import Roster
    from kvtier.schemas.rates import encode_fit

    weights = ScoringWeights()
    live = {w: (64, 1 << 40) for w in ("w0", "w1", "w2")}
    roster = Roster(read_at=0.0, live=live, lease_count=3, stale=frozenset(), marker_id="m", ready=True,
                    rebuilding=False, change=0, next_expiry_ms=1 << 40, load_version=None)

    def expected():
        return weights_by_worker(weights, pricing_by_worker(roster.rates, roster.candidates))

    fast, slow = RateFit(multipliers=(1.0, 1.0, 1.0), samples=9), RateFit(multipliers=(2.0, 2.0, 2.0), samples=9)
    roster.set_loads(1, [], [], [b"w0", encode_fit(fast), b"w1", encode_fit(fast), b"w2", encode_fit(fast)])
    assert roster.priced_weights(weights) == expected() and all(w == weights for w in expected().values())
    roster.add("w2", 0, 0, 2, slow)  # this replica's release taught w2: it is slow now
    assert roster.priced_weights(weights) == expected()
    assert roster.priced_weights(weights)["w2"].prefill_load_scale > weights.prefill_load_scale
    roster.set_loads(5, [], [], [b"w0", encode_fit(fast), b"w1", encode_fit(fast), b"w2", encode_fit(fast)])
    assert roster.priced_weights(weights) == expected() and roster.priced_weights(weights)["w2"] == weights


def test_a_fit_not_in_the_layout_starts_again_instead_of_failing_the_release(redis_server):
    """An old text form or a stray value under a worker's field: the next first token starts
    that worker's fit from the prior (a failing release would leave its load booked)."""
    import redis as sync_redis

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.schemas.rates import decode_fit
    from kvtier.schemas.state_keys import ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    learn = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + LEARN_ONE)
    key = ModelKeys.for_model("m-layout").rates
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    for stray in (b"1 1 1 1 0 0 0 1 0 0 0 1 0 5 0", b"x" * 119, b""):
        client.hset(key, "w", stray)
        fit = decode_fit(learn(keys=[key], args=lua_arguments("w", work, 0.3)))
        assert fit == observe(SETTINGS.first_fit(), PRIOR, work, 0.3, SETTINGS)
