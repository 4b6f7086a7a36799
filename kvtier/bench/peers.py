"""`kvtier bench peers`: kvtier beside the gateway SGLang users run today, on one cluster, in real time.

One cluster for every front door: `--workers` paced sim-workers (answers in wall time, each one
rank serving the OpenAI API with DeepSeek-V4's tokenizer, HiCache host pool), their bridges,
NATS, a processor, Redis and kvtier's router replicas in proxy mode (kvtier/testing/proxy_stack.py). One
trace (the shipped conversation sample, or kvtier's synthetic one), its requests turned into text
prompts (each 512-token trace block becomes `--block-tokens` tokens of seeded prose, the same text
wherever the block recurs, so shared prefixes stay shared), sent by one client at the trace's
times / `--time-scale`, streamed, through each front door in turn:

- `direct`: the client straight to the workers, round robin, nothing in between (the floor of
  added latency, and what no routing at all reuses);
- `bare-relay`: a bare Python relay (aiohttp on uvloop, round robin, kvtier/testing/bare_http.py):
  what relaying a stream costs in kvtier's language before any tokenizing or routing;
- `smg-<policy>`: SGLang's model gateway (`smg launch`, PyPI, kvtier/testing/peers.py) over the
  same worker URLs, each policy at its default settings;
- `kvtier`, `kvtier-2` (two replicas, requests alternating), `kvtier-predicted-ttft`, `kvtier-ids`
  (`--hand-over-token-ids`: the engine is sent the router's ids and does not tokenize again).

Between front doors every worker's cache is flushed (its AllBlocksCleared events reach kvtier's
state too) and the engines are let go idle. Per front door: TTFT p50/p99 (the client's first
byte of the answer), TPOT p99, prompt tokens reused by tier (the sim-workers' own count), and the
front door's CPU seconds per request and RSS (read from /proc by PID). Then:
- the L3 pass (`--l3-front-doors`): a second cluster whose workers share one real Mooncake
  master as HiCache's L3 tier, emptied between doors (it needs a private network namespace;
  elsewhere the pass is one line saying so);
- the ramp (`--ramp-front-doors`): `--ramp-requests` at `--time-scale`, then at twice the rate
  and so on, until TTFT p99 passes twice the first step's or a request fails: the highest rate
  held, and requests per core of the router's own CPU at it;
- Dynamo's side (kvtier/bench/peers_dynamo.py): its frontend and KV router over its own mocker
  engines against a client straight to them, at the same requests and times.

smg's event-driven KV index (`--kv-index`) is fed by the gRPC engine servicer's
SubscribeKvEvents; over HTTP workers it has no events to follow, so its cache-aware policy runs
on its own approximate tree, as it does in front of HTTP SGLang servers.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from kvtier.bench.settings import PeersBench
from kvtier.testing.peer_load import PeerCluster, TracePrompts, summarize

MODEL = "bench/peers-model"
PAGE_SIZE = 64
SMG_DOORS = ("smg-round_robin", "smg-cache_aware", "smg-prefix_hash", "smg-power_of_two")
#: kvtier's doors started beside the stack's replicas, with what they are started with.
EXTRA_ROUTERS = {"kvtier-predicted-ttft": ["--router-mode", "predicted-ttft"], "kvtier-ids": ["--hand-over-token-ids"]}
KVTIER_DOORS = ("kvtier", "kvtier-2", *EXTRA_ROUTERS)
FRONT_DOORS = ("direct", "bare-relay", *SMG_DOORS, *KVTIER_DOORS)
def front_doors(text: str, flag: str = "--front-doors") -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(FRONT_DOORS))
    if unknown or (not names and flag == "--front-doors"):
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
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


def _cluster(work: str, tokenizer: str, bench: PeersBench, doors: list[str], l3: bool):
    """The cluster for `doors` (kvtier's extra routers started on it), as a context manager."""
    import contextlib

    from kvtier.testing.processes import QUIET, start_router
    from kvtier.testing.proxy_stack import proxy_stack, wait_routers_up

    @contextlib.contextmanager
    def cluster():
        sim_flags = ["--pace", "--device-pages", str(bench.device_pages)]
        replicas = 2 if "kvtier-2" in doors else 1
        with proxy_stack(work, MODEL, PAGE_SIZE, tokenizer, bench.workers, replicas,
                         ["--max-request-tokens", str(1 << 18)], sim_flags=sim_flags, l3=l3) as stack:
            routers = {"kvtier": (stack.routers[:1], stack.router_procs[:1]),
                       "kvtier-2": (stack.routers[:2], stack.router_procs[:2])}
            extra = []
            try:
                for door in (d for d in doors if d in EXTRA_ROUTERS):
                    proc, url = start_router(work, f"router-{door}", stack.redis_url, [
                        "--proxy", "--tokenizer", f"{MODEL}={tokenizer}", "--max-request-tokens", str(1 << 18),
                        *EXTRA_ROUTERS[door], *stack.l3_router_flags, *QUIET])
                    extra.append(proc)
                    routers[door] = ([url], [proc])
                    asyncio.run(wait_routers_up([url], [proc]))
                yield PeerCluster(stack, routers, work, bench.settle_seconds, l3)
            finally:
                for proc in extra:
                    proc.stop()

    return cluster()


def _l3_pass(work: str, tokenizer: str, bench: PeersBench, requests) -> tuple[list[dict[str, Any]], str]:
    from kvtier.harness.mooncake import MooncakeUnavailable, in_private_netns

    doors = front_doors(bench.l3_front_doors, "--l3-front-doors")
    if not doors:
        return [], ""
    if not in_private_netns():
        return [], ("not run: the L3 pool is a Mooncake master, which listens on every interface; run the bench in "
                    "a private network namespace: unshare -n --map-root-user sh -c 'ip link set lo up && exec "
                    "kvtier bench peers ...'")
    try:
        with _cluster(work, tokenizer, bench, doors, l3=True) as cluster:
            results = [cluster.run(door, requests) for door in doors]
    except MooncakeUnavailable as exc:
        return [], f"not run: {str(exc).splitlines()[0]}"
    floor = next((summarize(r, None)["ttft_p50_ms"] for r in results if r.door == "direct"), None)
    return [summarize(r, floor) for r in results], ""


def run_peers_bench(bench: PeersBench) -> int:
    from kvtier.testing.model_tokenizers import write_deepseek_tokenizer
    from kvtier.testing.processes import work_folder

    doors = front_doors(bench.front_doors)
    ramped = front_doors(bench.ramp_front_doors, "--ramp-front-doors")
    with work_folder("kvtier-bench-peers-", "kvtier bench peers") as work:
        tokenizer = write_deepseek_tokenizer(os.path.join(work, "tokenizer"))
        prompts = TracePrompts(tokenizer, bench.block_tokens, bench.max_blocks)
        requests = _bodies(bench, prompts)
        with _cluster(work, tokenizer, bench, sorted(set(doors) | set(ramped)), l3=False) as cluster:
            results = [cluster.run(door, requests) for door in doors]
            ramps = [cluster.ramp(door, requests[:bench.ramp_requests]) for door in ramped]
        l3, l3_note = _l3_pass(work, tokenizer, bench, requests)
        dynamo = None
        if not bench.no_dynamo:
            from kvtier.bench.peers_dynamo import run_dynamo_side

            dynamo = run_dynamo_side(requests, work, workers=bench.workers, page_size=PAGE_SIZE,
                                     device_pages=bench.device_pages)
    floor = next((summarize(r, None)["ttft_p50_ms"] for r in results if r.door == "direct"), None)
    summaries = [summarize(r, floor) for r in results]
    report: dict[str, Any] = {
        "trace": bench.trace, "requests": len(requests), "workers": bench.workers, "time_scale": bench.time_scale,
        "block_tokens": bench.block_tokens, "front_doors": summaries, "l3": l3, "l3_note": l3_note,
        "ramps": ramps, "dynamo": dynamo, "kvtier_vs_direct": _added(summaries, "kvtier"),
        "targets": targets(summaries, l3, ramps)}
    _print(report)
    if bench.json:
        print(json.dumps(report))
    return 0 if all(d["served"] == d["requests"] or d["note"] for d in summaries + l3) else 1


def _added(doors: list[dict[str, Any]], door: str) -> dict[str, Any] | None:
    """What `door` adds to the client straight to the workers (Dynamo's side reads the same)."""
    rows = {d["front_door"]: d for d in doors}
    if door not in rows or "direct" not in rows:
        return None
    mine, direct = rows[door], rows["direct"]
    return {**{f"added_{k}": mine[k] - direct[k] if mine[k] is not None and direct[k] is not None else None
               for k in ("ttft_p50_ms", "ttft_p99_ms")}, "cpu_ms_per_request": mine["cpu_ms_per_request"]}


def targets(doors: list[dict[str, Any]], l3: list[dict[str, Any]], ramps: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each a ratio (None where a side is missing)."""
    def get(rows, door, key):
        row = next((r for r in rows if r["front_door"] == door), None)
        return row and row.get(key)

    def ratio(a, b):
        return a / b if a is not None and b else None

    def reused(rows, door):
        share = get(rows, door, "reused_share")
        return sum(v for v in share.values() if v) if share else None

    return {
        "ttft_p50_vs_smg_cache_aware": ratio(get(doors, "kvtier", "ttft_p50_ms"), get(doors, "smg-cache_aware",
                                                                                           "ttft_p50_ms")),
        "ttft_p50_vs_smg_cache_aware_l3": ratio(get(l3, "kvtier", "ttft_p50_ms"), get(l3, "smg-cache_aware",
                                                                                           "ttft_p50_ms")),
        "reused_vs_smg_cache_aware": ratio(reused(doors, "kvtier"), reused(doors, "smg-cache_aware")),
        "cpu_vs_smg_cache_aware": ratio(get(doors, "kvtier", "cpu_ms_per_request"),
                                        get(doors, "smg-cache_aware", "cpu_ms_per_request")),
        "requests_per_router_core": get(ramps, "kvtier", "requests_per_router_core"),
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _door_rows(rows: list[dict[str, Any]]) -> None:
    print(f"  {'front door':<24} {'served':>7} {'TTFT p50':>9} {'p99':>8} {'TPOT p99':>9} {'vs direct':>9} "
          f"{'reused dev/host/L3':>20} {'CPU ms/req':>10} {'RSS MB':>7}")
    for d in rows:
        share = d["reused_share"]
        reused = "/".join(_fmt(share[t] and share[t] * 100, ".0f") for t in ("device", "host", "l3"))
        print(f"  {d['front_door']:<24} {d['served']:>3}/{d['requests']:<3} {_fmt(d['ttft_p50_ms']):>9} "
              f"{_fmt(d['ttft_p99_ms']):>8} {_fmt(d['tpot_p99_ms'], '.2f'):>9} "
              f"{_fmt(d['ttft_p50_vs_direct'], '.2f'):>9} {reused + ' %':>20} "
              f"{_fmt(d['cpu_ms_per_request'], '.2f'):>10} {_fmt(d['rss_mb'], '.0f'):>7}"
              + (f"  ({d['note']})" if d["note"] else ""))


def _print(report: dict[str, Any]) -> None:
    print(f"{report['requests']} requests of the {report['trace']} trace at {report['time_scale']}x its pace, "
          f"{report['workers']} paced sim-workers (device and host pools), "
          f"each trace block {report['block_tokens']} tokens of prose (DeepSeek-V4's tokenizer)")
    _door_rows(report["front_doors"])
    print("With L3 (the workers share one Mooncake pool):" + (f" {report['l3_note']}" if report["l3_note"] else ""))
    if report["l3"]:
        _door_rows(report["l3"])
    for ramp in report["ramps"]:
        steps = ", ".join(f"{s['rate_per_s']:.1f}/s p99 {_fmt(s['ttft_p99_ms'], '.0f')}{'' if s['held'] else ' x'}"
                          for s in ramp["steps"])
        print(f"  ramp {ramp['front_door']:<19} held {_fmt(ramp.get('held_rate_per_s'))}/s, "
              f"{_fmt(ramp.get('requests_per_router_core'), '.0f')} requests per router core: {steps}"
              + (f" ({ramp['note']})" if ramp["note"] else ""))
    dynamo = report["dynamo"]
    if dynamo is not None:
        if dynamo.get("note"):
            print(f"Dynamo: {dynamo['note']}")
        else:
            f, d = dynamo["frontend"], dynamo["direct"]
            print(f"Dynamo {dynamo.get('version', '')} frontend (KV router) over {dynamo['workers']} mocker engines: "
                  f"TTFT p50 {_fmt(f['ttft_p50_ms'])} / p99 {_fmt(f['ttft_p99_ms'])} ms, direct "
                  f"{_fmt(d['ttft_p50_ms'])} / {_fmt(d['ttft_p99_ms'])} ms: adds {_fmt(dynamo['added_ttft_p50_ms'])} / "
                  f"{_fmt(dynamo['added_ttft_p99_ms'])} ms; CPU {_fmt(f['cpu_ms_per_request'], '.2f')} ms/request, "
                  f"RSS {_fmt(f['rss_mb'], '.0f')} MB")
            if (mine := report["kvtier_vs_direct"]) is not None:
                print(f"  kvtier over sim-workers, the same requests: adds {_fmt(mine['added_ttft_p50_ms'])} / "
                      f"{_fmt(mine['added_ttft_p99_ms'])} ms to direct; CPU {_fmt(mine['cpu_ms_per_request'], '.2f')} "
                      f"ms/request (both sides' added TTFT includes what their routers find cached)")
    print("Targets: " + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in report["targets"].items()))
