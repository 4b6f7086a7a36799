"""The suite's noise band (kvtier/eval/suite.py): tier_aware_redrawn is the formula itself with
other tie-break draws, the band is its largest move from tier_aware on a seed, and a policy is
judged worse or better only beyond that band."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.eval.policies import REDRAW_SEED_OFFSET, REDRAWN
from kvtier.eval.replay import ReplaySettings, run_policies
from kvtier.eval.suite import BASELINE, FIGURES, judge, noise_band
from kvtier.eval.trace import prepare
from kvtier.eval.workloads import workload
from kvtier.sim.sim_cluster import ClusterShape

SHAPE = ClusterShape(workers=4, worker_speeds=(1.0, 1.0, 0.5, 0.5))
COMPARED = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "requests", "recomputed_tokens")


def _requests(seed: int):
    return prepare(workload("conversation").trace(seed, 300, 4 * 20000.0), SHAPE.page_size)


def test_the_redrawn_formula_is_tier_aware_with_the_draws_of_another_seed():
    requests = _requests(1)
    settings = ReplaySettings(shape=SHAPE, via="model", seed=1)
    redrawn = run_policies(requests, replace(settings, policies=(REDRAWN,)))[REDRAWN]
    moved = run_policies(requests, replace(settings, policies=(BASELINE,), seed=1 + REDRAW_SEED_OFFSET))[BASELINE]
    same_draws = run_policies(requests, replace(settings, policies=(BASELINE,)))[BASELINE]
    assert {k: redrawn[k] for k in COMPARED} == {k: moved[k] for k in COMPARED}
    # and the draws alone change the outcome (else the band would say nothing)
    assert {k: redrawn[k] for k in COMPARED} != {k: same_draws[k] for k in COMPARED}
    assert redrawn["via"] == "in process"


def _summary(p50: float, p99: float, tpot: float) -> dict:
    return dict(zip(FIGURES, (p50, p99, tpot)))


def test_the_band_is_the_largest_move_on_any_seed_per_figure():
    per_seed = [{BASELINE: _summary(100, 1000, 10), REDRAWN: _summary(104, 950, 10)},
                {BASELINE: _summary(200, 2000, 20), REDRAWN: _summary(198, 2200, 21)}]
    assert noise_band(per_seed) == {"ttft_p50_ms": 0.04, "ttft_p99_ms": 0.1, "tpot_p99_ms": 0.05}
    assert noise_band([{BASELINE: _summary(1, 1, 1)}]) is None


@pytest.mark.parametrize(("ratio", "band", "verdict"), [
    (1.02, 0.05, "same"), (0.97, 0.05, "same"), (1.051, 0.05, "worse"), (0.949, 0.05, "better"),
    (1.0, 0.0, "same"), (1.001, 0.0, "worse"), (None, 0.1, "same")])
def test_a_ratio_is_judged_only_beyond_the_band(ratio, band, verdict):
    assert judge(ratio, band) == verdict
