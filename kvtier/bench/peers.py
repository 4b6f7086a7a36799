"""`kvtier bench peers`: kvtier beside the gateway SGLang users run today, on one cluster, in real time.

One cluster for every front door: `--workers` paced sim-workers (answers in wall time, each one
rank serving the OpenAI API with DeepSeek-V4's tokenizer, HiCache host pool; no L3 yet, since
separate sim-worker processes would each hold a pool of their own), their bridges, NATS, a
processor, Redis and kvtier's router replicas in proxy mode (kvtier/testing/proxy_stack.py). One
trace (the shipped conversation sample, or kvtier's synthetic one), its requests turned into text
prompts (each 512-token trace block becomes `--block-tokens` tokens of seeded prose, the same text
wherever the block recurs, so shared prefixes stay shared), sent by one client at the trace's
times / `--time-scale`, streamed, through each front door in turn:

- `direct`: the client straight to the workers, round robin, nothing in between (the floor of
  added latency, and what no routing at all reuses);
- `smg-<policy>`: SGLang's model gateway (`smg launch`, PyPI, kvtier/testing/peers.py) over the
  same worker URLs, each policy at its default settings;
- `kvtier`, `kvtier-2` (two replicas, requests alternating), `kvtier-predicted-ttft`.

Between front doors every worker's cache is flushed (its AllBlocksCleared events reach kvtier's
state too) and the engines are let go idle. Per front door: TTFT p50/p99 (the client's first
byte of the answer), TPOT p99, prompt tokens reused by tier (the sim-workers' own count), and the
front door's CPU seconds per request and RSS (read from /proc by PID).

smg's event-driven KV index (`--kv-index`) is fed by the gRPC engine servicer's
SubscribeKvEvents; over HTTP workers it has no events to follow, so its cache-aware policy runs
on its own approximate tree, as it does in front of HTTP SGLang servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.settings import PeersBench
from kvtier.testing.peer_load import Sent, TracePrompts, flush_and_settle, paced, served

MODEL = "bench/peers-model"
PAGE_SIZE = 64
SMG_DOORS = ("smg-round_robin", "smg-cache_aware", "smg-prefix_hash", "smg-power_of_two")
KVTIER_DOORS = ("kvtier", "kvtier-2", "kvtier-predicted-ttft")
FRONT_DOORS = ("direct", *SMG_DOORS, *KVTIER_DOORS)


@dataclass
class DoorResult:
    door: str
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    rss_mb: float | None = None
    served: dict[str, int] = field(default_factory=dict)
    note: str = ""


def front_doors(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FRONT_DOORS))
    if unknown or not names:
        raise ValueError(f"--front-doors: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(FRONT_DOORS)}")
    return names


def _bodies(bench: PeersBench, prompts: TracePrompts) -> list[tuple[float, dict[str, Any]]]:
    from kvtier.eval.trace import SAMPLE_TRACE, load_trace

    trace = load_trace(SAMPLE_TRACE if bench.trace == "conversation" else bench.trace, limit=bench.requests)
    t0 = trace[0].timestamp
    return [((r.timestamp - t0) / 1000.0 / bench.time_scale,
             {"model": MODEL, "prompt": prompts.prompt(r.hash_ids), "stream": True,
              "max_tokens": max(2, min(bench.max_tokens, r.output_length or bench.max_tokens))})
            for r in trace]


def _run_door(door: str, stack, routers: dict[str, tuple[list[str], list]], work: str, bench: PeersBench,
              requests: list[tuple[float, dict[str, Any]]]) -> DoorResult:
    """One front door's run on the flushed cluster; `routers`: kvtier's doors, their replicas'
    URLs and processes."""
    from kvtier.testing.peers import SmgMissing, start_smg, wait_smg
    from kvtier.testing.processes import rss_mb
    from kvtier.testing.samplers import cpu_seconds

    sim_bases = [url.rsplit("/w/", 1)[0] for url in stack.workers]
    flush_and_settle(sim_bases, bench.settle_seconds)
    result, gateway = DoorResult(door), None
    pids: list[int | None] = []
    if door == "direct":
        targets = list(stack.workers)
    elif door.startswith("smg-"):
        try:
            gateway, url = start_smg(work, door, stack.workers, door[len("smg-"):])
        except SmgMissing as exc:
            result.note = str(exc)
            return result
        wait_smg(url, len(stack.workers), gateway)
        targets, pids = [url], [gateway.live_pid]
    else:
        targets, procs = routers[door]
        pids = [p.live_pid for p in procs]
    try:
        before = [cpu_seconds(pid) for pid in pids]
        result.sent, result.wall_s = asyncio.run(paced(targets, requests))
        after = [cpu_seconds(pid) for pid in pids]
        spent = [a - b for a, b in zip(after, before) if a is not None and b is not None]
        if pids and len(spent) == len(pids):
            result.cpu_s = sum(spent)
            result.rss_mb = sum(rss_mb(pid) or 0.0 for pid in pids if pid is not None)
        result.served = served(sim_bases)
    finally:
        if gateway is not None:
            gateway.stop()
    return result


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(result: DoorResult, floor_p50: float | None) -> dict[str, Any]:
    ok = [s for s in result.sent if s.ok]
    ttfts = [s.ttft_s * 1000 for s in ok]
    tpots = [s.tpot_s * 1000 for s in ok if s.tpot_s is not None]
    served = result.served
    prompt = served.get("prompt", 0)
    p50 = statistics.median(ttfts) if ttfts else None
    return {
        "front_door": result.door, "requests": len(result.sent), "served": len(ok),
        "ttft_p50_ms": p50, "ttft_p99_ms": _pct(ttfts, 0.99), "tpot_p99_ms": _pct(tpots, 0.99),
        "ttft_p50_vs_direct": p50 / floor_p50 if p50 and floor_p50 else None,
        "reused_share": {tier: served.get(tier, 0) / prompt if prompt else None for tier in ("device", "host", "l3")},
        "prompt_tokens": prompt,
        "cpu_ms_per_request": result.cpu_s * 1000 / len(result.sent) if result.cpu_s is not None and result.sent
        else None,
        "rss_mb": result.rss_mb, "wall_s": result.wall_s, "note": result.note,
    }


def run_peers_bench(bench: PeersBench) -> int:
    from kvtier.testing.model_tokenizers import write_deepseek_tokenizer
    from kvtier.testing.processes import QUIET, start_router, work_folder
    from kvtier.testing.proxy_stack import proxy_stack, wait_routers_up

    doors = front_doors(bench.front_doors)
    with work_folder("kvtier-bench-peers-", "kvtier bench peers") as work:
        tokenizer = write_deepseek_tokenizer(os.path.join(work, "tokenizer"))
        prompts = TracePrompts(tokenizer, bench.block_tokens, bench.max_blocks)
        requests = _bodies(bench, prompts)
        # No L3 yet: each worker here is a sim-worker process of its own, so `--l3` would give each a
        # private pool that also outlives /flush_cache, not the one pool HiCache's Mooncake tier is.
        sim_flags = ["--pace", "--device-pages", str(bench.device_pages)]
        replicas = 2 if "kvtier-2" in doors else 1
        with proxy_stack(work, MODEL, PAGE_SIZE, tokenizer, bench.workers, replicas,
                         ["--max-request-tokens", str(1 << 18)], sim_flags=sim_flags) as stack:
            routers = {"kvtier": (stack.routers[:1], stack.router_procs[:1]),
                       "kvtier-2": (stack.routers[:2], stack.router_procs[:2])}
            predicted = None
            if "kvtier-predicted-ttft" in doors:
                predicted, url = start_router(work, "router-predicted-ttft", stack.redis_url,
                                              ["--proxy", "--tokenizer", f"{MODEL}={tokenizer}", "--router-mode",
                                               "predicted-ttft", "--max-request-tokens", str(1 << 18), *QUIET])
                routers["kvtier-predicted-ttft"] = ([url], [predicted])
            try:
                if predicted is not None:
                    asyncio.run(wait_routers_up(routers["kvtier-predicted-ttft"][0], [predicted]))
                results = [_run_door(door, stack, routers, work, bench, requests) for door in doors]
            finally:
                if predicted is not None:
                    predicted.stop()
    floor = next((summarize(r, None)["ttft_p50_ms"] for r in results if r.door == "direct"), None)
    summaries = [summarize(r, floor) for r in results]
    report: dict[str, Any] = {"trace": bench.trace, "requests": len(requests), "workers": bench.workers,
              "time_scale": bench.time_scale, "block_tokens": bench.block_tokens,
              "front_doors": summaries}
    _print(report)
    if bench.json:
        print(json.dumps(report))
    return 0 if all(d["served"] == d["requests"] or d["note"] for d in summaries) else 1


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _print(report: dict[str, Any]) -> None:
    print(f"{report['requests']} requests of the {report['trace']} trace at {report['time_scale']}x its pace, "
          f"{report['workers']} paced sim-workers (device and host pools, no L3), "
          f"each trace block {report['block_tokens']} tokens of prose (DeepSeek-V4's tokenizer)")
    print(f"  {'front door':<24} {'served':>7} {'TTFT p50':>9} {'p99':>8} {'TPOT p99':>9} {'vs direct':>9} "
          f"{'reused dev/host/L3':>20} {'CPU ms/req':>10} {'RSS MB':>7}")
    for d in report["front_doors"]:
        share = d["reused_share"]
        reused = "/".join(_fmt(share[t] and share[t] * 100, ".0f") for t in ("device", "host", "l3"))
        print(f"  {d['front_door']:<24} {d['served']:>3}/{d['requests']:<3} {_fmt(d['ttft_p50_ms']):>9} "
              f"{_fmt(d['ttft_p99_ms']):>8} {_fmt(d['tpot_p99_ms'], '.2f'):>9} "
              f"{_fmt(d['ttft_p50_vs_direct'], '.2f'):>9} {reused + ' %':>20} "
              f"{_fmt(d['cpu_ms_per_request'], '.2f'):>10} {_fmt(d['rss_mb'], '.0f'):>7}"
              + (f"  ({d['note']})" if d["note"] else ""))
