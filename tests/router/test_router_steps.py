"""The routing decision's pure steps (router/steps.py), each on small hand-built inputs: which
workers stay candidates, who is chosen, and what the answer and the decision log say. No Redis,
no index: the steps take what router/core.py read and return values."""

from __future__ import annotations

import pytest

from kvtier.router import scoring, steps
from kvtier.router.errors import Busy, NoWorkers
from kvtier.router.hashing import RequestPages
from kvtier.router.lean import SessionMemory
from kvtier.router.shared_pool import SharedPages
from kvtier.router.state import ModelDirectory, Views, WorkerStatus, WorkerView
from kvtier.router.tier_index import NO_OVERLAP
from kvtier.schemas.routing import AdmissionSettings, CandidateScore, ScoringWeights, TierOverlap
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

WEIGHTS = ScoringWeights()  # device credit 1.0, host 0.75, disk 0.25, shared 0.5, prefill scale 16
LAYOUT = MooncakeLayout(tp_size=2)


def view(worker: str, status: WorkerStatus = WorkerStatus.CANDIDATE, page_size: int = 16, device: int = 0,
         prefill: int = 0, decode: int = 0) -> WorkerView:
    return WorkerView(worker, status, page_size, TierOverlap(device=device, host=1), prefill, decode)


def views_of(*items: WorkerView, rebuilding: bool = False, degraded: str = "") -> Views:
    views = Views(items)
    views.rebuilding = rebuilding
    views.degraded = degraded
    return views


def directory(**page_sizes: int) -> ModelDirectory:
    """Workers named by keyword, each with its page size; "w1" publishes a Mooncake layout."""
    return ModelDirectory({w: WorkerMetadata(worker_id=w, model="m", page_size=size, http_endpoint=f"http://{w}",
                                             mooncake=LAYOUT if w == "w1" else None)
                           for w, size in page_sizes.items()}, read_at=0.0)


# --- page counts ---------------------------------------------------------------------------
def test_most_common_page_size_takes_the_majority_and_the_smallest_among_equals():
    assert steps.most_common_page_size([32, 16, 32]) == 32
    assert steps.most_common_page_size([32, 16]) == 16
    assert steps.most_common_page_size([64, 0, -1, 64, 16]) == 64
    assert steps.most_common_page_size([]) == 1
    assert steps.most_common_page_size([0]) == 1


def test_decode_pages_round_the_prompt_and_budget_up():
    assert steps.decode_pages_of(10, 5, 4) == 4  # 15 tokens: 3.75 pages
    assert steps.decode_pages_of(16, 0, 16) == 1
    assert steps.decode_pages_of(17, 0, 16) == 2


def test_prefill_pages_needed_leaves_out_device_and_predicted_pages():
    assert steps.prefill_pages_needed(10, TierOverlap(device=3, predicted=2, host=4)) == 5
    assert steps.prefill_pages_needed(4, TierOverlap(device=3, predicted=2)) == 0


# --- filtering: circuits, busy thresholds, stale and rebuilding state -------------------------
def test_reachable_drops_excluded_and_open_circuits():
    workers = ["a", "b", "c"]
    assert steps.reachable("m", workers, frozenset(), frozenset()) is workers
    assert steps.reachable("m", workers, frozenset({"a"}), frozenset()) == ["b", "c"]
    assert steps.reachable("m", workers, frozenset({"a"}), frozenset({"b"})) == ["c"]


def test_reachable_keeps_open_circuits_when_nothing_else_is_left():
    assert steps.reachable("m", ["a", "b"], frozenset({"a"}), frozenset({"b"})) == ["b"]
    assert steps.reachable("m", ["a", "b"], frozenset(), frozenset({"a", "b"})) == ["a", "b"]


def test_reachable_with_every_worker_tried_is_no_workers():
    with pytest.raises(NoWorkers, match="tried: a, b"):
        steps.reachable("m", ["b", "a"], frozenset({"a", "b"}), frozenset())


def test_reachable_reads_the_worker_of_each_item():
    items = [view("a"), view("b")]
    assert steps.reachable("m", items, frozenset({"a"}), frozenset(), lambda v: v.worker_id) == [items[1]]


def test_under_thresholds_counts_prefill_in_tokens_and_decode_in_pages():
    no_limits = AdmissionSettings()
    assert steps.under_thresholds("m", no_limits, [16, 16], [99, 99], [99, 99]) == [0, 1]
    prefill_limit = AdmissionSettings(busy_prefill_tokens=64)
    # 4 pages of 16 tokens reach 64 tokens; 3 do not; a page size of 0 counts as 1 token a page
    assert steps.under_thresholds("m", prefill_limit, [16, 16, 0], [4, 3, 63], [0, 0, 0]) == [1, 2]
    decode_limit = AdmissionSettings(busy_decode_pages=10)
    assert steps.under_thresholds("m", decode_limit, [16, 16], [0, 0], [10, 9]) == [1]


def test_under_thresholds_with_every_worker_busy_is_busy():
    with pytest.raises(Busy, match="model 'm'"):
        steps.under_thresholds("m", AdmissionSettings(busy_decode_pages=5), [16, 16], [0, 0], [5, 7])


def test_admitted_keeps_the_views_under_the_thresholds():
    views = [view("a", decode=9), view("b", decode=1)]
    assert steps.admitted("m", AdmissionSettings(), views) is views
    assert steps.admitted("m", AdmissionSettings(busy_decode_pages=5), views) == [views[1]]


def test_load_only_drops_the_overlap_and_keeps_the_loads():
    (only,) = steps.load_only([view("a", page_size=32, device=7, prefill=3, decode=4)])
    assert only == WorkerView("a", WorkerStatus.CANDIDATE, 32, TierOverlap(), 3, 4)


def test_candidates_of_a_normal_read_are_its_fresh_workers():
    fresh, stale = view("a", device=5), view("b", WorkerStatus.STALE, device=5)
    found = steps.candidates_of("m", views_of(fresh, stale, view("c", WorkerStatus.UNHASHED)), "")
    assert found == steps.Candidates([fresh], [], shared_trusted=True)


def test_candidates_of_only_stale_workers_are_chosen_on_load():
    stale = view("b", WorkerStatus.STALE, device=5, prefill=2)
    found = steps.candidates_of("m", views_of(stale, degraded="index-behind"), "pool down")
    assert found is not None
    assert [v.overlap for v in found.views] == [TierOverlap()]
    assert [v.prefill_load for v in found.views] == [2]
    assert found.degraded == ["index-behind", steps.DEGRADED_SHARED_POOL, steps.DEGRADED_ONLY_STALE]
    assert found.shared_trusted


def test_candidates_of_a_read_with_no_live_worker_is_no_workers():
    with pytest.raises(NoWorkers, match="no live worker"):
        steps.candidates_of("m", views_of(view("c", WorkerStatus.UNHASHED)), "")


def test_candidates_of_a_rebuilding_state_are_every_live_worker_on_load():
    views = views_of(view("a", device=5), view("b", WorkerStatus.STALE, device=3), rebuilding=True)
    found = steps.candidates_of("m", views, "pool down")
    assert found is not None
    assert [(v.worker_id, v.overlap) for v in found.views] == [("a", TierOverlap()), ("b", TierOverlap())]
    assert found.degraded == [steps.DEGRADED_SHARED_POOL, steps.DEGRADED_REBUILDING]
    assert not found.shared_trusted
    assert steps.candidates_of("m", views_of(rebuilding=True), "") is None


# --- the shared pool's credit -------------------------------------------------------------
def test_with_shared_counts_the_pool_pages_past_device_and_predicted():
    overlap = TierOverlap(device=1, predicted=1, host=1)
    shared = {16: {LAYOUT: SharedPages.of([True, True, True, False, True])}}
    found = steps.with_shared("w1", 16, overlap, directory(w1=16), shared)
    assert found == TierOverlap(device=1, predicted=1, host=1, shared_beyond=2)  # pages 2 and 4


def test_with_shared_leaves_the_overlap_without_an_answer_for_the_worker():
    overlap = TierOverlap(device=1)
    shared = {16: {LAYOUT: SharedPages.of([True, True])}}
    assert steps.with_shared("w1", 16, overlap, directory(w1=16), None) is overlap
    assert steps.with_shared("w2", 16, overlap, directory(w2=16), shared) is overlap  # no Mooncake layout
    assert steps.with_shared("gone", 16, overlap, directory(w1=16), shared) is overlap
    assert steps.with_shared("w1", 32, overlap, directory(w1=32), shared) is overlap  # no answer at 32


# --- scoring and choosing ---------------------------------------------------------------------
def test_score_inputs_count_pages_at_the_most_common_size():
    pages = {16: RequestPages.of(list(range(64)), 16), 32: RequestPages.of(list(range(64)), 32)}
    views = [view("a", 16, device=2, prefill=1), view("b", 16), view("c", 32)]
    scores = steps.score_inputs(views, directory(a=16, b=16, c=32), None, pages, 64, 30, WEIGHTS)
    assert (scores.primary_size, scores.n_pages, scores.decode_pages) == (16, 4, 6)
    assert [c.worker_id for c in scores.inputs] == ["a", "b", "c"]
    assert scores.inputs[0] == scoring.CandidateInputs("a", TierOverlap(device=2, host=1), 1, 0)
    assert scores.credits == [2.75, 0.75, 0.75]  # device 1.0 a page, host 0.75


def test_score_inputs_without_pages_at_the_primary_size_count_none():
    scores = steps.score_inputs([view("a", 16)], directory(a=16), None, {}, 64, 0, WEIGHTS)
    assert scores.n_pages == 0


def test_keep_session_says_whether_the_formula_agreed():
    inputs = [scoring.CandidateInputs("a", TierOverlap(device=4)), scoring.CandidateInputs("b", TierOverlap())]
    assert steps.keep_session(inputs, "a", 4, WEIGHTS, 0.0) == (0, "kept")
    assert steps.keep_session(inputs, "b", 4, WEIGHTS, 0.0) == (1, "overrode")
    assert steps.keep_session(inputs, "gone", 4, WEIGHTS, 0.0) == (None, "")
    assert steps.keep_session(inputs, None, 4, WEIGHTS, 0.0) == (None, "")


def test_booking_offers_and_loads_follow_the_candidates_order():
    inputs = [scoring.CandidateInputs("a", TierOverlap(device=3, predicted=1)),
              scoring.CandidateInputs("b", TierOverlap())]
    assert steps.booking_offers(inputs, [3.5, 0.0]) == [("a", 3.5, 4), ("b", 0.0, 0)]
    loaded = steps.with_loads(inputs, [5, 6], [7, 8])
    assert [(c.worker_id, c.overlap, c.prefill_load, c.decode_load) for c in loaded] == [
        ("a", inputs[0].overlap, 5, 7), ("b", TierOverlap(), 6, 8)]


def test_scored_candidates_carry_each_logit_load_and_page_size():
    inputs = [scoring.CandidateInputs("a", TierOverlap(device=1), 2, 3), scoring.CandidateInputs("b", TierOverlap())]
    assert steps.scored_candidates(inputs, [10.0, 20.0], [16, 32]) == [
        CandidateScore(worker_id="a", logit=10.0, overlap=TierOverlap(device=1), prefill_load=2, decode_load=3,
                       page_size=16),
        CandidateScore(worker_id="b", logit=20.0, overlap=TierOverlap(), prefill_load=0, decode_load=0,
                       page_size=32)]


# --- the lean decision's steps --------------------------------------------------------------
def test_lean_primary_size_is_the_roster_size_or_the_candidates_most_common():
    live = {"a": (16, 0), "b": (32, 0), "c": (32, 0)}
    assert steps.lean_primary_size({64: ["a", "b", "c"]}, live, ["a"]) == 64  # one size: the roster's
    assert steps.lean_primary_size({16: ["a"], 32: ["b", "c"]}, live, ["a", "b", "c"]) == 32
    assert steps.lean_primary_size({16: ["a"], 32: ["b", "c"]}, live, ["a", "b"]) == 16


def test_lean_credits_give_nothing_for_a_worker_with_no_page_in_the_index():
    overlaps = {"a": NO_OVERLAP, "b": TierOverlap(device=2, disk=4)}
    assert steps.lean_credits(["a", "b"], overlaps, WEIGHTS) == [0.0, 3.0]


def test_choose_on_copy_takes_the_formulas_choice_within_the_pool():
    ids = ["a", "b", "c"]
    credits = [4.0, 2.0, 0.0]  # a is best, then b
    chosen, formula, logits = steps.choose_on_copy(ids, [1, 2], 4, credits, [0, 0, 0], [0, 0, 0], WEIGHTS, 0.0,
                                                   None)
    assert (chosen, formula) == (1, 1)  # a is not in the pool
    assert logits == [0.0, 32.0, 64.0]  # 16 * max(4 - credit, 0)


def test_choose_on_copy_proposes_the_sessions_worker_when_it_is_in_the_pool():
    ids, credits, loads = ["a", "b", "c"], [4.0, 2.0, 0.0], [0, 0, 0]
    assert steps.choose_on_copy(ids, [0, 1, 2], 4, credits, loads, loads, WEIGHTS, 0.0, "c")[:2] == (2, 0)
    assert steps.choose_on_copy(ids, [0, 1], 4, credits, loads, loads, WEIGHTS, 0.0, "c")[:2] == (0, 0)
    assert steps.choose_on_copy(ids, [0, 1], 4, credits, loads, loads, WEIGHTS, 0.0, "gone")[:2] == (0, 0)


def test_in_pool():
    assert steps.in_pool("b", ["a", "b"], [1])
    assert not steps.in_pool("a", ["a", "b"], [1])
    assert not steps.in_pool("z", ["a", "b"], [0, 1])


def test_pool_candidates_list_only_the_workers_under_the_thresholds():
    overlaps = {"a": TierOverlap(device=1), "b": TierOverlap(), "c": TierOverlap(host=2)}
    live = {"a": (16, 0), "b": (16, 0), "c": (32, 0)}
    found = steps.pool_candidates(["a", "b", "c"], [0, 2], [1.0, 2.0, 3.0], overlaps, [4, 5, 6], [7, 8, 9], live)
    assert found == [
        CandidateScore(worker_id="a", logit=1.0, overlap=overlaps["a"], prefill_load=4, decode_load=7, page_size=16),
        CandidateScore(worker_id="c", logit=3.0, overlap=overlaps["c"], prefill_load=6, decode_load=9, page_size=32)]


def test_session_memory_forgets_the_oldest_session_first():
    memory = SessionMemory(limit=2)
    memory.remember(("m", "s1"), "a")
    memory.remember(("m", "s2"), "b")
    memory.remember(("m", "s1"), "c")  # s1 is now the newest
    memory.remember(("m", "s3"), "d")
    assert [memory.get(("m", s)) for s in ("s1", "s2", "s3")] == ["c", None, "d"]


# --- the answer and the decision log -------------------------------------------------------------
def test_fallback_response_lists_every_candidate_with_no_score():
    response = steps.fallback_response("r1", 70, "b", ["a", "b"], directory(a=16, b=32, c=32),
                                       steps.DEGRADED_STATE_STORE)
    assert (response.worker_id, response.worker_url, response.logit) == ("b", "http://b", 0.0)
    assert (response.page_size, response.request_pages) == (32, 2)  # 70 tokens at the most common size
    assert [(c.worker_id, c.page_size, c.overlap) for c in response.candidates] == [("a", 16, TierOverlap()),
                                                                                    ("b", 32, TierOverlap())]
    assert response.degraded == [steps.DEGRADED_STATE_STORE]
    assert not response.booked


def test_decision_record_keeps_every_page_hash_and_the_latency_in_ms():
    pages = {16: RequestPages.of(list(range(40)), 16)}
    decision = steps.decision_record(request_id="r1", model="m", router_id="router-1", ts=12.5, weights=WEIGHTS,
                                     u=0.25, pages_by_size=pages, n_pages=2, chosen="a", candidates=[],
                                     degraded=["x"], latency_s=0.003, shared_queried=True)
    assert decision.page_hashes == {16: list(pages[16].hashes)} and len(decision.page_hashes[16]) == 2
    assert (decision.request_id, decision.model, decision.router_id, decision.ts) == ("r1", "m", "router-1", 12.5)
    assert (decision.random_draw, decision.request_pages, decision.chosen) == (0.25, 2, "a")
    assert decision.latency_ms == pytest.approx(3.0)
    assert decision.degraded == ["x"] and decision.shared_pool_queried
