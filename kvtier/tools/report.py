"""`kvtier report`: tier statistics of a time window of the event and decision streams, as
PNG plots and a `summary.md`, computed with the same pure model as `kvtier analytics`
(consumers/analytics_model.py).

The events stream is read from its first retained message: what comes before `--since` only
builds the tier sets (so pages stored before the window are resident, and their removal in
the window has a lifetime and a kind), what falls in [since, until] is counted. Decisions are
read from `--since` (by stream time). Window bounds are the stream's timestamps; lifetimes
use the engine's. Write-back windows still open at the end are counted as evictions.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtier.consumers.analytics import MessageFeeder, decision_filters, event_filters
from kvtier.consumers.analytics_model import HIT_TIERS, TIER_NAMES, TierAnalytics
from kvtier.consumers.pull import read_stream
from kvtier.plumbing.timefmt import TimeFormatError, iso, parse_time
from kvtier.schemas.subjects import DECISIONS_STREAM, EVENTS_STREAM
from kvtier.tools import plots
from kvtier.tools.settings import ReportSettings

MOVE_KINDS = ("stored", "removed", "copy", "promotion", "demotion", "eviction")
DROP_KINDS = ("cleared", "new_epoch", "gap", "lease_expired")
LIFETIME_SAMPLES = 200_000


class ReportError(ValueError):
    """A report that cannot be made as asked; the message says why."""


@dataclass
class Snapshot:
    t: float
    resident: dict  # (model, worker, tier) -> pages


@dataclass
class ReportData:
    since: float
    until: float
    analytics: TierAnalytics
    snapshots: list[Snapshot] = field(default_factory=list)
    messages: dict = field(default_factory=dict)  # (stream, kind) -> messages in the window
    history_messages: int = 0  # events-stream messages before the window (state only)


async def collect(nats_url: str, since: float, until: float, model: str | None = None, bins: int = 60,
                  writeback_window_s: float = 2.0) -> ReportData:
    from kvtier.plumbing.nats_options import NatsConnectError, connect_once

    try:  # with the process's NATS credentials and TLS (kvtier/plumbing/nats_options.py)
        nc = await connect_once(nats_url, "kvtier-report", connect_timeout=5, max_reconnect_attempts=2)
    except NatsConnectError as exc:  # one clear line, no secret in it
        raise ReportError(str(exc)) from None
    models = [model] if model else None
    analytics = TierAnalytics(writeback_window_s=writeback_window_s, lifetime_samples=LIFETIME_SAMPLES)
    feeder = MessageFeeder(analytics, models)
    data = ReportData(since, until, analytics)
    edges = [since + (until - since) * i / bins for i in range(bins + 1)]
    next_edge = 0
    analytics.keep_timeline(since, (until - since) / bins)

    def snapshot(t: float) -> None:
        data.snapshots.append(Snapshot(t, analytics.resident()))

    try:
        analytics.counting = False
        async for msg in read_stream(nc, EVENTS_STREAM, event_filters(models), end_time=until):
            if msg.time >= since and not analytics.counting:
                analytics.advance(since)
                analytics.counting = True
            while next_edge <= bins and msg.time >= edges[next_edge]:
                analytics.advance(edges[next_edge])
                snapshot(edges[next_edge])
                next_edge += 1
            kind = feeder.event(msg.data, msg.time)
            if analytics.counting:
                data.messages[(EVENTS_STREAM, kind)] = data.messages.get((EVENTS_STREAM, kind), 0) + 1
            else:
                data.history_messages += 1
        analytics.counting = True
        while next_edge <= bins:
            analytics.advance(edges[next_edge])
            snapshot(edges[next_edge])
            next_edge += 1
        analytics.advance(until)
        analytics.finish()
        data.snapshots[-1] = Snapshot(until, analytics.resident())
        async for msg in read_stream(nc, DECISIONS_STREAM, decision_filters(models), start_time=since,
                                     end_time=until):
            if msg.time < since:
                continue
            kind = feeder.decision(msg.data, msg.time)
            data.messages[(DECISIONS_STREAM, kind)] = data.messages.get((DECISIONS_STREAM, kind), 0) + 1
    finally:
        await nc.close()
    return data


# --- numbers -----------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize(data: ReportData) -> dict:
    a = data.analytics
    end = data.snapshots[-1].resident if data.snapshots else a.resident()
    kinds = a.transition_totals("kind")
    by_worker = a.transition_totals("worker_kind")
    resident_by_tier = {t: sum(n for (_, _, tier), n in end.items() if tier == t) for t in TIER_NAMES}
    workers: dict[tuple[str, str], dict] = {}

    def row(model: str, worker: str) -> dict:
        key = (model, worker)
        if key not in workers:
            record = a.workers.get(key)
            state = ("unleased" if record is None or record.lease_until is None
                     else "expired" if record.expired else "live")
            workers[key] = {"model": model, "worker": worker, "lease": state,
                            "resident": {t: end.get((model, worker, t), 0) for t in TIER_NAMES},
                            "transitions": {k: 0 for k in MOVE_KINDS + DROP_KINDS},
                            "decisions": 0, "predicted_hit_tokens": {t: 0 for t in HIT_TIERS}}
        return workers[key]

    for (model, worker, kind), n in by_worker.items():
        row(model, worker)["transitions"][kind] += n
    for (model, worker, _tier), n in end.items():
        if n:
            row(model, worker)
    for (model, worker), n in a.decisions.items():
        row(model, worker)["decisions"] += n
    for (model, worker, tier), n in a.hit_tokens.items():
        row(model, worker)["predicted_hit_tokens"][tier] += n
    lifetimes = {}
    for tier in TIER_NAMES:
        samples = a.lifetime_samples[tier] if a.lifetime_samples else None
        if samples is None or not samples.seen:
            continue
        values = sorted(samples.values)
        p50, p90 = _percentile(values, 50), _percentile(values, 90)
        assert p50 is not None and p90 is not None  # values is not empty: samples were seen
        lifetimes[tier] = {"pages": samples.seen, "p50_s": round(p50, 3), "p90_s": round(p90, 3),
                           "max_s": round(values[-1], 3)}
    events = {kind: n for (stream, kind), n in sorted(data.messages.items()) if stream == EVENTS_STREAM}
    decisions = sum(a.decisions.values())
    rate = a.shared_pool_hit_rate()
    return {
        "window": {"since": iso(data.since, "seconds"), "until": iso(data.until, "seconds"),
                   "seconds": round(data.until - data.since, 3)},
        "events": {"messages": sum(events.values()), **events,
                   "page_events": kinds.get("stored", 0) + kinds.get("removed", 0) + sum(a.noops.values()),
                   "history_messages": data.history_messages},
        "workers": len(workers),
        "transitions": {k: kinds.get(k, 0) for k in MOVE_KINDS + DROP_KINDS},
        "resident_pages_at_end": resident_by_tier,
        "lifetimes": lifetimes,
        "decisions": decisions,
        "decisions_per_worker": {f"{m}/{w}" if len({k[0] for k in a.decisions}) > 1 else w: n
                                 for (m, w), n in sorted(a.decisions.items())},
        "predicted_hit_tokens": {t: sum(n for (_, _, tier), n in a.hit_tokens.items() if tier == t)
                                 for t in HIT_TIERS},
        "request_tokens": sum(a.request_tokens.values()),
        "shared_pool_decisions": sum(a.shared_queried.values()),
        "shared_pool_hit_rate": round(rate, 4) if rate is not None else None,
        "per_worker": sorted(workers.values(), key=lambda r: (r["model"], r["worker"])),
    }


# --- output ------------------------------------------------------------------------------
def write_summary(summary: dict, path: pathlib.Path, plots: list[str]) -> None:
    w, ev, tr = summary["window"], summary["events"], summary["transitions"]
    hits, req = summary["predicted_hit_tokens"], summary["request_tokens"]
    lines = [
        "# kvtier report", "",
        f"Window: {w['since']} .. {w['until']} ({w['seconds']:g} s, stream time).", "",
        "## Headline", "",
        (f"- Events: {ev['messages']} messages in the window ({ev.get('batch', 0)} batches, "
         f"{ev.get('announce', 0)} announcements, {ev.get('undecodable', 0)} undecodable), {ev['page_events']} page "
         f"events; {ev['history_messages']} earlier messages read to rebuild the tier state."),
        f"- Workers: {summary['workers']}.",
        (f"- Transitions: {tr['stored']} stored, {tr['removed']} removed, {tr['copy']} copies down, "
         f"{tr['promotion']} promotions, {tr['demotion']} demotions, {tr['eviction']} evictions; dropped: "
         f"{tr['cleared']} cleared, {tr['new_epoch']} by a new epoch, {tr['gap']} by a gap, "
         f"{tr['lease_expired']} by lease expiry."),
        "- Resident at the end: "
        + ", ".join(f"{n} {t}" for t, n in summary["resident_pages_at_end"].items()) + " pages.",
    ]
    if summary["lifetimes"]:
        lines.append("- Page lifetime (store to remove): " + "; ".join(
            f"{t} p50 {v['p50_s']:g} s, p90 {v['p90_s']:g} s ({v['pages']} pages)"
            for t, v in summary["lifetimes"].items()) + ".")
    lines.append(f"- Decisions: {summary['decisions']}; predicted hit tokens: "
                 + ", ".join(f"{hits[t]} {t}" for t in HIT_TIERS)
                 + f" of {req} request tokens"
                 + (f" ({(hits['device'] + hits['host'] + hits['disk']) / req:.1%} on the worker's own tiers)"
                    if req else "") + ".")
    rate = summary["shared_pool_hit_rate"]
    lines.append(f"- Shared pool: queried by {summary['shared_pool_decisions']} decisions"
                 + (f", hit rate {rate:.1%} (pages beyond the device prefix / request pages)." if rate is not None
                    else "."))
    lines += ["", "## Per worker", "",
              ("| model | worker | lease | device | host | disk | stored | removed | copies | promotions | demotions "
               "| evictions | dropped | decisions | hit tokens device/host/disk/shared |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["per_worker"]:
        t, res, h = r["transitions"], r["resident"], r["predicted_hit_tokens"]
        dropped = sum(t[k] for k in DROP_KINDS)
        lines.append(f"| {r['model']} | {r['worker']} | {r['lease']} | {res['device']} | {res['host']} | {res['disk']} "
                     f"| {t['stored']} | {t['removed']} | {t['copy']} | {t['promotion']} | {t['demotion']} "
                     f"| {t['eviction']} | {dropped} | {r['decisions']} "
                     f"| {h['device']}/{h['host']}/{h['disk']}/{h['shared_beyond']} |")
    lines += ["", ("Resident pages are at the end of the window; transitions and decisions are those in it. "
                   "Kinds are defined in consumers/analytics_model.py."), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path.write_text("\n".join(lines))


def write_plots(data: ReportData, summary: dict, out: pathlib.Path) -> list[str]:
    """The report's PNGs in `out`: resident pages, transitions, lifetimes, decisions; their
    names ([] without matplotlib)."""
    if not plots.available():
        return []
    a = data.analytics
    times = [(s.t - data.since) for s in data.snapshots]
    xlabel = f"seconds since {iso(data.since, 'seconds')}"
    _resident_pages(data, times, xlabel, out / "resident_pages.png")
    _transitions(a, summary, len(data.snapshots) - 1, xlabel, out / "transitions.png")
    _lifetimes(a, out / "lifetimes.png")
    _decisions(a, summary, out / "decisions.png")
    return ["resident_pages.png", "transitions.png", "lifetimes.png", "decisions.png"]


def _resident_pages(data: ReportData, times: list[float], xlabel: str, path: pathlib.Path) -> None:
    """Resident pages per tier over time, per worker (the total alone when there are many)."""
    tiers = [t for t in TIER_NAMES if any(s.resident.get(k, 0) for s in data.snapshots
                                          for k in s.resident if k[2] == t)] or ["device"]
    keys = sorted({(m, w) for s in data.snapshots for (m, w, _t) in s.resident})
    fig, axes = plots.figure(len(tiers), 1, (10, 2.8 * len(tiers)), sharex=True, squeeze=False)
    for axis, tier in zip(axes[:, 0], tiers):
        if len(keys) <= 12:
            plots.lines(axis, times, [(w, [s.resident.get((m, w, tier), 0) for s in data.snapshots])
                                      for m, w in keys], linewidth=1.2)
        axis.plot(times, [sum(n for k, n in s.resident.items() if k[2] == tier) for s in data.snapshots],
                  label="total", color="black", linewidth=2, linestyle="--")
        axis.set_ylabel(f"{tier} pages")
        axis.legend(fontsize=7, ncol=4, loc="upper left")
    axes[-1, 0].set_xlabel(xlabel)
    plots.save(fig, path, title="resident pages per tier")


def _transitions(a: TierAnalytics, summary: dict, steps: int, xlabel: str, path: pathlib.Path) -> None:
    """Transitions per kind per step, each at the time it happened."""
    fig, axis = plots.figure()
    kinds = [k for k in MOVE_KINDS + DROP_KINDS if summary["transitions"].get(k)]
    step_s = a.timeline_step
    mids = [(i + 0.5) * step_s for i in range(steps)]
    timeline: Mapping[tuple[int, str], int] = a.timeline or {}  # None only when the analytics kept no timeline
    plots.lines(axis, mids, [(kind, [timeline.get((i, kind), 0) for i in range(steps)]) for kind in kinds],
                marker=".")
    axis.set_xlabel(xlabel)
    axis.set_ylabel(f"pages per {step_s:.3g} s")
    axis.set_title("transitions per kind")
    if kinds:
        axis.legend(fontsize=8, ncol=3)
    plots.save(fig, path)


def _lifetimes(a: TierAnalytics, path: pathlib.Path) -> None:
    """How long pages stayed on each tier, as histograms on log bins."""
    fig, axis = plots.figure()
    plotted = False
    if a.lifetime_samples:
        import math

        values_all = [v for r in a.lifetime_samples.values() for v in r.values]
        if values_all:
            lo = max(min(v for v in values_all if v > 0) if any(v > 0 for v in values_all) else 1e-3, 1e-3)
            hi = max(max(values_all), lo * 10)
            edges = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            for tier, reservoir in a.lifetime_samples.items():
                if reservoir.values:
                    axis.hist([max(v, lo) for v in reservoir.values], bins=edges, histtype="step", linewidth=1.5,
                              label=f"{tier} ({reservoir.seen} pages)")
                    plotted = True
            axis.set_xscale("log")
            axis.set_xlim(lo, hi * 1.05 if math.isfinite(hi) else None)
    axis.set_xlabel("seconds on the tier (store to remove, engine time)")
    axis.set_ylabel("pages")
    axis.set_title("page lifetime per tier")
    if plotted:
        axis.legend(fontsize=8)
    else:
        plots.note(axis, "no page was removed in the window")
    plots.save(fig, path)


def _decisions(a: TierAnalytics, summary: dict, path: pathlib.Path) -> None:
    """Decisions per worker, and the hit tokens predicted for the chosen worker by tier."""
    fig, (left, right) = plots.figure(1, 2, (12, 4.2))
    per_worker = summary["decisions_per_worker"]
    if per_worker:
        plots.bar_chart(left, list(per_worker), list(per_worker.values()), plots.BLUE, ylabel="decisions",
                        title="decisions per worker")
    else:
        plots.note(left, "no decisions in the window")
        left.set_ylabel("decisions")
        left.set_title("decisions per worker")
    workers = sorted({(m, w) for (m, w, _t) in a.hit_tokens} | set(a.decisions))
    bottom = [0] * len(workers)
    labels = [w for _m, w in workers]
    colors = {"device": plots.GREEN, "host": plots.BLUE, "disk": plots.PURPLE, "shared_beyond": plots.RED}
    for tier in HIT_TIERS:
        values = [a.hit_tokens.get((m, w, tier), 0) for m, w in workers]
        if any(values):
            right.bar(labels, values, bottom=bottom, label=tier, color=colors[tier])
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set_ylabel("predicted hit tokens")
    right.set_title("predicted hit tokens by tier (chosen worker)")
    right.tick_params(axis="x", rotation=30)
    if any(bottom):
        right.legend(fontsize=8)
    plots.save(fig, path)


def run_report(settings: ReportSettings) -> int:
    now = time.time()
    try:
        since = parse_time(settings.since, now)
        until = parse_time(settings.until, now) if settings.until else now
    except TimeFormatError as exc:
        print(f"kvtier report: {exc}", file=sys.stderr)
        return 2
    if until <= since:
        print(f"kvtier report: --until ({iso(until, 'seconds')}) must be after --since ({iso(since, 'seconds')})",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        data = asyncio.run(collect(settings.nats_url, since, until, settings.model or None, bins=settings.bins,
                                   writeback_window_s=settings.writeback_window_s))
    except ReportError as exc:
        print(f"kvtier report: {exc}", file=sys.stderr)
        return 2
    summary = summarize(data)
    out = pathlib.Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(data, summary, out)
    write_summary(summary, out / "summary.md", plots)
    summary["out"] = {"summary": str(out / "summary.md"), "plots": [str(out / p) for p in plots]}
    summary["seconds"] = round(time.monotonic() - started, 2)
    ev, tr = summary["events"], summary["transitions"]
    print(f"kvtier report: {iso(since, 'seconds')} .. {iso(until, 'seconds')}: {ev['messages']} event messages, "
          f"{summary['workers']} workers, {tr['stored']} stored / {tr['removed']} removed / "
          f"{tr['promotion']} promotions / {tr['demotion']} demotions / {tr['eviction']} evictions, "
          f"{summary['decisions']} decisions")
    print(f"wrote {out / 'summary.md'}" + (", " + ", ".join(plots) if plots else " (no plots: pip install matplotlib)"))
    if settings.json:
        print(json.dumps(summary, separators=(",", ":")))
    return 0
