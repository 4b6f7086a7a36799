"""`kvtier bench replay`: a Mooncake-format trace on a simulated SGLang HiCache cluster, once
per routing policy, side by side, with the references a reader needs to judge them:

- baselines: `random`, `round_robin`;
- kvtier's policies: `least_load` (booked load only), `device_only` (device pages only),
  `tier_aware` (device, host and disk), `tier_aware_shared` (plus the shared L3 pool);
- `oracle`: kvtier's formula at the same weights on the simulator's ground truth at each
  arrival (perfect, instant information);
- bounds: `infinite` (one cache that never forgets) and `pooled_lru` (one LRU as large as the
  whole cluster's memory).

Per policy, `gap_closed` = (round_robin - policy) / (round_robin - oracle), for recomputed
tokens and for TTFT p50: the share of the gain the formula makes available that the policy
takes. The gap from a kvtier policy to the oracle is what the pipeline's information costs;
the gap from round robin to the oracle is what the formula is worth. `null` where the oracle
gains less than 1% over round robin (nothing to close).

Lockstep (the default, kvtier/eval/lockstep.py): the trace clock moves only when the
pipeline has caught up, so the figures are the same on any machine at any speed. kvtier's
policies go `--via pipeline` (the real bridge, JetStream, processor, Redis and two router
replicas) or `--via model` (the router's decision computed in process on the same
information, which a test holds equal to the pipeline's; fast, for sweeps and `kvtier tune`).
`--realtime` replays on the wall clock instead (kvtier/eval/realtime.py), to measure the live
pipeline rather than the policy.

This module runs the replays and builds the report dict; kvtier/eval/report.py prints it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from kvtier.eval.bounds import bounds
from kvtier.eval.lockstep import RunResult, run_lockstep
from kvtier.eval.policies import (
    DEVICE_ONLY,
    KVTIER_POLICIES,
    LOAD_ONLY,
    NAMED_POLICIES,
    ORACLES,
    POLICIES,
    REDRAW_SEED_OFFSET,
    REDRAWN,
    REFERENCE_POLICIES,
    OraclePolicy,
    PredictedTtftModel,
    RandomPolicy,
    RoundRobinPolicy,
    RouterModel,
    TtftOraclePolicy,
)
from kvtier.eval.report import (
    format_breakdown,
    format_shares,
    format_table,
    progress_bar,
    realtime_lines,
    verdict,
    write_plot,
)
from kvtier.eval.settings import ReplayBench
from kvtier.eval.trace import CONVERSATION_TRACE, PreparedRequest, load_trace, prepare
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.sim_cluster import ClusterShape

#: Trace seconds between an event leaving the engine and routers seeing it, by default: what
#: `kvtier bench ingest` measures for the whole path (ZMQ, bridge, JetStream, processor, Redis).
DEFAULT_VISIBILITY_LAG_MS = 5.0


@dataclass
class ReplaySettings:
    shape: ClusterShape = field(default_factory=ClusterShape)
    policies: tuple[str, ...] = POLICIES
    seed: int = 1
    visibility_lag_s: float = DEFAULT_VISIBILITY_LAG_MS / 1000
    via: str = "pipeline"  # kvtier policies: "pipeline" | "model"
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    predicted_pages: bool = False

    def __post_init__(self) -> None:
        known = POLICIES + NAMED_POLICIES + REFERENCE_POLICIES
        unknown = set(self.policies) - set(known)
        if unknown:
            raise ValueError(f"unknown policies {sorted(unknown)}; choose from {', '.join(known)}")
        if "tier_aware_shared" in self.policies and not self.shape.l3:
            self.policies = tuple(p for p in self.policies if p != "tier_aware_shared")
        if self.via not in ("pipeline", "model"):
            raise ValueError(f"--via must be pipeline or model, got {self.via!r}")


def policy_weights(name: str, weights: ScoringWeights) -> tuple[ScoringWeights, bool]:
    """(weights, credits the shared pool) of a kvtier policy."""
    if name == "least_load":
        return msgspec.structs.replace(weights, **LOAD_ONLY), False
    if name == "device_only":
        return msgspec.structs.replace(weights, **DEVICE_ONLY), False
    return weights, name == "tier_aware_shared"


def make_policy(name: str, settings: ReplaySettings, stack=None):
    shape, seed = settings.shape, settings.seed
    if name == "random":
        return RandomPolicy(shape.workers, seed)
    if name == "round_robin":
        return RoundRobinPolicy(shape.workers)
    if name == "oracle":
        return OraclePolicy(settings.weights, shape.l3, seed)
    if name == "ttft_oracle":
        return TtftOraclePolicy()
    if name == "predicted_ttft" and settings.via == "model":
        # the pool credited as tier_aware credits it (not at all): the two differ only in the
        # override; its rates learn from work that prices the pool's pages (--mooncake-master)
        weights, shared = policy_weights(name, settings.weights)
        return PredictedTtftModel(name, shape.workers, shape.page_size, weights, shared,
                                  settings.visibility_lag_s, seed, predicted=settings.predicted_pages)
    if settings.via == "pipeline" and name != REDRAWN:  # the yardstick runs in process
        from kvtier.eval.pipeline import PipelinePolicy

        weights, shared = policy_weights(name, settings.weights)
        router_args = (["--router-mode", "load"] if name == "least_load" else
                       ["--router-mode", "predicted-ttft"] if name == "predicted_ttft" else [])
        router_args += weight_flags(settings.weights)
        if settings.predicted_pages:
            router_args += ["--predicted-pages", "on"]
        overrides = DEVICE_ONLY if name == "device_only" else None
        return PipelinePolicy(name, stack, shape.workers, shape.page_size, settings.visibility_lag_s, seed,
                              router_args=router_args, overrides=overrides, shared=shared,
                              prices_pool=name == "predicted_ttft")
    weights, shared = policy_weights(name, settings.weights)
    draws = seed + REDRAW_SEED_OFFSET if name == REDRAWN else seed
    return RouterModel(name, shape.workers, shape.page_size, weights, shared, settings.visibility_lag_s, draws,
                       predicted=settings.predicted_pages)


def weight_flags(weights: ScoringWeights) -> list[str]:
    """The router flags that set `weights` (the defaults need none)."""
    defaults, flags = ScoringWeights(), []
    for name in weights.__struct_fields__:
        value = getattr(weights, name)
        if value != getattr(defaults, name):
            flags += [f"--{name.replace('_', '-')}", repr(float(value))]
    return flags


async def replay_policies(requests: list[PreparedRequest], settings: ReplaySettings, stack=None,
                          progress=None) -> dict[str, RunResult]:
    results = {}
    for name in settings.policies:
        policy = make_policy(name, settings, stack)
        results[name] = await run_lockstep(policy, requests, settings.shape, settings.weights, settings.shape.l3,
                                           settings.seed, progress)
    return results


def run_policies(requests: list[PreparedRequest], settings: ReplaySettings, progress=None,
                 log_dir: str | None = None) -> dict[str, dict]:
    """Every policy's summary; the servers (when kvtier policies go through the pipeline) are
    started here and stopped by PID before this returns."""
    routed = settings.via == "pipeline" and any(p in KVTIER_POLICIES + NAMED_POLICIES for p in settings.policies)
    if not routed:
        results = asyncio.run(replay_policies(requests, settings, None, progress))
    else:
        from kvtier.eval.pipeline import running_stack

        log_dir = log_dir or tempfile.mkdtemp(prefix="kvtier-replay-")
        with running_stack(log_dir) as stack:
            results = asyncio.run(replay_policies(requests, settings, stack, progress))
    summaries = {}
    for name, result in results.items():
        summary = result.summary()
        summary["via"] = settings.via if name in KVTIER_POLICIES + NAMED_POLICIES else "in process"
        summaries[name] = summary
    add_gap_closed(summaries)
    return summaries


def add_gap_closed(summaries: dict[str, dict]) -> None:
    rr, oracle = summaries.get("round_robin"), summaries.get("oracle")
    for summary in summaries.values():
        summary["gap_closed"] = {"recomputed": _gap(rr, oracle, summary, "recomputed_tokens"),
                                 "ttft_p50": _gap(rr, oracle, summary, "ttft_p50_ms")}


#: Below this share of round robin's figure, the oracle's gain is too small to divide by.
MIN_GAIN_SHARE = 0.01


def _gap(rr: dict | None, oracle: dict | None, policy: dict, key: str) -> float | None:
    if rr is None or oracle is None:
        return None
    available = rr[key] - oracle[key]
    if available <= MIN_GAIN_SHARE * abs(rr[key]):
        return None  # the oracle gains (next to) nothing over round robin here
    return round((rr[key] - policy[key]) / available, 3)


def median_of(summaries: list[dict]) -> dict:
    """Field by field median of several seeds' summaries (numbers; nested dicts alike)."""
    first = summaries[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [s[key] for s in summaries]
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(values) if all(v is not None for v in values) else None
        elif isinstance(value, dict):
            out[key] = median_of(values)
        else:
            out[key] = value
    return out


def build_report(trace: str, requests: list[PreparedRequest], settings: ReplaySettings, seeds: list[int],
                 progress=None) -> dict:
    bound = bounds(requests, settings.shape)
    per_seed = {}
    for seed in seeds:
        per_seed[seed] = run_policies(requests, replace(settings, seed=seed), progress)
    policies = {name: median_of([per_seed[s][name] for s in seeds]) for name in per_seed[seeds[0]]}
    if len(seeds) > 1:
        add_gap_closed(policies)  # of the medians, not the median of the ratios
    shape = settings.shape
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return {
        "trace": trace, "requests": len(requests), "span_s": round(span, 1), "mode": "lockstep",
        "visibility_lag_ms": settings.visibility_lag_s * 1000, "via": settings.via, "seeds": seeds,
        "cluster": {"workers": shape.workers, "page_size": shape.page_size, "device_pages": shape.device_pages,
                    "host_pages": shape.host_pages, "write_policy": shape.write_policy, "l3": shape.l3,
                    "l3_pages": shape.l3_capacity if shape.l3 else 0,
                    "worker_speeds": list(shape.worker_speeds) or [1.0] * shape.workers,
                    "slowdowns": [f"{s.rank}:{s.factor:g}@{s.at_s:g}" for s in shape.slowdowns]},
        "cost_model": {name: getattr(shape.cost, name) for name in shape.cost.__dataclass_fields__},
        "weights": msgspec.to_builtins(settings.weights), "predicted_pages": settings.predicted_pages,
        "bounds": {name: b.as_json() for name, b in bound.items()},
        "policies": policies,
        "per_seed": per_seed if len(seeds) > 1 else None,
        "verdict": verdict(policies),
    }


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError("--seeds: at least one seed")
    return seeds


def run_replay_bench(bench: ReplayBench) -> int:
    trace = bench.cluster.trace or str(CONVERSATION_TRACE)
    raw = load_trace(trace, bench.cluster.requests)
    shape = bench.cluster.shape()
    policies = tuple(bench.policies.split(",")) if bench.policies else POLICIES
    span = (raw[-1].timestamp - raw[0].timestamp) / 1000
    if bench.realtime:
        return _run_realtime(bench, raw, shape, policies, span, trace)
    settings = ReplaySettings(shape=shape, policies=policies, visibility_lag_s=bench.visibility_lag_ms / 1000,
                              via=bench.via, predicted_pages=bench.predicted_pages, weights=bench.weights)
    seeds = parse_seeds(bench.seeds) if bench.seeds else [bench.seed]
    print(f"{len(raw)} requests over {span:.0f}s of trace time, lockstep (visibility lag "
          f"{bench.visibility_lag_ms:g} ms of trace time), kvtier policies via {bench.via}; {shape.workers} workers, "
          f"page size {shape.page_size}, "
          f"device {shape.device_pages} / host {shape.host_pages} pages each, "
          f"{'L3 pool of ' + str(shape.l3_capacity) + ' pages' if shape.l3 else 'no L3'}; seeds {seeds}"
          + (f"; worker speeds {','.join(f'{x:g}' for x in shape.worker_speeds) or 'all 1'}"
             f"{''.join(f', slowdown {s.rank}:{s.factor:g}@{s.at_s:g}s' for s in shape.slowdowns)}"
             if shape.heterogeneous else ""),
          file=sys.stderr)
    requests = prepare(raw, shape.page_size)
    report = build_report(trace, requests, settings, seeds, progress_bar())
    print(format_table(report))
    print(format_breakdown(report))
    print(format_shares(report))
    print("verdict: " + report["verdict"])
    if bench.plot:
        write_plot(report, bench.plot)
    if bench.json:
        print(json.dumps(report))
    return 0


def _run_realtime(bench: ReplayBench, raw, shape, policies, span, trace) -> int:
    from kvtier.eval.realtime import ROUTED, run_realtime

    policies = tuple(p for p in policies if p not in ORACLES)
    print(f"{len(raw)} requests over {span:.0f}s of trace time on the wall clock, x{bench.time_scale} -> "
          f"~{span / bench.time_scale:.0f}s per policy (realtime: figures depend on this machine's load)",
          file=sys.stderr)
    results, log_dir = run_realtime(raw, shape, bench.time_scale, list(policies), bench.seed,
                                    progress_bar())
    summaries = {name: r.summary() for name, r in results.items()}
    for name, s in summaries.items():
        s["via"] = "realtime" if name in ROUTED else "in process"
    report = {"trace": trace, "requests": len(raw), "mode": "realtime", "time_scale": bench.time_scale,
              "policies": summaries, "logs": log_dir}
    for line in realtime_lines(summaries):
        print(line)
    if bench.json:
        print(json.dumps(report))
    return 0

