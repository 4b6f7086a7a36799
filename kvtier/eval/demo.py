"""`kvtier demo`: the main job on embedded defaults, no flags needed; under three minutes on
two cores.

1. The policies side by side on one cluster, lockstep (kvtier/eval/replay.py): random,
   round robin, kvtier's four policies, the oracle (kvtier's formula on the simulator's
   ground truth) and the bounds (infinite cache, one LRU as large as the whole cluster). The
   headline policies, device-only and tier-aware + shared, go through the real pipeline:
   simulated SGLang ranks speaking SGLang's KV-event wire format -> `kvtier bridge` ->
   JetStream -> `kvtier processor` -> Redis -> two `kvtier router` replicas; the others are
   computed in process by the router model the tests hold to the same decisions.
2. A sweep of where tier awareness pays and where it does not: host:device pool ratio
   0/2/4/8, with and without a shared L3 pool, round robin against kvtier and the oracle,
   with one sentence of verdict per point; then one heterogeneous point (half the workers at
   half speed, the routers not told) with predicted_ttft (the router model pricing the formula
   at the speeds it learns) and the TTFT oracle beside them.

The sample: the first 600 requests of kvtier's synthetic high-reuse trace
(kvtier/eval/synth_trace.py, seed 1), chosen because its reuse fits the demo cluster's
memory: one LRU of the cluster's whole memory reuses nearly what an infinite cache does, so
the policies can differ. The public conversation sample shipped in kvtier/data reuses mostly
farther back than a cluster of this size remembers (`--trace kvtier/data/mooncake_trace_sample.jsonl`
shows it: every policy within a few percent).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from dataclasses import replace

from kvtier.eval.policies import KVTIER_POLICIES
from kvtier.eval.replay import ReplaySettings, add_gap_closed, build_report
from kvtier.eval.report import best_kvtier, format_breakdown, format_table, progress_bar, verdict
from kvtier.eval.settings import DemoSettings
from kvtier.eval.trace import load_trace, prepare
from kvtier.sim.sim_cluster import ClusterShape
from kvtier.tools import plots

MIN_FREE_MEMORY = 2 << 30
DEMO_TRACE = "synthetic:1"
#: The sweep's host pool sizes, as multiples of the device pool.
SWEEP_RATIOS = (0, 2, 4, 8)
#: The main run: the baselines, kvtier's policies and the oracle; these two go through the pipeline.
PIPELINE_POLICIES = ("device_only", "tier_aware_shared")


def _free_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def point_verdict(report: dict) -> str:
    """One sentence for one sweep point: what kvtier's best policy gains over round robin."""
    policies = report["policies"]
    best, rr, oracle = best_kvtier(policies), policies["round_robin"], policies["oracle"]
    ours = policies[best]
    p50 = ours["ttft_p50_ms"] / rr["ttft_p50_ms"] if rr["ttft_p50_ms"] else 1.0
    p99 = ours["ttft_p99_ms"] / rr["ttft_p99_ms"] if rr["ttft_p99_ms"] else 1.0
    reuse = ours["reused_pct"] - rr["reused_pct"]
    room = oracle["reused_pct"] - rr["reused_pct"]
    if reuse >= 2.0 or p50 <= 0.9:
        head = f"tier awareness pays: {reuse:+.1f} points reused, TTFT p50 x{p50:.2f}, p99 x{p99:.2f}"
    elif p99 <= 0.9:
        head = (f"the same reuse as round robin (within {abs(reuse):.1f} points), but a shorter tail: "
                f"TTFT p99 x{p99:.2f}")
    elif p50 >= 1.05 or reuse <= -1.0:
        head = f"kvtier does worse than round robin here (TTFT p50 x{p50:.2f}, reuse {reuse:+.1f} points)"
    else:
        head = f"no difference worth routing for (TTFT p50 x{p50:.2f}, reuse {reuse:+.1f} points)"
    return f"{head}; the oracle's room over round robin: {room:+.1f} points reused"


def half_slow(workers: int) -> tuple[float, ...]:
    """The sweep's heterogeneous cluster: the last half of the workers at half speed."""
    return (1.0,) * (workers - workers // 2) + (0.5,) * (workers // 2)


def _sweep_point(requests, shape: ClusterShape, seed: int, extra: tuple[str, ...] = ()) -> dict:
    policies = ("round_robin", "device_only", "tier_aware") + (("tier_aware_shared",) if shape.l3 else ()) + (
        "oracle", *extra)
    report = build_report("sweep", requests, ReplaySettings(shape=shape, policies=policies, via="model", seed=seed),
                          [seed])
    point = {"host_ratio": shape.host_pages // shape.device_pages, "l3": shape.l3,
             "speeds": list(shape.worker_speeds) or None, "bounds": report["bounds"],
             "policies": {name: {k: s[k] for k in ("reused_pct", "recomputed_tokens", "ttft_p50_ms", "ttft_p99_ms",
                                                      "gap_closed")}
                          for name, s in report["policies"].items()}}
    point["best"] = best_kvtier(report["policies"])
    point["verdict"] = point_verdict(report)
    if "ttft_oracle" in report["policies"]:
        ours, greedy = report["policies"][point["best"]], report["policies"]["ttft_oracle"]
        point["verdict"] += (f"; the least true TTFT, which knows each worker's speed, would reach p50 "
                             f"{greedy['ttft_p50_ms']:.0f} ms / p99 {greedy['ttft_p99_ms']:.0f} ms against kvtier's "
                             f"{ours['ttft_p50_ms']:.0f} / {ours['ttft_p99_ms']:.0f} ms")
    if "predicted_ttft" in report["policies"]:
        learned = report["policies"]["predicted_ttft"]
        point["verdict"] += (f"; predicted_ttft, learning the speeds from first tokens, {learned['ttft_p50_ms']:.0f} / "
                             f"{learned['ttft_p99_ms']:.0f} ms")
    return point


def run_sweep(requests, base: ClusterShape, seed: int, progress=None) -> list[dict]:
    shapes = [replace(base, host_pages=base.device_pages * ratio, l3=l3)
              for l3 in (True, False) for ratio in SWEEP_RATIOS
              if ratio or not l3]  # HiCache's L3 sits behind its host pool: no host pool, no L3
    points = []
    for shape in shapes:
        points.append(_sweep_point(requests, shape, seed))
        if progress:
            progress(points[-1])
    if base.workers > 1 and not base.heterogeneous:
        points.append(_sweep_point(requests, replace(base, l3=True, worker_speeds=half_slow(base.workers)), seed,
                                   ("predicted_ttft", "ttft_oracle")))
        if progress:
            progress(points[-1])
    return points


def format_sweep(points: list[dict]) -> str:
    header = (f"{'host:device':>11} {'L3':>3} {'speeds':>8} {'bound':>6} {'RR reused':>9} {'kvtier':>7} {'oracle':>7} "
              f"{'RR p50':>7} {'kvtier':>7} {'oracle':>7} {'RR p99':>7} {'kvtier':>7}  verdict")
    lines = [header, "-" * 120]
    for p in points:
        rr, ours, oracle = p["policies"]["round_robin"], p["policies"][p["best"]], p["policies"]["oracle"]
        speeds = "all 1" if not p.get("speeds") else f"{sum(x != 1 for x in p['speeds'])}x{min(p['speeds']):g}"
        lines.append(f"{p['host_ratio']:>11} {'yes' if p['l3'] else 'no':>3} {speeds:>8} "
                     f"{p['bounds']['pooled_lru']['reused_pct']:>5.1f}% "
                     f"{rr['reused_pct']:>8.1f}% {ours['reused_pct']:>6.1f}% {oracle['reused_pct']:>6.1f}% "
                     f"{rr['ttft_p50_ms']:>5.0f}ms {ours['ttft_p50_ms']:>5.0f}ms {oracle['ttft_p50_ms']:>5.0f}ms "
                     f"{rr['ttft_p99_ms']:>5.0f}ms {ours['ttft_p99_ms']:>5.0f}ms  {p['verdict']}")
    lines.append("bound: one LRU of the whole cluster's memory; kvtier: its best policy at that point "
                 "(tier-aware, + shared with L3); speeds: how many workers run slower, and at what factor")
    return "\n".join(lines)


def write_demo_plot(report: dict, sweep: list[dict], path: str) -> bool:
    """The demo's figure as a PNG: reuse and TTFT per policy, then across the sweep of host
    pool sizes; False without matplotlib."""
    if not plots.available():
        return False
    fig, ((reuse_ax, ttft_ax), (sweep_ttft, sweep_reuse)) = plots.figure(2, 2, (13, 9))
    policies = report["policies"]
    names = [n for n in policies if n != "oracle"]
    oracle = policies["oracle"]
    colours = [plots.BLUE if n not in KVTIER_POLICIES else plots.GREEN for n in names]
    plots.bar_chart(reuse_ax, names, [policies[n]["reused_pct"] for n in names], colours, [
        (oracle["reused_pct"], plots.ORANGE, "-", "oracle"),
        (report["bounds"]["infinite"]["reused_pct"], plots.RED, "--", "infinite cache"),
        (report["bounds"]["pooled_lru"]["reused_pct"], plots.RED, ":", "pooled LRU (whole cluster)")],
        ylabel="prompt tokens reused (%)", title="reuse (blue: baselines, green: kvtier)")
    plots.bar_chart(ttft_ax, names, [policies[n]["ttft_p50_ms"] for n in names], colours,
                    [(oracle["ttft_p50_ms"], plots.ORANGE, "-", "oracle p50")],
                    ylabel="simulated TTFT p50 (ms)", title="time to first token")
    for l3, style in ((True, "-"), (False, "--")):
        pts = [p for p in sweep if p["l3"] == l3 and not p.get("speeds")]  # the pool-size lines
        ratios = [p["host_ratio"] for p in pts]
        label = "L3" if l3 else "no L3"
        for who, colour in (("round_robin", plots.BLUE), ("best", plots.GREEN), ("oracle", plots.ORANGE)):
            def policy_of(p: dict, who: str = who) -> str:
                return p["best"] if who == "best" else who

            title = {"round_robin": "round robin", "best": "kvtier", "oracle": "oracle"}[who]
            sweep_ttft.plot(ratios, [p["policies"][policy_of(p)]["ttft_p50_ms"] for p in pts], style, color=colour,
                            marker="o", label=f"{title}, {label}")
            sweep_reuse.plot(ratios, [p["policies"][policy_of(p)]["reused_pct"] for p in pts], style, color=colour,
                             marker="o", label=f"{title}, {label}")
        sweep_reuse.plot(ratios, [p["bounds"]["pooled_lru"]["reused_pct"] for p in pts], style, color=plots.RED,
                         alpha=0.5, label=f"pooled LRU, {label}")
    sweep_ttft.set_xlabel("host pool / device pool")
    sweep_ttft.set_ylabel("TTFT p50 (ms)")
    sweep_ttft.set_title("where tier awareness pays: TTFT")
    sweep_reuse.set_xlabel("host pool / device pool")
    sweep_reuse.set_ylabel("prompt tokens reused (%)")
    sweep_reuse.set_title("... and reuse")
    sweep_ttft.legend(fontsize=7)
    sweep_reuse.legend(fontsize=7)
    plots.save(fig, path, dpi=100, title="kvtier demo: lockstep replay on a simulated SGLang HiCache cluster")
    return True


def run_demo(settings: DemoSettings) -> int:
    free = _free_memory()
    if free is not None and free < MIN_FREE_MEMORY:
        print(f"kvtier demo: only {free / 2**30:.1f} GiB of memory available; the demo runs ~10 processes and "
              f"needs about {MIN_FREE_MEMORY / 2**30:.0f} GiB free", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("kvtier demo: one CPU core: it will run, but expect about twice the ~2.5 minutes", file=sys.stderr)
    started = time.monotonic()
    trace = settings.cluster.trace or DEMO_TRACE
    raw = load_trace(trace, settings.cluster.requests)
    shape = settings.cluster.shape()
    requests = prepare(raw, shape.page_size)
    span = requests[-1].arrival_s - requests[0].arrival_s
    print(f"kvtier demo: {len(requests)} requests ({span:.0f}s of trace time) of "
          f"{'the synthetic high-reuse trace' if trace.startswith('synthetic') else trace} on {shape.workers} "
          f"simulated SGLang HiCache workers (Llama-3.1-8B on H100s by the cost model in docs/COST_MODEL.md; page "
          f"size {shape.page_size}, {shape.device_pages} device + {shape.host_pages} host pages each, "
          f"{'a shared L3 pool' if shape.l3 else 'no L3'}), lockstep: the same figures on any machine.\n"
          f"{', '.join(PIPELINE_POLICIES)} go through the real pipeline (bridge -> JetStream -> processor -> Redis "
          f"-> two routers); the rest in process.")
    policies = tuple(p for p in ("random", "round_robin", "least_load", "device_only", "tier_aware",
                                 "tier_aware_shared", "oracle") if shape.l3 or p != "tier_aware_shared")
    model = ReplaySettings(shape=shape, policies=tuple(p for p in policies if p not in PIPELINE_POLICIES),
                           via="model", seed=settings.seed)
    piped = ReplaySettings(shape=shape, policies=tuple(p for p in policies if p in PIPELINE_POLICIES),
                           via="pipeline", seed=settings.seed)
    show = progress_bar(sys.stdout)
    report = build_report(trace, requests, model, [settings.seed], show)
    through = build_report(trace, requests, piped, [settings.seed], show)
    merged = {name: (through["policies"].get(name) or report["policies"][name]) for name in policies}
    report["policies"] = merged
    add_gap_closed(report["policies"])
    report["verdict"] = verdict(report["policies"])
    report["via"] = {name: s["via"] for name, s in merged.items()}
    print()
    print(format_table(report))
    print(format_breakdown(report))
    print("\nverdict: " + report["verdict"])

    sweep: list[dict] = []
    if not settings.no_sweep:
        print(f"\nsweep: host pool 0/2/4/8 x the device pool, with and without L3, then half the workers at half "
              f"speed ({len(requests)} requests each, kvtier's router model in process):")
        sweep = run_sweep(requests, shape, settings.seed,
                          lambda p: print(f"  host:device {p['host_ratio']}, {'L3' if p['l3'] else 'no L3'}"
                                          f"{', half the workers at half speed' if p['speeds'] else ''}: "
                                          f"{p['verdict']}", flush=True))
        print()
        print(format_sweep(sweep))
    out = pathlib.Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    report["sweep"] = sweep
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plotted = write_demo_plot(report, sweep, str(out / "policies.png")) if sweep else False
    print(f"\nreport: {out / 'report.json'}" + (f", plot: {out / 'policies.png'}" if plotted else ""))
    print(f"took {time.monotonic() - started:.0f}s")
    return 0
