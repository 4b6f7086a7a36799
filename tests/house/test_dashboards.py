"""The Grafana dashboard, its provisioning and Prometheus' alert rules, checked without Grafana,
Prometheus or a Docker engine.

Every metric a dashboard panel or an alert rule queries must be one kvtier exports. What it
exports is read from the code, not from a list: the router's `RouterMetrics()` registry, the
processor's and the bridge's module-level metrics (the default registry their --metrics-port
serves) and the registry `kvtier analytics` serves, each family expanded into the series
Prometheus sees (a counter `x` is `x_total`, a histogram `h` is `h_bucket`, `h_count`, `h_sum`),
with its label names. A small PromQL tokenizer takes each expression apart: strings, durations,
numbers, functions, keywords and grouping lists are set aside, and what is left are metric
names; the label names in matchers and groupings must be labels of those metrics. Beyond that:
the dashboard JSON uses the provisioned data source, unique panel ids and non-empty targets;
every rule has `expr`, `for`, a severity, a summary, a description and a runbook in
docs/DEPLOY.md; Prometheus loads the rule file that compose mounts; Grafana's provisioning and
dashboards are mounted where its providers look, and its data source reaches the prometheus
service. Each check has a negative test that feeds a broken copy of the real files to the same
checker and expects its error. There is no promtool here: a PromQL syntax error the tokenizer
does not see (it checks brackets, function names and tokens, not the grammar) is not caught.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .test_compose import ROOT, Compose, _check_target, load_files, read_compose

yaml = pytest.importorskip("yaml", reason="PyYAML reads the rule file and Grafana's provisioning: pip install pyyaml")

DASHBOARDS_DIR = ROOT / "deploy" / "grafana" / "dashboards"
PROVISIONING_DIR = ROOT / "deploy" / "grafana" / "provisioning"
DATASOURCES_FILE = PROVISIONING_DIR / "datasources" / "prometheus.yml"
PROVIDERS_FILE = PROVISIONING_DIR / "dashboards" / "kvtier.yml"
ALERTS_FILE = ROOT / "deploy" / "alerts.yml"
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"

#: Series that are not kvtier's but may be queried, each with its labels (None: any) and why.
ALLOWED_SERIES: dict[str, tuple[frozenset[str] | None, str]] = {
    "up": (frozenset(), "Prometheus writes it for every scrape target"),
    "scrape_duration_seconds": (frozenset(), "Prometheus writes it for every scrape target"),
    "scrape_samples_scraped": (frozenset(), "Prometheus writes it for every scrape target"),
    "ALERTS": (None, "Prometheus writes it for the alert rules it evaluates (deploy/alerts.yml), with their labels"),
}
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
SEVERITIES = {"critical", "warning", "info"}


# --- what kvtier exports -------------------------------------------------------------------------

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"),
             "summary": ("", "_count", "_sum"), "info": ("_info",), "stateset": ("",),
             "gaugehistogram": ("_bucket", "_gcount", "_gsum"), "unknown": ("",)}


@dataclass
class Exported:
    """Series name -> (label names, what exports it)."""

    series: dict[str, tuple[frozenset[str], str]] = field(default_factory=dict)

    def add_family(self, family: Any, labelnames: Iterable[str], source: str) -> None:
        base = (set(labelnames) | {n for sample in family.samples for n in sample.labels}) - {"le", "quantile"}
        names = {family.name + suffix for suffix in _SUFFIXES[family.type]} | {s.name for s in family.samples}
        for name in names:
            own = set(base)
            if name.endswith("_bucket"):
                own.add("le")
            if family.type == "summary" and name == family.name:
                own.add("quantile")
            previous = self.series.get(name, (frozenset(), source))[0]
            self.series[name] = (previous | frozenset(own), source)

    def source(self, name: str) -> str:
        return self.series[name][1] if name in self.series else f"Prometheus ({ALLOWED_SERIES[name][1]})"

    def labels(self, name: str) -> frozenset[str] | None:
        """The labels a queried series may carry (None: any); KeyError for an unknown series."""
        if name in ALLOWED_SERIES:
            allowed = ALLOWED_SERIES[name][0]
            return None if allowed is None else allowed | TARGET_LABELS
        return self.series[name][0] | TARGET_LABELS

    def __contains__(self, name: str) -> bool:
        return name in ALLOWED_SERIES or name in self.series


def _wrapper_labels(metric: Any) -> tuple[str, ...]:
    # prometheus_client keeps a metric's declared label names here; a labelled metric that has
    # seen no value yet has no samples to read them from.
    return tuple(getattr(metric, "_labelnames", ()))


def _module_metrics(module: Any) -> list[Any]:
    from prometheus_client.metrics import MetricWrapperBase

    return [value for value in vars(module).values() if isinstance(value, MetricWrapperBase)]


def exported_metrics() -> Exported:
    from prometheus_client.metrics import MetricWrapperBase

    from kvtier.consumers import processor_metrics as processor
    from kvtier.consumers.analytics import AnalyticsConfig, AnalyticsService
    from kvtier.producers import bridge, bridge_metrics
    from kvtier.router.metrics import RouterMetrics

    found = Exported()
    router = RouterMetrics()
    declared = {m.describe()[0].name: _wrapper_labels(m) for m in vars(router).values()
                if isinstance(m, MetricWrapperBase)}
    for family in router.registry.collect():
        found.add_family(family, declared.get(family.name, ()), "router (RouterMetrics)")
    for module, source in ((processor, "processor"), (bridge, "bridge"), (bridge_metrics, "bridge")):
        for metric in _module_metrics(module):
            for family in metric.collect():
                found.add_family(family, _wrapper_labels(metric), f"{source} ({module.__name__})")
    analytics = AnalyticsService(AnalyticsConfig(nats_url="nats://127.0.0.1:4222"))  # connects to nothing
    for family in analytics.registry.collect():
        found.add_family(family, getattr(family, "_labelnames", ()), "analytics (AnalyticsService)")
    return found


# --- PromQL, taken apart --------------------------------------------------------------------------

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
FUNCTIONS = AGGREGATIONS | {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "double_exponential_smoothing", "exp",
    "floor", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
    "start", "end",  # the @ modifier's start() and end()
}
GROUPINGS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPINGS | {"bool", "and", "or", "unless", "offset", "atan2"}
#: Functions that make up labels of their own: label names around them are not checked.
LABEL_MAKERS = {"label_replace", "label_join", "count_values"}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w.])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>(?:[A-Za-z_]|:(?!\d))[A-Za-z0-9_:]*)  # not the ':' of a subquery's [1h:5m]
  | (?P<variable>\$(?:\{[^}]*\}|\w+))
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=@,:])
  | (?P<bracket>[(){}\[\]])
""", re.VERBOSE)
_PAIRS = {")": "(", "]": "[", "}": "{"}


@dataclass
class Token:
    kind: str
    text: str


@dataclass
class Query:
    """What one PromQL expression refers to."""

    metrics: list[str] = field(default_factory=list)
    #: (metric, label) for a matcher written on that metric; (None, label) for a bare {...} or a grouping
    labels: list[tuple[str | None, str]] = field(default_factory=list)
    jobs: list[tuple[str, str]] = field(default_factory=list)  # (matcher op, value) of job matchers
    functions: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _tokens(expr: str, errors: list[str]) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            errors.append(f"unexpected {expr[pos]!r} at offset {pos}")
            pos += 1
            continue
        pos = m.end()
        if m.lastgroup not in ("space", "comment"):
            tokens.append(Token(m.lastgroup or "", m.group(0)))
    return tokens


def _unquote(text: str) -> str:
    return text[1:-1] if text[:1] in "\"'`" else text


def parse_promql(expr: str, grafana: bool) -> Query:
    """The metric names, label names and job matchers of a PromQL expression. `grafana`: the
    expression is a Grafana target, where $variables may stand for durations."""
    q = Query()
    toks = _tokens(expr, q.errors)
    stack: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.kind == "variable":
            if not grafana:
                q.errors.append(f"{t.text} is a Grafana variable, which Prometheus does not know")
        elif t.kind == "bracket" and t.text == "[":  # a range or subquery: durations, variables, ':'
            depth_start = i
            i += 1
            while i < len(toks) and toks[i].text != "]":
                if toks[i].kind not in ("duration", "variable", "number") and toks[i].text != ":":
                    q.errors.append(f"{toks[i].text!r} inside [...] is not a duration")
                if toks[i].kind == "variable" and not grafana:
                    q.errors.append(f"{toks[i].text} is a Grafana variable, which Prometheus does not know")
                i += 1
            if i == len(toks):
                q.errors.append(f"unbalanced '[' at token {depth_start}")
        elif t.kind == "bracket" and t.text == "{":  # label matchers, of the metric just before or bare
            owner = toks[i - 1].text if i and toks[i - 1].kind == "ident" and toks[i - 1].text in q.metrics else None
            i += 1
            while i < len(toks) and toks[i].text != "}":
                name, op, value = (toks[i:i + 3] + [Token("", "")] * 3)[:3]
                if name.kind not in ("ident", "string") or op.text not in ("=", "!=", "=~", "!~") \
                        or value.kind != "string":
                    q.errors.append(f"malformed label matcher near {' '.join(x.text for x in toks[i:i + 3])!r}")
                    while i < len(toks) and toks[i].text not in (",", "}"):
                        i += 1
                else:
                    label = _unquote(name.text)
                    if label == "__name__" and op.text == "=":
                        q.metrics.append(_unquote(value.text))
                    elif label == "job":
                        q.jobs.append((op.text, _unquote(value.text)))
                    if label != "__name__":
                        q.labels.append((owner, label))
                    i += 3
                if i < len(toks) and toks[i].text == ",":
                    i += 1
            if i == len(toks):
                q.errors.append("unbalanced '{'")
        elif t.kind == "bracket" and t.text == "(":
            stack.append("(")
        elif t.kind == "bracket":  # ) or a stray ] }
            if not stack or stack[-1] != _PAIRS[t.text]:
                q.errors.append(f"unbalanced {t.text!r}")
            else:
                stack.pop()
        elif t.kind == "ident":
            word = t.text
            if word in GROUPINGS:
                if nxt is not None and nxt.text == "(":
                    i += 2
                    while i < len(toks) and toks[i].text != ")":
                        if toks[i].kind == "ident":
                            q.labels.append((None, toks[i].text))
                        elif toks[i].text != ",":
                            q.errors.append(f"{toks[i].text!r} in {word}(...) is not a label name")
                        i += 1
                    if i == len(toks):
                        q.errors.append(f"unbalanced '(' after {word}")
                elif word not in ("group_left", "group_right"):
                    q.errors.append(f"{word} without its label list")
            elif word in KEYWORDS or word.lower() in ("inf", "nan"):
                pass
            elif nxt is not None and nxt.text in ("by", "without"):  # sum by (l) (...)
                if word not in AGGREGATIONS:
                    q.errors.append(f"{word} {nxt.text} (...): {word} is no PromQL aggregation")
                q.functions.append(word)
            elif nxt is not None and nxt.text == "(":
                if word not in FUNCTIONS:
                    q.errors.append(f"{word}() is no PromQL function")
                q.functions.append(word)
            else:
                q.metrics.append(word)
        i += 1
    if stack:
        q.errors.append("unbalanced '('")
    return q


def check_query(expr: str, where: str, exported: Exported, jobs: set[str], grafana: bool,
                templates: Iterable[str] = ()) -> list[str]:
    """Errors of one expression: unknown metrics, labels none of its metrics has, unknown jobs.
    `templates`: label names an alert's annotations use ({{ $labels.x }})."""
    if not isinstance(expr, str) or not expr.strip():
        return [f"{where}: no expression"]
    q = parse_promql(expr, grafana)
    errors = [f"{where}: {e} in {expr!r}" for e in q.errors]
    if not q.metrics and not q.errors:
        errors.append(f"{where}: {expr!r} queries no metric")
    for name in q.metrics:
        if name not in exported:
            errors.append(f"{where}: queries {name}, which kvtier does not export (nor is it an allowed series)")
    known = [exported.labels(name) for name in q.metrics if name in exported]
    if len(known) == len(q.metrics) and not LABEL_MAKERS & set(q.functions) and None not in known:
        union = frozenset().union(*known) if known else TARGET_LABELS
        for owner, label in q.labels:
            own = exported.labels(owner) if owner and owner in exported else None
            if own is not None and label not in own:
                errors.append(f"{where}: {owner} has no label {label!r} (it has {sorted(own)}; exported by "
                              f"{exported.source(owner)})")
            elif owner is None and label not in union:
                errors.append(f"{where}: no metric of {expr!r} has a label {label!r}")
        for label in templates:
            if label not in union:
                errors.append(f"{where}: its annotations use $labels.{label}, which no metric of its expr has")
    for op, value in q.jobs:  # each name (each alternative of a regex) is a scrape job
        for name in value.split("|") if "~" in op else [value]:
            try:
                found = any(re.fullmatch(name, job) if "~" in op else name == job for job in jobs)
            except re.error as exc:
                errors.append(f"{where}: job matcher {value!r} is no valid regex ({exc})")
                break
            if not found:
                errors.append(f"{where}: job {name!r} names no scrape job of deploy/prometheus.yml ({sorted(jobs)})")
    return errors


def _jobs(prometheus: dict) -> set[str]:
    return {str(job.get("job_name")) for job in prometheus.get("scrape_configs") or []}


# --- the dashboards ------------------------------------------------------------------------------

def _all_panels(panels: list[dict]) -> Iterable[dict]:
    for panel in panels:
        yield panel
        yield from _all_panels(panel.get("panels") or [])  # a collapsed row holds its panels


def check_dashboard(name: str, dashboard: dict, datasource_uid: str, exported: Exported, jobs: set[str]) -> list[str]:
    errors: list[str] = []
    for key in ("uid", "title", "panels", "schemaVersion"):
        if not dashboard.get(key):
            errors.append(f"{name}: no {key}")
    seen: dict[int, str] = {}
    for panel in _all_panels(dashboard.get("panels") or []):
        title = panel.get("title", "?")
        pid = panel.get("id")
        where = f"{name}: panel {title!r} (id {pid})"
        if not isinstance(pid, int):
            errors.append(f"{where}: no integer id")
        elif pid in seen:
            errors.append(f"{where}: id {pid} is also panel {seen[pid]!r}'s")
        else:
            seen[pid] = title
        pos = panel.get("gridPos") or {}
        if not all(isinstance(pos.get(k), int) for k in ("x", "y", "w", "h")) or pos["x"] + pos["w"] > 24:
            errors.append(f"{where}: gridPos {pos} is not within the 24-column grid")
        if panel.get("type") == "row":
            continue
        source = panel.get("datasource") or {}
        if source.get("uid") != datasource_uid or source.get("type") != "prometheus":
            errors.append(f"{where}: datasource {source} is not the provisioned Prometheus (uid {datasource_uid})")
        targets = panel.get("targets") or []
        if not targets:
            errors.append(f"{where}: no targets")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            errors.append(f"{where}: refIds {refs} are not unique")
        for target in targets:
            own = (target.get("datasource") or {}).get("uid", datasource_uid)
            if own != datasource_uid:
                errors.append(f"{where}: target {target.get('refId')} uses datasource {own}, not {datasource_uid}")
            errors += check_query(target.get("expr", ""), f"{where} target {target.get('refId')}", exported, jobs,
                                  grafana=True)
    for variable in (dashboard.get("templating") or {}).get("list") or []:
        if variable.get("type") == "query":
            query = variable.get("query")
            query = query.get("query", "") if isinstance(query, dict) else str(query or "")
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
            expr = m.group(1) if m else re.sub(r"^\s*query_result\((.*)\)\s*$", r"\1", query)
            errors += check_query(expr, f"{name}: variable {variable.get('name')!r}", exported, jobs, grafana=True,
                                  templates=[m.group(2)] if m else [])
    return errors


# --- the alert rules -----------------------------------------------------------------------------

_DURATION = re.compile(r"(?:\d+(?:ms|[smhdwy]))+")
_RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
_GROUP_KEYS = {"name", "interval", "rules", "limit", "query_offset"}
_TEMPLATE_LABEL = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def check_alerts(rules: dict, exported: Exported, jobs: set[str], doc: str) -> list[str]:
    errors: list[str] = []
    groups = rules.get("groups") if isinstance(rules, dict) else None
    if not groups:
        return ["alerts.yml: no groups"]
    anchors = _anchors(doc)
    group_names: set[str] = set()
    alert_names: set[str] = set()
    for group in groups:
        gname = group.get("name")
        if not gname or gname in group_names:
            errors.append(f"alerts.yml: group name {gname!r} missing or used twice")
        group_names.add(gname)
        errors += [f"alerts.yml: group {gname}: unknown key {k!r}" for k in sorted(set(group) - _GROUP_KEYS)]
        if not group.get("rules"):
            errors.append(f"alerts.yml: group {gname} has no rules")
        for rule in group.get("rules") or []:
            name = rule.get("alert") or rule.get("record")
            where = f"alerts.yml: {name or 'a rule of ' + str(gname)}"
            errors += [f"{where}: unknown key {k!r}" for k in sorted(set(rule) - _RULE_KEYS)]
            if "record" in rule:
                errors += check_query(rule.get("expr", ""), where, exported, jobs, grafana=False)
                continue
            if not name:
                errors.append(f"{where}: no alert name")
            elif name in alert_names:
                errors.append(f"{where}: alert {name} is defined twice")
            alert_names.add(name)
            if not isinstance(rule.get("for"), str) or not _DURATION.fullmatch(rule["for"]):
                errors.append(f"{where}: no `for` duration (got {rule.get('for')!r})")
            severity = (rule.get("labels") or {}).get("severity")
            if severity not in SEVERITIES:
                errors.append(f"{where}: labels.severity {severity!r} is not one of {sorted(SEVERITIES)}")
            notes = rule.get("annotations") or {}
            for key in ("summary", "description", "runbook"):
                if not str(notes.get(key) or "").strip():
                    errors.append(f"{where}: no annotations.{key}")
            runbook = str(notes.get("runbook") or "")
            if runbook:
                path, _, anchor = runbook.partition("#")
                if path != "docs/DEPLOY.md" or anchor not in anchors:
                    errors.append(f"{where}: runbook {runbook!r} is no heading of docs/DEPLOY.md")
            if name and name not in doc:
                errors.append(f"{where}: docs/DEPLOY.md does not mention {name}")
            used = {m for text in notes.values() for m in _TEMPLATE_LABEL.findall(str(text))}
            errors += check_query(rule.get("expr", ""), where, exported, jobs, grafana=False, templates=sorted(used))
    return errors


# --- the wiring: compose, prometheus.yml, Grafana's provisioning ---------------------------------------

def _mounts(spec: dict) -> dict[str, tuple[str, bool]]:
    """Container path -> (repo path of a bind mount from the checkout, read-only)."""
    found = {}
    for mount in spec.get("volumes") or []:
        if isinstance(mount, dict):
            if mount.get("type") == "bind":
                found[str(mount["target"])] = (str(mount["source"]), bool(mount.get("read_only")))
            continue
        parts = str(mount).split(":")
        if len(parts) >= 2 and parts[0].startswith("."):
            found[parts[1]] = (posixpath.normpath(parts[0]), len(parts) > 2 and "ro" in parts[2].split(","))
    return found


def _source_of(mounts: dict[str, tuple[str, bool]], path: str) -> tuple[Path, bool] | None:
    """Where a container path comes from in the checkout (through the deepest mount above it)."""
    for target in sorted(mounts, key=len, reverse=True):
        if path == target or path.startswith(target.rstrip("/") + "/"):
            source, read_only = mounts[target]
            return ROOT / source / path[len(target):].lstrip("/"), read_only
    return None


@dataclass
class Monitoring:
    compose: dict
    prometheus: dict
    datasources: dict
    providers: dict
    rules: dict
    dashboards: dict[str, dict]


def load_monitoring() -> Monitoring:
    compose, prometheus = load_files()
    dashboards = {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS_DIR.glob("*.json"))}
    return Monitoring(compose, prometheus, yaml.safe_load(DATASOURCES_FILE.read_text()),
                      yaml.safe_load(PROVIDERS_FILE.read_text()), yaml.safe_load(ALERTS_FILE.read_text()), dashboards)


def provisioned_uid(m: Monitoring) -> tuple[str | None, list[str]]:
    sources = [d for d in (m.datasources.get("datasources") or []) if d.get("type") == "prometheus"]
    if len(sources) != 1 or not sources[0].get("uid"):
        return None, [f"{DATASOURCES_FILE.relative_to(ROOT)}: wants exactly one Prometheus data source with a uid, "
                      f"got {sources}"]
    return str(sources[0]["uid"]), []


def check_wiring(m: Monitoring) -> list[str]:
    errors: list[str] = []
    c: Compose = read_compose(m.compose, m.prometheus)
    # Prometheus loads the rule file, which compose mounts from the checkout.
    servers = c.of("prometheus")
    rule_files = [str(r) for r in m.prometheus.get("rule_files") or []]
    if not rule_files:
        errors.append("prometheus.yml: no rule_files")
    for server in servers:
        mounts = _mounts(server.spec)
        config = next((t for t, (s, _) in mounts.items() if s == "deploy/prometheus.yml"), "")
        loaded = set()
        for pattern in rule_files:
            pattern = posixpath.join(posixpath.dirname(config), pattern)  # relative to the config file
            hits = [t for t in mounts if fnmatch.fnmatch(t, pattern)]
            if not hits:
                errors.append(f"{server.name}: rule file {pattern} (prometheus.yml rule_files) is not mounted")
            for target in hits:
                source = _source_of(mounts, target)
                if source is None or not source[0].is_file():
                    errors.append(f"{server.name}: rule file {target} is mounted from a file that does not exist")
                else:
                    loaded.add(source[0].resolve())
        if ALERTS_FILE.resolve() not in loaded:
            errors.append(f"{server.name}: deploy/alerts.yml is not mounted where prometheus.yml's rule_files look")
    # Grafana: provisioning and dashboards mounted read-only, its data source reaches prometheus.
    grafanas = c.of("grafana")
    if not grafanas:
        errors.append("no grafana service")
    for g in grafanas:
        mounts = _mounts(g.spec)
        for target, (source, read_only) in mounts.items():
            if not read_only:
                errors.append(f"{g.name}: {source} is mounted at {target} read-write; mount it :ro")
        provisioning = g.env.get("GF_PATHS_PROVISIONING") or "/etc/grafana/provisioning"
        for file in (DATASOURCES_FILE, PROVIDERS_FILE):
            inside = posixpath.join(provisioning, file.relative_to(PROVISIONING_DIR).as_posix())
            found = _source_of(mounts, inside)
            if found is None or found[0].resolve() != file.resolve():
                errors.append(f"{g.name}: {file.relative_to(ROOT)} is not mounted at {inside}")
        shown: set[Path] = set()
        for provider in m.providers.get("providers") or []:
            path = str((provider.get("options") or {}).get("path") or "")
            found = _source_of(mounts, path) if provider.get("type", "file") == "file" else None
            if found is None or not found[0].is_dir():
                errors.append(f"{g.name}: dashboards provider {provider.get('name')!r} reads {path!r}, which is not "
                              "mounted from a folder of the checkout")
            else:
                shown |= {p.resolve() for p in found[0].glob("*.json")}
        for name in m.dashboards:
            if (DASHBOARDS_DIR / name).resolve() not in shown:
                errors.append(f"{g.name}: dashboard {name} is in no provider's mounted folder")
        home = g.env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
        if home:
            found = _source_of(mounts, home)
            if found is None or not found[0].is_file():
                errors.append(f"{g.name}: GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH {home} is not a mounted file")
        for source in m.datasources.get("datasources") or []:
            url = str(source.get("url") or "")
            m_url = re.fullmatch(r"https?://([^:/]+)(?::(\d+))?/?", url)
            if not m_url:
                errors.append(f"{g.name}: data source {source.get('name')!r} has url {url!r}, not http://host:port")
                continue
            port = int(m_url.group(2)) if m_url.group(2) else 80
            _check_target(c, f"{g.name}: data source {source.get('name')!r}", url, m_url.group(1), port, errors,
                          runs_with=g, role="http")
            target = c.services.get(m_url.group(1))
            if target is not None and target.kind != "prometheus":
                errors.append(f"{g.name}: data source {url} is {target.name}, not a prometheus service")
        for entry in g.spec.get("ports") or []:
            if not str(entry).startswith("127.0.0.1:"):
                errors.append(f"{g.name}: port {entry} is published beyond 127.0.0.1")
        if str(g.env.get("GF_AUTH_ANONYMOUS_ENABLED", "")).lower() == "true" and \
                g.env.get("GF_AUTH_ANONYMOUS_ORG_ROLE", "Viewer") != "Viewer":
            errors.append(f"{g.name}: anonymous users get role {g.env.get('GF_AUTH_ANONYMOUS_ORG_ROLE')}, not Viewer")
    return errors


def all_errors(m: Monitoring, exported: Exported) -> list[str]:
    uid, errors = provisioned_uid(m)
    jobs = _jobs(m.prometheus)
    for name, dashboard in m.dashboards.items():
        errors += check_dashboard(name, dashboard, uid or "?", exported, jobs)
    errors += check_alerts(m.rules, exported, jobs, DEPLOY_DOC.read_text())
    errors += check_wiring(m)
    return errors


# --- the tests --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported() -> Exported:
    return exported_metrics()


@pytest.fixture(scope="module")
def monitoring() -> Monitoring:
    return load_monitoring()


def test_exported_metrics_are_read_from_the_code(exported):
    """The walk finds each part's series under the names Prometheus sees, with their labels."""
    assert exported.labels("router_ttft_seconds_bucket") == {"worker", "mode", "tier", "le", "job", "instance"}
    assert exported.labels("router_tokenizer_checks_total") == {"model", "outcome", "job", "instance"}
    assert exported.labels("kvtier_processor_consumer_pending") == {"partition", "job", "instance"}
    assert exported.labels("kvtier_bridge_gaps_total") == {"worker", "recovered", "job", "instance"}
    assert exported.labels("kvtier_analytics_consumer_lag_seconds") == {"stream", "job", "instance"}
    assert "router_proxy_overhead_seconds_count" in exported and "kvtier_processor_event_lag_seconds_sum" in exported
    for bare in ("router_decisions", "router_ttft_seconds", "kvtier_processor_gaps", "router_made_up_total"):
        assert bare not in exported


def test_dashboards_alerts_and_wiring_are_consistent(monitoring, exported):
    assert monitoring.dashboards, f"no dashboard in {DASHBOARDS_DIR}"
    assert all_errors(monitoring, exported) == []


def _queried(exprs: Iterable[str], grafana: bool) -> set[str]:
    return {name for expr in exprs for name in parse_promql(expr, grafana).metrics}


#: What the dashboard and the alerts must keep showing: one series for each failure mode or
#: figure docs/DEPLOY.md promises. (Not what is exported: that is read from the code above.)
SHOWN = {
    "decisions by mode": "router_decisions_total", "chosen overlap by tier": "router_chosen_overlap_pages_sum",
    "TTFT by mode": "router_ttft_seconds_bucket", "request time": "router_request_seconds_bucket",
    "proxy overhead": "router_proxy_overhead_seconds_bucket", "tokenizer checks": "router_tokenizer_checks_total",
    "pipeline lag": "kvtier_processor_event_lag_seconds_bucket", "backlog": "kvtier_processor_consumer_pending",
    "partial workers": "router_partial_workers", "stale workers": "kvtier_processor_stale_workers",
    "expired workers": "kvtier_processor_expired_workers_total",
    "hash mismatches": "router_worker_hash_mismatch_pages", "hash checks": "kvtier_processor_hash_checked_pages_total",
    "shared-pool errors": "router_shared_pool_errors_total", "Redis": "router_state_store_up",
    "NATS": "kvtier_bridge_publish_retries_total", "scrape targets": "up", "index ready": "router_index_ready",
    "index lag": "router_index_lag_seconds_bucket", "index bootstraps": "router_index_bootstraps_total",
}
ALERTED = {
    "state store down": "router_state_store_up", "fallback decisions": "router_fallback_decisions_total",
    "index not ready": "router_index_ready", "index lag": "router_index_lag_seconds_bucket",
    "hash mismatches": "router_worker_hash_mismatch_pages", "tokenizer mismatches": "router_tokenizer_checks_total",
    "shared-pool errors": "router_shared_pool_errors_total",
    "processor lag": "kvtier_processor_event_lag_seconds_bucket",
    "backlog": "kvtier_processor_consumer_pending", "dead letters": "kvtier_processor_dead_letters_total",
    "bridge gaps": "kvtier_bridge_gaps_total", "bridge epochs": "kvtier_bridge_epochs_total",
    "target down": "up", "partial workers": "router_partial_workers",
    "Redis data loss": "kvtier_processor_state_rebuilds_total",
}


def test_the_dashboard_shows_and_the_alerts_cover_each_failure_mode(monitoring):
    shown = _queried((t.get("expr", "") for d in monitoring.dashboards.values() for p in _all_panels(d["panels"])
                      for t in p.get("targets") or []), grafana=True)
    alerted = _queried((r["expr"] for g in monitoring.rules["groups"] for r in g["rules"]), grafana=False)
    assert {what: name for what, name in SHOWN.items() if name not in shown} == {}
    assert {what: name for what, name in ALERTED.items() if name not in alerted} == {}


@pytest.mark.parametrize("expr, metrics, labels", [
    ('sum by (le, mode) (rate(router_ttft_seconds_bucket{tier!="none"}[$__rate_interval]))',
     ["router_ttft_seconds_bucket"], [("router_ttft_seconds_bucket", "tier"), (None, "le"), (None, "mode")]),
    ('a_total / on (job) group_left (model) b offset 5m > bool 1e3', ["a_total", "b"],
     [(None, "job"), (None, "model")]),
    ('{__name__="x", job=~"a|b"} or count_over_time(y[1h:5m]) unless z @ start()', ["x", "y", "z"], [(None, "job")]),
    ('absent(m{s="a } ( [ by"}) * -Inf + NaN', ["m"], [("m", "s")]),
])
def test_the_tokenizer_finds_metrics_and_labels(expr, metrics, labels):
    q = parse_promql(expr, grafana=True)
    assert q.errors == []
    assert sorted(q.metrics) == sorted(metrics)
    assert sorted(q.labels, key=str) == sorted(labels, key=str)


def _first_target(m: Monitoring) -> dict:
    return next(p for p in _all_panels(m.dashboards["kvtier.json"]["panels"]) if p.get("targets"))["targets"][0]


def _rule(m: Monitoring, name: str) -> dict:
    return next(r for g in m.rules["groups"] for r in g["rules"] if r.get("alert") == name)


def _panel(m: Monitoring, title: str) -> dict:
    return next(p for p in _all_panels(m.dashboards["kvtier.json"]["panels"]) if p.get("title") == title)


def _set(obj: Callable[[Monitoring], Any], key: str, value: Any) -> Callable[[Monitoring], None]:
    def apply(m: Monitoring) -> None:
        node = obj(m)
        if value is None:
            node.pop(key, None)
        else:
            node[key] = value
    return apply


def _services(m: Monitoring, name: str) -> dict:
    return m.compose["services"][name]


BROKEN: dict[str, tuple[Callable[[Monitoring], None], str]] = {
    # dashboard panels
    "panel queries a made-up metric": (_set(_first_target, "expr", "sum(rate(router_made_up_total[5m]))"),
                                       "queries router_made_up_total, which kvtier does not export"),
    "panel queries the counter's bare name": (_set(lambda m: _panel(m, "Decisions by mode")["targets"][0], "expr",
                                                   "sum by (mode) (rate(router_decisions[5m]))"),
                                              "queries router_decisions,"),
    "panel matches a label its metric lacks": (_set(lambda m: _panel(m, "Decisions by mode")["targets"][0], "expr",
                                                    'rate(router_decisions_total{outcome="kv"}[5m])'),
                                               "router_decisions_total has no label 'outcome'"),
    "panel groups by a label no metric has": (_set(lambda m: _panel(m, "Decisions by mode")["targets"][0], "expr",
                                                   "sum by (moda) (rate(router_decisions_total[5m]))"),
                                              "has a label 'moda'"),
    "panel calls no PromQL function": (_set(_first_target, "expr", "rat(router_decisions_total[5m])"),
                                       "rat() is no PromQL function"),
    "panel with an unclosed bracket": (_set(_first_target, "expr", "sum(rate(router_decisions_total[5m])"),
                                       "unbalanced '('"),
    "panel names an unknown job": (_set(_first_target, "expr", 'up{job="kvtier-routr"}'),
                                   "job 'kvtier-routr' names no"),
    "panel on another data source": (_set(lambda m: _panel(m, "Event lag"), "datasource",
                                          {"type": "prometheus", "uid": "other"}), "not the provisioned Prometheus"),
    "panel without targets": (_set(lambda m: _panel(m, "Event lag"), "targets", []), "no targets"),
    "two panels with one id": (_set(lambda m: _panel(m, "Event lag"), "id", 2), "id 2 is also panel"),
    "provisioned uid differs": (_set(lambda m: m.datasources["datasources"][0], "uid", "prometheus"),
                                "not the provisioned Prometheus (uid prometheus)"),
    # alert rules
    "alert queries a made-up metric": (_set(lambda m: _rule(m, "KvtierStaleWorkers"), "expr",
                                            "sum(rate(router_made_up_total[5m])) > 0"),
                                       "KvtierStaleWorkers: queries router_made_up_total, which kvtier does not"),
    "alert without for": (_set(lambda m: _rule(m, "KvtierTargetDown"), "for", None), "no `for` duration"),
    "alert without severity": (_set(lambda m: _rule(m, "KvtierTargetDown")["labels"], "severity", None),
                               "labels.severity None"),
    "alert without summary": (_set(lambda m: _rule(m, "KvtierTargetDown")["annotations"], "summary", None),
                              "no annotations.summary"),
    "alert's runbook is no heading": (_set(lambda m: _rule(m, "KvtierTargetDown")["annotations"], "runbook",
                                           "docs/DEPLOY.md#nowhere"), "is no heading of docs/DEPLOY.md"),
    "alert with a Grafana variable": (_set(lambda m: _rule(m, "KvtierSharedPoolErrors"), "expr",
                                           "rate(router_shared_pool_errors_total[$__rate_interval]) > 0"),
                                      "$__rate_interval is a Grafana variable"),
    "alert with a misspelt key": (_set(lambda m: _rule(m, "KvtierTargetDown"), "annotation", {}),
                                  "unknown key 'annotation'"),
    "annotation names a label the expr lacks": (_set(lambda m: _rule(m, "KvtierTargetDown")["annotations"], "summary",
                                                     "{{ $labels.worker }} is down"), "$labels.worker"),
    "alert defined twice": (lambda m: m.rules["groups"][0]["rules"].append(copy.deepcopy(_rule(m, "KvtierTargetDown"))),
                            "alert KvtierTargetDown is defined twice"),
    # wiring
    "rule file not loaded": (_set(lambda m: m.prometheus, "rule_files", ["/etc/prometheus/rules.yml"]),
                             "rule file /etc/prometheus/rules.yml (prometheus.yml rule_files) is not mounted"),
    "rule file not mounted": (_set(lambda m: _services(m, "prometheus"), "volumes",
                                   ["./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                                    "prometheus-data:/prometheus"]), "is not mounted"),
    "provisioning not mounted": (_set(lambda m: _services(m, "grafana"), "volumes",
                                      ["./deploy/grafana/dashboards:/etc/grafana/dashboards:ro"]),
                                 "datasources/prometheus.yml is not mounted at /etc/grafana/provisioning"),
    "dashboards folder not where the provider reads": (
        _set(lambda m: m.providers["providers"][0]["options"], "path", "/var/lib/grafana/dashboards"),
        "reads '/var/lib/grafana/dashboards', which is not mounted"),
    "provisioning mounted read-write": (_set(lambda m: _services(m, "grafana"), "volumes",
                                             ["./deploy/grafana/provisioning:/etc/grafana/provisioning",
                                              "./deploy/grafana/dashboards:/etc/grafana/dashboards:ro"]), "read-write"),
    "data source on the wrong port": (_set(lambda m: m.datasources["datasources"][0], "url", "http://prometheus:9091"),
                                      "prometheus:9091, but prometheus listens on"),
    "data source names no service": (_set(lambda m: m.datasources["datasources"][0], "url", "http://prom:9090"),
                                     "no service of the compose file"),
    "grafana published on every interface": (_set(lambda m: _services(m, "grafana"), "ports", ["3000:3000"]),
                                             "beyond 127.0.0.1"),
    "anonymous admins": (_set(lambda m: _services(m, "grafana")["environment"], "GF_AUTH_ANONYMOUS_ORG_ROLE", "Admin"),
                         "not Viewer"),
    "no grafana": (_set(lambda m: m.compose["services"], "grafana", None), "no grafana service"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_catches_its_breakage(monitoring, exported, case):
    mutate, expected = BROKEN[case]
    broken = copy.deepcopy(monitoring)
    mutate(broken)
    errors = all_errors(broken, exported)
    assert any(expected in e for e in errors), f"{case}: no error mentions {expected!r}; got {errors}"
