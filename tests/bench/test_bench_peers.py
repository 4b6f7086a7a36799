"""`kvtier bench peers`, the short version CI runs: one policy per front door (the client straight to
the workers, SGLang's model gateway with cache_aware, one kvtier replica), 200 requests of the
synthetic trace each, on one paced cluster, and kvtier ramped on 40. Every front door must serve
every request, the two that route by cache must find prompts cached where no routing finds fewer,
and the ramp must hold its first step. Its figures are not
judged here (this machine is shared): BENCHMARKS.md quotes them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench.peers import front_doors

REQUESTS = 200
DOORS = ["direct", "smg-cache_aware", "kvtier"]

pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


@pytest.mark.timeout(600)
def test_bench_peers_short():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "peers", "--front-doors", ",".join(DOORS), "--trace",
         "synthetic", "--requests", str(REQUESTS), "--time-scale", "4", "--workers", "4", "--settle-seconds", "1",
         "--ramp-front-doors", "kvtier", "--ramp-requests", "40", "--l3-front-doors", "kvtier", "--no-dynamo",
         "--log-level", "WARNING", "--json"],
        capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    doors = {d["front_door"]: d for d in report["front_doors"]}
    assert list(doors) == DOORS
    for name, door in doors.items():
        assert (door["requests"], door["served"]) == (REQUESTS, REQUESTS), (name, door)
        assert door["ttft_p50_ms"] > 0 and door["tpot_p99_ms"] > 0 and door["prompt_tokens"] > 0, (name, door)
    for name in ("smg-cache_aware", "kvtier"):  # a gateway process of its own, measured by PID
        assert doors[name]["cpu_ms_per_request"] > 0 and doors[name]["rss_mb"] > 0, doors[name]
        assert doors[name]["reused_share"]["device"] > doors["direct"]["reused_share"]["device"], doors
    assert doors["direct"]["ttft_p50_vs_direct"] == 1.0
    ramp, = report["ramps"]
    assert ramp["front_door"] == "kvtier" and ramp["steps"][0]["held"], ramp
    assert ramp["held_rate_per_s"] >= ramp["steps"][0]["rate_per_s"] > 0 and ramp["requests_per_router_core"] > 0
    # outside a private network namespace no Mooncake master is started, and the report says why
    assert report["l3"] == [] and "unshare -n" in report["l3_note"], report["l3_note"]
    assert report["targets"]["ttft_p50_vs_smg_cache_aware"] > 0


def test_unknown_front_doors_are_named():
    with pytest.raises(ValueError, match="unknown nginx"):
        front_doors("direct,nginx")
    assert front_doors(" direct , kvtier-2 ") == ["direct", "kvtier-2"]
