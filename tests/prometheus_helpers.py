"""A real Prometheus on loopback for the tests that check kvtier's alert rules and dashboard
queries (tests/house/test_prometheus.py, tests/router/test_openai_proxy.py). The binaries come from Debian's
prometheus package, which scripts/test unpacks into .venv/prometheus (KVTIER_PROMETHEUS_DIR
overrides); the server is a child process on a free port, stopped by its PID."""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.harness.embedded import _Server


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`; the test fails (never skips) without it."""
    folders = [os.environ["KVTIER_PROMETHEUS_DIR"]] if os.environ.get("KVTIER_PROMETHEUS_DIR") else [
        str(Path(sys.prefix) / "prometheus" / "usr" / "bin")]
    for folder in folders:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(f"{name} not found in {folders} or on PATH: scripts/test unpacks Debian's prometheus package into "
                ".venv/prometheus; elsewhere set KVTIER_PROMETHEUS_DIR to a folder holding prometheus and promtool")


#: Grafana's variables in the dashboard's queries, as Grafana would fill them in for a 1 h view.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def as_prometheus_query(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


@dataclass
class PrometheusServer(_Server):
    name: str = "prometheus"
    #: the configuration file's text (scrape_configs, rule_files)
    config: str = "global:\n  scrape_interval: 1s\n"

    def _command(self) -> list[str]:
        path = os.path.join(self.workdir, "prometheus.yml")
        with open(path, "w") as f:
            f.write(self.config)
        return [prometheus_tool("prometheus"), f"--config.file={path}",
                f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=0.5) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict:
        """`/api/v1/query`'s answer, an error answer included (status "error", errorType, error)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())
