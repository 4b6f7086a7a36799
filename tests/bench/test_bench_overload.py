"""`kvtier bench overload`, short: at 2x the capacity it measured, with a sim-worker killed and
a replica stopped mid-run, idle sockets and oversized prompts, every request is accounted for:
none lost, every refusal with Retry-After, none failed before its first byte, the oversized
prompts refused with 413, no booking left behind, the drained replica gone within its
--drain-timeout + 2 s. Its TTFT and memory figures are not judged here (this machine is
shared): BENCHMARKS.md quotes a full run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

OUTCOMES = ["completed", "refused", "rejected", "failed_before_first_byte", "failed_after_first_byte", "lost"]


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


@pytest.mark.timeout(240)
def test_bench_overload_short_loses_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "overload", "--workers", "3", "--capacity-seconds", "3",
         "--low-seconds", "4", "--seconds", "8", "--idle-sockets", "50", "--log-level", "WARNING", "--json"],
        capture_output=True, text=True, timeout=230, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["sent"] == sum(report[k] for k in OUTCOMES) > 0, report
    assert report["lost"] == 0, report["lost_details"]
    assert report["failed_before_first_byte"] == 0, report["failed_before_first_byte_details"]
    assert report["refused_with_retry_after"] == report["refused"], report
    assert report["refused"] > 0 and report["completed_high"] > 0, report  # 2x was more than it could take
    assert report["oversized_refused_413"] == report["oversized_sent"] == 3, report
    assert report["capacity_requests_per_s"] > 0 and report["queue_peak"] > 0, report
    # the piece cache, read from the replica's router_tokenizer_cache_bytes, held prompts and its bound
    assert 0 < report["tokenizer_cache_mb_end"] <= report["tokenizer_cache_bound_mb"], report
    # every booking given back (5 s after the run), and the drained replica gone in time
    assert report["leaked_bookings"] == 0, report
    assert report["drained_replica_exit_s"] <= report["drain_timeout_s"] + 2, report
