"""`kvtier tune`: search the scoring weights on a trace replay and print the best settings for
TTFT p50, TTFT p99 and recomputed tokens, beside the defaults' figures and the oracle's.

Every trial is a lockstep replay of kvtier's own router (`RouterModel`, the decision the
pipeline makes, computed in process; tests/eval/test_lockstep.py holds the two equal; with
`--policy predicted_ttft`, that model overridden for workers faster at the rates it learns), so trials
are comparable and the same command prints the same answer. The search: the defaults, then
seeded random points over the space, then a coordinate refinement around each objective's
best. With `--holdout F` the search sees only the first (1 - F) of the trace and every
setting is then replayed on the last F it never saw, so a reader can tell a real gain from
one fitted to the trace.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
from dataclasses import dataclass, replace

import msgspec

from kvtier.eval.lockstep import run_lockstep
from kvtier.eval.policies import OraclePolicy, PredictedTtftModel, RoundRobinPolicy, RouterModel
from kvtier.eval.settings import TuneSettings
from kvtier.eval.trace import CONVERSATION_TRACE, PreparedRequest, load_trace, prepare
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.sim_cluster import ClusterShape

OBJECTIVES = {"ttft_p50": "ttft_p50_ms", "ttft_p99": "ttft_p99_ms", "recomputed": "recomputed_tokens"}

#: (weight, low, high, log scale): the space searched.
SPACE = (
    ("host_cache_hit_weight", 0.0, 1.5, False),
    ("disk_cache_hit_weight", 0.0, 1.0, False),
    ("shared_cache_multiplier", 0.0, 1.5, False),
    ("prefill_load_scale", 0.25, 64.0, True),
    ("predicted_page_weight", 0.0, 1.5, False),
    ("temperature", 0.0, 0.3, False),
)


@dataclass(frozen=True)
class Trial:
    weights: ScoringWeights
    summary: dict

    def value(self, objective: str) -> float:
        return self.summary[OBJECTIVES[objective]]


def _draw(rng: random.Random, shared: bool) -> dict:
    point = {}
    for name, low, high, log in SPACE:
        if name == "shared_cache_multiplier" and not shared:
            continue
        if name == "temperature":
            point[name] = 0.0 if rng.random() < 0.6 else round(rng.uniform(low, high), 3)
        elif log:
            point[name] = round(math.exp(rng.uniform(math.log(low), math.log(high))), 3)
        else:
            point[name] = round(rng.uniform(low, high), 3)
    return point


def _neighbours(weights: ScoringWeights, shared: bool) -> list[dict]:
    out = []
    for name, low, high, log in SPACE:
        if name == "shared_cache_multiplier" and not shared:
            continue
        value = getattr(weights, name)
        for factor in ((0.5, 2.0) if log else (-0.25, 0.25)):
            moved = value * factor if log else value + factor * (high - low)
            moved = round(min(high, max(low, moved)), 3)
            if moved != value:
                out.append({name: moved})
    return out


#: The router models `kvtier tune --policy` tunes: the formula, or the formula overridden for
#: workers faster at the rates it learns (PredictedTtftModel), whose weights are the formula's.
TUNED = ("tier_aware", "predicted_ttft")


class Tuner:
    def __init__(self, requests: list[PreparedRequest], shape: ClusterShape, lag_s: float, seed: int,
                 policy: str = "tier_aware"):
        if policy not in TUNED:
            raise ValueError(f"kvtier tune tunes {' or '.join(TUNED)}, not {policy!r}")
        self.requests = requests
        self.shape = shape
        self.lag_s = lag_s
        self.seed = seed
        self.shared = shape.l3
        self.priced = policy == "predicted_ttft"
        self.trials: list[Trial] = []
        self._seen: dict[bytes, Trial] = {}

    def policy_name(self) -> str:
        if self.priced:
            return "predicted_ttft"
        return "tier_aware_shared" if self.shared else "tier_aware"

    def replay(self, weights: ScoringWeights, requests: list[PreparedRequest] | None = None) -> dict:
        model = PredictedTtftModel if self.priced else RouterModel
        policy = model(self.policy_name(), self.shape.workers, self.shape.page_size, weights, self.shared,
                       self.lag_s, self.seed)
        result = asyncio.run(run_lockstep(policy, requests or self.requests, self.shape, weights, self.shared,
                                          self.seed))
        return result.summary()

    def trial(self, weights: ScoringWeights) -> Trial:
        key = msgspec.json.encode(weights)
        if key not in self._seen:
            self._seen[key] = Trial(weights, self.replay(weights))
            self.trials.append(self._seen[key])
        return self._seen[key]

    def best(self, objective: str) -> Trial:
        # ties: the earliest trial (the defaults come first)
        return min(self.trials, key=lambda t: t.value(objective))

    def search(self, budget: int, progress=None) -> None:
        rng = random.Random(self.seed)
        defaults = ScoringWeights()
        self.trial(defaults)
        explore = max(0, budget // 2 - 1)
        for _ in range(explore):
            self.trial(msgspec.structs.replace(defaults, **_draw(rng, self.shared)))
            if progress:
                progress(len(self.trials), budget)
        while len(self.trials) < budget:
            before = len(self.trials)
            for objective in OBJECTIVES:
                for change in _neighbours(self.best(objective).weights, self.shared):
                    if len(self.trials) >= budget:
                        break
                    self.trial(msgspec.structs.replace(self.best(objective).weights, **change))
                    if progress:
                        progress(len(self.trials), budget)
            if len(self.trials) == before:
                break  # every neighbour of every best point was tried


def _changes(weights: ScoringWeights) -> dict:
    defaults = ScoringWeights()
    return {name: getattr(weights, name) for name in weights.__struct_fields__
            if getattr(weights, name) != getattr(defaults, name)}


def _reference(policy, requests, shape, shared, seed) -> dict:
    return asyncio.run(run_lockstep(policy, requests, shape, ScoringWeights(), shared, seed)).summary()


def tune(requests: list[PreparedRequest], shape: ClusterShape, budget: int, lag_s: float, seed: int,
         holdout: float = 0.0, progress=None, policy: str = "tier_aware") -> dict:
    split = len(requests) - int(len(requests) * holdout) if holdout > 0 else len(requests)
    train, test = requests[:split], requests[split:]
    tuner = Tuner(train, shape, lag_s, seed, policy)
    tuner.search(budget, progress)
    defaults = tuner.trial(ScoringWeights())
    oracle = _reference(OraclePolicy(ScoringWeights(), shape.l3, seed), train, shape, shape.l3, seed)
    rr = _reference(RoundRobinPolicy(shape.workers), train, shape, shape.l3, seed)
    report: dict = {"policy": tuner.policy_name(), "trials": len(tuner.trials), "requests": len(train),
                    "defaults": _figures(defaults.summary), "oracle_at_defaults": _figures(oracle),
                    "round_robin": _figures(rr), "best": {}}
    if test:
        test = _reindexed(test)
        report["holdout_requests"] = len(test)
        report["holdout"] = {"defaults": _figures(tuner.replay(ScoringWeights(), test)),
                             "oracle_at_defaults": _figures(_reference(OraclePolicy(ScoringWeights(), shape.l3, seed),
                                                                       test, shape, shape.l3, seed)),
                             "round_robin": _figures(_reference(RoundRobinPolicy(shape.workers), test, shape,
                                                                shape.l3, seed))}
    for objective, key in OBJECTIVES.items():
        best = tuner.best(objective)
        entry = {"changes": _changes(best.weights), "weights": msgspec.to_builtins(best.weights),
                 "figures": _figures(best.summary),
                 "vs_defaults_pct": _pct(best.summary[key], defaults.summary[key]),
                 "vs_oracle_pct": _pct(best.summary[key], oracle[key])}
        if test:
            held = tuner.replay(best.weights, test)
            entry["holdout_figures"] = _figures(held)
            entry["holdout_vs_defaults_pct"] = _pct(held[key], report["holdout"]["defaults"][key])
        report["best"][objective] = entry
    report["verdict"] = tune_verdict(report)
    return report


def _reindexed(requests: list[PreparedRequest]) -> list[PreparedRequest]:
    """A later slice replayed on its own: request indexes from 0 (round robin and replica
    alternation start afresh, as on a fresh cluster)."""
    return [replace(r, index=i) for i, r in enumerate(requests)]


def _figures(summary: dict) -> dict:
    return {"ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
            "recomputed_tokens": summary["recomputed_tokens"], "reused_pct": summary["reused_pct"]}


def _pct(value: float, reference: float) -> float | None:
    """How much lower `value` is than `reference`, in percent (positive: better)."""
    return round(100 * (reference - value) / reference, 2) if reference else None


def tune_verdict(report: dict) -> str:
    wins = [(objective, e["vs_oracle_pct"]) for objective, e in report["best"].items()
            if e["vs_oracle_pct"] is not None and e["vs_oracle_pct"] > 0]
    gains = [(objective, e["vs_defaults_pct"]) for objective, e in report["best"].items()
             if e["vs_defaults_pct"] is not None and e["vs_defaults_pct"] > 0]
    parts = []
    if gains:
        parts.append("tuned weights beat the defaults on " + ", ".join(f"{o} by {g:.1f}%" for o, g in gains))
    else:
        parts.append("no setting tried beats the defaults")
    if wins:
        parts.append("and beat the oracle at default weights on " + ", ".join(f"{o} by {w:.1f}%" for o, w in wins))
    if "holdout" in report:
        held = [(o, e["holdout_vs_defaults_pct"]) for o, e in report["best"].items()]
        parts.append("on the held-out part: " + ", ".join(
            f"{o} {'+' if (v or 0) >= 0 else ''}{v:.1f}%" for o, v in held if v is not None))
    return "; ".join(parts) + "."


def format_tune(report: dict) -> str:
    lines = [f"{report['trials']} settings of {report['policy']} replayed on {report['requests']} requests "
             f"(lockstep, in process)", ""]
    header = f"{'':<26} {'TTFT p50':>10} {'TTFT p99':>10} {'recomputed tok':>15} {'reused':>7}"
    lines += [header, "-" * len(header)]

    def row(label: str, f: dict) -> str:
        return (f"{label:<26} {f['ttft_p50_ms']:>8.0f}ms {f['ttft_p99_ms']:>8.0f}ms {f['recomputed_tokens']:>15,.0f} "
                f"{f['reused_pct']:>6.1f}%")

    lines.append(row("round robin", report["round_robin"]))
    lines.append(row("defaults", report["defaults"]))
    lines.append(row("oracle at default weights", report["oracle_at_defaults"]))
    for objective, e in report["best"].items():
        lines.append(row(f"best for {objective}", e["figures"]))
    lines.append("")
    for objective, e in report["best"].items():
        changes = ", ".join(f"{k}={v:g}" for k, v in e["changes"].items()) or "the defaults"
        lines.append(f"best for {objective}: {changes} ({e['vs_defaults_pct']:+.1f}% vs defaults, "
                     f"{e['vs_oracle_pct']:+.1f}% vs the oracle at default weights"
                     + (f"; held out: {e['holdout_vs_defaults_pct']:+.1f}% vs defaults" if "holdout_figures" in e
                        else "") + ")")
        flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in e["changes"].items())
        if flags:
            lines.append(f"    kvtier router {flags}")
    lines.append("")
    lines.append("verdict: " + report["verdict"])
    return "\n".join(lines)


def run_tune(settings: TuneSettings) -> int:
    trace = settings.cluster.trace or str(CONVERSATION_TRACE)
    shape = settings.cluster.shape()
    requests = prepare(load_trace(trace, settings.cluster.requests), shape.page_size)

    def progress(done: int, total: int) -> None:
        print(f"\r  tried {done}/{total}", end="", file=sys.stderr, flush=True)

    report = tune(requests, shape, settings.budget, settings.visibility_lag_ms / 1000, settings.seed, settings.holdout,
                  progress, settings.policy)
    print("", file=sys.stderr)
    report["trace"] = trace
    print(format_tune(report))
    if settings.json:
        print(json.dumps(report))
    return 0
