"""Replays on clusters whose workers differ in speed: the TTFT oracle (least true TTFT at each
arrival) sends less to slow workers, every summary carries TPOT and per-worker shares, the
command refuses a speed list that does not fit the cluster, and predicted_ttft learns each
worker's speed (and a slowdown) while deciding as the formula does on equal workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from kvtier.eval.lockstep import run_lockstep
from kvtier.eval.policies import PredictedTtftModel, RoundRobinPolicy, RouterModel, TtftOraclePolicy
from kvtier.eval.trace import SAMPLE_TRACE, load_trace, prepare
from kvtier.router.rates import FASTER_PICK
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.sim_cluster import ClusterShape, Slowdown

SPEEDS = (1.0, 1.0, 0.25, 0.25)
SHAPE = ClusterShape(workers=4, page_size=64, device_pages=256, host_pages=1024, l3=True, worker_speeds=SPEEDS)


def replay(policy, n: int = 120):
    requests = prepare(load_trace(SAMPLE_TRACE, n), SHAPE.page_size)
    return asyncio.run(run_lockstep(policy, requests, SHAPE, ScoringWeights(), SHAPE.l3, 1))


def test_the_ttft_oracle_sends_less_to_slow_workers_and_gets_first_tokens_sooner():
    greedy, rr = replay(TtftOraclePolicy()).summary(), replay(RoundRobinPolicy(4)).summary()
    fast_share = sum(greedy["load_share_pct"][r] for r in ("0", "1"))
    assert fast_share > 60 and sum(rr["load_share_pct"][r] for r in ("0", "1")) == 50
    assert sum(greedy["load_share_pct"].values()) == 100
    assert greedy["ttft_p50_ms"] < rr["ttft_p50_ms"]
    assert greedy["ttft_p99_ms"] < rr["ttft_p99_ms"]
    for summary in (greedy, rr):
        assert 0 < summary["tpot_p50_ms"] <= summary["tpot_p99_ms"]


def test_the_ttft_oracle_is_deterministic():
    assert replay(TtftOraclePolicy(), 60).outcomes == replay(TtftOraclePolicy(), 60).outcomes


def kvtier(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *argv], capture_output=True, text=True, timeout=120)


def test_the_replay_command_reports_speeds_and_refuses_ones_that_do_not_fit():
    common = ["bench", "replay", "--requests", "40", "--workers", "2", "--via", "model",
              "--policies", "round_robin,ttft_oracle"]
    out = kvtier(*common, "--worker-speeds", "1,0.5", "--slowdown", "0:0.5@1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["cluster"]["worker_speeds"] == [1.0, 0.5] and report["cluster"]["slowdowns"] == ["0:0.5@1"]
    assert set(report["policies"]) == {"round_robin", "ttft_oracle"}
    assert "requests per worker (%):" in out.stdout and "speed" in out.stdout
    wrong = kvtier(*common, "--worker-speeds", "1,1,1")
    assert wrong.returncode != 0 and "3 factors for 2 workers" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    garbled = kvtier(*common, "--slowdown", "slow")
    assert garbled.returncode == 2 and "RANK:FACTOR@SECONDS" in garbled.stderr


# --- predicted_ttft: the router model overridden for workers faster at the rates it learns -------
def small_shape(**kwargs) -> ClusterShape:
    return ClusterShape(workers=4, page_size=64, device_pages=256, host_pages=1024, l3=True, **kwargs)


def run_model(model_class, shape: ClusterShape, n: int):
    requests = prepare(load_trace(SAMPLE_TRACE, n), shape.page_size)
    model = model_class("m", 4, 64, ScoringWeights(), True, 0.005, 1)
    return asyncio.run(run_lockstep(model, requests, shape, ScoringWeights(), True, 1))


def test_on_equal_workers_predicted_ttft_decides_as_the_formula():
    shape = small_shape()
    learning, plain = run_model(PredictedTtftModel, shape, 150), run_model(RouterModel, shape, 150)
    assert [o.rank for o in learning.outcomes] == [o.rank for o in plain.outcomes]
    assert all(abs(v["compute"] - 1) < 0.05 for v in learning.learned.values())
    assert all(v["samples"] >= FASTER_PICK.min_samples for v in learning.learned.values())  # trusted, yet equal


def test_predicted_ttft_learns_each_workers_speed_and_a_slowdown():
    mixed = run_model(PredictedTtftModel, small_shape(worker_speeds=(1.0, 1.0, 0.5, 0.5)), 400).summary()
    for rank, learned in mixed["learned"].items():
        assert learned["samples"] >= 50, rank
        assert abs(learned["compute"] - learned["true_compute"]) <= 0.10 * learned["true_compute"], (rank, learned)
    slowed = run_model(PredictedTtftModel, small_shape(slowdowns=(Slowdown(1, 0.5, 60.0),)), 400).summary()
    assert slowed["learned"]["1"]["true_compute"] == 2.0
    assert abs(slowed["learned"]["1"]["compute"] - 2.0) <= 0.2
    assert set(slowed["slowdown"]) == {"rank", "at_s", "window", "share_before_pct", "share_after_pct"}
    assert "learned" not in run_model(RouterModel, small_shape(), 40).summary()
