"""The report of a lockstep replay (kvtier/eval/replay.py): the verdict sentence, the table of
policies beside the bounds, why decisions differ from the oracle's, the plot, the progress bar
and the lines of a realtime replay. It reads the report dict; it runs nothing."""

from __future__ import annotations

import sys
import time

from kvtier.eval.lockstep import REASONS
from kvtier.eval.policies import KVTIER_POLICIES
from kvtier.tools import plots


def best_kvtier(policies: dict[str, dict]) -> str | None:
    """The kvtier policy with the lowest TTFT p50 (recomputed tokens break ties)."""
    ours = [p for p in KVTIER_POLICIES if p in policies]
    if not ours:
        return None
    return min(ours, key=lambda p: (policies[p]["ttft_p50_ms"], policies[p]["recomputed_tokens"]))


def verdict(policies: dict[str, dict]) -> str:
    """One plain sentence: does the best kvtier policy beat round robin, and by how much."""
    best, rr, oracle = best_kvtier(policies), policies.get("round_robin"), policies.get("oracle")
    if best is None or rr is None:
        return "no kvtier policy and round robin side by side: nothing to compare"
    ours = policies[best]
    ttft = ours["ttft_p50_ms"] / rr["ttft_p50_ms"] if rr["ttft_p50_ms"] else 1.0
    reuse = ours["reused_pct"] - rr["reused_pct"]
    faster = ttft < 0.98
    reuses_more = reuse > 0.5
    if faster or reuses_more:
        parts = []
        if faster:
            parts.append(f"first tokens {100 * (1 - ttft):.0f}% sooner at the median"
                         + (" (a small margin)" if ttft > 0.95 else ""))
        if reuses_more:
            parts.append(f"{reuse:.1f} points more of the prompt reused")
        sentence = f"{best} beats round robin: " + " and ".join(parts)
    elif ttft > 1.02 or reuse < -0.5:
        sentence = (f"{best} is worse than round robin here (TTFT p50 x{ttft:.2f}, reuse {reuse:+.1f} points): "
                    f"do not deploy it for this workload")
    else:
        sentence = f"no difference that matters: {best} is within 2% of round robin on TTFT p50 and reuse"
    if oracle is not None:
        sentence += (f"; with perfect information the formula would reach TTFT p50 {oracle['ttft_p50_ms']:.0f} ms "
                     f"and {oracle['reused_pct']:.1f}% reused (round robin {rr['ttft_p50_ms']:.0f} ms, "
                     f"{rr['reused_pct']:.1f}%; {best} {ours['ttft_p50_ms']:.0f} ms, {ours['reused_pct']:.1f}%)")
    return sentence + "."


def _fmt_gap(value: float | None) -> str:
    return "   -" if value is None else f"{value:4.2f}"


def format_table(report: dict) -> str:
    header = (f"{'policy':<18} {'via':<10} {'reused':>7} {'recomputed tok':>15} {'device hit':>11} {'host hit':>10} "
              f"{'L3 hit':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p99':>9} {'gap closed':>10} {'=oracle':>7} "
              f"{'degr.':>5}")
    lines = [header, "-" * len(header)]
    for name, r in report["policies"].items():
        h = r["hit_tokens"]
        gap = r["gap_closed"]
        lines.append(
            f"{name:<18} {r['via'][:10]:<10} {r['reused_pct']:>6.1f}% {r['recomputed_tokens']:>15,.0f} "
            f"{h['device']:>11,.0f} {h['host']:>10,.0f} {h['l3']:>10,.0f} {r['ttft_p50_ms']:>7.0f}ms "
            f"{r['ttft_p99_ms']:>7.0f}ms {r['tpot_p99_ms']:>7.1f}ms {_fmt_gap(gap['recomputed'])}/"
            f"{_fmt_gap(gap['ttft_p50'])} "
            f"{r['oracle_agreement_pct']:>6.0f}% {r['degraded_decisions']:>5.0f}")
    for name, b in report["bounds"].items():
        label = "infinite cache" if name == "infinite" else "pooled LRU"
        lines.append(f"{label:<18} {'bound':<10} {b['reused_pct']:>6.1f}% {b['recomputed_tokens']:>15,}")
    lines.append("gap closed = (round robin - policy) / (round robin - oracle), recomputed tokens / TTFT p50; "
                 "=oracle: decisions matching the oracle's")
    return "\n".join(lines)


def format_breakdown(report: dict) -> str:
    """Where the gain goes: per kvtier policy, why its decisions differ from the oracle's."""
    lines = ["why decisions differ from the oracle's (share of decisions):"]
    for name in KVTIER_POLICIES:
        r = report["policies"].get(name)
        if r is None:
            continue
        total = sum(r["breakdown"].values()) or 1
        parts = [f"{key} {100 * count / total:.1f}%" for key, count in r["breakdown"].items() if count]
        lines.append(f"  {name:<18} " + ", ".join(parts))
    lines.append("  " + "; ".join(f"{key}: {text}" for key, text in REASONS.items() if key != "same"))
    return "\n".join(lines)


def format_shares(report: dict) -> str:
    """Each policy's share of the requests per worker (%), and where the cluster's speeds differ,
    each worker's speed above them: a slow worker should draw less."""
    speeds = report["cluster"].get("worker_speeds") or []
    lines = ["requests per worker (%):"]
    if any(speed != 1.0 for speed in speeds) or report["cluster"].get("slowdowns"):
        slowed = ", ".join(report["cluster"]["slowdowns"])
        lines.append(f"  {'speed':<18} " + " ".join(f"{speed:>5g}" for speed in speeds)
                     + (f"  (slowdowns: {slowed})" if slowed else ""))
    for name, r in report["policies"].items():
        lines.append(f"  {name:<18} " + " ".join(f"{share:>5.1f}" for share in r["load_share_pct"].values()))
    for name, r in report["policies"].items():
        if "slowdown" in r:
            slow = r["slowdown"]
            after = ", ".join(f"{share}% in requests {span}" for span, share in slow["share_after_pct"].items())
            lines.append(f"  {name}: worker {slow['rank']} drew {slow['share_before_pct']}% of the "
                         f"{slow['window']} requests before its slowdown at {slow['at_s']:g}s, then {after}")
        if "learned" in r:
            lines.append(f"  {name} learned compute multipliers (true, samples): " + ", ".join(
                f"{rank} {v['compute']:.2f} ({v['true_compute']:.2f}, {v['samples']:.0f})"
                for rank, v in r["learned"].items()))
            lines.append(f"  {name} first tokens off their predicted time over the replay (MAPE, bias): " + ", ".join(
                f"{rank} {v['ttft_mape_run']:.0%} {v['ttft_bias_run']:+.0%}" for rank, v in r["learned"].items()
                if v.get("ttft_mape_run") is not None))
    return "\n".join(lines)


def write_plot(report: dict, path: str, title: str = "") -> bool:
    """Reuse and TTFT p50 per policy beside the oracle and the bounds, as a PNG; False without
    matplotlib."""
    if not plots.available():
        return False
    fig, (left, right) = plots.figure(1, 2, (12, 4.8))
    policies = report["policies"]
    names = [n for n in policies if n != "oracle"]
    oracle = policies.get("oracle")

    def oracle_line(metric: str, label: str) -> list[plots.Reference]:
        return [(oracle[metric], plots.ORANGE, "-", label)] if oracle else []

    bounds: list[plots.Reference] = [
        (report["bounds"][name]["reused_pct"], plots.RED, style,
         "infinite cache" if name == "infinite" else "pooled LRU (whole cluster's memory)")
        for name, style in (("infinite", "--"), ("pooled_lru", ":"))]
    plots.bar_chart(left, names, [policies[n]["reused_pct"] for n in names], plots.BLUE,
                    [*oracle_line("reused_pct", "oracle"), *bounds], ylabel="prompt tokens reused (%)")
    plots.bar_chart(right, names, [policies[n]["ttft_p50_ms"] for n in names], plots.GREEN,
                    oracle_line("ttft_p50_ms", "oracle p50"), ylabel="simulated TTFT p50 (ms)", label="p50")
    plots.save(fig, path, dpi=110,
               title=title or "kvtier: routing policies on a simulated HiCache cluster (lockstep replay)")
    return True


def progress_bar(stream=sys.stderr):
    state = {"last": 0.0}

    def show(policy: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - state["last"] < 0.2:
            return
        state["last"] = now
        width = 30
        filled = int(width * done / total)
        stream.write(f"\r  {policy:<18} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def realtime_lines(summaries: dict[str, dict]) -> list[str]:
    """One line per policy of a realtime replay (`--realtime`)."""
    return [
        f"{name:<18} reused {s['reused_pct']:5.1f}%  TTFT p50 {s['ttft_p50_ms']:7.0f} ms  p99 "
        f"{s['ttft_p99_ms']:8.0f} ms (in trace order only: {s['ttft_p99_in_order_ms']} ms; "
        f"{s['out_of_order_requests']} requests reached their worker out of trace order)  route p50 "
        f"{s['route_p50_ms']} ms  degraded {s['degraded_decisions']}; reached the worker "
        f"{s['reached_worker_late_p50_s']} s (p50) / {s['reached_worker_late_p99_s']} s (p99) of trace "
        f"time after arriving"
        for name, s in summaries.items()
    ]
