"""Each worker's rates, learned from what a router observes, and the formula priced at them:
pure functions (no I/O, no clock), the spec the Redis twin (learn_rates.lua) is checked
against.

Learning. A decision predicts the work a first token waits for on its worker: tokens to
compute (the request's recompute plus the prefill booked ahead of it), host pages to load
back, shared-pool pages to fetch. When the first token comes, the router knows how long it
took. `observe` fits first-token seconds = sum(tokens x prior seconds per token x multiplier)
per worker by recursive least squares:
- forgetting (each old sample weighs `forgetting` times less per new one), so a worker that
  slows down is seen within tens of requests;
- relative: each sample weighs as much as any other, whatever the size of its request;
- outliers cut: an error beyond `outlier_errors` times the running mean error counts as that
  bound (a stalled request, a client that reports late) once the fit has warmed up, unless it
  is the `change_after`-th such error in a row the same way: then the worker changed, and the
  fit becomes as unsure as it was at the start, so it learns the new rates within tens of
  requests;
- bounded: multipliers stay within `bounds`, and the covariance's trace within
  `max_uncertainty`, so a long quiet spell cannot make the next sample swing the fit.

Pricing. `priced_logits` is the scoring formula (router/scoring.py) with each worker's terms
priced relative to the typical (median) worker: its prefill work weighs its compute
multiplier over the typical one, and its host and pool credits shrink where its loads are
slower than its compute relative to the typical worker. On a cluster of equal workers every
factor is 1 and the decisions are the formula's, whatever the prior.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kvtier.router import scoring
from kvtier.router.tier_index import NO_OVERLAP
from kvtier.schemas.rates import RateFit, RatePrior
from kvtier.schemas.routing import ScoringWeights, TierOverlap


@dataclass(frozen=True)
class FitSettings:
    #: 0.96: a sample 60 requests old weighs a tenth of the newest; after a slowdown the fit is
    #: within 10% of the new rates by then.
    forgetting: float = 0.96
    outlier_errors: float = 4.0
    #: Weight of the newest error in the running mean error.
    error_memory: float = 0.05
    #: Samples before outliers are cut (until then the mean error is not known).
    warmup: int = 10
    #: This many errors in a row beyond the bound, all one way, are a change of the worker's
    #: speed, not outliers: from the last of them on they count in full.
    change_after: int = 3
    bounds: tuple[float, float] = (0.05, 50.0)
    max_uncertainty: float = 30.0
    #: How much the prior believes a worker slow at one kind of work is slow at the others (a
    #: slower card computes and loads slower): what is learned of its compute, which every
    #: request shows, carries over to its loads until they are seen themselves.
    kinds_correlated: float = 0.9
    #: A first token timed under this (s) is taken as this: the clocks that time it (ms in
    #: Redis, a client's) cannot tell shorter times apart, and a time of nearly nothing would
    #: otherwise drive the fit to its lower bound at once.
    first_token_floor_s: float = 0.001

    def first_fit(self) -> RateFit:
        """A worker's fit before its first sample: the prior's rates, unsure by one."""
        rho = self.kinds_correlated
        return RateFit(covariance=(1.0, rho, rho, rho, 1.0, rho, rho, rho, 1.0))


@dataclass(frozen=True)
class ClientSamples:
    """What a first-token time a client reports (POST /v1/release to a router without
    --auth-token, where anyone may) can teach, so that no single client moves a worker's fit
    more than a bounded amount per minute, whatever it reports: its fit changes on evidence
    from many bookings, not from one client's story. The proxy's own timings, and a router's
    clients that hold its token, teach in full.

    With the defaults one client moves a multiplier at most 1.015^6 = 9.3% a minute, within
    the EQUAL_WITHIN at which workers are priced alike: it cannot turn a tie in a minute."""

    #: Samples one client (its address) may teach each worker per minute; past them a
    #: release still gives the load back, and teaches nothing (reason "budget").
    per_minute: int = 6
    #: The most one such sample moves a multiplier, relative to it.
    max_step: float = 0.015
    #: A reported first token longer than the booking has lived, by more than this, is not a
    #: first token (reason "late").
    late_slack_ms: float = 100.0


CLIENT_SAMPLES = ClientSamples()

#: Why a release's first-token time taught nothing (router_rate_samples_refused_total).
SAMPLE_REFUSALS = ("budget", "late")


#: The rates every router learns with (kvtier's defaults; the fit learns each worker's
#: multipliers on them, so the prior only sets where a new worker starts).
RATE_PRIOR = RatePrior()
FIT_SETTINGS = FitSettings()


#: A first token's time that teaches nothing (release.lua's fit ignores a time that is not
#: positive): the proxy's release of an answer that was not streamed, whose first byte is its last.
NOT_A_SAMPLE_MS = 0.0


def fit_arguments(prior: RatePrior, settings: FitSettings) -> list[str]:
    """The prior and the fit's settings as learn_rates.lua's `learn_rate` takes them (each
    float written to read back exactly)."""
    return [repr(prior.compute_tokens_per_s), repr(prior.host_load_tokens_per_s), repr(prior.l3_load_tokens_per_s),
            repr(settings.forgetting), repr(settings.outlier_errors), repr(settings.error_memory),
            str(settings.warmup), repr(settings.bounds[0]), repr(settings.bounds[1]), repr(settings.max_uncertainty),
            repr(settings.kinds_correlated), str(settings.change_after), repr(settings.first_token_floor_s)]


@dataclass(frozen=True)
class Work:
    """What a decision predicted its first token waits for, in tokens."""

    compute_tokens: float
    host_tokens: float
    l3_tokens: float

    def text(self) -> str:
        """As a booking keeps it for release.lua: the three token counts, each written to read
        back exactly."""
        return f"{self.compute_tokens:.17g} {self.host_tokens:.17g} {self.l3_tokens:.17g}"

    def nominal_s(self, prior: RatePrior) -> tuple[float, float, float]:
        """Each kind's seconds at the prior's rates (the fit's regressors)."""
        p, h, l3 = prior.seconds_per_token()
        return (self.compute_tokens * p, self.host_tokens * h, self.l3_tokens * l3)


def predicted_work(n_tokens: int, overlap: TierOverlap, prefill_load: int, page_size: int) -> Work:
    """The work a decision predicts its first token waits for on the worker it chose: the
    request's tokens past its device, predicted, host and pool pages (recomputed), plus the
    prefill booked ahead of it (`prefill_load` pages), host pages to load back, pool pages to
    fetch."""
    cached = overlap.device + overlap.predicted
    host = overlap.host
    pool = max(overlap.shared_beyond - host, 0)
    recompute = max(n_tokens - (cached + host + pool) * page_size, 0)
    return Work(compute_tokens=recompute + prefill_load * page_size, host_tokens=host * page_size,
                l3_tokens=pool * page_size)


def predict_s(fit: RateFit, prior: RatePrior, work: Work) -> float:
    return sum(m * x for m, x in zip(fit.multipliers, work.nominal_s(prior)))


def observe(fit: RateFit, prior: RatePrior, work: Work, ttft_s: float, settings: FitSettings = FitSettings(),
            max_step: float = 0.0) -> RateFit:
    """The fit after one first token that took `ttft_s` for `work`. A sample that says nothing
    (no work predicted, a time that is not positive) leaves the fit as it was. `max_step`: the
    most the sample may move each multiplier, relative to it (0: no bound; ClientSamples).

    Each sample is taken relative to what the fit predicted for it (regressors and time divided
    by the prediction), so a 40 ms first token teaches as much as a 2 s one, and the forgetting
    counts requests whatever their size; errors and the outlier bound are relative too."""
    nominal = work.nominal_s(prior)
    if not ttft_s > 0 or not any(v > 0 for v in nominal):
        return fit
    ttft_s = max(ttft_s, settings.first_token_floor_s)
    theta, p = fit.multipliers, fit.covariance
    predicted = sum(m * v for m, v in zip(theta, nominal))  # > 0: multipliers are bounded above 0
    x = [v / predicted for v in nominal]
    error = ttft_s / predicted - 1.0
    streak = 0
    if fit.samples >= settings.warmup and fit.relative_error > 0:
        bound = settings.outlier_errors * fit.relative_error
        if abs(error) > bound:
            # beyond the bound again, the same way: a run of them is a change, not an outlier
            streak = fit.streak + 1 if error * fit.streak > 0 else (1 if error > 0 else -1)
            if abs(streak) < settings.change_after:
                error = min(max(error, -bound), bound)
            elif abs(streak) == settings.change_after:
                p = settings.first_fit().covariance  # the worker changed: as unsure as at the start
    px = [p[3 * i] * x[0] + p[3 * i + 1] * x[1] + p[3 * i + 2] * x[2] for i in range(3)]
    denominator = settings.forgetting + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
    gain = [v / denominator for v in px]
    low, high = settings.bounds
    moved = [theta[i] + gain[i] * error for i in range(3)]
    if max_step > 0:
        moved = [min(max(m, theta[i] * (1 - max_step)), theta[i] * (1 + max_step)) for i, m in enumerate(moved)]
    multipliers = tuple(min(max(m, low), high) for m in moved)
    covariance = [(p[3 * i + j] - gain[i] * px[j]) / settings.forgetting for i in range(3) for j in range(3)]
    trace = covariance[0] + covariance[4] + covariance[8]
    if trace > settings.max_uncertainty:
        covariance = [c * settings.max_uncertainty / trace for c in covariance]
    memory = settings.error_memory if fit.samples else 1.0
    return RateFit(multipliers=(multipliers[0], multipliers[1], multipliers[2]), covariance=tuple(covariance),
                   relative_error=(1 - memory) * fit.relative_error + memory * abs(error), samples=fit.samples + 1,
                   streak=streak)


@dataclass(frozen=True)
class Pricing:
    """One worker's factors relative to the typical worker (all 1: priced as the formula)."""

    compute: float = 1.0
    host_load: float = 1.0  # its host loads against its compute, over the typical worker's
    l3_load: float = 1.0


#: Workers whose factors differ by less than this are priced alike: the fit's noise must not
#: turn the formula's ties, which its random draw spreads over equal workers, into a rule that
#: always picks whichever worker's fit came out a hair faster. 10%: at 5% the noise of fits
#: learned at each first token still moved equal workers' median TTFT by 2.3% (conversation
#: trace, no L3, docs/benchmarks/replay.md); a worker 10% slower than the typical one is
#: priced as typical.
EQUAL_WITHIN = 0.10


def _snap(factor: float) -> float:
    return 1.0 if abs(factor - 1.0) < EQUAL_WITHIN else factor


def relative_pricing(fits: Sequence[RateFit | None]) -> list[Pricing]:
    """Each worker's Pricing against the median of the fits given; a worker with no fit yet is
    priced as the typical one."""
    known = [f.multipliers for f in fits if f is not None]
    if not known:
        return [Pricing() for _ in fits]
    compute = statistics.median(m[0] for m in known)
    host = statistics.median(m[1] / m[0] for m in known)
    l3 = statistics.median(m[2] / m[0] for m in known)
    return [Pricing() if f is None else
            Pricing(compute=_snap(f.multipliers[0] / compute),
                    host_load=_snap(f.multipliers[1] / f.multipliers[0] / host),
                    l3_load=_snap(f.multipliers[2] / f.multipliers[0] / l3))
            for f in fits]


def priced_weights(weights: ScoringWeights, pricing: Pricing) -> ScoringWeights:
    """The formula's weights for one worker at its pricing: its prefill work weighs its compute
    factor more, and a host or pool page saves what it saves on the typical worker scaled by how
    much slower this worker's loads are than its compute (never below nothing). A factor of 1
    leaves its weight as it is, so equal workers are scored exactly as the formula scores them."""
    changes = {}
    if pricing.compute != 1.0:
        changes["prefill_load_scale"] = weights.prefill_load_scale * pricing.compute
    if pricing.host_load != 1.0:
        changes["host_cache_hit_weight"] = max(1 - (1 - weights.host_cache_hit_weight) * pricing.host_load, 0.0)
    if pricing.l3_load != 1.0:
        changes["shared_cache_multiplier"] = max(1 - (1 - weights.shared_cache_multiplier) * pricing.l3_load, 0.0)
    return msgspec.structs.replace(weights, **changes) if changes else weights


def priced_logits(request_pages: int, candidates: Sequence[scoring.CandidateInputs], weights: ScoringWeights,
                  pricing: Sequence[Pricing]) -> list[float]:
    """The formula (router/scoring.py) for each candidate at its own priced weights."""
    return [scoring.score_terms(request_pages, c, priced_weights(weights, p)).logit
            for c, p in zip(candidates, pricing)]


def priced_score(request_pages: int, candidates: Sequence[scoring.CandidateInputs], weights: ScoringWeights,
                 pricing: Mapping[str, Pricing] | None, u: float) -> scoring.Scored:
    """router/scoring.py's `score` on the logits priced by worker (None: the formula's)."""
    if pricing is None:
        return scoring.score(request_pages, candidates, weights, u)
    values = priced_logits(request_pages, candidates, weights, [pricing[c.worker_id] for c in candidates])
    return scoring.Scored(scoring.choose(values, weights.temperature, u), values)


def pricing_by_worker(fits: Mapping[str, RateFit], workers: Sequence[str]) -> dict[str, Pricing]:
    """Each of `workers` priced against the median of those that have a fit (a worker with
    none yet is priced as the typical one)."""
    return dict(zip(workers, relative_pricing([fits.get(w) for w in workers])))


def weights_by_worker(weights: ScoringWeights, pricing: Mapping[str, Pricing]) -> dict[str, ScoringWeights]:
    """Each priced worker's weights (`priced_weights`)."""
    return {worker: priced_weights(weights, p) for worker, p in pricing.items()}


def columns_at(ids: Sequence[str], overlaps: Mapping[str, TierOverlap], weights: ScoringWeights,
               by_worker: Mapping[str, ScoringWeights]) -> tuple[list[float], list[float]]:
    """Each candidate's cache credit and prefill_load_scale at its own weights (`weights` for
    a worker not in `by_worker`): what the lean choice (router/scoring.py `logits_scaled`) and
    select_and_book.lua take, equal to `priced_logits` term by term. A worker the index holds
    no page of has no credit, whatever its weights."""
    credits, scales = [], []
    for worker in ids:
        priced = by_worker.get(worker, weights)
        overlap = overlaps[worker]
        credits.append(0.0 if overlap is NO_OVERLAP else scoring.cache_credit(overlap, priced))
        scales.append(priced.prefill_load_scale)
    return credits, scales


def priced_columns(ids: Sequence[str], overlaps: Mapping[str, TierOverlap], weights: ScoringWeights,
                   pricing: Mapping[str, Pricing]) -> tuple[list[float], list[float]]:
    """`columns_at` at each candidate's pricing."""
    return columns_at(ids, overlaps, weights, weights_by_worker(weights, pricing))
