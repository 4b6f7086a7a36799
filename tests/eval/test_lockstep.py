"""The lockstep replay: bounds computed by hand, the cost model against its formula, the
oracle and the breakdown, determinism in process, and the real pipeline (bridge, JetStream,
processor, Redis, two routers) giving the same decisions as the in-process router model,
run twice, the second time with the CPU busy."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from kvtier.eval.bounds import infinite_cache, pooled_lru
from kvtier.eval.lockstep import percentile, reason_for, run_lockstep
from kvtier.eval.policies import (
    CandidateView,
    Decision,
    OraclePolicy,
    RoundRobinPolicy,
    RouterModel,
)
from kvtier.eval.replay import ReplaySettings, add_gap_closed, build_report
from kvtier.eval.report import verdict
from kvtier.eval.synth_trace import SynthParams, generate
from kvtier.eval.trace import (
    SAMPLE_TRACE,
    PreparedRequest,
    TraceRequest,
    load_trace,
    prepare,
)
from kvtier.schemas.routing import ScoringWeights, TierOverlap
from kvtier.sim.cost_model import CostModel
from kvtier.sim.hicache_sim import HiCacheSim, SimConfig
from kvtier.sim.sim_cluster import ClusterShape


def prepared(pages: list[list[bytes]], tokens_per_page: int = 4) -> list[PreparedRequest]:
    """Requests made of named pages; each has one partial page more (always recomputed)."""
    return [PreparedRequest(index=i, arrival_s=float(i), input_tokens=len(p) * tokens_per_page + 1, output_tokens=0,
                            digests=p, source=TraceRequest(timestamp=i * 1000.0, input_length=0, output_length=0,
                                                           hash_ids=[]))
            for i, p in enumerate(pages)]


# --- bounds, by hand -------------------------------------------------------------------------
def test_bounds_on_a_hand_computed_trace():
    a, b, c, d = b"a", b"ab", b"abc", b"d"  # a chain: a, then ab, then abc; d elsewhere
    requests = prepared([[a, b], [a, b, c], [d], [a, b, c]])
    # infinite: r1 reuses a,b (2 pages), r3 reuses a,b,c (3): 5 of 9 pages; the partial pages never
    infinite = infinite_cache(requests, 4)
    assert infinite.prompt_tokens == 4 * 1 + 9 * 4 and infinite.recomputed_tokens == 40 - 5 * 4
    # an LRU of 3 pages: after r2 it holds d (newest), a, b (c, the oldest, went): r3 reuses a,b only
    lru = pooled_lru(requests, 4, capacity_pages=3)
    assert lru.recomputed_tokens == 40 - (2 + 2) * 4
    # an LRU as large as the trace is the infinite cache
    assert pooled_lru(requests, 4, capacity_pages=100) == infinite
    assert round(lru.reused_share, 4) == round(16 / 40, 4)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99 and percentile(values, 1.0) == 100
    assert percentile([7.0], 0.99) == 7.0


# --- the cost model ----------------------------------------------------------------------------
def test_an_idle_worker_costs_what_the_formula_says():
    cost = CostModel()
    sim = HiCacheSim(SimConfig(page_size=64, device_pages=200, host_pages=400, cost=cost, dma_delay_s=0.002))
    tokens = list(range(1000, 1000 + 6400))  # 100 pages
    first = sim.serve(tokens, 0.0)
    assert first.queue_s == 0 and first.ttft_s == pytest.approx(6400 / 20000)  # 0.32 s of prefill
    # the same prompt later: every page on device, nothing to compute
    again = sim.serve(tokens, 10.0)
    assert again.device_hit_pages == 100 and again.ttft_s == 0
    # push it off device (its host copies landed): a load back of 100 pages of 8 MiB at 25 GB/s
    sim.serve(list(range(50_000, 50_000 + 200 * 64)), 20.0)
    back = sim.serve(tokens, 30.0)
    assert back.host_hit_pages == 100 and back.recomputed_tokens == 0
    assert back.ttft_s == pytest.approx(100 * 64 * 131072 / 25e9)


def test_decode_runs_in_steps_and_a_prefill_waits_for_the_step_in_progress():
    cost = CostModel(weight_bytes=1e9, hbm_gb_s=100.0, kv_bytes_per_token=1)  # a 10 ms step, KV negligible
    sim = HiCacheSim(SimConfig(page_size=4, device_pages=1000, host_pages=0, cost=cost))
    first = sim.serve(list(range(1, 1 + 400)), 0.0, output_tokens=100)
    first_token = first.ttft_s  # 400 / 20000 = 0.02 s
    assert first.complete_at == pytest.approx(first_token + 100 * 0.01, rel=1e-6)
    # 25 ms into decoding (steps at 20, 30, 40, 50 ms): the step from 40 ms ends at 50 ms, the prefill starts then
    second = sim.serve(list(range(5000, 5000 + 40)), first_token + 0.025)
    assert second.queue_s == pytest.approx(0.005, rel=1e-4)
    assert second.ttft_s == pytest.approx(0.005 + 40 / 20000, rel=1e-4)
    # the engine's true loads: the first request decodes, nothing is queued any more
    now = second.complete_at + 0.001
    assert sim.engine.queued_prefill_pages(now) == 0
    assert sim.engine.decode_pages(now) == -(-(400 + 100) // 4)


# --- the breakdown ---------------------------------------------------------------------------
def view(rank, device=0, host=0, prefill=0, decode=0, logit=0.0, shared=0):
    return CandidateView(rank, TierOverlap(device=device, host=host, shared_beyond=shared), prefill, decode, logit)


def test_reasons_for_a_different_choice():
    weights = ScoringWeights()
    truth = [view(0, device=8, logit=2.0), view(1, logit=10.0)]
    # the router did not see the oracle's worker's pages yet
    assert reason_for(Decision(1, [view(0, device=2, logit=8.0), view(1, logit=7.0)]), 0, truth, weights,
                      False) == "not_yet_visible"
    # it saw pages that were gone
    assert reason_for(Decision(1, [view(0, device=8, logit=2.0), view(1, device=9, logit=1.0)]), 0, truth,
                      weights, False) == "overstated"
    # same cache view, other load
    assert reason_for(Decision(1, [view(0, device=8, prefill=50, logit=52.0), view(1, logit=10.0)]), 0, truth,
                      weights, False) == "load"
    assert reason_for(Decision(1, [view(0, device=8, logit=5.0), view(1, logit=5.0)]), 0, truth, weights,
                      False) == "tie"
    assert reason_for(Decision(1, [view(1)]), 0, truth, weights, False) == "missing"
    assert reason_for(Decision(1, None, ["state-store-unavailable"]), 0, truth, weights, False) == "degraded"
    assert reason_for(Decision(0, []), 0, truth, weights, False) == "same"
    # another worker the oracle scores the same counts as agreeing
    assert reason_for(Decision(1, None), 0, [view(0, logit=3.0), view(1, logit=3.0)], weights, False) == "same"


def test_gap_closed_and_the_verdict():
    def policy(reused, recomputed, p50):
        return {"reused_pct": reused, "recomputed_tokens": recomputed, "ttft_p50_ms": p50}

    summaries = {"round_robin": policy(10.0, 900, 200.0), "oracle": policy(30.0, 700, 100.0),
                 "tier_aware": policy(25.0, 750, 120.0), "random": policy(9.0, 950, 210.0)}
    add_gap_closed(summaries)
    assert summaries["tier_aware"]["gap_closed"] == {"recomputed": 0.75, "ttft_p50": 0.8}
    assert summaries["random"]["gap_closed"] == {"recomputed": -0.25, "ttft_p50": -0.1}
    assert summaries["oracle"]["gap_closed"] == {"recomputed": 1.0, "ttft_p50": 1.0}
    assert verdict(summaries).startswith("tier_aware beats round robin: first tokens 40% sooner")
    # where the oracle gains nothing, there is no gap to close
    flat = {"round_robin": policy(10.0, 900, 200.0), "oracle": policy(10.0, 900, 250.0)}
    add_gap_closed(flat)
    assert flat["oracle"]["gap_closed"] == {"recomputed": None, "ttft_p50": None}
    worse = {"round_robin": policy(10.0, 900, 200.0), "tier_aware": policy(8.0, 950, 260.0)}
    assert "worse than round robin" in verdict(worse)


# --- determinism ------------------------------------------------------------------------------
SHAPE = ClusterShape(workers=4, page_size=64, device_pages=256, host_pages=1024, l3=True)


def small_trace(n: int = 150) -> list[PreparedRequest]:
    return prepare(load_trace(SAMPLE_TRACE, n), SHAPE.page_size)


def run(policy, requests, shape=SHAPE):
    return asyncio.run(run_lockstep(policy, requests, shape, ScoringWeights(), shape.l3, 1))


@pytest.mark.slow
def test_in_process_replays_are_deterministic_and_check_their_cost_accounting():
    requests = small_trace()
    for make in (lambda: RouterModel("tier_aware_shared", 4, 64, ScoringWeights(), True, 0.005, 1),
                 lambda: OraclePolicy(ScoringWeights(), True, 1), lambda: RoundRobinPolicy(4)):
        first, second = run(make(), requests), run(make(), requests)
        assert first.outcomes == second.outcomes
        check = first.summary()["cost_check"]
        assert check["ttft_at_least_service"] and check["busy_equals_service"] and check["saturated_workers"] == 0
    oracle = run(OraclePolicy(ScoringWeights(), True, 1), requests)
    assert all(o.reason == "same" for o in oracle.outcomes)


@pytest.mark.slow
def test_a_router_that_sees_events_late_loses_reuse_for_that_reason():
    requests = prepare(generate(SynthParams(requests=200, duration_s=600.0)), 64)
    shape = ClusterShape(workers=4, page_size=64, device_pages=256, host_pages=1024, l3=False)

    def with_lag(seconds: float):
        return run(RouterModel("tier_aware", 4, 64, ScoringWeights(), False, seconds, 1), requests, shape)

    prompt = with_lag(0.0)
    late = with_lag(3600.0)  # nothing the engines did is visible within the hour
    # even at lag 0 a router cannot see a prefill still running (its pages are published when it
    # has run), so some decisions differ for that reason; an hour's lag makes many more
    def unseen(replay) -> int:
        return sum(o.reason == "not_yet_visible" for o in replay.outcomes)

    assert unseen(late) > 2 * unseen(prompt) + 10
    assert late.summary()["recomputed_tokens"] > prompt.summary()["recomputed_tokens"]


@pytest.mark.slow
def test_a_replay_report_puts_the_oracle_and_bounds_beside_every_policy():
    requests = small_trace(80)
    settings = ReplaySettings(shape=SHAPE, via="model")
    report = build_report("sample", requests, settings, [1, 2])
    policies = report["policies"]
    assert set(policies) == {"random", "round_robin", "least_load", "device_only", "tier_aware",
                             "tier_aware_shared", "oracle", "ttft_oracle"}
    assert set(report["bounds"]) == {"infinite", "pooled_lru"}
    assert report["bounds"]["infinite"]["reused_pct"] >= report["bounds"]["pooled_lru"]["reused_pct"]
    for summary in policies.values():
        assert set(summary["gap_closed"]) == {"recomputed", "ttft_p50"}
        assert sum(summary["breakdown"].values()) == 80
    assert report["per_seed"] and set(report["per_seed"]) == {1, 2}
    assert report["verdict"].endswith(".")


# --- the real pipeline --------------------------------------------------------------------------
def cpu_burner(seconds: float) -> subprocess.Popen:
    """A process that keeps one core busy for at most `seconds`, then exits by itself."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.mark.slow
def test_the_pipeline_decides_like_the_model_whatever_the_machine_load():
    from kvtier.eval.pipeline import PipelinePolicy, running_stack

    requests = small_trace(120)
    # predicted pages on, so their booking and walk in Redis are held to the model's too
    model = run(RouterModel("tier_aware_shared", 4, 64, ScoringWeights(), True, 0.005, 7, predicted=True), requests)
    runs = []
    with tempfile.TemporaryDirectory() as log_dir, running_stack(log_dir) as stack:
        for load in (False, True):
            burners = [cpu_burner(120) for _ in range(2)] if load else []
            try:
                policy = PipelinePolicy(f"lockstep-{int(load)}", stack, 4, 64, 0.005, 7, shared=True,
                                        router_args=["--predicted-pages", "on"])
                runs.append(run(policy, requests))
            finally:
                for b in burners:
                    if b.poll() is None:
                        os.kill(b.pid, signal.SIGKILL)
                    b.wait()
    quiet, busy = runs
    assert [o.rank for o in quiet.outcomes] == [o.rank for o in model.outcomes]
    assert quiet.outcomes == busy.outcomes  # same decisions, same simulated TTFTs, under load too
    assert all(not o.degraded for o in quiet.outcomes)
    # the routers used what the pipeline showed them: some decisions saw cache on some worker
    assert sum(o.hit_pages[0] + o.hit_pages[1] for o in quiet.outcomes) > 0
