"""The alert rules and every dashboard query, read by a real Prometheus (Debian's 2.42 build;
docker-compose.yml runs 2.55): promtool checks the rule file and the compose Prometheus
configuration, and a Prometheus on loopback parses each query the dashboard sends (Grafana's
variables filled in as Grafana would). tests/house/test_dashboards.py checks the names and labels
the queries use against what kvtier exports; this checks the grammar it cannot."""

from __future__ import annotations

import subprocess

import pytest

from ..prometheus_helpers import PrometheusServer, as_prometheus_query, prometheus_tool
from .test_compose import PROMETHEUS_FILE
from .test_dashboards import ALERTS_FILE, _all_panels, load_monitoring

pytestmark = pytest.mark.timeout(120)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_tool("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_the_alert_rules_and_the_compose_configuration_pass_promtool(tmp_path):
    rules = promtool("check", "rules", str(ALERTS_FILE))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    # the configuration names the rule file where compose mounts it; checked here from the repo
    config = PROMETHEUS_FILE.read_text().replace("/etc/prometheus/alerts.yml", str(ALERTS_FILE))
    assert str(ALERTS_FILE) in config, "deploy/prometheus.yml no longer loads /etc/prometheus/alerts.yml"
    (tmp_path / "prometheus.yml").write_text(config)
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    # and a broken rule is refused (the check can fail)
    broken = tmp_path / "broken.yml"
    broken.write_text(ALERTS_FILE.read_text().replace("router_state_store_up == 0", "router_state_store_up == ", 1))
    assert promtool("check", "rules", str(broken)).returncode != 0


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, query) for every target of every panel of every dashboard."""
    out = []
    for name, dashboard in load_monitoring().dashboards.items():
        for panel in _all_panels(dashboard.get("panels") or []):
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append((f"{name}: {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    return out


def test_prometheus_parses_every_dashboard_query():
    queries = dashboard_queries()
    assert len(queries) >= 50, len(queries)
    with PrometheusServer() as prometheus:
        refused = []
        for where, expr in queries:
            answer = prometheus.query(as_prometheus_query(expr))
            if answer.get("status") != "success":
                refused.append(f"{where}: {answer.get('error')}\n  {expr}")
        assert not refused, "\n".join(refused)
        # the same check refuses a query Prometheus cannot parse
        assert prometheus.query("sum by (le) (rate(router_ttft_seconds_bucket[1m])")["errorType"] == "bad_data"
