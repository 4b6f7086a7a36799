"""`kvtier tune` and `kvtier demo` take their flags from kvtier/eval/settings.py's classes: a bare
command line reads as the declared defaults (the demo's smaller cluster and tune's 2,000 requests
being the commands' own), the cluster they build is the one the flags describe, and a rule between
flags is a usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.cli import build_parser
from kvtier.eval.settings import ClusterFlags, DemoSettings, ReplayBench, TuneSettings
from kvtier.plumbing.settings import read_settings
from kvtier.sim.sim_cluster import Slowdown


@pytest.fixture(autouse=True)
def _no_kvtier_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)


def test_bare_command_lines_read_as_the_declared_defaults():
    parse = build_parser().parse_args
    assert read_settings(TuneSettings, parse(["tune"])) == TuneSettings(cluster=ClusterFlags(requests=2000))
    demo = ClusterFlags(trace="synthetic:1", requests=600, workers=4, device_pages=2048, host_pages=4096)
    assert read_settings(DemoSettings, parse(["demo"])) == DemoSettings(cluster=demo)


def test_the_cluster_is_the_one_the_flags_describe():
    args = build_parser().parse_args(["bench", "replay", "--workers", "4", "--no-l3", "--worker-speeds", "1,1,2,0.5",
                                      "--slowdown", "1:0.5@30", "--slowdown", "1:0.5@60", "--prefill-tokens-per-s",
                                      "10000", "--predicted-pages", "on"])
    bench = read_settings(ReplayBench, args)
    shape = bench.cluster.shape()
    assert shape.workers == 4 and not shape.l3 and shape.worker_speeds == (1.0, 1.0, 2.0, 0.5)
    assert shape.slowdowns == (Slowdown(1, 0.5, 30.0), Slowdown(1, 0.5, 60.0))
    assert shape.speed(1, 61.0) == 0.25 and shape.cost.prefill_tokens_per_s == 10000
    assert bench.predicted_pages is True and bench.via == "pipeline"


def test_a_holdout_outside_its_range_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "tune", "--holdout", "1.5"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--holdout must be in [0, 1), got 1.5" in out.stderr
    assert "Traceback" not in out.stderr
