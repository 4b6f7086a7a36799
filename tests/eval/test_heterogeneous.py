"""Replays on clusters whose workers differ in speed: the TTFT oracle (least true TTFT at each
arrival) sends less to slow workers, every summary carries TPOT and per-worker shares, and the
command refuses a speed list that does not fit the cluster."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from kvtier.eval.lockstep import run_lockstep
from kvtier.eval.policies import RoundRobinPolicy, TtftOraclePolicy
from kvtier.eval.trace import SAMPLE_TRACE, load_trace, prepare
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.sim_cluster import ClusterShape

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
