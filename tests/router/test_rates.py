"""The learned worker rates (router/rates.py), as pure functions: the fit finds a worker's true
multipliers, follows a slowdown, shrugs off outliers and stays bounded; the override of the
formula's choice takes only a clearly faster worker that does no more work, and never while a
fit is unsure."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.router.rates import (
    CLIENT_SAMPLES,
    FASTER_PICK,
    FitSettings,
    Work,
    faster_than_formula,
    fit_arguments,
    observe,
    predict_s,
    ttft_columns,
)
from kvtier.schemas.rates import RateFit, RatePrior
from kvtier.schemas.routing import TierOverlap

PRIOR = RatePrior()
SETTINGS = FitSettings()


def random_work(rng: random.Random) -> Work:
    return Work(compute_tokens=rng.uniform(0, 8000), host_tokens=rng.choice([0, rng.uniform(0, 30000)]),
                l3_tokens=rng.choice([0, 0, rng.uniform(0, 30000)]),
                queued_tokens=rng.choice([0, rng.uniform(0, 20000)]))


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
    fit = learn(SETTINGS.first_fit(), (2.0, 1.5, 3.0, 0.6), 200, rng, noise=0.02)
    # compute and the queue, which most of a first token's time is, exactly; the loads, a tenth
    # of it, closely
    assert abs(fit.multipliers[0] - 2.0) < 0.03 * 2.0, fit.multipliers
    assert abs(fit.multipliers[3] - 0.6) < 0.03 * 0.6, fit.multipliers
    assert close(fit.multipliers[1:3], (1.5, 3.0), 0.10), fit.multipliers
    assert fit.samples == 200 and fit.relative_error > 0
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    assert abs(predict_s(fit, PRIOR, work) - 2.0 * 4000 / PRIOR.compute_tokens_per_s) < 0.02


def test_a_slowdown_is_followed_within_tens_of_requests():
    rng = random.Random(2)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0, 1.0), 300, rng)
    fit = learn(fit, (2.0, 2.0, 2.0, 2.0), 60, rng)
    # compute and the queue, most of a first token's time, closely; the loads, a tenth of it
    # shared among four kinds, less closely; the time itself closely
    assert close([fit.multipliers[i] for i in (0, 3)], (2.0, 2.0), 0.05), fit.multipliers
    assert close(fit.multipliers[1:3], (2.0, 2.0), 0.15), fit.multipliers
    work = random_work(rng)
    assert predict_s(fit, PRIOR, work) == pytest.approx(truth_s((2.0,) * 4, work), rel=0.05)


def test_what_is_learned_of_compute_carries_over_to_loads_not_seen_yet():
    rng = random.Random(3)
    fit = SETTINGS.first_fit()
    for _ in range(100):  # only compute work: nothing says how fast this worker loads
        work = Work(compute_tokens=rng.uniform(100, 8000), host_tokens=0, l3_tokens=0)
        fit = observe(fit, PRIOR, work, truth_s((2.0, 2.0, 2.0, 2.0), work), SETTINGS)
    assert abs(fit.multipliers[0] - 2.0) < 0.05
    assert all(m > 1.7 for m in fit.multipliers[1:]), fit.multipliers  # the prior: a slow card loads slowly too
    assert RateFit().multipliers == (1.0, 1.0, 1.0, 1.0)


def test_one_stalled_request_barely_moves_a_warm_fit():
    rng = random.Random(4)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0, 1.0), 100, rng, noise=0.05)
    work = Work(compute_tokens=2000, host_tokens=0, l3_tokens=0)
    stalled = observe(fit, PRIOR, work, 30.0, SETTINGS)  # 300x what the work takes
    assert abs(stalled.multipliers[0] - fit.multipliers[0]) < 0.05
    uncut = observe(fit, PRIOR, work, 30.0, FitSettings(outlier_errors=1e12))
    assert uncut.multipliers[0] > stalled.multipliers[0] + 0.5  # what cutting it saved


@given(samples=st.lists(st.tuples(st.floats(0, 1e7), st.floats(0, 1e7), st.floats(0, 1e7), st.floats(0, 1e7),
                                  st.floats(-10, 1e6, allow_nan=False)), max_size=40))
def test_the_fit_stays_bounded_whatever_it_is_told(samples):
    fit = SETTINGS.first_fit()
    low, high = SETTINGS.bounds
    for compute, host, l3, queued, ttft in samples:
        fit = observe(fit, PRIOR, Work(compute, host, l3, queued), ttft, SETTINGS)
        assert all(low <= m <= high for m in fit.multipliers)
        trace = sum(fit.covariance[::len(fit.multipliers) + 1])
        assert trace <= SETTINGS.max_uncertainty * (1 + 1e-9)


def test_a_sample_that_says_nothing_leaves_the_fit():
    fit = SETTINGS.first_fit()
    assert observe(fit, PRIOR, Work(0, 0, 0), 0.5, SETTINGS) is fit
    assert observe(fit, PRIOR, Work(100, 0, 0), 0.0, SETTINGS) is fit
    assert observe(fit, PRIOR, Work(100, 0, 0), float("nan"), SETTINGS) is fit


overlaps = st.builds(TierOverlap, device=st.integers(0, 64), host=st.integers(0, 64), disk=st.integers(0, 64),
                     shared_beyond=st.integers(0, 64), predicted=st.integers(0, 8))
candidate_lists = st.lists(st.tuples(overlaps, st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=8)
multipliers = st.tuples(st.floats(0.05, 50), st.floats(0.05, 50), st.floats(0.05, 50), st.floats(0.05, 50))


PAGE = 16
#: Fits the override trusts (FasterPick.min_samples first tokens, no change under way).
trusted_fits = st.builds(lambda m, e: RateFit(multipliers=m, samples=FASTER_PICK.min_samples, relative_error=e),
                         multipliers, st.floats(0, FASTER_PICK.max_error))


def columns_of(candidates, fits, n_tokens: int):
    return ttft_columns(n_tokens, [o for o, _, _ in candidates], [PAGE] * len(candidates), fits, PRIOR)


@given(candidates=candidate_lists, data=st.data())
def test_the_override_only_takes_a_clearly_faster_worker_that_does_no_more_work(candidates, data):
    """Whatever the fits and loads: the override is the formula's choice, or a candidate
    faster at compute by more than faster_by beyond both fits' mean errors, predicted sooner
    by more than the margin (with the queues at their queued rates, and at their compute rates
    too), whose own work and decode load are no more than the formula's worker's: the
    soonest such one."""
    fits = data.draw(st.lists(trusted_fits, min_size=len(candidates), max_size=len(candidates)))
    formula = data.draw(st.integers(0, len(candidates) - 1))
    columns = columns_of(candidates, fits, data.draw(st.integers(1, 128 * PAGE)))
    prefill, decode = [p for _, p, _ in candidates], [d for _, _, d in candidates]
    pool = range(len(candidates))
    chosen = faster_than_formula(formula, pool, columns, prefill, decode)

    def ttft(i):
        return columns.service_s[i] + prefill[i] * columns.queue_s_per_page[i]

    def ttft_at_compute(i):
        return columns.service_s[i] + prefill[i] * columns.queue_at_compute_s_per_page[i]

    assert columns.queue_at_compute_s_per_page == [
        pytest.approx(PAGE * f.multipliers[0] / PRIOR.compute_tokens_per_s) for f in fits]

    # faster beyond both fits' errors
    faster = (1 - FASTER_PICK.faster_by) * fits[formula].multipliers[0] * (1 - fits[formula].relative_error)
    eligible = [i for i in pool if fits[i].multipliers[0] * (1 + fits[i].relative_error) < faster
                and columns.service_s[i] <= columns.service_s[formula] and decode[i] <= decode[formula]] or [formula]
    soonest = min(eligible, key=ttft)
    if (ttft(soonest) < (1 - FASTER_PICK.margin) * ttft(formula)
            and ttft_at_compute(soonest) < (1 - FASTER_PICK.margin) * ttft_at_compute(formula)):
        assert chosen == soonest
    else:
        assert chosen == formula


@given(candidates=candidate_lists, data=st.data())
def test_while_any_fit_is_unsure_the_formulas_choice_stands(candidates, data):
    """A candidate with too few first tokens behind its fit, one whose fit is in a change (its
    streak), one whose fit predicts too poorly (max_error), or one with none: no override,
    however fast the others look."""
    n = len(candidates)
    fits = data.draw(st.lists(trusted_fits, min_size=n, max_size=n))
    unsure = data.draw(st.integers(0, n - 1))
    fits[unsure] = data.draw(st.sampled_from([
        None, RateFit(multipliers=fits[unsure].multipliers, samples=FASTER_PICK.min_samples - 1),
        RateFit(multipliers=fits[unsure].multipliers, samples=500, streak=data.draw(st.sampled_from([-2, -1, 1, 2]))),
        RateFit(multipliers=fits[unsure].multipliers, samples=500, relative_error=FASTER_PICK.max_error + 0.01)]))
    formula = data.draw(st.integers(0, n - 1))
    columns = columns_of(candidates, fits, 64 * PAGE)
    assert not columns.trusted[unsure] and columns.text() == ""
    assert faster_than_formula(formula, range(n), columns, [p for _, p, _ in candidates],
                               [d for _, _, d in candidates]) == formula


@given(candidates=candidate_lists, data=st.data())
def test_between_workers_within_faster_by_of_each_other_the_formulas_choice_stands(candidates, data):
    """Compute rates learned within faster_by of each other (equal workers, a fit's noise):
    whatever the loads, overlaps, other rates and fits' errors, nobody is faster, so every
    decision is the formula's."""
    low = data.draw(st.floats(0.05, 20))
    within = st.floats(low, low / (1 - FASTER_PICK.faster_by), exclude_max=True)
    fits = [RateFit(multipliers=(data.draw(within), data.draw(st.floats(0.05, 50)), data.draw(st.floats(0.05, 50)),
                                 data.draw(st.floats(0.05, 50))),
                    samples=100, relative_error=data.draw(st.floats(0, 0.6))) for _ in candidates]
    columns = columns_of(candidates, fits, data.draw(st.integers(1, 2048)))
    formula = data.draw(st.integers(0, len(candidates) - 1))
    assert faster_than_formula(formula, range(len(candidates)), columns, [p for _, p, _ in candidates],
                               [d for _, _, d in candidates]) == formula


def test_a_clearly_faster_worker_replaces_the_formulas_and_a_slightly_faster_one_does_not():
    """Workers holding nothing of the request: the formula takes the one with a long prefill
    queue (its scale weighs it little beside the others' decode loads), twice as slow; the
    override moves the request to the fast one, whose first token is predicted sooner and whose
    decode load is no more. Not to a fast worker busier at decode, nor one 10% faster, nor one
    whose fit is as unsure as it is apart."""
    candidates = [(TierOverlap(), 40, 120), (TierOverlap(), 0, 100), (TierOverlap(), 60, 200)]
    slow = RateFit(multipliers=(2.0, 2.0, 2.0, 2.0), samples=50)
    fast = RateFit(multipliers=(1.0, 1.0, 1.0, 1.0), samples=50)
    columns = columns_of(candidates, [slow, fast, slow], 1024)
    prefill, decode = [40, 0, 60], [120, 100, 200]
    assert faster_than_formula(0, [0, 1, 2], columns, prefill, decode) == 1
    # the fast worker holds more decode than the formula's: it stays on the formula's
    assert faster_than_formula(0, [0, 1, 2], columns, prefill, [90, 100, 200]) == 0
    # outside the pool (over the busy thresholds): not a candidate
    assert faster_than_formula(0, [0, 2], columns, prefill, decode) == 0
    near = RateFit(multipliers=(0.9, 0.9, 0.9, 0.9), samples=50)
    columns = columns_of(candidates, [RateFit(samples=50), near, slow], 1024)
    assert faster_than_formula(0, [0, 1, 2], columns, [40, 0, 60], decode) == 0
    # twice as fast, but each fit 30% off its first tokens: not clearly faster
    unsure_slow = RateFit(multipliers=(2.0, 2.0, 2.0, 2.0), samples=50, relative_error=0.3)
    unsure_fast = RateFit(multipliers=(1.0, 1.0, 1.0, 1.0), samples=50, relative_error=0.3)
    columns = columns_of(candidates, [unsure_slow, unsure_fast, slow], 1024)
    assert faster_than_formula(0, [0, 1, 2], columns, prefill, decode) == 0


def test_an_override_sooner_only_at_the_learned_queue_rate_is_not_made():
    """A fast worker with 60 pages booked ahead, learned to cost 0.3 of a computed page each:
    at that rate its first token is far sooner than the slow formula worker's, but if its
    queue were pages still to compute, it is not sooner by the margin. The queue's cost is
    unsure, and the formula's choice stands; with a short queue both prices agree."""
    candidates = [(TierOverlap(), 5, 120), (TierOverlap(), 60, 100)]
    slow = RateFit(multipliers=(2.0, 2.0, 2.0, 1.2), samples=50)
    cheap_queue = RateFit(multipliers=(1.0, 1.0, 1.0, 0.3), samples=50)
    columns = columns_of(candidates, [slow, cheap_queue], 1024)
    assert columns.predicted_ms(1, 60) < 0.8 * columns.predicted_ms(0, 5)  # sooner at the learned rate
    assert faster_than_formula(0, [0, 1], columns, [5, 60], [120, 100]) == 0
    assert faster_than_formula(0, [0, 1], columns, [5, 10], [120, 100]) == 1


def test_a_worker_that_would_recompute_what_the_formulas_worker_holds_is_not_taken():
    """The formula's worker holds the request's prefix on its device; an idle worker that is
    twice as fast but holds nothing would recompute it: not a faster pick."""
    candidates = [(TierOverlap(device=60), 4, 10), (TierOverlap(), 0, 10)]
    columns = columns_of(candidates, [RateFit(multipliers=(2.0, 2.0, 2.0, 2.0), samples=50),
                                      RateFit(multipliers=(1.0, 1.0, 1.0, 1.0), samples=50)], 64 * PAGE)
    assert columns.service_s[1] > columns.service_s[0]
    assert faster_than_formula(0, [0, 1], columns, [4, 0], [10, 10]) == 0


# --- learn_rates.lua against observe() ---------------------------------------------------------
#: learn_rates.lua's function called alone (release.lua calls it at a first token's release).
LEARN_ONE = """
return learn_rate(KEYS[1], ARGV[1], {tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])},
                  tonumber(ARGV[6]), {unpack(ARGV, 7, 19)}, tonumber(ARGV[20]))
"""

#: learn_rate, then track_error as release.lua runs them (KEYS[2]: the errors hash; ARGV[20]:
#: the error's memory): the fit and the prediction error, as Redis holds them.
LEARN_AND_TRACK = """
local fit, predicted, floored = learn_rate(KEYS[1], ARGV[1], {tonumber(ARGV[2]), tonumber(ARGV[3]),
                                           tonumber(ARGV[4]), tonumber(ARGV[5])}, tonumber(ARGV[6]),
                                           {unpack(ARGV, 7, 19)}, tonumber(ARGV[20]))
if predicted then track_error(KEYS[2], ARGV[1], predicted, floored, tonumber(ARGV[21])) end
return {fit, redis.call('HGET', KEYS[2], ARGV[1]) or ''}
"""


def lua_arguments(worker: str, work: Work, ttft_s: float, max_step: float = 0.0) -> list:
    return [worker, repr(work.compute_tokens), repr(work.host_tokens), repr(work.l3_tokens),
            repr(work.queued_tokens), repr(ttft_s),
            *fit_arguments(PRIOR, SETTINGS), repr(max_step)]


def test_the_fit_in_redis_is_the_pure_fit(redis_server):
    """A random history per worker (slowdowns, stalls, empty samples, samples bounded as a
    client's are) through the Redis twin and through observe_and_track(): the same fit and the
    same prediction error after every sample, to the last bit."""
    import redis as sync_redis

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.router.rates import ERROR_MEMORY, observe_and_track
    from kvtier.schemas.rates import PredictionError, decode_error, decode_fit, encode_error, encode_fit
    from kvtier.schemas.state_keys import ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    learn = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + LEARN_AND_TRACK)
    keys = [ModelKeys.for_model("m").rates, ModelKeys.for_model("m").ttft_errors]
    key = keys[0]
    rng = random.Random(7)
    fits = {w: SETTINGS.first_fit() for w in ("w0", "w1", "w2")}
    errors = dict.fromkeys(fits, PredictionError())
    truth = dict.fromkeys(fits, 1.0)
    for step in range(600):
        worker = rng.choice(sorted(fits))
        if rng.random() < 0.01:
            truth[worker] *= rng.choice([0.5, 2.0])
        work = random_work(rng) if rng.random() > 0.03 else Work(0, 0, 0)
        ttft = truth_s((truth[worker],) * 4, work) * rng.uniform(0.9, 1.1)
        ttft = rng.choice([ttft, ttft, ttft, 50.0, 0.0, -1.0]) if rng.random() < 0.05 else ttft
        max_step = rng.choice([0.0, CLIENT_SAMPLES.max_step, 0.2])  # the router's own, or a client's
        fits[worker], errors[worker], _ = observe_and_track(fits[worker], errors[worker], PRIOR, work, ttft,
                                                            SETTINGS, max_step)
        answer, error = learn(keys=keys, args=[*lua_arguments(worker, work, ttft, max_step), repr(ERROR_MEMORY)])
        assert decode_fit(answer) == fits[worker], f"step {step}"
        assert answer == encode_fit(fits[worker])
        assert error == (encode_error(errors[worker]) if errors[worker].samples else b""), f"step {step}"
    assert {k.decode(): decode_fit(v) for k, v in client.hgetall(key).items()} == fits
    assert {k.decode(): decode_error(v) for k, v in client.hgetall(keys[1]).items()} == errors
    assert all(f.samples > 100 for f in fits.values())
    # every first token that taught was compared with the prediction just before it
    assert all(e.samples == f.samples and e.mape > 0 for e, f in zip(errors.values(), fits.values()))


def test_the_prediction_error_is_the_mean_of_the_first_20_then_follows_the_last_20():
    from kvtier.router.rates import ERROR_MEMORY, track_error
    from kvtier.schemas.rates import PredictionError

    held, off = track_error(PredictionError(), 1.0, 0.8)  # predicted 1 s, came in 0.8: 25% too long
    assert off == pytest.approx(0.25) and held == PredictionError(samples=1, mape=off, bias=off)
    held, off = track_error(held, 1.0, 1.25)  # then 20% too short
    assert off == pytest.approx(-0.2)
    assert (held.samples, held.mape, held.bias) == (2, pytest.approx(0.225), pytest.approx(0.025))
    for _ in range(int(1 / ERROR_MEMORY) - 2):
        held, _ = track_error(held, 1.0, 1.0)
    assert held.mape == pytest.approx(0.45 / 20)  # the mean of the first 20
    for _ in range(100):  # the worker changed: predictions now 50% too short, and the mean follows
        held, _ = track_error(held, 1.0, 2.0)
    assert held.mape == pytest.approx(0.5, rel=0.01) and held.bias == pytest.approx(-0.5, rel=0.01)


def test_errors_beyond_the_bound_in_a_row_are_a_change_not_outliers():
    rng = random.Random(5)
    fit = learn(SETTINGS.first_fit(), (1.0, 1.0, 1.0, 1.0), 200, rng, noise=0.01)  # a tight fit: a small bound
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    slow = truth_s((3.0, 3.0, 3.0, 3.0), work)
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

    fit = RateFit(multipliers=(2.0, 1.5, 1.0, 1.0), samples=3)
    # an unreadable field is left out: that worker is untrusted, so nothing is overridden
    assert fits_of([b"w0", encode_fit(fit), b"w1", b"not a fit"]) == {"w0": fit}
    roster = Roster(read_at=0.0, live={"w0": (64, 1 << 40)}, lease_count=1, stale=frozenset(), marker_id="m",
                    ready=True, rebuilding=False, change=0, next_expiry_ms=1 << 40, load_version=None)
    roster.set_loads(7, [b"w0", b"3"], [], [b"w0", encode_fit(fit)])
    assert roster.rates == {"w0": fit} and roster.load_version == 7
    taught = RateFit(multipliers=(2.5, 1.5, 1.0, 1.0), samples=4)
    roster.add("w0", -3, 0, 8, taught)  # this replica's release, the version right after the copy's
    assert roster.rates["w0"] == taught and roster.prefill == {}
    roster.add("w0", 0, 0, 10, RateFit())  # another replica wrote in between: nothing is trusted
    assert roster.load_version is None and roster.rates["w0"] == taught
    roster.set_loads(10, [], [])  # loads without rates (a replica that does not price) keep them
    assert roster.rates["w0"] == taught


def test_a_fit_not_in_the_layout_starts_again_instead_of_failing_the_release(redis_server):
    """An old text form, a fit in the layout before the queued kind, or a stray value under a
    worker's field: the next first token starts that worker's fit from the prior (a failing
    release would leave its load booked), and the readers say why they cannot show it."""
    import redis as sync_redis

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.schemas.rates import decode_fit
    from kvtier.schemas.state_keys import ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    learn = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + LEARN_ONE)
    key = ModelKeys.for_model("m-layout").rates
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    three_kinds = struct.pack("<15d", 2.0, 1.0, 1.0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0.1, 50, 0)
    with pytest.raises(ValueError, match="before the queued kind"):
        decode_fit(three_kinds)
    for stray in (b"1 1 1 1 0 0 0 1 0 0 0 1 0 5 0", b"x" * 119, three_kinds, b""):
        client.hset(key, "w", stray)
        fit = decode_fit(learn(keys=[key], args=lua_arguments("w", work, 0.3)))
        assert fit == observe(SETTINGS.first_fit(), PRIOR, work, 0.3, SETTINGS)


def test_a_booking_from_before_the_queued_kind_teaches_as_work_with_nothing_queued(redis_server):
    """A booking a router wrote before the queued kind keeps three token counts; its first
    token's release still teaches (none queued) instead of failing."""
    import redis as sync_redis

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.schemas.rates import decode_fit
    from kvtier.schemas.state_keys import ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    three = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + """
return learn_rate(KEYS[1], 'w', {4000, 2000, 0}, 0.3, {unpack(ARGV, 1, 13)}, 0)
""")
    key = ModelKeys.for_model("m-three").rates
    fit = decode_fit(three(keys=[key], args=fit_arguments(PRIOR, SETTINGS)))
    assert fit == observe(SETTINGS.first_fit(), PRIOR, Work(4000, 2000, 0, 0), 0.3, SETTINGS)
    assert fit.samples == 1


def test_a_stray_prediction_error_starts_again_and_is_shown_as_none_yet(redis_server):
    """A value under a worker's field of the errors hash that is not a PredictionError: the next
    first token's release starts that worker's error again instead of failing (its load would
    stay booked), and /healthz's reader, meanwhile, shows the worker's rates with no error yet."""
    import asyncio

    import redis as sync_redis
    import redis.asyncio

    from kvtier.plumbing.lua_scripts import load_lua
    from kvtier.router.rates import ERROR_MEMORY, observe_and_track
    from kvtier.router.state import read_worker_rates
    from kvtier.schemas.rates import PredictionError, decode_error, encode_fit
    from kvtier.schemas.state_keys import MODELS_KEY, ModelKeys

    client = sync_redis.Redis.from_url(redis_server.url)
    keys = ModelKeys.for_model("m-errors")
    learn = client.register_script(load_lua("kvtier.router", "learn_rates.lua") + LEARN_AND_TRACK)
    work = Work(compute_tokens=4000, host_tokens=0, l3_tokens=0)
    fit = RateFit(multipliers=(2.0, 1.0, 1.0, 1.0), samples=30)
    for stray in (b"x" * 23, b"not an error", b""):
        client.hset(keys.rates, "w", encode_fit(fit))
        client.hset(keys.ttft_errors, "w", stray)
        client.sadd(MODELS_KEY, keys.model_token)

        async def shown():
            reader = redis.asyncio.Redis.from_url(redis_server.url)
            try:
                return await read_worker_rates(reader)
            finally:
                await reader.aclose()

        [row] = [r for r in asyncio.run(shown()) if r.model == keys.model_token]
        assert (row.compute, row.ttft_compared, row.ttft_mape) == (2.0, 0, 0.0), row
        _, error = learn(keys=[keys.rates, keys.ttft_errors],
                         args=[*lua_arguments("w", work, 0.3), repr(ERROR_MEMORY)])
        assert decode_error(error) == observe_and_track(fit, PredictionError(), PRIOR, work, 0.3, SETTINGS)[1]
