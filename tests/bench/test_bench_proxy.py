"""`kvtier bench proxy` at small sizes with two replicas and DeepSeek-V4's tokenizer: it must finish
every workload, route every measured request through a router that tokenized it as the engine
and the bench did, and print the keys BENCHMARKS.md reads. Its figures are not judged here (this
machine is shared): BENCHMARKS.md quotes them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

WORKLOADS = ["fresh", "multi_turn", "shared_system"]
KEYS = ["direct_ttft_p50_ms", "direct_ttft_p99_ms", "routed_ttft_p50_ms", "routed_ttft_p99_ms",
        "added_ttft_p50_ms", "added_ttft_p99_ms", "router_time_p50_ms", "router_time_p99_ms", "tokenize_floor_ms",
        "tokenize_mean_ms", "decision_mean_ms", "prompt_tokens_p50", "routed_to", "prompt_count_errors",
        "tokenizer_mismatches"]
TARGETS = {"fresh": ["target_added_p50_le_floor_plus_1ms"],
           "multi_turn": ["target_added_p50_le_2ms", "target_added_p99_le_5ms"],
           "shared_system": ["target_added_p50_le_2ms", "target_added_p99_le_5ms"]}
TOP_KEYS = ["requests", "workers", "replicas", "hand_over_token_ids", "direct_requests_per_s",
            "requests_per_s_per_replica", "requests_per_s_all_replicas", "tokenizer_mismatches",
            "added_ttft_p50_ms", "added_ttft_p99_ms", "router_time_p50_ms", "workloads"]
REQUESTS = 8


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


@pytest.mark.timeout(150)
def test_bench_proxy_small():
    # the fresh and system prompts (~10k characters) are long enough to be encoded in parts by
    # the routers and sim-workers, the chats short enough to grow past --conversation-tokens
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "proxy", "--prompt-tokens", "2048", "--requests", str(REQUESTS),
         "--warm-up", "2", "--conversations", "4", "--turn-tokens", "64", "--conversation-tokens", "512",
         "--system-tokens", "2048", "--question-tokens", "128", "--replicas", "2", "--seconds", "0.5",
         "--concurrency", "4", "--log-level", "WARNING", "--json"],
        capture_output=True, text=True, timeout=140, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(lines[-1])
    assert not [k for k in TOP_KEYS if k not in report], report
    assert report["hand_over_token_ids"] is False, report
    # the top level keeps the fresh prompts' figures, as before there were workloads
    assert report["added_ttft_p50_ms"] == report["workloads"]["fresh"]["added_ttft_p50_ms"]
    assert sorted(report["workloads"]) == WORKLOADS, report
    for name, w in report["workloads"].items():
        assert not [k for k in KEYS + TARGETS[name] if k not in w], (name, w)
        assert w["requests"] == REQUESTS and sum(w["routed_to"].values()) == REQUESTS, (name, w)
        assert set(w["routed_to"]) <= {"w0", "w1"}, (name, w)
        # every routed prompt was counted by the engine as the bench and the router counted it
        assert w["prompt_count_errors"] == 0 and w["tokenizer_mismatches"] == 0, (name, w)
        assert 0 < w["tokenize_floor_ms"] < math.inf, (name, w)
        # the router's own time is part of the routed request's TTFT, and was reported for each
        assert 0 < w["router_time_p50_ms"] < w["routed_ttft_p99_ms"], (name, w)
        assert all(math.isfinite(w[k]) for k in KEYS if isinstance(w[k], float)), (name, w)
    assert report["workloads"]["fresh"]["prompt_tokens_p50"] == 2048
    # the warm-ups' and the rate phase's prompts too
    assert report["tokenizer_mismatches"] == 0, report
    assert len(report["requests_per_s_per_replica"]) == 2 and min(report["requests_per_s_per_replica"]) > 0
