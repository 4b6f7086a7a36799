"""The lockstep replay: a trace through a simulated cluster, one request at a time, on the
trace's clock only. Same trace, policy and seed => the same result on any machine at any
speed: nothing here reads a wall clock, and a policy that goes through the real pipeline
(kvtier/eval/pipeline.py) waits until the pipeline has caught up before each decision.

Per request, at its arrival time t:
  1. the cluster lands the device->host copies due by t;
  2. the ground truth is read (every rank's tiers and true queued work);
  3. the policy decides (a pipeline policy first lets through the events due by
     t - visibility lag and waits until routers can see them);
  4. the chosen rank serves the request (simulated TTFT from the cost model).

Beside each decision the oracle's choice on the same ground truth is recorded, and when the
policy chose otherwise, why (`reason_for`), so a reader sees where the available gain goes.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

import msgspec

from kvtier.eval.policies import CandidateView, Decision, Policy, oracle_choice
from kvtier.eval.trace import PreparedRequest
from kvtier.router import scoring
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.hicache_sim import ServeResult
from kvtier.sim.sim_cluster import ClusterShape, RankTruth, SimCluster

#: Why a policy did not choose the oracle's rank (breakdown keys, in the order they are tested).
REASONS = {
    "same": "chose the oracle's worker (or one the oracle scores the same)",
    "degraded": "the decision was degraded (state store, shared pool or stale workers)",
    "missing": "the oracle's worker was not a candidate (stale, expired or unknown)",
    "not_yet_visible": "the oracle's worker holds more of the prefix than the router could see yet",
    "overstated": "the router saw more cache on some worker than it really had (removals not yet visible)",
    "shared_pool": "the router saw the shared pool differently",
    "load": "same cache view, but booked load differs from the true queued work",
    "tie": "a tie broken differently",
}


@dataclass
class RequestOutcome:
    rank: int
    oracle_rank: int
    reason: str
    ttft_s: float
    queue_s: float
    service_s: float
    recomputed_tokens: int
    hit_pages: tuple[int, int, int]  # device, host, L3
    degraded: bool
    #: Seconds per output token after the first (None: no output tokens). Cache affinity can
    #: pack decode batches, which this shows.
    tpot_s: float | None = None
    #: Trace seconds after the first request.
    since_start_s: float = 0.0


@dataclass
class RunResult:
    policy: str
    shape: ClusterShape
    outcomes: list[RequestOutcome] = field(default_factory=list)
    prompt_tokens: int = 0
    span_s: float = 0.0
    utilisation: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)  # each rank's prefill seconds, as its engine counted them
    #: What the policy learned, where it learns (Policy.learned), beside the truth at the end.
    learned: dict | None = None

    def cost_check(self) -> dict:
        """The replay's own accounting against the cost model (docs/COST_MODEL.md)."""
        service = [0.0] * self.shape.workers
        for o in self.outcomes:
            service[o.rank] += o.service_s
        return {
            "max_utilisation": round(max(self.utilisation), 3) if self.utilisation else None,
            "saturated_workers": sum(u >= 1.0 for u in self.utilisation),
            "ttft_at_least_service": all(o.ttft_s >= o.service_s - 1e-9 for o in self.outcomes),
            "busy_equals_service": all(abs(b - s) <= 1e-6 * max(1.0, s) for b, s in zip(self.busy_s, service)),
        }

    def summary(self) -> dict:
        recomputed = sum(o.recomputed_tokens for o in self.outcomes)
        ttft = sorted(o.ttft_s for o in self.outcomes) or [0.0]
        counts = [0] * self.shape.workers
        for o in self.outcomes:
            counts[o.rank] += 1
        mean = statistics.fmean(counts)
        page = self.shape.page_size
        hits = {tier: sum(o.hit_pages[i] for o in self.outcomes) * page
                for i, tier in enumerate(("device", "host", "l3"))}
        reasons = {name: 0 for name in REASONS}
        for o in self.outcomes:
            reasons[o.reason] += 1
        tpot = sorted(o.tpot_s for o in self.outcomes if o.tpot_s is not None) or [0.0]
        return {
            "requests": len(self.outcomes),
            "recomputed_tokens": recomputed,
            "reused_pct": round(100 * (1 - recomputed / self.prompt_tokens), 2) if self.prompt_tokens else 0.0,
            "hit_tokens": hits,
            "ttft_p50_ms": round(percentile(ttft, 0.5) * 1000, 1),
            "ttft_p99_ms": round(percentile(ttft, 0.99) * 1000, 1),
            "ttft_mean_ms": round(statistics.fmean(ttft) * 1000, 1),
            "tpot_p50_ms": round(percentile(tpot, 0.5) * 1000, 2),
            "tpot_p99_ms": round(percentile(tpot, 0.99) * 1000, 2),
            "imbalance": round(max(counts) / mean, 3) if mean else None,
            "load_share_pct": {str(rank): round(100 * n / len(self.outcomes), 1) if self.outcomes else 0.0
                               for rank, n in enumerate(counts)},
            "cost_check": self.cost_check(),
            "degraded_decisions": sum(o.degraded for o in self.outcomes),
            "oracle_agreement_pct": round(100 * reasons["same"] / len(self.outcomes), 1) if self.outcomes else 0.0,
            "breakdown": reasons,
            **({"slowdown": self.slowdown_shares()} if self.shape.slowdowns else {}),
            **({"learned": self.learned} if self.learned is not None else {}),
        }

    #: Requests per window of the slowdown view.
    SLOWDOWN_WINDOW = 100

    def slowdown_shares(self) -> dict:
        """The first slowdown's worker: its share of the requests in the window before the
        slowdown and in each window after it, so a reader sees how soon a policy noticed."""
        slow = self.shape.slowdowns[0]
        before = [o for o in self.outcomes if o.since_start_s < slow.at_s][-self.SLOWDOWN_WINDOW:]
        after = [o for o in self.outcomes if o.since_start_s >= slow.at_s]
        windows = [after[i:i + self.SLOWDOWN_WINDOW] for i in range(0, len(after), self.SLOWDOWN_WINDOW)][:5]

        def share(group: list[RequestOutcome]) -> float | None:
            return round(100 * sum(o.rank == slow.rank for o in group) / len(group), 1) if group else None

        return {"rank": slow.rank, "at_s": slow.at_s, "window": self.SLOWDOWN_WINDOW, "share_before_pct": share(before),
                "share_after_pct": {f"{i * self.SLOWDOWN_WINDOW}-{(i + 1) * self.SLOWDOWN_WINDOW}": share(w)
                                    for i, w in enumerate(windows)}}


def percentile(sorted_values: list[float], q: float) -> float:
    """The value at rank ceil(q * n) (nearest rank), so p99 of 100 values is the 99th."""
    if not sorted_values:
        return 0.0
    index = math.ceil(round(q * len(sorted_values), 9)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, index))]


def tpot_of(served: ServeResult, arrival: float, output_tokens: int) -> float | None:
    """Seconds per output token from the first token to the last."""
    if output_tokens <= 0:
        return None
    return (served.complete_at - arrival - served.ttft_s) / output_tokens


def _credit(c: CandidateView, weights: ScoringWeights) -> float:
    return scoring.cache_credit(c.overlap, weights)


def reason_for(decision: Decision, oracle_rank: int, oracle_seen: list[CandidateView], weights: ScoringWeights,
               shared: bool) -> str:
    """Why `decision` differs from the oracle's choice (REASONS)."""
    truth = {c.rank: c for c in oracle_seen}
    if decision.rank == oracle_rank or truth[decision.rank].logit == truth[oracle_rank].logit:
        return "same"
    if decision.degraded:
        return "degraded"
    if decision.seen is None:
        return "load"  # a cache-blind policy: its choice is all it has
    seen = {c.rank: c for c in decision.seen}
    if oracle_rank not in seen:
        return "missing"
    local = _no_shared(weights)  # the worker's own tiers; the pool is judged apart below
    for rank in (oracle_rank, decision.rank):
        s, t = seen[rank], truth[rank]
        local_seen = (s.overlap.device + s.overlap.predicted, s.overlap.host, s.overlap.disk)
        local_true = (t.overlap.device, t.overlap.host, 0)
        if local_seen != local_true:
            return "not_yet_visible" if _credit(s, local) < _credit(t, local) else "overstated"
    if shared and any(seen[r].overlap.shared_beyond != truth[r].overlap.shared_beyond for r in seen):
        return "shared_pool"
    if seen[oracle_rank].logit == seen[decision.rank].logit:
        return "tie"
    return "load"


def _no_shared(weights: ScoringWeights) -> ScoringWeights:
    return msgspec.structs.replace(weights, shared_cache_multiplier=0.0)


async def run_lockstep(policy: Policy, requests: list[PreparedRequest], shape: ClusterShape,
                       oracle_weights: ScoringWeights, shared: bool, seed: int, progress=None) -> RunResult:
    """Replay `requests` through `policy` on a fresh cluster (`policy.start` is given it).
    `shared`: the oracle credits the shared pool. Token ids are computed only for policies
    whose events leave the process (they carry them)."""
    cluster = SimCluster(shape, emit_events=policy.needs_events, event_token_ids=policy.needs_tokens)
    try:
        await policy.start(cluster)
        return await _replay(policy, cluster, requests, shape, oracle_weights, shared, seed, progress)
    finally:
        await policy.close()


async def _replay(policy: Policy, cluster: SimCluster, requests: list[PreparedRequest], shape: ClusterShape,
                  oracle_weights: ScoringWeights, shared: bool, seed: int, progress) -> RunResult:
    oracle_rng = random.Random(seed)
    result = RunResult(policy.name, shape)
    for request in requests:
        now = request.arrival_s
        cluster.advance(now)
        truth: list[RankTruth] = cluster.truth(request.digests, now)
        oracle_rank, oracle_seen = oracle_choice(request, truth, oracle_weights, shared, oracle_rng.random())
        tokens = request.token_ids() if policy.needs_tokens else None
        decision = await policy.decide(request, now, cluster, truth, tokens)
        served = cluster.serve(decision.rank, tokens if tokens is not None else range(request.input_tokens), now,
                               request.output_tokens, request.digests)
        policy.served(request, decision, served, now)
        result.outcomes.append(RequestOutcome(
            rank=decision.rank, oracle_rank=oracle_rank,
            reason=reason_for(decision, oracle_rank, oracle_seen, oracle_weights, shared),
            ttft_s=served.ttft_s, queue_s=served.queue_s, service_s=served.service_s,
            recomputed_tokens=served.recomputed_tokens,
            hit_pages=(served.device_hit_pages, served.host_hit_pages, served.l3_hit_pages),
            degraded=bool(decision.degraded), tpot_s=tpot_of(served, now, request.output_tokens),
            since_start_s=now - requests[0].arrival_s))
        result.prompt_tokens += request.input_tokens
        if progress is not None:
            progress(policy.name, len(result.outcomes), len(requests))
    result.span_s = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    result.utilisation = cluster.utilisation(result.span_s)
    result.busy_s = [sim.engine.busy_s for sim in cluster.ranks]
    learned = getattr(policy, "learned", None)
    if learned is not None and requests:
        result.learned = learned(cluster, requests[-1].arrival_s)
    return result

