"""`kvtier bench replay --suite`: every workload of kvtier/eval/workloads.py, on a cluster of
equal workers and on one with half the workers at half speed, each over several seeds, the
policies in process (lockstep, `--via model`), and one table of medians: each policy's TTFT
p50 / p99 and TPOT p99 as a ratio to tier_aware's (the formula's), which a new policy must
not lose to. The oracle, the TTFT oracle and round robin stand beside every row, so a ratio
can be read against the best and the plainest answer.

Beside them, the noise: tier_aware_redrawn is the same formula with its ties broken by other
random draws, and on the suite's mixed-speed clusters that alone moves TTFT p50 by 2-20% and
p99 by 7-30% on a seed (one changed decision changes every cache after it;
docs/benchmarks/replay.md). Each row's
band is the largest such move over its seeds, per figure; a policy's median ratio is judged
"worse" or "better" only beyond it, and "same" inside it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from kvtier.eval.policies import REDRAWN
from kvtier.eval.replay import ReplaySettings, median_of, run_policies
from kvtier.eval.settings import ReplayBench
from kvtier.eval.trace import prepare
from kvtier.eval.workloads import HELD_OUT_SEEDS, SUITE_REQUESTS, TUNING_SEEDS, WORKLOAD_NAMES, offered_load, workload
from kvtier.sim.sim_cluster import ClusterShape

SUITE_POLICIES = ("tier_aware", "predicted_ttft", REDRAWN, "ttft_oracle", "oracle", "round_robin")
#: The policy each row judges against the noise band.
JUDGED = "predicted_ttft"
#: What each ratio is taken against.
BASELINE = "tier_aware"
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms")


def clusters(shape: ClusterShape) -> list[tuple[str, ClusterShape]]:
    """The suite's two clusters: equal workers, and the given speeds (default: half at 0.5)."""
    half = tuple(1.0 if rank < shape.workers // 2 else 0.5 for rank in range(shape.workers))
    mixed = shape.worker_speeds if shape.heterogeneous else half
    return [("equal", replace(shape, worker_speeds=(), slowdowns=())),
            ("half at 0.5" if mixed == half else "given speeds", replace(shape, worker_speeds=mixed))]


def capacity(shape: ClusterShape) -> float:
    """The cluster's prefill tokens per second, all workers together."""
    speeds = shape.worker_speeds or (1.0,) * shape.workers
    return shape.cost.prefill_tokens_per_s * sum(speeds)


def suite_row(name: str, label: str, shape: ClusterShape, seeds: list[int], requests: int,
              settings: ReplaySettings) -> dict:
    """One workload on one cluster: each policy's summary, median over the seeds."""
    per_seed, loads = [], []
    for seed in seeds:
        trace = workload(name).trace(seed, requests, capacity(shape))
        loads.append(offered_load(trace, capacity(shape)))
        per_seed.append(run_policies(prepare(trace, shape.page_size), replace(settings, shape=shape, seed=seed)))
    policies = {p: median_of([s[p] for s in per_seed]) for p in per_seed[0]}
    base = policies.get(BASELINE)
    ratios = {p: {f: round(s[f] / base[f], 3) if base and base[f] else None for f in FIGURES}
              for p, s in policies.items() if p != BASELINE}
    band = noise_band(per_seed)
    judged = {f: judge(ratios[JUDGED][f], band[f]) for f in FIGURES} if band and JUDGED in ratios else None
    return {"workload": name, "cluster": label, "seeds": seeds, "requests": requests,
            "offered_load": round(sorted(loads)[len(loads) // 2], 3), "prediction": prediction_error(policies),
            BASELINE: {f: base[f] for f in FIGURES} if base else None, "ratios": ratios,
            "noise": band, "judged": judged, "policies": policies}


def noise_band(per_seed: list[dict]) -> dict | None:
    """Per figure, the largest move of the redrawn formula from tier_aware on any one seed (a
    ratio's distance from 1); None when the row did not run both."""
    pairs = [(s[BASELINE], s[REDRAWN]) for s in per_seed if BASELINE in s and REDRAWN in s]
    if not pairs:
        return None
    return {f: round(max(abs(r[f] / b[f] - 1) if b[f] else 0.0 for b, r in pairs), 3) for f in FIGURES}


def judge(ratio: float | None, band: float) -> str:
    """A median ratio to tier_aware against the row's noise band: "worse" or "better" only
    beyond it."""
    if ratio is None:
        return "same"
    if ratio > 1 + band:
        return "worse"
    if ratio < 1 - band:
        return "better"
    return "same"


def prediction_error(policies: dict) -> dict | None:
    """How far predicted_ttft's first tokens came from their predictions over the replay, the
    mean over workers of each one's MAPE and bias (medians of the seeds); None when it did not run."""
    learned = (policies.get("predicted_ttft") or {}).get("learned")
    runs = [v for v in (learned or {}).values() if v.get("ttft_mape_run") is not None]
    if not runs:
        return None
    return {"mape": round(sum(v["ttft_mape_run"] for v in runs) / len(runs), 3),
            "bias": round(sum(v["ttft_bias_run"] for v in runs) / len(runs), 3)}


def format_suite(rows: list[dict]) -> str:
    others = [p for p in SUITE_POLICIES if p != BASELINE and any(p in r["ratios"] for r in rows)]
    head = f"{'workload':15} {'cluster':13} {'load':>5}  {'tier_aware p50/p99/tpot99 ms':>28}"
    head += "".join(f"  {p + ' (x)':>20}" for p in others) + "  noise band (±)    predicted MAPE/bias  judged"
    lines = [head, "-" * len(head)]
    for r in rows:
        b = r[BASELINE] or {}
        line = (f"{r['workload']:15} {r['cluster']:13} {r['offered_load']:5.2f}  "
                f"{b.get('ttft_p50_ms', 0):8.0f} /{b.get('ttft_p99_ms', 0):6.0f} /{b.get('tpot_p99_ms', 0):6.1f}   ")
        for p in others:
            x = r["ratios"].get(p)
            line += f"  {x['ttft_p50_ms']:6.2f}/{x['ttft_p99_ms']:5.2f}/{x['tpot_p99_ms']:5.2f}" if x else " " * 22
        band = r.get("noise")
        line += ("  " + "/".join(f"{band[f]:5.3f}" for f in FIGURES)) if band else " " * 19
        error = r.get("prediction")
        line += f"  {error['mape']:7.0%} /{error['bias']:+5.0%}     " if error is not None else " " * 21
        if (judged := r.get("judged")) is not None:
            line += "/".join(judged[f] for f in FIGURES)
        lines.append(line)
    lines.append("ratios: TTFT p50 / TTFT p99 / TPOT p99 of each policy over tier_aware's, medians of the seeds; "
                 "load: new prompt tokens offered per second over the cluster's prefill capacity; predicted "
                 "MAPE/bias: how far predicted_ttft's first tokens came from what its rates predicted (> 0: too long); "
                 f"noise band: the largest move of {REDRAWN} (the formula, ties broken by other draws) from "
                 f"tier_aware on one seed; judged: {JUDGED}'s p50/p99/tpot99 ratios against that band")
    return "\n".join(lines)


def run_suite_bench(bench: ReplayBench) -> int:
    seeds = list(HELD_OUT_SEEDS if bench.held_out else TUNING_SEEDS)
    if bench.seeds:
        from kvtier.eval.replay import parse_seeds

        seeds = parse_seeds(bench.seeds)
    names = [n.strip() for n in bench.workloads.split(",") if n.strip()] if bench.workloads else list(WORKLOAD_NAMES)
    for name in names:
        workload(name)  # an unknown name is refused before anything runs
    policies = tuple(bench.policies.split(",")) if bench.policies else SUITE_POLICIES
    requests = bench.cluster.requests or SUITE_REQUESTS
    base = bench.cluster.shape()
    settings = ReplaySettings(shape=base, policies=policies, visibility_lag_s=bench.visibility_lag_ms / 1000,
                              via="model", predicted_pages=bench.predicted_pages, weights=bench.weights)
    print(f"suite: {', '.join(names)}; {requests} requests each, seeds {seeds}"
          f"{' (held out of tuning)' if bench.held_out else ''}; {base.workers} workers, "
          f"{'L3 pool' if base.l3 else 'no L3'}; in process, lockstep", file=sys.stderr)
    rows = []
    for name in names:
        for label, shape in clusters(base):
            rows.append(suite_row(name, label, shape, seeds, requests, settings))
            print(f"  {name} on {label}: done", file=sys.stderr)
    print(format_suite(rows))
    if bench.json:
        print(json.dumps({"suite": rows, "seeds": seeds, "held_out": bench.held_out, "l3": base.l3}))
    return 0
