"""`kvtier bench route` on a small state with every part on (both state sources, the lookup,
the index at scale, the bootstrap, the lag under a writer process, two replica processes):
it must finish and print the keys BENCHMARKS.md reads; the index's decisions must all come
from its index once ready."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = [
    # in-process, the index and the walk in Redis side by side
    "p50_ms", "p99_ms", "decisions_per_s", "redis_cpu_us_per_decision", "redis_process_cpu_us_per_decision",
    "redis_cpu_us_per_decision_concurrent",
    "redis_ms_per_decision", "hashing_p50_ms", "index_not_ready_decisions",
    "redis_p50_ms", "redis_p99_ms", "redis_decisions_per_s", "redis_redis_cpu_us_per_decision",
    # the in-memory read alone
    "lookup_p50_ms", "lookup_p99_ms", "walk_p50_ms", "walk_p99_ms",
    # at scale
    "index_scale_entries", "index_bytes_per_entry", "bootstrap_s_1m", "bootstrap_last_s_1m", "bootstrap_entries_1m",
    # lag under writes
    "index_lag_p50_ms", "index_lag_p99_ms", "index_lag_transitions_per_s",
    # replicas
    "replicas_decisions_per_s", "replicas_redis_cpu_us_per_decision",
]


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


@pytest.mark.timeout(170)
def test_bench_route_small():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "route", "--workers", "8", "--conversations", "32",
         "--conversations-per-worker", "4", "--noise-pages", "100", "--decisions", "200", "--no-http",
         "--scale-entries", "40000", "--lag-rate", "5000", "--lag-seconds", "1", "--replicas", "2",
         "--replica-seconds", "1", "--log-level", "WARNING", "--json"],
        capture_output=True, text=True, timeout=160, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    report = json.loads(lines[-1])
    for key in KEYS:
        assert key in report, key
    assert report["index_not_ready_decisions"] == 0
    assert report["replicas_index_not_ready_decisions"] == 0
    assert report["index_scale_entries"] >= 40_000
    assert report["bootstrap_entries_1m"] == report["index_scale_entries"]
    assert report["index_lag_entries"] > 0 and report["index_lag_batches_applied"] == report["index_lag_batches"]
    assert not report["index_lag_behind_at_end"]
    # The walk in Redis costs Redis more than reading who is live and loaded.
    assert report["redis_redis_cpu_us_per_decision"] > report["redis_cpu_us_per_decision"]
    assert "index  |  redis" in "\n".join(lines[:-1])
