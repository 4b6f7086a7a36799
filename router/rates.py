"""Each worker's rates, learned from what a router observes, and the choice they allow:
pure functions (no I/O, no clock), the spec the Redis twin (learn_rates.lua) is checked
against.

Learning. A decision predicts the work a first token waits for on its worker: tokens to
compute (the request's recompute), host pages to load back, shared-pool pages to fetch, and
the prefill booked ahead of it (schemas/rates.py WORK_KINDS). When the first token comes, the
router knows how long it took. `observe` fits first-token seconds = sum(tokens x prior
seconds per token x multiplier) per worker by recursive least squares:
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

Choosing. `faster_than_formula` (--router-mode predicted-ttft) keeps the formula's choice
unless every candidate's fit is trusted and another candidate, clearly faster at compute by
its learned rates, is predicted to give the first token sooner by a wide margin without
recomputing what the formula's worker holds or taking more decode load than it (FasterPick).
What it prices is what delays a first token: the prefill queued ahead at the worker's queued
rate, its recompute, load-back and pool fetch at its learned rates; not decode, which the
formula weighs for TPOT. The margin must hold with the queues at their compute rates too
(pages still to compute, the most a queue can cost), so a queue learned cheap on little
evidence does not move a request by itself. Only a worker faster beyond both fits' errors
may take a request: where the workers are equal (learned within FasterPick.faster_by and their fits' errors of
each other) every decision is the formula's, by construction; the replay suite
(kvtier/eval/suite.py) measures what it gains where they are not.

Checking. Each first token that teaches is first compared with what the fit predicted for
it (`track_error`, PredictionError): the routers show each worker's running MAPE and bias,
and a replay the same figure over its run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.schemas.rates import KINDS, PredictionError, RateFit, RatePrior
from kvtier.schemas.routing import ScoringWeights, TierOverlap

from . import scoring


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
        return RateFit(covariance=tuple(1.0 if i == j else rho for i in range(KINDS) for j in range(KINDS)))


@dataclass(frozen=True)
class ClientSamples:
    """What a first-token time a client reports (POST /v1/release to a router without
    --auth-token, where anyone may) can teach, so that no single client moves a worker's fit
    more than a bounded amount per minute, whatever it reports: its fit changes on evidence
    from many bookings, not from one client's story. The proxy's own timings, and a router's
    clients that hold its token, teach in full.

    With the defaults one client moves a multiplier at most 1.015^6 = 9.3% a minute, well
    within FasterPick's 20% margin: in a minute it cannot make the router override the
    formula between equal workers."""

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
    """What a decision predicted its first token waits for, in tokens of each kind
    (schemas/rates.py WORK_KINDS)."""

    compute_tokens: float
    host_tokens: float
    l3_tokens: float
    #: The prefill booked ahead of it on its worker (pages x page size).
    queued_tokens: float = 0.0

    def text(self) -> str:
        """As a booking keeps it for release.lua: the four token counts, each written to read
        back exactly."""
        return f"{self.compute_tokens:.17g} {self.host_tokens:.17g} {self.l3_tokens:.17g} {self.queued_tokens:.17g}"

    def nominal_s(self, prior: RatePrior) -> tuple[float, float, float, float]:
        """Each kind's seconds at the prior's rates (the fit's regressors)."""
        p, h, l3, q = prior.seconds_per_token()
        return (self.compute_tokens * p, self.host_tokens * h, self.l3_tokens * l3, self.queued_tokens * q)


def predicted_work(n_tokens: int, overlap: TierOverlap, prefill_load: int, page_size: int) -> Work:
    """The work a decision predicts its first token waits for on the worker it chose: the
    request's tokens past its device, predicted, host and pool pages (recomputed), host pages
    to load back, pool pages to fetch, and the prefill booked ahead of it (`prefill_load`
    pages)."""
    cached = overlap.device + overlap.predicted
    host = overlap.host
    pool = max(overlap.shared_beyond - host, 0)
    recompute = max(n_tokens - (cached + host + pool) * page_size, 0)
    return Work(compute_tokens=recompute, host_tokens=host * page_size, l3_tokens=pool * page_size,
                queued_tokens=prefill_load * page_size)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    """Left to right from 0, as learn_rates.lua adds (the same doubles both sides); not
    `sum()`, which compensates float rounding from Python 3.12 on and would part from Lua."""
    total = 0.0
    for u, v in zip(a, b):
        total += u * v
    return total


def predict_s(fit: RateFit, prior: RatePrior, work: Work) -> float:
    return _dot(fit.multipliers, work.nominal_s(prior))


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
    predicted = _dot(theta, nominal)  # > 0: multipliers are bounded above 0
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
    # sums left to right from 0, as learn_rates.lua adds them, so both give the same doubles
    px = [_dot(p[KINDS * i:KINDS * (i + 1)], x) for i in range(KINDS)]
    denominator = settings.forgetting + _dot(x, px)
    gain = [v / denominator for v in px]
    low, high = settings.bounds
    moved = [theta[i] + gain[i] * error for i in range(KINDS)]
    if max_step > 0:
        moved = [min(max(m, theta[i] * (1 - max_step)), theta[i] * (1 + max_step)) for i, m in enumerate(moved)]
    m = [min(max(v, low), high) for v in moved]
    covariance = [(p[KINDS * i + j] - gain[i] * px[j]) / settings.forgetting for i in range(KINDS)
                  for j in range(KINDS)]
    trace = _dot(covariance[::KINDS + 1], [1.0] * KINDS)
    if trace > settings.max_uncertainty:
        covariance = [c * settings.max_uncertainty / trace for c in covariance]
    memory = max(settings.error_memory, 1.0 / (fit.samples + 1))  # the mean of the first ones, then recent
    return RateFit(multipliers=(m[0], m[1], m[2], m[3]), covariance=tuple(covariance),
                   relative_error=(1 - memory) * fit.relative_error + memory * abs(error), samples=fit.samples + 1,
                   streak=streak)


#: Weight of the newest first token in a worker's running prediction error (PredictionError):
#: the mean of the first 20, then about the last 20.
ERROR_MEMORY = 0.05


def track_error(held: PredictionError, predicted_s: float, ttft_s: float, memory: float = ERROR_MEMORY
                ) -> tuple[PredictionError, float]:
    """`held` after one first token that took `ttft_s` (> 0) where `predicted_s` was predicted,
    and that one's error: relative to the true time, signed so that > 0 predicts too long."""
    off = (predicted_s - ttft_s) / ttft_s
    return with_error(held, off, memory), off


def with_error(held: PredictionError, off: float, memory: float = ERROR_MEMORY) -> PredictionError:
    """`held` after one more error `off` (memory 0: the mean over every one)."""
    weight = max(memory, 1.0 / (held.samples + 1))
    return PredictionError(samples=held.samples + 1, mape=(1 - weight) * held.mape + weight * abs(off),
                           bias=(1 - weight) * held.bias + weight * off)


def observe_and_track(fit: RateFit, held: PredictionError, prior: RatePrior, work: Work, ttft_s: float,
                      settings: FitSettings = FitSettings(), max_step: float = 0.0
                      ) -> tuple[RateFit, PredictionError, float | None]:
    """What a first token's release does (release.lua): the fit after it (`observe`) and, when
    the sample teaches, the worker's prediction error with the fit's prediction just before it
    (the first token's time at the clocks' floor, as the fit takes it), and that one's error
    (None: the sample taught nothing)."""
    nominal = work.nominal_s(prior)
    if not ttft_s > 0 or not any(v > 0 for v in nominal):
        return fit, held, None
    predicted = predict_s(fit, prior, work)
    tracked, off = track_error(held, predicted, max(ttft_s, settings.first_token_floor_s))
    return observe(fit, prior, work, ttft_s, settings, max_step), tracked, off


@dataclass(frozen=True)
class FasterPick:
    """When --router-mode predicted-ttft overrides the formula's choice (`faster_than_formula`).

    The formula weighs decode load for TPOT and credits cached pages at fixed weights; what it
    cannot see is a worker's speed. The override moves a request off the formula's worker only
    where the learned rates say, by a wide margin, that another one gives its first token
    sooner without taking on work the formula's worker would not: with fewer than
    `min_samples` first tokens behind any candidate's fit, or a candidate that just changed
    (its fit's streak), or one whose fit is more than `max_error` off its first tokens, the
    formula's choice stands: wherever the rates are unsure, decisions are the formula's."""

    #: The override's predicted first token must be at least this much sooner than the
    #: formula's (at 0.35 and 0.5 the suite's mixed clusters gained less and its bursty
    #: workload lost more, docs/benchmarks/replay.md).
    margin: float = 0.2
    #: And the override's worker must compute faster than the formula's by this much beyond
    #: both fits' mean relative errors: its seconds per token x (1 + its error) under
    #: (1 - faster_by) x the other's x (1 - the other's error). Between workers whose fits
    #: differ by less, nothing moves (and past `max_error` a fit is not trusted at all).
    #: Without the errors, at 0.2 and at 0.33, the suite's equal workers saw overrides (fits
    #: 20-30% apart on agentic, bursty and shared-prompt workloads) and lost up to 7% at p99;
    #: with them, none.
    faster_by: float = 0.2
    min_samples: int = 20
    #: A fit whose mean relative error is above this predicts first tokens too poorly to act on:
    #: no override among candidates that include it. On the suite's conversation and synthetic
    #: workloads fits are 2-14% off (p10-p90); on its agentic, shared-prompt and bursty ones
    #: 12-73% (their first tokens wait on decode steps and on partly done prefill the rates do
    #: not see), and with overrides there (at 0.3) agentic on half-speed workers lost 7% at
    #: TTFT p50 (docs/benchmarks/replay.md).
    max_error: float = 0.15

    def trusted(self, fit: RateFit | None) -> bool:
        return (fit is not None and fit.samples >= self.min_samples and fit.streak == 0
                and fit.relative_error <= self.max_error)


FASTER_PICK = FasterPick()


@dataclass(frozen=True)
class TtftColumns:
    """Each candidate's predicted first-token time, in two parts (seconds): its own work with
    nothing queued ahead (recompute, host load-back, pool fetch at its rates), and what each
    prefill page booked ahead of it adds (its queued rate, and the same page at its compute
    rate: `queue_at_compute_s_per_page`, what the queue would cost if none of it were loads
    or partly done); and its compute seconds per token with the fit's mean relative error
    (`spread`), which say which workers are clearly faster. A column per candidate, so the Redis twin
    (select_and_book.lua) adds its live loads the same way. A candidate whose fit is not
    trusted (FasterPick.trusted) has zeros, and no override is made among candidates that
    include it."""

    service_s: list[float]
    queue_s_per_page: list[float]
    compute_s_per_token: list[float]
    spread: list[float]
    trusted: list[bool]
    queue_at_compute_s_per_page: list[float]

    def predicted_ms(self, i: int, prefill_pages: int) -> float | None:
        """Candidate `i`'s first token with `prefill_pages` booked ahead of it, in ms (None:
        its fit is not trusted)."""
        if not self.trusted[i]:
            return None
        return 1000 * (self.service_s[i] + prefill_pages * self.queue_s_per_page[i])

    def text(self) -> str:
        """As select_and_book.lua takes them: "service queue compute spread queue-at-compute"
        per candidate, comma-separated, each float written to read back exactly; "" (no
        override) unless every one is trusted."""
        if not all(self.trusted):
            return ""
        return ",".join(f"{s!r} {q!r} {c!r} {e!r} {a!r}" for s, q, c, e, a in
                        zip(self.service_s, self.queue_s_per_page, self.compute_s_per_token, self.spread,
                            self.queue_at_compute_s_per_page))


def ttft_columns(n_tokens: int, overlaps: Sequence[TierOverlap], page_sizes: Sequence[int],
                 fits: Sequence[RateFit | None], prior: RatePrior, pick: FasterPick = FASTER_PICK) -> TtftColumns:
    """The candidates' TtftColumns at their fits."""
    per_token = prior.seconds_per_token()[0]
    service, queue, compute, spread, trusted, at_compute = [], [], [], [], [], []
    for overlap, size, fit in zip(overlaps, page_sizes, fits):
        if fit is None or not pick.trusted(fit):
            at_compute.append(0.0)
            service.append(0.0)
            queue.append(0.0)
            compute.append(0.0)
            spread.append(0.0)
            trusted.append(False)
            continue
        service.append(predict_s(fit, prior, predicted_work(n_tokens, overlap, 0, size)))
        queue.append(fit.multipliers[3] * (size * per_token))
        at_compute.append(fit.multipliers[0] * (size * per_token))
        compute.append(fit.multipliers[0] * per_token)
        spread.append(fit.relative_error)
        trusted.append(True)
    return TtftColumns(service, queue, compute, spread, trusted, at_compute)


def faster_than_formula(formula: int, pool: Sequence[int], columns: TtftColumns | None, prefill: Sequence[int],
                        decode: Sequence[int], pick: FasterPick = FASTER_PICK) -> int:
    """The candidate to book instead of the formula's choice `formula` (itself when none is
    clearly faster), among `pool` (candidate indexes). A candidate qualifies when it computes
    faster than `formula`'s worker by more than `pick.faster_by` beyond both fits' errors (so
    between equal workers nothing moves), and takes on no more than the formula's worker
    would: its own work is predicted no slower (it does not recompute what the formula's worker
    holds) and its decode load is no more (the formula weighs decode for TPOT). The qualified
    candidate with the least predicted first token (service + prefill booked ahead x queue
    seconds per page; ties: the lowest index) replaces `formula` when it is predicted sooner
    by more than `pick.margin`, both with the queues at their learned queued rates and with
    them at their compute rates (a queue of pages still to compute, the most it can cost):
    where the two prices disagree, the queue's cost is unsure, and `formula` stands; when
    any candidate of `pool` is not trusted, `formula` stands.

    Without the second price, the suite's held-out conversation workload on half-speed
    workers came out 1.029x tier_aware at TTFT p50 and 1.042x at TPOT p99, beyond its
    noise band (docs/benchmarks/replay.md).

    With a looser decode bound (up to the busiest candidate's load less the request's), the
    suite's agentic workload on half-speed workers lost 3% at TTFT p50 in each of its seeds."""
    if columns is None or not all(columns.trusted[i] for i in pool):
        return formula
    service, queue, compute = columns.service_s, columns.queue_s_per_page, columns.compute_s_per_token
    margin, spread = pick.margin, columns.spread
    own, decode_own = service[formula], decode[formula]
    # clearly faster: its rate at the slow end of its fit's error under the formula's worker's
    # at the fast end, by faster_by
    faster = (1.0 - pick.faster_by) * compute[formula] * (1.0 - spread[formula])
    best, best_s = formula, service[formula] + prefill[formula] * queue[formula]
    limit = (1.0 - margin) * best_s
    for i in pool:
        if compute[i] * (1.0 + spread[i]) < faster and service[i] <= own and decode[i] <= decode_own:
            ttft_s = service[i] + prefill[i] * queue[i]
            if ttft_s < best_s:  # ties: the lowest index (the formula's own ttft never passes the margin)
                best, best_s = i, ttft_s
    if not best_s < limit:
        return formula
    at_compute = columns.queue_at_compute_s_per_page
    sure = service[best] + prefill[best] * at_compute[best] < (1.0 - margin) * (
        service[formula] + prefill[formula] * at_compute[formula])
    return best if sure else formula


def formula_then_faster(n_pages: int, inputs: Sequence[scoring.CandidateInputs], weights: ScoringWeights, u: float,
                        columns: TtftColumns | None, pick: FasterPick = FASTER_PICK) -> scoring.Scored:
    """What select_and_book.lua chooses among `inputs` at the loads they carry: the formula's
    choice, then with `columns` (--router-mode predicted-ttft) a clearly faster worker instead
    (`faster_than_formula`)."""
    scored = scoring.score(n_pages, inputs, weights, u)
    if columns is None:
        return scored
    chosen = faster_than_formula(scored.chosen, range(len(inputs)), columns, [c.prefill_load for c in inputs],
                                 [c.decode_load for c in inputs], pick)
    return scoring.Scored(chosen, scored.logits)
