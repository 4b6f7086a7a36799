"""`kvtier bench soak`'s verdicts (kvtier/bench/soak.py runs the soak): pure judgements of its
samples (unit-tested on synthetic series), the per-phase table and the plot.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvtier.tools import plots


@dataclass
class Thresholds:
    #: RSS growth between the first and last steady windows (medians), and projected over the
    #: run by the least-squares slope of every sample from the first steady window on.
    rss_growth: float = 0.10
    #: Redis bytes per live (page, tier) entry, net of the pre-load baseline: every phase that
    #: holds at least `entries_floor` of the peak stays within this factor of the steady value.
    per_entry_band: float = 1.5
    entries_floor: float = 0.2
    #: When live entries fall by Y (evict, die), net Redis memory must fall by >= this x Y.
    memory_fall_ratio: float = 0.6
    #: ... and the phase must really have removed pages: Y at least this much.
    evict_min_fall: float = 0.5
    die_min_fall: float = 0.25
    #: JetStream: bytes in the tail at most this x the first steady window's (retention holds).
    stream_growth: float = 1.5
    #: the load itself: achieved rate >= this x --rate, errors <= this share of requests.
    min_rate_share: float = 0.5
    max_error_share: float = 0.01




# --- the verdicts ----------------------------------------------------------------------------
def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def least_squares(points: list[tuple[float, float | None]]) -> tuple[float, float] | None:
    """(slope, intercept) of y = a t + b fitted to the points; None with fewer than 3."""
    known = [(t, y) for t, y in points if y is not None]
    if len(known) < 3:
        return None
    mt = statistics.fmean(t for t, _ in known)
    my = statistics.fmean(y for _, y in known)
    var = sum((t - mt) ** 2 for t, _ in known)
    if var == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in known) / var
    return slope, my - slope * mt


def _in(samples: list[dict], start: float, end: float) -> list[dict]:
    return [s for s in samples if start <= s["t"] < end]


def windows(phases: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
    """The settled part of each phase: its second half (the first is the transition)."""
    return {name: (start + (end - start) / 2, end) for name, start, end in phases}


def _verdict(name: str, ok: bool, detail: str, **numbers) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail, **numbers}


def rss_names(samples: list[dict]) -> list[str]:
    names = []
    for s in samples:
        for key in s:
            if key.startswith("rss_") and key not in names:
                names.append(key)
    return names


def judge(samples: list[dict], phases: list[tuple[str, float, float]], baseline_used_memory: int,
          meta: dict, th: Thresholds | None = None) -> list[dict]:
    """The soak's verdicts, from its samples alone (pure: unit-tested on synthetic series).

    `samples`: dicts with `t` (s since the load started), `redis_mem` (Redis used_memory less
    client buffers; `baseline_used_memory` is the same before any page), `entries`,
    `dead_entries`, `keys`, `bookings`, `rss_<process>` (MB; None once dead), `js_<stream>_mb`,
    `js_<stream>_age_s`. `phases`: (name, start, end) of steady, evict, refill, die, tail.
    `meta`: `rate`, `requests`, `errors`, `load_s`, `kill_t`, `lease_ttl_s`, `routed_to_dead_late`,
    `end` (the checks after the drain: bookings, load_fields, dead worker keys), `survivors`
    (rss_ names judged for growth), `stream_max_age_s`.
    """
    th = th or Thresholds()
    w = windows(phases)
    out: list[dict] = []

    def med(window: str, key: str, fn=None):
        picked = _in(samples, *w[window])
        return _median([(fn(s) if fn else s.get(key)) for s in picked])

    def net(s):
        return s["redis_mem"] - baseline_used_memory

    def per_entry(s):
        return net(s) / s["entries"] if s["entries"] else None

    # 1. Redis bytes per live entry stay in a band wherever there are many entries.
    peak = max((s["entries"] for s in samples), default=0)
    ref = med("steady", "", per_entry)
    band = {}
    for name in ("steady", "refill", "die", "tail"):
        entries = med(name, "entries")
        if entries and peak and entries >= th.entries_floor * peak:
            band[name] = med(name, "", per_entry)
    ok = bool(ref) and ref > 0 and all(v is not None and ref / th.per_entry_band <= v <= ref * th.per_entry_band
                                       for v in band.values())
    out.append(_verdict(
        "redis_bytes_per_entry", ok,
        "Redis memory (used_memory - client buffers, net of the baseline) per live (page, tier) entry: " + ", ".join(
            f"{k} {v:.0f} B" if v is not None else f"{k} -" for k, v in band.items())
        + f" (band: steady / {th.per_entry_band:g} .. x{th.per_entry_band:g})",
        bytes_per_entry={k: round(v, 1) if v is not None else None for k, v in band.items()}))

    # 2. Memory falls with the pages when the workers flush (steady -> evict windows).
    def fall(name: str, e0, e1, m0, m1, min_fall: float, what: str, extra: str = "", **numbers) -> dict:
        if not e0 or m0 is None or m1 is None or e1 is None or m0 <= 0:
            return _verdict(name, False, f"{what}: no data")
        pages_fall = 1 - e1 / e0
        memory_fall = 1 - m1 / m0
        ok = pages_fall >= min_fall and memory_fall >= th.memory_fall_ratio * pages_fall
        return _verdict(
            name, ok, f"{what}: live entries {e0:,.0f} -> {e1:,.0f} ({-pages_fall:+.0%}), Redis net memory "
                      f"{m0 / 2**20:.2f} -> {m1 / 2**20:.2f} MB ({-memory_fall:+.0%}); needs entries -{min_fall:.0%} "
                      f"or more and memory down >= {th.memory_fall_ratio:g}x as much{extra}",
            pages_fall=round(pages_fall, 4), memory_fall=round(memory_fall, 4), **numbers)

    out.append(fall("redis_falls_on_evict", med("steady", "entries"), med("evict", "entries"),
                    med("steady", "", net), med("evict", "", net), th.evict_min_fall, "steady -> evict"))

    # 3. ... and when workers die: the last samples before the kill against the first ones after
    # their entries are gone (medians of up to 3 each; the survivors' pools are full by then).
    kill_t = meta.get("kill_t")
    gone_t = None
    if kill_t is not None:
        gone_t = next((s["t"] for s in samples if s["t"] >= kill_t and s.get("dead_entries", 0) == 0), None)
    if kill_t is None or gone_t is None:
        out.append(_verdict("redis_falls_on_death", False, "the dead workers' entries never went away"))
    else:
        # between the kill and the removal the dead workers' state is frozen: the last state
        # before the removal (or, if the removal beat the sampler, the last before the kill)
        before = ([s for s in samples if kill_t <= s["t"] < gone_t] or [s for s in samples if s["t"] < kill_t])[-3:]
        after = [s for s in samples if s["t"] >= gone_t][:3]
        dead_share = _median([s.get("dead_entries", 0) / s["entries"] if s["entries"] else None for s in before])
        out.append(fall("redis_falls_on_death", _median([s["entries"] for s in before]),
                        _median([s["entries"] for s in after]), _median([net(s) for s in before]),
                        _median([net(s) for s in after]), th.die_min_fall, "dead workers' pages removed",
                        f" (the dead held {dead_share or 0:.0%} of the entries)",
                        dead_share=round(dead_share or 0, 4)))

    # 4. RSS of the long-lived processes: no growth between the steady windows, nor by slope.
    first_start, first_end = w["steady"]
    last_end = w["tail"][1]
    for key in meta.get("survivors") or rss_names(samples):
        first = med("steady", key)
        last = med("tail", key)
        fit = least_squares([(s["t"], s.get(key)) for s in samples if s["t"] >= first_start])
        if not first or last is None or fit is None:
            out.append(_verdict(f"rss_{key[4:-3]}", False, f"{key}: not enough samples"))
            continue
        slope, intercept = fit
        at_start = slope * first_start + intercept
        span = last_end - first_start
        projected = slope * span / at_start if at_start > 0 else math.inf
        growth = last / first - 1
        ok = growth < th.rss_growth and projected < th.rss_growth
        out.append(_verdict(
            f"rss_{key[4:-3]}", ok,
            f"{key[4:-3]} RSS {first:.1f} MB (steady) -> {last:.1f} MB (tail), {growth:+.1%}; least-squares slope "
            f"{slope * 60:+.2f} MB/min = {projected:+.1%} over {span / 60:.1f} min (bound < {th.rss_growth:.0%})",
            first_mb=round(first, 2), last_mb=round(last, 2), growth=round(growth, 4),
            slope_mb_per_min=round(slope * 60, 3), projected_growth=round(projected, 4)))

    # 5. Bookings: bounded while loaded, all given back after the drain.
    end = meta.get("end", {})
    bound = math.ceil(meta["rate"] * (meta.get("max_hold_s", 2.0) + 2) * 2) + meta.get("max_inflight", 48)
    peak_bookings = max((s.get("bookings", 0) for s in samples), default=0)
    fit = least_squares([(s["t"], s.get("bookings")) for s in samples
                         if first_start <= s["t"] and not (w["evict"][0] - 1 <= s["t"] < w["evict"][0])])
    ok = (peak_bookings <= bound and end.get("bookings") == 0 and end.get("load_fields") == 0
          and end.get("booking_keys") == 0)
    out.append(_verdict(
        "bookings_released", ok,
        f"pending bookings peak {peak_bookings} (bound {bound}); after the drain {end.get('bookings')} bookings, "
        f"{end.get('booking_keys')} bk: keys, {end.get('load_fields')} load fields"
        + (f"; slope {fit[0] * 60:+.2f}/min" if fit else ""),
        peak=peak_bookings, bound=bound, after_drain=end.get("bookings")))

    # 6. Dead workers: pages and lease gone after expiry, state bounded, no routes to them.
    dead = end.get("dead_workers", {})
    limit = meta.get("lease_ttl_s", 5.0) + 2 + 2 * meta.get("sample_s", 1.0) + 3
    problems = []
    for worker, info in dead.items():
        if info.get("pages_key"):
            problems.append(f"{worker}: pages set still there")
        if info.get("lease"):
            problems.append(f"{worker}: lease still there")
        if info.get("entries"):
            problems.append(f"{worker}: state still counts {info['entries']} entries")
        if info.get("state_ttl", -2) == -1:
            problems.append(f"{worker}: state hash without TTL")
        if info.get("load"):
            problems.append(f"{worker}: booked load left")
    late = meta.get("routed_to_dead_late", 0)
    if late:
        problems.append(f"{late} decisions chose a dead worker after its lease expired")
    removed_after = None if gone_t is None or kill_t is None else gone_t - kill_t
    if removed_after is None or removed_after > limit:
        problems.append(f"dead workers' entries not gone within {limit:.0f}s of the kill")
    lingering = sorted({k for info in dead.values() for k in info.get("lingering", [])})
    out.append(_verdict(
        "dead_workers_cleared", bool(dead) and not problems,
        (f"{len(dead)} dead workers: entries gone {removed_after:.1f}s after the kill "
         f"(lease {meta.get('lease_ttl_s')}s)"
         if removed_after is not None else f"{len(dead)} dead workers: entries never reached 0")
        + (f"; state TTL {min(i.get('state_ttl', -2) for i in dead.values())}s" if dead else "")
        + (f"; left without TTL: {', '.join(lingering)}" if lingering else "")
        + ("; " + "; ".join(problems) if problems else ""),
        removed_after_s=None if removed_after is None else round(removed_after, 1), lingering=lingering))

    # 7. Redis keys: the tail holds no more keys than the steady state did.
    k_first = max((s["keys"] for s in _in(samples, *w["steady"])), default=None)
    k_last = max((s["keys"] for s in _in(samples, *w["tail"])), default=None)
    ok = k_first is not None and k_last is not None and k_last <= k_first
    out.append(_verdict("redis_keys_bounded", ok, f"Redis keys: steady max {k_first}, tail max {k_last}",
                        steady_max=k_first, tail_max=k_last))

    # 8. JetStream: bounded by its retention: the oldest message is never older than the max
    # age, and (when the steady phase outlasts a max age) the tail holds no more bytes than
    # the steady state did.
    max_age = meta.get("stream_max_age_s")
    details, ok = [], True
    judged_bytes = max_age is not None and first_end >= max_age + 2 * meta.get("sample_s", 1.0)
    for stream in sorted({k[3:-3] for s in samples for k in s if k.startswith("js_") and k.endswith("_mb")}):
        b_first = max((s.get(f"js_{stream}_mb") or 0 for s in _in(samples, *w["steady"])), default=0)
        b_last = max((s.get(f"js_{stream}_mb") or 0 for s in _in(samples, *w["tail"])), default=0)
        oldest = max((s.get(f"js_{stream}_age_s") or 0 for s in samples), default=0)
        stream_ok = max_age is None or oldest <= max_age + 10
        if judged_bytes:
            stream_ok = stream_ok and b_last <= th.stream_growth * max(b_first, 0.01)
        ok = ok and stream_ok
        details.append(f"{stream} {b_first:.1f} -> {b_last:.1f} MB, oldest {oldest:.0f}s")
    out.append(_verdict("jetstream_retention", ok and bool(details),
                        "; ".join(details) + (f" (max age {max_age:g}s" if max_age else " (")
                        + (f"; tail <= {th.stream_growth:g}x steady)" if judged_bytes else
                           "; bytes not compared: the steady phase is shorter than a max age)"),
                        bytes_judged=judged_bytes))

    # 9. The load itself (a soak that routed nothing proves nothing).
    achieved = meta["requests"] / meta["load_s"] if meta.get("load_s") else 0
    error_share = meta.get("errors", 0) / max(meta["requests"], 1)
    ok = achieved >= th.min_rate_share * meta["rate"] and error_share <= th.max_error_share
    out.append(_verdict("load_sustained", ok,
                        f"{meta['requests']:,} requests, {achieved:.1f}/s of {meta['rate']:g}/s asked, "
                        f"{meta.get('errors', 0)} errors, {meta.get('routed_to_dead', 0)} routed to a dying worker "
                        f"before its lease ran out", achieved_rate=round(achieved, 2), errors=meta.get("errors", 0)))
    return out


def phase_medians(samples: list[dict], phases: list[tuple[str, float, float]]) -> dict[str, dict]:
    out = {}
    for name, start, end in phases:
        picked = _in(samples, start, end)
        metrics: dict[str, float | None] = {"samples": len(picked)}
        keys = [k for k in (picked[0] if picked else {}) if k not in ("t", "phase")]
        for s in picked:
            keys += [k for k in s if k not in keys and k not in ("t", "phase")]
        for key in keys:
            values = [s.get(key) for s in picked]
            if all(isinstance(v, (int, float)) or v is None for v in values):
                m = _median(values)
                metrics[key] = round(m, 3) if isinstance(m, float) else m
        out[name] = metrics
    return out


def format_table(medians: dict[str, dict], phases, baseline_used_memory: int) -> str:
    order = ("rss_processor", "rss_router", "rss_bridge", "rss_sim", "rss_nats", "rss_redis")
    rss_keys = sorted({k for m in medians.values() for k in m if k.startswith("rss_")},
                      key=lambda k: (next((i for i, o in enumerate(order) if k.startswith(o)), len(order)), k))
    rss_short = {k: k[4:].replace("_mb", "") for k in rss_keys}
    header = (f"{'phase':<7} {'s':>5} {'wrk':>3} {'device':>7} {'host':>7} {'redis MB':>8} {'feed MB':>7} "
              f"{'B/entry':>7} "
              f"{'keys':>5} {'bk':>4} {'dec/s':>5} {'JS MB ev/dec':>12} "
              + " ".join(f"{v:>9}" for v in rss_short.values()))
    lines = ["medians per phase; RSS in MB", header, "-" * len(header)]
    for name, start, end in phases:
        m = medians.get(name, {})

        def g(key, fmt="{:.0f}", m=m):
            v = m.get(key)
            return fmt.format(v) if v is not None else "-"

        used = m.get("used_memory")
        mem = m.get("redis_mem")
        entries = m.get("entries") or 0
        per = (mem - baseline_used_memory) / entries if mem is not None and entries >= 1000 else None
        lines.append(
            f"{name:<7} {end - start:>5.0f} {g('live_workers'):>3} {g('entries_n1'):>7} {g('entries_n2'):>7} "
            f"{(used or 0) / 2**20:>8.2f} {g('feed_mb', '{:.2f}'):>7} "
            f"{per if per is not None else float('nan'):>7.0f} {g('keys'):>5} "
            f"{g('bookings'):>4} {g('decisions_per_s', '{:.1f}'):>5} "
            f"{g('js_KVTIER_EVENTS_mb', '{:.1f}') + '/' + g('js_KVTIER_DECISIONS_mb', '{:.1f}'):>12} "
            + " ".join(f"{g(k, '{:.1f}'):>9}" for k in rss_keys))
    cpu_keys = [k.replace("rss_", "cpu_").replace("_mb", "") for k in rss_keys]
    lines += ["", "CPU cores used (medians per phase)",
              f"{'phase':<7} {'all':>5} " + " ".join(f"{v:>9}" for v in rss_short.values())]
    for name, _start, _end in phases:
        m = medians.get(name, {})
        total = sum(m.get(k) or 0 for k in cpu_keys)
        lines.append(f"{name:<7} {total:>5.2f} " + " ".join(
            f"{m[k]:>9.2f}" if m.get(k) is not None else f"{'-':>9}" for k in cpu_keys))
    return "\n".join(lines)


def format_verdicts(verdicts: list[dict]) -> str:
    return "\n".join(f"{'PASS' if v['ok'] else 'FAIL'}  {v['name']:<22} {v['detail']}" for v in verdicts)


def write_plot(samples: list[dict], phases, baseline_used_memory: int, path: str) -> bool:
    """The run's series against time, phase by phase, as a PNG; False without matplotlib."""
    if not plots.available():
        return False
    t = [s["t"] / 60 for s in samples]
    fig, axes = plots.figure(6, 1, (11, 15), sharex=True)

    def shade(ax):
        for i, (name, start, end) in enumerate(phases):
            ax.axvspan(start / 60, end / 60, color="#000000", alpha=0.04 * (i % 2))
            if ax is axes[0]:
                ax.text((start + end) / 120, 1.01, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=8)

    def series(keys) -> list[tuple[str, list]]:
        return [(label, [s.get(key) for s in samples]) for key, label in keys]

    ax = axes[0]
    plots.lines(ax, t, series((("entries_n1", "device"), ("entries_n2", "host"), ("entries", "all"))))
    ax.set_ylabel("live (page, tier)\nentries")
    ax2 = ax.twinx()
    ax2.step(t, [s.get("live_workers") for s in samples], color=plots.GREY, where="post", label="live workers")
    ax2.set_ylabel("live workers")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    ax.plot(t, [s["used_memory"] / 2**20 for s in samples], label="used_memory", color=plots.RED)
    ax.plot(t, [s["redis_mem"] / 2**20 for s in samples], label="less client buffers", color=plots.ORANGE)
    ax.axhline(baseline_used_memory / 2**20, color=plots.ORANGE, linestyle=":", label="baseline")
    ax.set_ylabel("Redis MB")
    ax2 = ax.twinx()
    ax2.plot(t, [(s["redis_mem"] - baseline_used_memory) / s["entries"] if s["entries"] > 1000 else None
                 for s in samples], color=plots.GREEN, label="net B/entry")
    ax2.set_ylabel("net bytes / entry")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ours = ("rss_processor", "rss_router", "rss_bridge")
    for ax, keys, label in ((axes[2], [k for k in rss_names(samples) if k.startswith(ours)], "kvtier RSS MB"),
                            (axes[3], [k for k in rss_names(samples) if not k.startswith(ours)], "others' RSS MB")):
        plots.lines(ax, t, series((key, key[4:].replace("_mb", "")) for key in keys))
        ax.set_ylabel(label)
        ax.legend(loc="upper left", fontsize=7, ncol=5)
    ax = axes[4]
    plots.lines(ax, t, series((("bookings", "pending bookings"), ("decisions_per_s", "decisions/s"),
                               ("keys", "Redis keys"))))
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[5]
    streams = sorted({k for s in samples for k in s if k.startswith("js_") and k.endswith("_mb")})
    plots.lines(ax, t, series((key, key[3:-3]) for key in streams))
    ax.set_ylabel("JetStream MB")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper left", fontsize=8)
    for ax in axes:
        shade(ax)
    plots.save(fig, path, dpi=90, title="kvtier bench soak: memory against live pages")
    return True
