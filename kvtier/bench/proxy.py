"""`kvtier bench proxy`: what the OpenAI-compatible proxy adds to the latency a user feels.

The whole path as processes on embedded loopback servers (kvtier/testing/proxy_stack.py):
sim-workers serving the OpenAI API, their bridges, NATS, a processor, Redis and router replicas
in proxy mode, workers and routers tokenizing with DeepSeek-V4's real byte-level BPE tokenizer
and a DeepSeek-shaped chat template (kvtier/testing/model_tokenizers.py). Prompts are English
prose from a seeded sentence generator (kvtier/testing/prose.py), cut to
their token counts with that same tokenizer. Every measured request is streamed with one output
token; its TTFT is the client's time to the first byte of the answer.

Three workloads (kvtier/testing/proxy_workloads.py), each measured alone:
- `fresh`: a new `--prompt-tokens` text prompt per request (/v1/completions);
- `multi_turn`: `--conversations` chats (/v1/chat/completions) taken in turn, each request
  adding the previous turn's short answer and a new `--turn-tokens` user turn; a chat that
  would pass `--conversation-tokens` starts again with a new system prompt (`--turn-tokens`
  long). The chats start at seeded lengths spread over that range, as on a server that has
  served them for a while, and the warm-up sends each at least once, so the workers' caches
  and the routers' tokenizer piece caches hold their history;
- `shared_system`: one `--system-tokens` system prompt shared by every request, and a new
  `--question-tokens` user question each.

Requests go in pairs, one straight to a worker and one through a router, sequentially and in
alternating order, so both see the same machine: the proxy's added latency is the routed TTFT
less the direct one, pair by pair. The direct request is the best possible answer (nothing
added). The router's own time (body read, tokenization, decision, up to the first byte sent
to the worker) comes from its `X-Kvtier-Router-Ms` header.

The two requests of a pair are twins, not one body sent twice: built the same way, of the same
token counts, the same where the workload shares text (the system prompt of `shared_system`)
and distinct where it is new. One body sent twice would find its own pages on the worker the
second time, since the sim-worker caches prefixes (and the router would send it to that
worker), so whichever path went second would do less work. Twins keep every path's cache state
alike: new text is a miss on both, shared text a hit on both, and in `multi_turn` each twin
has a twin chat of its own, the direct one always sent to the same worker (holding its
history) as the router sends its twin to the worker holding that one's.

Each routed prompt is also tokenized here, right after its pair, as an engine tokenizes it: the
`tokenizers` library's encode of the whole text (a chat's rendered by the template first), with
none of kvtier's faster encoders. Its count is checked against the engine's `usage`
(`prompt_count_errors`), and its time is `tokenize_floor_ms` (the median): what tokenizing the
prompt whole costs on this machine, the least a proxy that tokenizes it whole must add.
Then each replica's requests/s at `--concurrency` is measured for `--seconds` on `fresh`
prompts (non-streamed), beside the workers' own rate with the same clients sent straight to them.
Prose is too slow to write at that rate, so these prompts are a few texts written beforehand,
each request's made new by a first line of its own: no cache (a router's pieces, a worker's
pages) has seen it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.bench.settings import ProxyBench
from kvtier.schemas.openai import reported_usage
from kvtier.testing.clients import closed_loop_rate, metric_sum
from kvtier.testing.model_tokenizers import PlainTokenizer
from kvtier.testing.prose import Prose
from kvtier.testing.proxy_workloads import COMPLETIONS, WORKLOADS, Workload, completion, proxy_workloads

MODEL = "bench/proxy-model"
PAGE_SIZE = 64
#: Texts the rate phase's prompts are made from (each request's made new by its first line).
RATE_TEXTS = 16


@dataclass
class Timed:
    ttft_s: float
    router_ms: float | None
    worker: str
    prompt_tokens: int


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"p50": statistics.median(ordered), "p99": at(0.99), "max": ordered[-1]}


async def _timed(session, url: str, path: str, payload: dict[str, Any]) -> Timed:
    body = json.dumps(payload).encode()
    started = time.perf_counter()
    async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}{path} answered {r.status}: {(await r.text())[:500]}")
        first = None
        tail = b""
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tail = (tail + chunk)[-4096:]
        done = time.perf_counter()
    usage = reported_usage(tail, streamed=True)
    router_ms = r.headers.get("X-Kvtier-Router-Ms")
    return Timed(ttft_s=(first or done) - started, router_ms=float(router_ms) if router_ms is not None else None,
                 worker=r.headers.get("X-Kvtier-Worker", ""), prompt_tokens=usage.prompt_tokens if usage else 0)


async def _scrape(session, routers: list[str]) -> list[str]:
    return [await (await session.get(router + "/metrics")).text() for router in routers]


def _growth(before: list[str], after: list[str], name: str, **labels: str) -> float:
    """How much a metric grew between two scrapes of every router."""
    return sum(metric_sum(a, name, **labels) - metric_sum(b, name, **labels)
               for b, a in zip(before, after, strict=True))


async def _measure_workload(session, workload: Workload, workers: list[str], routers: list[str],
                            tokenizer: PlainTokenizer, bench: ProxyBench) -> dict[str, Any]:
    warm_up = workload.warm_up(bench.warm_up)
    for i in range(warm_up):  # connections, code paths and caches warm
        pair = workload.pair(i)
        await _timed(session, workers[pair.worker], workload.path, pair.direct)
        await _timed(session, routers[pair.router], workload.path, pair.routed)
    before = await _scrape(session, routers)
    direct: list[Timed] = []
    routed: list[Timed] = []
    counted: list[int] = []
    floor_s: list[float] = []
    for k in range(bench.requests):
        pair = workload.pair(warm_up + k)
        to_worker = _timed(session, workers[pair.worker], workload.path, pair.direct)
        to_router = _timed(session, routers[pair.router], workload.path, pair.routed)
        if k % 2 == 0:
            direct.append(await to_worker)
            routed.append(await to_router)
        else:
            routed.append(await to_router)
            direct.append(await to_worker)
        # timed beside its pair, so on the same machine state as the requests
        started = time.perf_counter()
        counted.append(tokenizer.count(pair.routed))
        floor_s.append(time.perf_counter() - started)
    after = await _scrape(session, routers)
    return _summary(workload.name, warm_up, direct, routed, counted, floor_s, before, after)


def _summary(name: str, warm_up: int, direct: list[Timed], routed: list[Timed], counted: list[int],
             floor_s: list[float], before: list[str], after: list[str]) -> dict[str, Any]:
    added = _quantiles([(r.ttft_s - d.ttft_s) * 1000 for d, r in zip(direct, routed, strict=True)])
    router = _quantiles([r.router_ms for r in routed if r.router_ms is not None])
    direct_q = _quantiles([d.ttft_s * 1000 for d in direct])
    routed_q = _quantiles([r.ttft_s * 1000 for r in routed])
    floor_ms = statistics.median(floor_s) * 1000

    def mean_ms(metric: str) -> float:  # over the measured requests alone
        count = _growth(before, after, metric + "_count")
        return 1000 * _growth(before, after, metric + "_sum") / count if count else float("nan")

    if name == "fresh":
        targets = {"target_added_p50_le_floor_plus_1ms": added["p50"] <= floor_ms + 1.0}
    else:
        targets = {"target_added_p50_le_2ms": added["p50"] <= 2.0, "target_added_p99_le_5ms": added["p99"] <= 5.0}
    return {
        "requests": len(routed), "warm_up": warm_up,
        "prompt_tokens_p50": statistics.median(counted), "prompt_tokens_max": max(counted),
        "direct_ttft_p50_ms": direct_q["p50"], "direct_ttft_p99_ms": direct_q["p99"],
        "routed_ttft_p50_ms": routed_q["p50"], "routed_ttft_p99_ms": routed_q["p99"],
        "added_ttft_p50_ms": added["p50"], "added_ttft_p99_ms": added["p99"],
        "router_time_p50_ms": router["p50"], "router_time_p99_ms": router["p99"], "router_time_max_ms": router["max"],
        "tokenize_floor_ms": floor_ms,
        # where the router's time goes
        "tokenize_mean_ms": mean_ms("router_tokenize_seconds"),
        "decision_mean_ms": mean_ms("router_decision_latency_seconds"),
        "routed_to": {w: sum(1 for r in routed if r.worker == w) for w in sorted({r.worker for r in routed})},
        "prompt_count_errors": sum(1 for r, n in zip(routed, counted, strict=True) if r.prompt_tokens != n),
        "tokenizer_mismatches": _growth(before, after, "router_tokenizer_checks_total", outcome="mismatch"),
        **targets,
    }


def _fresh_bodies(texts: list[str]) -> Callable[[], bytes]:
    """Text completions, each new to every cache: one of `texts` after a first line of its own."""
    serial = itertools.count()

    def body() -> bytes:
        n = next(serial)
        return json.dumps(completion(MODEL, f"Request {n}.\n\n{texts[n % len(texts)]}", stream=False)).encode()

    return body


async def _measure(workers: list[str], routers: list[str], folder: str, names: list[str],
                   bench: ProxyBench) -> dict[str, Any]:
    import aiohttp

    tokenizer = PlainTokenizer.load(folder)
    workloads = proxy_workloads(
        names, tokenizer, model=MODEL, seed=bench.seed, workers=len(workers), routers=len(routers),
        prompt_tokens=bench.prompt_tokens, conversations=bench.conversations, turn_tokens=bench.turn_tokens,
        conversation_tokens=bench.conversation_tokens, system_tokens=bench.system_tokens,
        question_tokens=bench.question_tokens)
    rate_prose = Prose(random.Random(f"{bench.seed}:rate"), tokenizer.raw)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        measured = {w.name: await _measure_workload(session, w, workers, routers, tokenizer, bench) for w in workloads}
        body = _fresh_bodies([rate_prose.text(tokenizer.text_tokens(bench.prompt_tokens)) for _ in range(RATE_TEXTS)])
        direct_rate = await closed_loop_rate(session, workers, COMPLETIONS, body, bench.concurrency, bench.seconds)
        per_replica = [await closed_loop_rate(session, [router], COMPLETIONS, body, bench.concurrency, bench.seconds)
                       for router in routers]
        all_replicas = (await closed_loop_rate(session, routers, COMPLETIONS, body, bench.concurrency, bench.seconds)
                        if len(routers) > 1 else per_replica[0])
        metrics = await _scrape(session, routers)
    return {
        "prompt_tokens": bench.prompt_tokens, "requests": bench.requests, "workers": len(workers),
        "replicas": len(routers), "hand_over_token_ids": bench.hand_over_token_ids,
        # continuity with the single-workload bench: its figures were the fresh prompts'
        **{key: value for key, value in measured.get("fresh", {}).items() if key not in ("requests", "warm_up")},
        "workloads": measured,
        "direct_requests_per_s": direct_rate,
        "requests_per_s_per_replica": per_replica, "requests_per_s_all_replicas": all_replicas,
        "concurrency": bench.concurrency,
        "tokenizer_mismatches": sum(metric_sum(text, "router_tokenizer_checks_total", outcome="mismatch")
                                    for text in metrics),
        "token_ids_handed_over": sum(metric_sum(text, "router_token_ids_handed_over_total") for text in metrics),
    }


def _workload_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise SystemExit(f"kvtier bench proxy --workloads: unknown {unknown or 'none given'}; "
                         f"choose from {', '.join(WORKLOADS)}")
    return list(dict.fromkeys(names))


def run_proxy_bench(bench: ProxyBench) -> int:
    from kvtier.testing.model_tokenizers import write_deepseek_tokenizer
    from kvtier.testing.processes import work_folder
    from kvtier.testing.proxy_stack import proxy_stack

    names = _workload_names(bench.workloads)
    longest = max(bench.prompt_tokens, bench.conversation_tokens, bench.system_tokens + bench.question_tokens)
    with work_folder("kvtier-bench-proxy-", "kvtier bench proxy") as work:
        tokenizer = write_deepseek_tokenizer(os.path.join(work, "tokenizer"))
        router_flags = ["--max-request-tokens", str(max(longest * 2, 1 << 18)),
                        *(["--hand-over-token-ids"] if bench.hand_over_token_ids else [])]
        with proxy_stack(work, MODEL, PAGE_SIZE, tokenizer, bench.workers, bench.replicas, router_flags,
                         sim_flags=["--device-pages", "65536"]) as stack:
            results = asyncio.run(_measure(stack.workers, stack.routers, tokenizer, names, bench))
    _print(results)
    if bench.json:
        print(json.dumps(results))
    return 0


def _print(r: dict[str, Any]) -> None:
    print(f"{r['requests']} request pairs per workload, {r['workers']} sim-workers, {r['replicas']} router "
          f"replica(s) in proxy mode, DeepSeek-V4's tokenizer"
          f"{', token ids handed over to the engine' if r['hand_over_token_ids'] else ''}")
    for name, w in r["workloads"].items():
        target = (f"target <= floor + 1 = {w['tokenize_floor_ms'] + 1:.2f}" if name == "fresh"
                  else "target p50 <= 2, p99 <= 5")
        print(f"  {name} (prompts of {w['prompt_tokens_p50']:.0f} tokens at the median, {w['prompt_tokens_max']} "
              f"at most; {w['warm_up']} pairs of warm-up)")
        for label, key, note in (("TTFT direct to a worker (nothing added):", "direct", ""),
                                 ("TTFT through a router:", "routed", ""),
                                 ("added by the proxy, pair by pair:", "added", f" ({target})")):
            print(f"    {label:<40} p50 {w[key + '_ttft_p50_ms']:.2f} ms, p99 {w[key + '_ttft_p99_ms']:.2f} ms{note}")
        print(f"    the router's own time (X-Kvtier-Router-Ms): p50 {w['router_time_p50_ms']:.2f} ms, "
              f"p99 {w['router_time_p99_ms']:.2f} ms; of which tokenizing {w['tokenize_mean_ms']:.2f} ms and "
              f"deciding {w['decision_mean_ms']:.2f} ms on average")
        print(f"    tokenizing a prompt whole, here with no cache (the floor): p50 {w['tokenize_floor_ms']:.2f} ms")
        spread = ", ".join(f"{worker} {n}" for worker, n in w["routed_to"].items())
        print(f"    routed to {spread}; prompts the engine counted otherwise than here: {w['prompt_count_errors']}, "
              f"than the router: {w['tokenizer_mismatches']:.0f}")
    rates = ", ".join(f"{x:.0f}" for x in r["requests_per_s_per_replica"])
    print(f"  requests/s at concurrency {r['concurrency']} ({r['prompt_tokens']}-token text prompts): per replica "
          f"{rates}; all replicas {r['requests_per_s_all_replicas']:.0f}; straight to the workers "
          f"{r['direct_requests_per_s']:.0f}")
    handed = f"; text prompts sent as token ids: {r['token_ids_handed_over']:.0f}" if r["hand_over_token_ids"] else ""
    print(f"  prompts counted differently by router and engine: {r['tokenizer_mismatches']:.0f}{handed}")
