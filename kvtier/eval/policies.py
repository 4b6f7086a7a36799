"""Routing policies a lockstep replay (kvtier/eval/lockstep.py) can run, all behind one
interface: at a request's arrival, pick a rank, and say what was seen.

In process (no servers):
- `random`, `round_robin`: the baselines.
- `oracle`: kvtier's scoring formula (router/scoring.py) at the same weights, evaluated on the
  simulator's ground truth at arrival: every rank's true tiers per page and its true queued
  prefill and decode work. kvtier's own policy with perfect, instant information.
- `ttft_oracle`: the rank with the least true TTFT for this request at arrival (its queue,
  loads and recompute at its true speed, SimCluster.ttfts): greedy, blind to where the next
  turns will find their pages.
- `RouterModel`: the router's decision on the information the pipeline would give it, computed
  in process: tier state built from the events published up to (now - visibility lag),
  the shared pool asked live, loads from bookings released at first token and completion,
  candidates in worker-id order and the same random draws. It is what `kvtier bench replay`
  measures through the real pipeline (kvtier/eval/pipeline.py); a test holds the two to the
  same decisions, and `kvtier tune` searches weights on it.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvtier.eval.trace import PreparedRequest
from kvtier.router import scoring
from kvtier.router.rates import (
    FASTER_PICK,
    FasterPick,
    FitSettings,
    Work,
    formula_then_faster,
    observe_and_track,
    predicted_work,
    ttft_columns,
    with_error,
)
from kvtier.router.walk import walk as tier_walk
from kvtier.schemas.hashes import BlockHash, block_hash_of_digest
from kvtier.schemas.rates import PredictionError, RateFit, RatePrior
from kvtier.schemas.routing import ScoringWeights, TierOverlap
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.schemas.tiers import tier_of_medium
from kvtier.sim.hicache_sim import ServeResult
from kvtier.sim.sim_cluster import RankTruth, SimCluster

#: The policies a replay can run (`--policies`), and among them kvtier's own (the router's).
POLICIES = ("random", "round_robin", "least_load", "device_only", "tier_aware", "tier_aware_shared", "oracle",
            "ttft_oracle")
#: Policies a replay runs when asked by name (`--policies`): kvtier's formula overridden for
#: workers faster at learned rates (`--router-mode predicted-ttft`; through the pipeline or in process).
NAMED_POLICIES = ("predicted_ttft",)
#: The formula with its ties broken by other random draws (the routers' draws from seed +
#: REDRAW_SEED_OFFSET), always in process: not a policy to deploy but the yardstick of how far
#: the formula moves from itself when nothing but its tie-breaks change (one changed decision
#: changes every cache after it). A policy's ratio to tier_aware inside that band says nothing.
REDRAWN = "tier_aware_redrawn"
REDRAW_SEED_OFFSET = 7919
REFERENCE_POLICIES = (REDRAWN,)
#: The policies that decide on the simulator's ground truth (no router could run them).
ORACLES = ("oracle", "ttft_oracle")
KVTIER_POLICIES = ("least_load", "device_only", "tier_aware", "tier_aware_shared")
#: Per-request overrides of the `device_only` policy (scoring ignores every other tier).
DEVICE_ONLY = {"host_cache_hit_weight": 0.0, "disk_cache_hit_weight": 0.0, "shared_cache_multiplier": 0.0}
#: The router's cache-blind mode (`--router-mode load`): every cache weight zero.
LOAD_ONLY = {"overlap_score_credit": 0.0, **DEVICE_ONLY}


@dataclass(frozen=True)
class CandidateView:
    """What a policy saw of one rank when it decided (pages)."""

    rank: int
    overlap: TierOverlap
    prefill_load: int
    decode_load: int
    logit: float


@dataclass
class Decision:
    rank: int
    seen: list[CandidateView] | None = None  # None: a policy that looks at nothing
    degraded: list[str] = field(default_factory=list)


class Policy(Protocol):
    """A policy that learns as it goes may also have `learned(cluster, now) -> dict`: what it
    learned, beside the truth, for the replay's summary."""

    name: str
    #: The policy reads the simulator's KV events.
    needs_events: bool
    #: ... and they leave the process, so they must carry the requests' real token ids.
    needs_tokens: bool

    async def start(self, cluster: SimCluster) -> None: ...

    async def decide(self, request: PreparedRequest, now: float, cluster: SimCluster,
                     truth: list[RankTruth], tokens: list[int] | None = None) -> Decision:
        """`tokens`: the request's token ids, given to policies that need events."""

    def served(self, request: PreparedRequest, decision: Decision, result: ServeResult, now: float) -> None: ...

    async def close(self) -> None: ...


class _Blind:
    needs_events = False
    needs_tokens = False

    async def start(self, cluster) -> None:
        pass

    def served(self, request, decision, result, now) -> None:
        pass

    async def close(self) -> None:
        pass


class RandomPolicy(_Blind):
    name = "random"

    def __init__(self, workers: int, seed: int):
        self.workers = workers
        self.rng = random.Random(seed)

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        return Decision(self.rng.randrange(self.workers))


class RoundRobinPolicy(_Blind):
    name = "round_robin"

    def __init__(self, workers: int):
        self.workers = workers

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        return Decision(request.index % self.workers)


def truth_candidates(truth: list[RankTruth], shared: bool) -> list[scoring.CandidateInputs]:
    return [scoring.CandidateInputs(str(rank), TierOverlap(device=t.device, host=t.host,
                                                            shared_beyond=t.shared_beyond if shared else 0),
                                    t.prefill_pages, t.decode_pages)
            for rank, t in enumerate(truth)]


def seen_of(candidates: list[scoring.CandidateInputs], ranks: list[int], logits: list[float]) -> list[CandidateView]:
    return [CandidateView(rank, c.overlap, c.prefill_load, c.decode_load, logit)
            for rank, c, logit in zip(ranks, candidates, logits)]


def oracle_choice(request: PreparedRequest, truth: list[RankTruth], weights: ScoringWeights, shared: bool,
                  u: float) -> tuple[int, list[CandidateView]]:
    candidates = truth_candidates(truth, shared)
    scored = scoring.score(len(request.digests), candidates, weights, u)
    return scored.chosen, seen_of(candidates, list(range(len(truth))), scored.logits)


class OraclePolicy(_Blind):
    name = "oracle"

    def __init__(self, weights: ScoringWeights, shared: bool, seed: int):
        self.weights = weights
        self.shared = shared
        self.rng = random.Random(seed)

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        rank, seen = oracle_choice(request, truth, self.weights, self.shared, self.rng.random())
        return Decision(rank, seen)


class TtftOraclePolicy(_Blind):
    name = "ttft_oracle"

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        ttfts = cluster.ttfts(request.digests, request.input_tokens, now)
        return Decision(min(range(len(ttfts)), key=ttfts.__getitem__))  # ties: the lowest rank


# --- the router, modelled in process ------------------------------------------------------------
class TierView:
    """One rank's tier state as the processor would have written it: page -> tier bits."""

    def __init__(self) -> None:
        self.pages: dict[BlockHash, int] = {}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.pages.clear()
                continue
            bit = tier_of_medium(event.medium).bit
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.pages[h] = self.pages.get(h, 0) | bit
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    bits = self.pages.get(h, 0) & ~bit
                    if bits:
                        self.pages[h] = bits
                    else:
                        self.pages.pop(h, None)

    def walk(self, hashes: list[BlockHash], predicted: dict[BlockHash, int] | None = None
             ) -> tuple[int, int, int, int]:
        """(device, host, disk, predicted): router/walk.py's walk over this rank's pages, the
        spec that read_overlap.lua and the router's index are checked against."""
        overlap = tier_walk(hashes, self.pages, predicted or ())
        return overlap.device, overlap.host, overlap.disk, overlap.predicted


@dataclass(order=True)
class _Release:
    at: float
    seq: int
    rank: int = field(compare=False)
    prefill: int = field(compare=False)
    decode: int = field(compare=False)
    predicted: list[BlockHash] = field(compare=False, default_factory=list)
    #: A first token's release: what the decision predicted, and the first token's time as the
    #: client reports it (ms), for a policy that learns from releases.
    learn: tuple[Work, float] | None = field(compare=False, default=None)


class RouterModel:
    """kvtier's router on what the pipeline shows it, in process (see the module docstring)."""

    needs_events = True
    needs_tokens = False
    #: Asks the shared pool for every decision even where the formula does not credit it
    #: (`shared` off), so that the work a booking keeps for its rates to learn from prices the
    #: pages its first token fetches from it: a router given `--mooncake-master` whose rates
    #: learn. The override still decides on the formula's overlaps (router/rates.py ttft_columns).
    prices_pool = False

    def __init__(self, name: str, workers: int, page_size: int, weights: ScoringWeights, shared: bool,
                 visibility_lag_s: float, seed: int, replicas: int = 2, predicted: bool = False):
        self.name = name
        self.workers = workers
        self.page_size = page_size
        self.weights = weights
        self.shared = shared
        self.lag = visibility_lag_s
        # The pipeline's routers: replica r draws from random.Random(seed + r), one draw a decision.
        self.rngs = [random.Random(seed + r) for r in range(replicas)]
        self.views = [TierView() for _ in range(workers)]
        # Candidates in the router's order: sorted by worker id ("sim-dp10" before "sim-dp2").
        self.order = sorted(range(workers), key=lambda r: worker_id(r))
        self.prefill = [0] * workers
        self.decode = [0] * workers
        #: Booked pages not yet complete, per rank: page -> bookings holding it.
        self.predicted: list[dict[BlockHash, int]] | None = [{} for _ in range(workers)] if predicted else None
        self._releases: list[_Release] = []
        self._seq = 0
        #: request -> (rank, prefill, predicted pages, the work a learning policy predicted)
        self._booked: dict[int, tuple[int, int, list[BlockHash], Work | None]] = {}

    def _release_due(self, now: float) -> None:
        while self._releases and self._releases[0].at <= now:
            r = heapq.heappop(self._releases)
            if r.learn is not None:
                self._first_token(r.rank, *r.learn)
            self.prefill[r.rank] -= r.prefill
            self.decode[r.rank] -= r.decode
            if r.predicted and self.predicted is not None:  # only booked with predicted pages on
                held = self.predicted[r.rank]
                for h in r.predicted:
                    if held[h] == 1:
                        del held[h]
                    else:
                        held[h] -= 1

    async def start(self, cluster) -> None:
        pass

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        self._release_due(now)
        for rank, view in enumerate(self.views):
            for events in cluster.events_until(rank, now - self.lag):
                view.apply(events)
        hashes = [block_hash_of_digest(d) for d in request.digests]
        pooled = None
        if (self.shared or self.prices_pool) and cluster.pool is not None:
            pooled = [cluster.pool.contains(d) for d in request.digests]
        candidates, priced = [], []
        for rank in self.order:
            held = self.predicted[rank] if self.predicted is not None else None
            device, host, disk, guess = self.views[rank].walk(hashes, held)
            beyond = sum(pooled[device + guess:]) if pooled is not None else 0
            overlap = TierOverlap(device=device, host=host, disk=disk, shared_beyond=beyond, predicted=guess)
            priced.append(overlap)
            scored_overlap = overlap if self.shared else msgspec.structs.replace(overlap, shared_beyond=0)
            candidates.append(scoring.CandidateInputs(worker_id(rank), scored_overlap, self.prefill[rank],
                                                      self.decode[rank]))
        u = self.rngs[request.index % len(self.rngs)].random()
        scored = self._score(len(hashes), candidates, u)
        chosen = self.order[scored.chosen]
        seen = candidates[scored.chosen].overlap
        work = self._decided(request, candidates[scored.chosen], priced[scored.chosen])
        prefill_pages = max(len(hashes) - seen.device - seen.predicted, 0)
        self.prefill[chosen] += prefill_pages
        self.decode[chosen] += decode_pages(request, self.page_size)
        booked: list[BlockHash] = []
        if self.predicted is not None:
            booked = hashes[seen.device:]
            held = self.predicted[chosen]
            for h in booked:
                held[h] = held.get(h, 0) + 1
        self._booked[request.index] = (chosen, prefill_pages, booked, work)
        return Decision(chosen, seen_of(candidates, self.order, scored.logits))

    def _score(self, request_pages: int, candidates: list[scoring.CandidateInputs], u: float) -> scoring.Scored:
        return scoring.score(request_pages, candidates, self.weights, u)

    def _decided(self, request: PreparedRequest, seen: scoring.CandidateInputs, priced: TierOverlap) -> Work | None:
        """What a policy that learns from its first tokens keeps of a decision (nothing, here);
        `priced`: the chosen one's overlap with the pool's pages, credited or not (`prices_pool`)."""
        return None

    def _first_token(self, rank: int, work: Work, ttft_ms: float) -> None:
        """A first token's release told a learning policy how long it took (nothing, here)."""

    def served(self, request, decision, result, now) -> None:
        rank, prefill_pages, booked, work = self._booked.pop(request.index)
        first_token = now + result.ttft_s
        self._seq += 1
        # the client's TTFT in ms, as a release carries it (the pipeline's driver sends the same)
        learn = (work, result.ttft_s * 1000) if work is not None else None
        heapq.heappush(self._releases, _Release(first_token, self._seq, rank, prefill_pages, 0, learn=learn))
        self._seq += 1
        heapq.heappush(self._releases, _Release(result.complete_at, self._seq, rank, 0,
                                                decode_pages(request, self.page_size), booked))

    async def close(self) -> None:
        pass


class PredictedTtftModel(RouterModel):
    """`--router-mode predicted-ttft` in process: the router model whose formula's choice is
    overridden where the rates it learns say another worker is clearly faster
    (router/rates.py `faster_than_formula`), learned from the first-token times it is told
    (the lockstep's simulated TTFT, as a client's release would report it)."""

    prices_pool = True

    def __init__(self, *args, prior: RatePrior | None = None, fit: FitSettings | None = None,
                 pick: FasterPick = FASTER_PICK, **kwargs):
        super().__init__(*args, **kwargs)
        self.prior = prior or RatePrior()
        self.fit_settings = fit or FitSettings()
        self.pick = pick
        self.fits: list[RateFit] = [self.fit_settings.first_fit() for _ in range(self.workers)]
        self.errors: list[PredictionError] = [PredictionError() for _ in range(self.workers)]
        #: Per rank, the same errors' means over the whole replay (a replay's own figure beside
        #: the routers' running ones).
        self.run_errors: list[PredictionError] = [PredictionError() for _ in range(self.workers)]
        self._request: PreparedRequest | None = None

    async def decide(self, request, now, cluster, truth, tokens=None) -> Decision:
        self._request = request  # what _score prices (the router's decision sees the request too)
        return await super().decide(request, now, cluster, truth, tokens)

    def _score(self, request_pages, candidates, u):
        request = self._request
        assert request is not None
        columns = ttft_columns(request.input_tokens, [c.overlap for c in candidates],
                               [self.page_size] * len(candidates), [self.fits[r] for r in self.order], self.prior,
                               self.pick)
        return formula_then_faster(request_pages, candidates, self.weights, u, columns, self.pick)

    def _decided(self, request, seen, priced) -> Work:
        return predicted_work(request.input_tokens, priced, seen.prefill_load, self.page_size)

    def _first_token(self, rank: int, work: Work, ttft_ms: float) -> None:
        # seconds as release.lua reads them (ms / 1000), so the pipeline's fit and errors are these exactly
        self.fits[rank], self.errors[rank], off = observe_and_track(self.fits[rank], self.errors[rank], self.prior,
                                                                    work, ttft_ms / 1000, self.fit_settings)
        if off is not None:
            self.run_errors[rank] = with_error(self.run_errors[rank], off, memory=0.0)

    def learned(self, cluster: SimCluster, now: float) -> dict:
        """Per rank: samples, the learned compute multiplier and the true one at `now` (the
        inverse of its speed), the learned load multipliers, and how far the first tokens came
        from their predictions (PredictionError, as the routers' /healthz shows it)."""
        return {str(rank): {"samples": fit.samples, "compute": round(fit.multipliers[0], 3),
                            "true_compute": round(1 / cluster.speed(rank, now), 3),
                            "host_load": round(fit.multipliers[1], 3), "l3_load": round(fit.multipliers[2], 3),
                            "queued": round(fit.multipliers[3], 3),
                            "ttft_mape": round(error.mape, 3), "ttft_bias": round(error.bias, 3),
                            "ttft_mape_run": round(run.mape, 3) if run.samples else None,
                            "ttft_bias_run": round(run.bias, 3) if run.samples else None}
                for rank, (fit, error, run) in enumerate(zip(self.fits, self.errors, self.run_errors))}


def worker_id(rank: int) -> str:
    """The worker id `kvtier bridge --worker-id sim --dp-size N` gives rank r."""
    return f"sim-dp{rank}"


def decode_pages(request: PreparedRequest, page_size: int) -> int:
    """What a router books as decode load: prompt plus expected output, in pages."""
    return -(-(request.input_tokens + request.output_tokens) // page_size)
