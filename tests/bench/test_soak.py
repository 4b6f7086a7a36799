"""`kvtier bench soak`: the verdicts on synthetic series (a healthy run passes, a leaking one
fails where it leaks), then the real machinery for a minute (every process on loopback, a
flush, a death), which must pass and print the JSON the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench.soak import SoakConfig
from kvtier.eval.soak_verdicts import Thresholds, judge, least_squares, phase_medians

BASE = 1_500_000  # Redis used_memory before any page
PER_ENTRY = 60  # bytes per (page, tier) entry


def _series(leak: bool = False):
    cfg = SoakConfig(minutes=10)
    phases = cfg.phase_bounds()
    starts = {n: s for n, s, _ in phases}
    kill_t = starts["die"]
    samples, peak = [], 0
    for i in range(0, 600, 5):
        t = float(i)
        phase = next(n for n, s, e in phases if s <= t < e)
        full = min(1.0, (t - starts[phase]) / 30) if phase in ("steady", "refill") else 1.0
        if phase == "evict":
            entries, dead = 100, 50
        elif phase in ("steady", "refill"):
            entries, dead = int(20_000 * full), int(10_000 * full)
        elif t < kill_t + 10:  # the dead workers' lease runs out
            entries, dead = 20_000, 10_000
        else:
            entries, dead = 10_000, 0
        peak = max(peak, entries)
        wobble = (i % 3) * 0.2
        growth = 1 + 0.3 * t / 600 if leak else 1.0
        s = {
            "t": t, "phase": phase, "entries": entries, "entries_n1": entries // 5,
            "entries_n2": entries - entries // 5,
            "dead_entries": dead if t >= kill_t else 0,
            # a leaking Redis keeps what it ever held: memory follows the peak, not the pages
            "redis_mem": BASE + 40_000 + PER_ENTRY * (peak if leak else entries) + (i % 4) * 1000,
            "keys": 30 if phase != "tail" else 28, "bookings": 8 + (i % 3),
            "rss_processor_mb": 60 * growth + wobble, "rss_router0_mb": 55 + wobble, "rss_bridge_a_mb": 47 + wobble,
            "js_KVTIER_EVENTS_mb": min(t, 120) * 0.05 * (0.5 if phase == "tail" else 1),
            "js_KVTIER_EVENTS_age_s": min(t, 121), "decisions_per_s": 6.0,
        }
        samples.append(s)
    dead_worker = {"pages_key": leak, "lease": False, "entries": 0, "state_ttl": 86_000, "load": False,
                   "lingering": ["meta key"]}
    meta = {"rate": 6.0, "requests": 3550, "errors": 0, "load_s": 600.0, "kill_t": kill_t, "lease_ttl_s": 5.0,
            "sample_s": 5.0, "stream_max_age_s": 120.0, "max_hold_s": 2.0, "max_inflight": 48,
            "routed_to_dead": 20, "routed_to_dead_late": 0,
            "survivors": ["rss_processor_mb", "rss_router0_mb", "rss_bridge_a_mb"],
            "end": {"bookings": 37 if leak else 0, "load_fields": 2 if leak else 0, "booking_keys": 37 if leak else 0,
                    "dead_workers": {"soak-b-dp0": dead_worker, "soak-b-dp1": dict(dead_worker)}}}
    return samples, phases, meta


def _by_name(verdicts):
    return {v["name"]: v for v in verdicts}


def test_verdicts_pass_on_a_healthy_series():
    samples, phases, meta = _series()
    verdicts = _by_name(judge(samples, phases, BASE, meta))
    assert all(v["ok"] for v in verdicts.values()), [v["detail"] for v in verdicts.values() if not v["ok"]]
    assert set(verdicts) >= {"redis_bytes_per_entry", "redis_falls_on_evict", "redis_falls_on_death", "rss_processor",
                             "rss_router0", "rss_bridge_a", "bookings_released", "dead_workers_cleared",
                             "redis_keys_bounded", "jetstream_retention", "load_sustained"}
    assert verdicts["redis_falls_on_evict"]["pages_fall"] > 0.99
    assert verdicts["dead_workers_cleared"]["lingering"] == ["meta key"]  # reported, not failed


def test_verdicts_fail_on_a_leaking_series():
    samples, phases, meta = _series(leak=True)
    verdicts = _by_name(judge(samples, phases, BASE, meta))
    failed = {name for name, v in verdicts.items() if not v["ok"]}
    assert failed == {"rss_processor", "redis_falls_on_evict", "redis_falls_on_death", "redis_bytes_per_entry",
                      "bookings_released", "dead_workers_cleared"}, {n: verdicts[n]["detail"] for n in failed}
    assert verdicts["rss_processor"]["growth"] > 0.10
    assert verdicts["rss_processor"]["projected_growth"] > 0.10
    assert verdicts["rss_router0"]["ok"]


def test_rss_a_slow_leak_fails():
    """~0.9 MB/min on a 60 MB process: +12% over the judged span, by the slope and the medians."""
    samples, phases, meta = _series()
    for s in samples:
        s["rss_processor_mb"] = 60 + 0.015 * s["t"]
    verdict = _by_name(judge(samples, phases, BASE, meta))["rss_processor"]
    assert not verdict["ok"] and verdict["projected_growth"] > 0.10
    relaxed = _by_name(judge(samples, phases, BASE, meta, Thresholds(rss_growth=0.2)))["rss_processor"]
    assert relaxed["ok"]


def test_least_squares_and_phase_medians():
    slope, intercept = least_squares([(0, 1.0), (1, 3.0), (2, 5.0), (3, None)])
    assert slope == pytest.approx(2.0) and intercept == pytest.approx(1.0)
    assert least_squares([(0, 1.0), (1, 2.0)]) is None
    samples, phases, _ = _series()
    medians = phase_medians(samples, phases)
    assert list(medians) == ["steady", "evict", "refill", "die", "tail"]
    assert medians["evict"]["entries"] == 100 and medians["tail"]["entries"] == 10_000


def test_config_bounds():
    with pytest.raises(ValueError, match="within"):
        SoakConfig(minutes=20)
    with pytest.raises(ValueError, match="survivor"):
        SoakConfig(sim_workers=2, die=2)
    with pytest.raises(ValueError, match="warm-up"):
        SoakConfig(warm_up_s=1000)
    assert SoakConfig(minutes=10).sample_s == 5.0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_soak_one_minute(tmp_path):
    plot = tmp_path / "soak.png"
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "soak", "--minutes", "1", "--rate", "15", "--warm-up-s", "40",
         "--device-pages", "256", "--host-pages", "1024", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=400, check=False)
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{result.stderr[-3000:]}"
    report = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    assert result.returncode == (0 if report["ok"] else 1)
    assert report["ok"], f"{table}\n{result.stderr[-2000:]}"
    assert report["minutes"] == 1.0 and report["samples"] >= 40
    assert list(report["phases"]) == ["steady", "evict", "refill", "die", "tail"]
    for medians in report["phases"].values():
        for key in ("used_memory", "entries", "bookings", "keys", "rss_processor_mb", "rss_router0_mb",
                    "js_KVTIER_EVENTS_mb", "decisions_per_s"):
            assert key in medians, key
    names = {v["name"] for v in report["verdicts"]}
    assert {"redis_falls_on_evict", "redis_falls_on_death", "rss_processor", "rss_router0", "rss_router1",
            "bookings_released", "dead_workers_cleared"} <= names
    assert all(isinstance(v["ok"], bool) and v["detail"] for v in report["verdicts"])
    # the phases did what they say: a flush emptied the pools, a death halved the workers
    assert report["phases"]["evict"]["entries"] < 0.1 * report["phases"]["steady"]["entries"]
    assert report["phases"]["tail"]["live_workers"] == 2 and report["phases"]["steady"]["live_workers"] == 4
    assert report["load"]["requests"] > 400 and report["end"]["bookings"] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS  redis_falls_on_evict" in table
