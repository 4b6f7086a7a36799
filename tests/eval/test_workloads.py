"""The suite's workloads (kvtier/eval/workloads.py) have the shapes their names promise, come
out the same for a seed and differ between seeds, offer the load they are set to, and
`kvtier bench replay --suite` prints one table of ratios to tier_aware over them."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import build_parser
from kvtier.eval.settings import ReplayBench
from kvtier.eval.suite import run_suite_bench
from kvtier.eval.trace_record import TRACE_BLOCK_TOKENS
from kvtier.eval.workloads import (
    HELD_OUT_SEEDS,
    TUNING_SEEDS,
    WORKLOAD_NAMES,
    new_tokens,
    offered_load,
    workload,
)
from kvtier.plumbing.settings import read_settings

CAPACITY = 8 * 20000.0


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_a_workload_is_its_seed_and_a_valid_mooncake_trace(name):
    one, again, other = (workload(name).trace(seed, 400, CAPACITY) for seed in (1, 1, 2))
    assert one == again and one != other
    assert len(one) == 400
    assert all(a.timestamp <= b.timestamp for a, b in zip(one, one[1:]))
    for request in one:  # every block but the last is full; the last holds what is left
        assert (len(request.hash_ids) - 1) * TRACE_BLOCK_TOKENS < request.input_length \
            <= len(request.hash_ids) * TRACE_BLOCK_TOKENS, request
        assert request.output_length >= 1


def test_held_out_seeds_are_not_tuning_seeds():
    assert not set(HELD_OUT_SEEDS) & set(TUNING_SEEDS) and len(HELD_OUT_SEEDS) >= 3


def test_agent_sessions_grow_by_their_tool_output_and_keep_their_prefix():
    trace = workload("agentic").trace(3, 1500, CAPACITY)
    by_prefix = {}
    grown = 0
    for request in trace:
        full = request.hash_ids[:-1]
        for earlier in by_prefix.get(request.hash_ids[0], []):
            known = earlier.hash_ids[:len(earlier.hash_ids) - 1]
            if len(full) > len(known) and full[:len(known)] == known:
                grown += 1
                break
        by_prefix.setdefault(request.hash_ids[0], []).append(request)
    assert len(by_prefix) <= 6, "six applications, each its own shared system prompt"
    assert grown > len(trace) / 2, "most requests are a session's later turn over its whole earlier context"
    assert 0.35 < offered_load(trace, CAPACITY) < 0.55  # 0.45 asked: sessions cut by the trace's end skew it


def test_shared_prompts_are_long_and_the_questions_short():
    trace = workload("shared_prompts").trace(1, 1500, CAPACITY)
    fresh = new_tokens(trace)
    assert sorted(r.input_length for r in trace)[len(trace) // 2] > 4000
    assert sorted(fresh)[len(fresh) // 2] <= 2 * TRACE_BLOCK_TOKENS  # what is new is a block or two
    assert len({r.hash_ids[0] for r in trace}) <= 40
    assert 0.4 < offered_load(trace, CAPACITY) < 0.5


def test_bursty_arrivals_swing_between_half_and_more_than_the_capacity():
    trace = workload("bursty").trace(1, 1500, CAPACITY)
    fresh = new_tokens(trace)
    loads = []
    for start in range(0, len(trace) - 150, 150):  # windows of 150 requests
        span = (trace[start + 150].timestamp - trace[start].timestamp) / 1000
        loads.append(sum(fresh[start:start + 150]) / span / CAPACITY)
    assert min(loads) < 0.75 and max(loads) > 0.95, loads
    assert 0.5 < offered_load(trace, CAPACITY) < 1.2


def test_an_unknown_workload_is_named_with_the_choices():
    with pytest.raises(ValueError, match="unknown workload 'chat'.*agentic"):
        workload("chat")


def test_the_suite_prints_one_table_of_ratios_to_tier_aware(capsys):
    args = build_parser().parse_args(["bench", "replay", "--suite", "--workloads", "shared_prompts", "--requests",
                                      "120", "--seeds", "1", "--workers", "4", "--policies",
                                      "tier_aware,round_robin,oracle,predicted_ttft,tier_aware_redrawn", "--json"])
    assert run_suite_bench(read_settings(ReplayBench, args)) == 0
    out = capsys.readouterr().out.splitlines()
    rows = json.loads(out[-1])["suite"]
    assert [(r["workload"], r["cluster"]) for r in rows] == [("shared_prompts", "equal"),
                                                            ("shared_prompts", "half at 0.5")]
    for row in rows:
        base = row["tier_aware"]
        for policy in ("round_robin", "oracle"):
            summary = row["policies"][policy]
            assert row["ratios"][policy]["ttft_p50_ms"] == round(summary["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
    assert rows[1]["policies"]["tier_aware"]["requests"] == 120
    # how far predicted_ttft's first tokens came from its predictions, beside its ratios
    assert all(0 < row["prediction"]["mape"] < 5 for row in rows), [row["prediction"] for row in rows]
    # the noise band (the formula with other tie-break draws) and predicted_ttft judged against it
    for row in rows:
        moved = row["policies"]["tier_aware_redrawn"]["ttft_p99_ms"] / row["tier_aware"]["ttft_p99_ms"]
        assert row["noise"]["ttft_p99_ms"] == round(abs(moved - 1), 3)
        assert set(row["judged"].values()) <= {"same", "worse", "better"}
    table = "\n".join(out[:-1])
    assert "shared_prompts  equal" in table and "round_robin (x)" in table and "predicted MAPE/bias" in table
    assert "noise band" in table and "judged" in table
