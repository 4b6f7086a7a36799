"""`kvtier tune` on a tiny trace, and the synthetic high-reuse trace generator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.eval.synth_trace import SynthParams, generate, trace_stats
from kvtier.eval.trace import load_trace, prepare
from kvtier.eval.tune import OBJECTIVES, tune
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.sim_cluster import ClusterShape

SHAPE = ClusterShape(workers=3, page_size=64, device_pages=512, host_pages=512, l3=False)


@pytest.mark.slow
def test_tune_finds_settings_at_least_as_good_as_the_defaults_and_checks_them_held_out():
    requests = prepare(load_trace("synthetic:3", 150), SHAPE.page_size)
    report = tune(requests, SHAPE, budget=6, lag_s=0.005, seed=2, holdout=0.3)
    assert report["trials"] == 6 and report["requests"] == 105 and report["holdout_requests"] == 45
    for objective, key in OBJECTIVES.items():
        best = report["best"][objective]
        assert best["figures"][key] <= report["defaults"][key]  # the defaults are one of the trials
        assert best["vs_defaults_pct"] >= 0
        assert set(best["holdout_figures"]) == {"ttft_p50_ms", "ttft_p99_ms", "recomputed_tokens", "reused_pct"}
        # every change is a real weight and shows up as a router flag
        assert set(best["changes"]) <= set(best["weights"])
    assert report["oracle_at_defaults"] and report["round_robin"] and report["verdict"].endswith(".")
    # the same command, the same answer
    assert tune(requests, SHAPE, budget=6, lag_s=0.005, seed=2, holdout=0.3) == report


@pytest.mark.slow
def test_tune_cli_prints_a_table_and_json():
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "tune", "--trace", "synthetic:3", "--requests", "80",
                          "--workers", "2", "--device-pages", "512", "--host-pages", "1024", "--budget", "3",
                          "--json"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["policy"] == "tier_aware_shared" and report["trials"] == 3
    assert "best for ttft_p50" in out.stdout and "oracle at default weights" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "tune", "--holdout", "1.5", "--requests", "10"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--holdout must be in [0, 1)" in bad.stderr


def test_the_synthetic_trace_has_the_statistics_it_promises():
    stats = trace_stats(generate())
    assert stats["requests"] == 3993 and 950 <= stats["span_s"] <= 1100
    assert 60 <= stats["blocks_seen_before_pct"] <= 68 and 40 <= stats["requests_with_prefix_hit_pct"] <= 50
    assert 10_000 <= stats["input_median"] <= 13_000 and 14_000 <= stats["input_mean"] <= 18_000
    assert 130 <= stats["output_mean"] <= 170
    assert generate(seed=4) == generate(seed=4) and generate(seed=4) != generate(seed=5)
    # a follow-up carries its session's whole context: its first block was seen before
    small = generate(SynthParams(requests=200, followup_share=1.0, document_share=0.0), seed=1)
    assert trace_stats(small)["requests_with_prefix_hit_pct"] >= 99.0


def test_synth_trace_cli_writes_a_mooncake_format_trace(tmp_path):
    path = tmp_path / "synthetic.jsonl"
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "synth-trace", "--out", str(path),
                          "--requests", "50", "--seed", "3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    written = load_trace(path)
    assert written == generate(SynthParams(requests=50), seed=3)
    assert json.loads(out.stderr.strip().splitlines()[-1])["stats"]["requests"] == 50


@pytest.mark.slow
def test_a_tuned_setting_replays_with_the_routers_flags():
    """`kvtier tune` prints `kvtier router` flags; `kvtier bench replay` takes the same flags, and
    they reach the policies (other weights route the same trace differently)."""
    base = [sys.executable, "-m", "kvtier.cli", "bench", "replay", "--trace", "synthetic:3", "--requests", "120",
            "--workers", "2", "--device-pages", "256", "--host-pages", "512", "--no-l3", "--via", "model",
            "--policies", "tier_aware", "--json"]
    reports = []
    for extra in ([], ["--prefill-load-scale", "2", "--host-cache-hit-weight", "0.4"]):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=170)
        assert out.returncode == 0, out.stderr[-3000:]
        reports.append(json.loads(out.stdout.strip().splitlines()[-1]))
    defaults, tuned = reports
    assert defaults["weights"]["prefill_load_scale"] == ScoringWeights().prefill_load_scale
    assert tuned["weights"]["prefill_load_scale"] == 2.0 and tuned["weights"]["host_cache_hit_weight"] == 0.4
    assert tuned["policies"]["tier_aware"] != defaults["policies"]["tier_aware"]
    bad = subprocess.run(base + ["--prefill-load-scale", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--prefill-load-scale" in bad.stderr


def test_tune_searches_predicted_ttfts_weights_on_a_mixed_cluster():
    shape = ClusterShape(workers=3, page_size=64, device_pages=512, host_pages=512, l3=False,
                         worker_speeds=(1.0, 1.0, 0.5))
    requests = prepare(load_trace("synthetic:3", 90), shape.page_size)
    report = tune(requests, shape, budget=3, lag_s=0.005, seed=2, policy="predicted_ttft")
    assert report["policy"] == "predicted_ttft" and report["trials"] == 3
    for objective, key in OBJECTIVES.items():
        assert report["best"][objective]["figures"][key] <= report["defaults"][key]
    with pytest.raises(ValueError, match="tunes tier_aware or predicted_ttft"):
        tune(requests, shape, budget=1, lag_s=0.005, seed=2, policy="oracle")
