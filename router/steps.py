"""The pure steps of a routing decision: filtering the candidates, choosing among them and
building what the decision answers and logs.

Nothing here does I/O: router/core.py reads Redis, the index and the shared pool, and hands
what it read to these steps, which return a value or raise the RoutingError the service
answers with. So each step can be checked on hand-built inputs (tests/router/test_router_steps.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvtier.schemas.routing import (
    AdmissionSettings,
    CandidateScore,
    RouteDecision,
    RouteResponse,
    ScoringWeights,
    TierOverlap,
)
from kvtier.schemas.worker import MooncakeLayout

from . import scoring
from .errors import Busy, NoWorkers
from .hashing import RequestPages
from .shared_pool import SharedPages
from .state import ModelDirectory, Views, WorkerStatus, WorkerView
from .tier_index import NO_OVERLAP

DEGRADED_STATE_STORE = "state-store-unavailable"
DEGRADED_SHARED_POOL = "shared-pool-unavailable"
DEGRADED_ONLY_STALE = "only-stale-workers"
DEGRADED_REBUILDING = "state-store-rebuilding"

#: What the shared pool answered: {page size: {Mooncake layout: the pages it holds}}.
SharedAnswer = dict[int, dict[MooncakeLayout, SharedPages]]

Worker = TypeVar("Worker")


def most_common_page_size(sizes: Iterable[int]) -> int:
    """The page size most workers use (the smallest among equals); 1 when none is known."""
    counts = Counter(size for size in sizes if size > 0)
    return max(sorted(counts), key=lambda size: counts[size]) if counts else 1


def decode_pages_of(n_tokens: int, max_new_tokens: int, page_size: int) -> int:
    """Pages the request's prompt and output budget fill at `page_size` (rounded up)."""
    return -(-(n_tokens + max_new_tokens) // page_size)


def _itself(worker):
    return worker


def reachable(model: str, workers: list[Worker], exclude: frozenset[str], left_out: frozenset[str],
              worker_of: Callable[[Worker], str] = _itself) -> list[Worker]:
    """`workers` less those excluded and those whose circuit is open (`left_out`); the open
    ones are kept when nothing else is left (better a worker that failed lately than none)."""
    if not exclude and not left_out:
        return workers
    untried = [w for w in workers if worker_of(w) not in exclude]
    if not untried:
        raise NoWorkers(f"no other worker of model {model!r} to try (tried: {', '.join(sorted(exclude))})")
    closed = [w for w in untried if worker_of(w) not in left_out]
    return closed or untried


def under_thresholds(model: str, admission: AdmissionSettings, page_sizes: Sequence[int], prefill: Sequence[int],
                     decode: Sequence[int]) -> list[int]:
    """The indexes of the workers (given by columns) under both busy thresholds; Busy when none is."""
    busy_prefill, busy_decode = admission.busy_prefill_tokens, admission.busy_decode_pages
    if not busy_prefill and not busy_decode:
        return list(range(len(prefill)))
    under = [i for i in range(len(prefill))
             if not (busy_prefill and prefill[i] * max(page_sizes[i], 1) >= busy_prefill)
             and not (busy_decode and decode[i] >= busy_decode)]
    if not under:
        raise Busy(f"every worker of model {model!r} is at its busy threshold (booked prefill >= "
                   f"{busy_prefill} tokens or decode >= {busy_decode} pages)")
    return under


def admitted(model: str, admission: AdmissionSettings, views: list[WorkerView]) -> list[WorkerView]:
    """The views of workers under both busy thresholds; Busy when none is."""
    under = under_thresholds(model, admission, [v.page_size for v in views], [v.prefill_load for v in views],
                             [v.decode_load for v in views])
    return views if len(under) == len(views) else [views[i] for i in under]


def load_only(views: Iterable[WorkerView]) -> list[WorkerView]:
    """The views with their overlaps dropped, for a choice on load alone."""
    return [WorkerView(v.worker_id, v.status, v.page_size, TierOverlap(), v.prefill_load, v.decode_load)
            for v in views]


@dataclass(frozen=True)
class Candidates:
    """The views a full read leaves to score, and why the decision is degraded."""

    views: list[WorkerView]
    degraded: list[str]
    #: False while the model's state is rebuilt: the shared pool's answer is not used either.
    shared_trusted: bool = True


def candidates_of(model: str, views: Views, shared_error: str) -> Candidates | None:
    """The fresh workers of a read; while the state is rebuilt, every live worker on load
    alone (None when there is none: the caller routes without state); with no fresh worker,
    the stale ones on load alone. NoWorkers when no lease was renewed lately."""
    fresh = [v for v in views if v.status is WorkerStatus.CANDIDATE]
    degraded: list[str] = []
    if views.degraded:
        degraded.append(views.degraded)
    if shared_error:
        degraded.append(DEGRADED_SHARED_POOL)
    if views.rebuilding:
        # The store lost this model's state and it is being rebuilt: what it holds is not
        # what the workers hold. Route on load alone, among every live worker.
        if not views:
            return None
        return Candidates(load_only(views), [*degraded, DEGRADED_REBUILDING], shared_trusted=False)
    if not fresh:
        stale = [v for v in views if v.status is WorkerStatus.STALE]
        if not stale:
            raise NoWorkers(f"no live worker for model {model!r} (no lease renewed recently)")
        # Their state may under-report pages: route among them by load alone.
        return Candidates(load_only(stale), [*degraded, DEGRADED_ONLY_STALE])
    return Candidates(fresh, degraded)


def with_shared(worker_id: str, page_size: int, overlap: TierOverlap, directory: ModelDirectory,
                shared: SharedAnswer | None) -> TierOverlap:
    """`overlap` with the pages the shared pool holds past the worker's own (for a worker
    that publishes a Mooncake layout the pool answered for)."""
    if not shared:
        return overlap
    meta = directory.workers.get(worker_id)
    if meta is None or meta.mooncake is None:
        return overlap
    pages: SharedPages | None = shared.get(page_size, {}).get(meta.mooncake)
    if pages is None:
        return overlap
    return TierOverlap(device=overlap.device, host=overlap.host, disk=overlap.disk, predicted=overlap.predicted,
                       shared_beyond=pages.beyond(overlap.device + overlap.predicted))


@dataclass(frozen=True)
class ScoreInputs:
    """What a full read's candidates are scored and booked on."""

    inputs: list[scoring.CandidateInputs]
    credits: list[float]
    primary_size: int  # the page size the request's pages are counted at
    n_pages: int
    decode_pages: int
    #: Each input's overlap with the shared pool's pages, credited or not: what its first token
    #: waits for (the booking's work, which its rates learn from).
    priced: list[TierOverlap]


def score_inputs(views: list[WorkerView], directory: ModelDirectory, shared: SharedAnswer | None,
                 pages_by_size: Mapping[int, RequestPages], n_tokens: int, max_new_tokens: int,
                 weights: ScoringWeights, credit_shared: bool = True) -> ScoreInputs:
    """Each view's overlap (with the shared pool's pages where `credit_shared`), load and
    cache credit, and its overlap with the pool's pages in any case (`ScoreInputs.priced`)."""
    priced = [with_shared(v.worker_id, v.page_size, v.overlap, directory, shared) for v in views]
    inputs = [scoring.CandidateInputs(v.worker_id, p if credit_shared else v.overlap, v.prefill_load, v.decode_load)
              for v, p in zip(views, priced)]
    # Workers of one model share a page size in practice; with mixed sizes the request's
    # page count is taken at the most common one, and each worker's overlap at its own.
    primary_size = most_common_page_size(v.page_size for v in views)
    n_pages = len(pages_by_size[primary_size]) if primary_size in pages_by_size else 0
    credits = [scoring.cache_credit(c.overlap, weights) for c in inputs]
    return ScoreInputs(inputs, credits, primary_size, n_pages, decode_pages_of(n_tokens, max_new_tokens, primary_size),
                       priced)


def kept_only(scores: ScoreInputs, index: int) -> ScoreInputs:
    """`scores` with its candidate at `index` alone (a session's worker that stays)."""
    return dataclasses.replace(scores, inputs=[scores.inputs[index]], credits=[scores.credits[index]],
                               priced=[scores.priced[index]])


def keep_session(inputs: Sequence[scoring.CandidateInputs], kept: str | None, n_pages: int,
                 weights: ScoringWeights, u: float) -> tuple[int | None, str]:
    """The index of the session's worker among `inputs` and whether the formula would have
    chosen it too ("kept") or not ("overrode"); (None, "") when it is not a candidate."""
    index = next((i for i, c in enumerate(inputs) if c.worker_id == kept), None)
    if index is None:
        return None, ""
    would = inputs[scoring.score(n_pages, inputs, weights, u).chosen].worker_id
    return index, "kept" if would == kept else "overrode"


def booking_offers(inputs: Sequence[scoring.CandidateInputs], credits: Sequence[float]) -> list[tuple[str, float, int]]:
    """select_and_book.lua's candidates: (worker id, cache credit, pages it need not compute)."""
    return [(c.worker_id, credit, c.overlap.device + c.overlap.predicted) for c, credit in zip(inputs, credits)]


def with_loads(inputs: Sequence[scoring.CandidateInputs], prefill_loads: Sequence[int],
               decode_loads: Sequence[int]) -> list[scoring.CandidateInputs]:
    """The candidates with the loads the booking saw."""
    return [scoring.CandidateInputs(c.worker_id, c.overlap, p, d)
            for c, p, d in zip(inputs, prefill_loads, decode_loads)]


def scored_candidates(inputs: Sequence[scoring.CandidateInputs], logits: Sequence[float],
                      page_sizes: Sequence[int]) -> list[CandidateScore]:
    """The answer's candidates, one per input, in their order."""
    return [CandidateScore(worker_id=c.worker_id, logit=logits[i], overlap=c.overlap, prefill_load=c.prefill_load,
                           decode_load=c.decode_load, page_size=page_sizes[i])
            for i, c in enumerate(inputs)]


# --- the lean decision's steps (router/lean.py) ------------------------------------------
def lean_primary_size(by_size: Mapping[int, list[str]], live: Mapping[str, tuple[int, int]],
                      ids: Iterable[str]) -> int:
    """The page size the request's pages are counted at: the roster's one size, else the most
    common among the candidates."""
    return next(iter(by_size)) if len(by_size) == 1 else most_common_page_size(live[w][0] for w in ids)


def lean_credits(ids: Iterable[str], overlaps: Mapping[str, TierOverlap], weights: ScoringWeights) -> list[float]:
    """Each candidate's cache credit; none for a worker the index holds no page of."""
    return [0.0 if overlaps[w] is NO_OVERLAP else scoring.cache_credit(overlaps[w], weights) for w in ids]


def choose_on_copy(ids: Sequence[str], pool: Sequence[int], n_pages: int, credits: Sequence[float],
                   prefill: Sequence[int], decode: Sequence[int], weights: ScoringWeights, u: float,
                   kept: str | None) -> tuple[int, int, list[float]]:
    """(the index proposed, the index the formula chose, every candidate's logit): the
    formula's choice among `pool` (the indexes under the busy thresholds), or the session's
    worker `kept` when it is in the pool (None: no worker to keep)."""
    values = scoring.logits_of(n_pages, credits, prefill, decode, weights.prefill_load_scale)
    formula = pool[scoring.choose([values[i] for i in pool], weights.temperature, u)]
    chosen = ids.index(kept) if kept is not None and in_pool(kept, ids, pool) else formula
    return chosen, formula, values


def in_pool(worker: str, ids: Sequence[str], pool: Sequence[int]) -> bool:
    """Whether `worker` is a candidate under the busy thresholds."""
    return worker in ids and ids.index(worker) in pool


def prefill_pages_needed(n_pages: int, overlap: TierOverlap) -> int:
    """The request's pages the worker must compute (those not on its device, nor predicted)."""
    return max(n_pages - overlap.device - overlap.predicted, 0)


def pool_candidates(ids: Sequence[str], pool: Iterable[int], logits: Sequence[float],
                    overlaps: Mapping[str, TierOverlap], prefill: Sequence[int], decode: Sequence[int],
                    live: Mapping[str, tuple[int, int]]) -> list[CandidateScore]:
    """The lean answer's candidates: the workers under the busy thresholds, with the copy's loads."""
    return [CandidateScore(worker_id=ids[i], logit=logits[i], overlap=overlaps[ids[i]], prefill_load=prefill[i],
                           decode_load=decode[i], page_size=live[ids[i]][0])
            for i in pool]


def fallback_response(request_id: str, n_tokens: int, worker_id: str, workers: Sequence[str],
                      directory: ModelDirectory, reason: str) -> RouteResponse:
    """The answer of a decision made without tier state: every candidate with no overlap,
    no load and no score, the request counted at the most common page size."""
    page_size = most_common_page_size(meta.page_size for meta in directory.workers.values())
    candidates = [CandidateScore(worker_id=w, logit=0.0, overlap=TierOverlap(), prefill_load=0, decode_load=0,
                                 page_size=directory.workers[w].page_size) for w in workers]
    return RouteResponse(
        request_id=request_id, worker_id=worker_id, logit=0.0, overlap=TierOverlap(), candidates=candidates,
        request_pages=n_tokens // page_size, page_size=page_size, degraded=[reason], booked=False,
        worker_url=directory.workers[worker_id].http_endpoint)


def decision_record(*, request_id: str, model: str, router_id: str, ts: float, weights: ScoringWeights, u: float,
                    pages_by_size: Mapping[int, RequestPages], n_pages: int, chosen: str,
                    candidates: list[CandidateScore], degraded: list[str], latency_s: float,
                    shared_queried: bool, predicted_ttft_ms: float | None = None) -> RouteDecision:
    """The decision as the decision log publishes it."""
    return RouteDecision(
        request_id=request_id, model=model, router_id=router_id, ts=ts, weights=weights, random_draw=u,
        page_hashes={size: list(p.hashes) for size, p in pages_by_size.items()}, request_pages=n_pages,
        chosen=chosen, candidates=candidates, degraded=degraded, latency_ms=latency_s * 1000,
        shared_pool_queried=shared_queried, predicted_ttft_ms=predicted_ttft_ms)

