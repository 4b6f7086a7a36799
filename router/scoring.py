"""The scoring formula of docs/DESIGN.md (the Dynamo HiCache guide's), as pure functions: no I/O,
no clock, no hidden randomness. The caller supplies the random draw `u` in [0, 1), so a
decision can be reproduced exactly from its inputs (the decision log records `u`).

    adjusted = max(prefill_blocks - credit*device - host_w*host - disk_w*disk
                   - shared_multiplier*shared_beyond, 0)
    logit    = prefill_load_scale*adjusted + decode_blocks        (lower is better)

`prefill_blocks` = request pages + the worker's queued prefill pages; `decode_blocks` = its
active decode pages. Temperature 0: argmin, ties broken by `u`; T > 0: softmax over the
min-max normalised logits, sampled with `u`.

`select_and_book.lua` evaluates the same load-dependent step inside Redis so selection and
booking are one atomic step across router replicas; it takes `cache_credit()` from here and
`tests/router/test_router_scoring.py` checks that both agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.schemas.routing import ScoringWeights, TierOverlap


@dataclass(frozen=True)
class CandidateInputs:
    worker_id: str
    overlap: TierOverlap
    prefill_load: int = 0  # queued prefill pages booked on the worker
    decode_load: int = 0  # active decode pages booked on the worker


def credit_terms(overlap: TierOverlap, weights: ScoringWeights) -> tuple[float, float, float, float, float]:
    """The cache credit's terms, in pages: device, host, disk, shared pool beyond the device
    prefix, predicted pages."""
    return (weights.overlap_score_credit * overlap.device,
            weights.host_cache_hit_weight * overlap.host,
            weights.disk_cache_hit_weight * overlap.disk,
            weights.shared_cache_multiplier * overlap.shared_beyond,
            weights.predicted_page_weight * overlap.predicted)


def cache_credit(overlap: TierOverlap, weights: ScoringWeights) -> float:
    """Pages of prefill the worker's caches save for this request (the load-free part)."""
    return sum(credit_terms(overlap, weights))


def logit(request_pages: int, credit: float, prefill_load: int, decode_load: int,
          prefill_load_scale: float) -> float:
    adjusted = max(request_pages + prefill_load - credit, 0.0)
    return prefill_load_scale * adjusted + decode_load


@dataclass(frozen=True)
class ScoreTerms:
    """Every term of one candidate's logit, as `logits()` computes it (`kvtier replay explain`
    prints them): logit = prefill_load_scale * adjusted + decode_blocks, where
    adjusted = max(prefill_blocks - credit, 0) and credit is the sum of the four credit terms."""

    prefill_blocks: int  # request pages + the worker's queued prefill pages
    device_credit: float
    host_credit: float
    disk_credit: float
    shared_credit: float
    predicted_credit: float
    credit: float
    adjusted: float
    decode_blocks: int  # the worker's active decode pages
    logit: float


def score_terms(request_pages: int, candidate: CandidateInputs, weights: ScoringWeights) -> ScoreTerms:
    """One candidate's logit with its terms; `logits()` is built on it, so they cannot drift."""
    device, host, disk, shared, predicted = credit_terms(candidate.overlap, weights)
    credit = device + host + disk + shared + predicted
    prefill_blocks = request_pages + candidate.prefill_load
    value = logit(request_pages, credit, candidate.prefill_load, candidate.decode_load, weights.prefill_load_scale)
    return ScoreTerms(prefill_blocks=prefill_blocks, device_credit=device, host_credit=host, disk_credit=disk,
                      shared_credit=shared, predicted_credit=predicted, credit=credit,
                      adjusted=max(prefill_blocks - credit, 0.0), decode_blocks=candidate.decode_load, logit=value)


def logits(request_pages: int, candidates: Sequence[CandidateInputs], weights: ScoringWeights) -> list[float]:
    return [score_terms(request_pages, c, weights).logit for c in candidates]


def logits_of(request_pages: int, credits: Sequence[float], prefill_loads: Sequence[int],
              decode_loads: Sequence[int], prefill_load_scale: float) -> list[float]:
    """`logits()` on columns, for the decision's hot path: each candidate's credit given (as
    `cache_credit` computes it), the same `logit()` applied, no terms built.
    tests/router/test_router_scoring.py checks both give the same values."""
    # logit() inlined (max(x, 0.0) is `0.0 if 0.0 > x else x`): a call per candidate costs
    # more than the arithmetic.
    return [prefill_load_scale * (0.0 if 0.0 > (x := request_pages + prefill - credit) else x) + decode
            for credit, prefill, decode in zip(credits, prefill_loads, decode_loads)]


def choose(values: Sequence[float], temperature: float, u: float) -> int:
    """Index of the chosen candidate. `u` in [0, 1) breaks ties (T = 0) or samples (T > 0)."""
    if not values:
        raise ValueError("no candidates to choose from")
    u = min(max(u, 0.0), math.nextafter(1.0, 0.0))
    low = min(values)
    if temperature <= 0.0:
        ties = [i for i, v in enumerate(values) if v == low]
        return ties[int(u * len(ties))]
    high = max(values)
    span = high - low
    if span == 0.0:
        return int(u * len(values))
    weights = [math.exp(-((v - low) / span) / temperature) for v in values]
    # added left to right as select_and_book.lua adds them: sum() compensates float rounding
    # from Python 3.12 on, and the two could choose differently at a boundary
    total = 0.0
    for w in weights:
        total += w
    target = u * total
    running = 0.0
    for i, w in enumerate(weights):
        running += w
        if target < running:
            return i
    return len(values) - 1


@dataclass(frozen=True)
class Scored:
    chosen: int
    logits: list[float]


def score(request_pages: int, candidates: Sequence[CandidateInputs], weights: ScoringWeights, u: float) -> Scored:
    values = logits(request_pages, candidates, weights)
    return Scored(choose(values, weights.temperature, u), values)
