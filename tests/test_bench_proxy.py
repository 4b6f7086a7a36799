"""`kvtier bench proxy` on short prompts with two replicas: it must finish, route every measured
request through a router that tokenized it as the engine did, and print the keys BENCHMARKS.md
reads. Its figures are not judged here (this machine is shared): BENCHMARKS.md quotes them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

KEYS = ["direct_ttft_p50_ms", "direct_ttft_p99_ms", "routed_ttft_p50_ms", "routed_ttft_p99_ms",
        "added_ttft_p50_ms", "added_ttft_p99_ms", "router_time_p50_ms", "router_time_p99_ms", "tokenize_mean_ms",
        "decision_mean_ms", "direct_requests_per_s", "requests_per_s_per_replica", "requests_per_s_all_replicas",
        "target_added_p50_le_2ms", "target_added_p99_le_5ms"]


@pytest.mark.timeout(150)
def test_bench_proxy_small():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "proxy", "--prompt-tokens", "512", "--requests", "12",
         "--warm-up", "2", "--replicas", "2", "--seconds", "0.5", "--concurrency", "4", "--log-level", "WARNING",
         "--json"], capture_output=True, text=True, timeout=140, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(lines[-1])
    assert not [k for k in KEYS if k not in report], report
    assert report["requests"] == 12 and sum(report["routed_to"].values()) == 12, report
    assert set(report["routed_to"]) <= {"w0", "w1"}
    # every routed prompt was counted by the engine as the router counted it
    assert report["prompt_count_errors"] == 0 and report["tokenizer_mismatches"] == 0, report
    # the router's own time is part of the routed request's TTFT, and was reported for each
    assert 0 < report["router_time_p50_ms"] < report["routed_ttft_p99_ms"], report
    assert len(report["requests_per_s_per_replica"]) == 2 and min(report["requests_per_s_per_replica"]) > 0
    assert all(math.isfinite(report[k]) for k in KEYS if isinstance(report[k], float)), report
