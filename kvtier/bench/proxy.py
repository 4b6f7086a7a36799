"""`kvtier bench proxy`: what the OpenAI-compatible proxy adds to the latency a user feels.

The whole path as processes on embedded loopback servers: sim-workers serving the OpenAI API
(tokenizing with the same files as the routers), their bridges, NATS, a processor, Redis and
router replicas in proxy mode. Each measured request is a streamed text completion of
`--prompt-tokens` tokens with one output token; its TTFT is the client's time to the first
byte of the answer. Requests go in pairs, one straight to a worker and one through a router,
sequentially and in alternating order, so both see the same machine: the proxy's added
latency is the routed TTFT less the direct one, pair by pair. The direct request is the best
possible answer (nothing added). The router's own time (body read, tokenization, decision,
up to the first byte sent to the worker) comes from its `X-Kvtier-Router-Ms` header.

Prompts are fresh random words (no request reuses another's pages), so the workers do the same
work on both paths. Then each replica's requests/s at `--concurrency` is measured for
`--seconds`, beside the workers' own rate with the same clients sent straight to them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from kvtier.schemas.openai import reported_usage

MODEL = "bench/proxy-model"
PAGE_SIZE = 64
SPECIAL = ["<s>", "</s>"]


def write_tokenizer(folder: str, words: int = 30_000) -> list[str]:
    """A word-level tokenizer (one token per word, a BOS added as the engines' files do) saved
    as tokenizer.json + tokenizer_config.json; returns its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocabulary = [f"w{i}" for i in range(words)]
    ids = {token: i for i, token in enumerate(["[UNK]", *SPECIAL, *vocabulary])}
    tokenizer = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ids["<s>"])])
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    return vocabulary


@dataclass
class Timed:
    ttft_s: float
    total_s: float
    router_ms: float | None
    worker: str
    prompt_tokens: int


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p99": float("nan")}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"p50": statistics.median(ordered), "p99": at(0.99), "max": ordered[-1]}


async def _timed_completion(session, url: str, body: bytes) -> Timed:
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {(await r.text())[:500]}")
        first = None
        tail = b""
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tail = (tail + chunk)[-4096:]
        done = time.perf_counter()
    usage = reported_usage(tail, streamed=True)
    router_ms = r.headers.get("X-Kvtier-Router-Ms")
    return Timed(ttft_s=(first or done) - started, total_s=done - started,
                 router_ms=float(router_ms) if router_ms is not None else None,
                 worker=r.headers.get("X-Kvtier-Worker", ""), prompt_tokens=usage.prompt_tokens if usage else 0)


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples in a Prometheus text page, of those with `labels`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + " ") or line.startswith(name + "{"))
               and all(f'{key}="{value}"' in line for key, value in labels.items()))


def _prompt(rng: random.Random, vocabulary: list[str], tokens: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(tokens - 1))  # the BOS is the last token


def _body(prompt: str, stream: bool) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}).encode()


async def _measure(workers: list[str], routers: list[str], vocabulary: list[str], args) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for i in range(args.warm_up):  # connections, code paths and the tokenizers' caches warm
            await _timed_completion(session, workers[i % len(workers)],
                                    _body(_prompt(rng, vocabulary, args.prompt_tokens), True))
            await _timed_completion(session, routers[i % len(routers)],
                                    _body(_prompt(rng, vocabulary, args.prompt_tokens), True))
        direct: list[Timed] = []
        routed: list[Timed] = []
        for i in range(args.requests):
            to_worker = _body(_prompt(rng, vocabulary, args.prompt_tokens), True)
            to_router = _body(_prompt(rng, vocabulary, args.prompt_tokens), True)
            worker, router = workers[i % len(workers)], routers[i % len(routers)]
            if i % 2 == 0:
                direct.append(await _timed_completion(session, worker, to_worker))
                routed.append(await _timed_completion(session, router, to_router))
            else:
                routed.append(await _timed_completion(session, router, to_router))
                direct.append(await _timed_completion(session, worker, to_worker))

        # the breakdown of the router's time on the sequential requests above (the rate phase queues)
        sequential = [await (await session.get(router + "/metrics")).text() for router in routers]
        bodies = [_body(_prompt(rng, vocabulary, args.prompt_tokens), False) for _ in range(64)]

        async def rate(targets: list[str]) -> float:
            done = 0
            deadline = time.perf_counter() + args.seconds

            async def client(k: int) -> None:
                nonlocal done
                n = k
                while time.perf_counter() < deadline:
                    async with session.post(targets[n % len(targets)] + "/v1/completions",
                                            data=bodies[n % len(bodies)],
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"{targets[n % len(targets)]} answered {r.status}")
                    done += 1
                    n += args.concurrency
            started = time.perf_counter()
            await asyncio.gather(*(client(k) for k in range(args.concurrency)))
            return done / (time.perf_counter() - started)

        direct_rate = await rate(workers)
        per_replica = [await rate([router]) for router in routers]
        all_replicas = await rate(routers) if len(routers) > 1 else per_replica[0]
        metrics = [await (await session.get(router + "/metrics")).text() for router in routers]

    added = [(r.ttft_s - d.ttft_s) * 1000 for d, r in zip(direct, routed, strict=True)]
    router_ms = [r.router_ms for r in routed if r.router_ms is not None]
    miscounted = sum(1 for r in routed if r.prompt_tokens != args.prompt_tokens)
    mismatches = sum(_metric(text, "router_tokenizer_checks_total", outcome="mismatch") for text in metrics)
    def mean_ms(name: str) -> float:
        sums = [_metric(text, name + "_sum") for text in sequential]
        counts = [_metric(text, name + "_count") for text in sequential]
        return 1000 * sum(sums) / sum(counts) if sum(counts) else float("nan")

    added_q, router_q = _quantiles(added), _quantiles(router_ms)
    direct_q = _quantiles([d.ttft_s * 1000 for d in direct])
    routed_q = _quantiles([r.ttft_s * 1000 for r in routed])
    return {
        "prompt_tokens": args.prompt_tokens, "requests": args.requests, "workers": len(workers),
        "replicas": len(routers),
        "direct_ttft_p50_ms": direct_q["p50"], "direct_ttft_p99_ms": direct_q["p99"],
        "routed_ttft_p50_ms": routed_q["p50"], "routed_ttft_p99_ms": routed_q["p99"],
        "added_ttft_p50_ms": added_q["p50"], "added_ttft_p99_ms": added_q["p99"],
        "router_time_p50_ms": router_q["p50"], "router_time_p99_ms": router_q["p99"],
        "router_time_max_ms": router_q["max"],
        # where the router's time goes: means over the warm-up and the sequential pairs
        "tokenize_mean_ms": mean_ms("router_tokenize_seconds"),
        "decision_mean_ms": mean_ms("router_decision_latency_seconds"),
        "direct_requests_per_s": direct_rate,
        "requests_per_s_per_replica": per_replica, "requests_per_s_all_replicas": all_replicas,
        "concurrency": args.concurrency,
        "routed_to": {w: sum(1 for r in routed if r.worker == w) for w in sorted({r.worker for r in routed})},
        "prompt_count_errors": miscounted, "tokenizer_mismatches": mismatches,
        "target_added_p50_le_2ms": added_q["p50"] <= 2.0, "target_added_p99_le_5ms": added_q["p99"] <= 5.0,
    }


def run_proxy_bench(args) -> int:
    import redis

    from kvtier.bench.processes import KvtierSubprocess, start_sim_workers, wait_announced
    from kvtier.harness.embedded import NatsServer, RedisServer, free_port

    work = tempfile.mkdtemp(prefix="kvtier-bench-proxy-")
    tokenizer = os.path.join(work, "tokenizer")
    vocabulary = write_tokenizer(tokenizer)
    quiet = ["--log-level", "WARNING"]
    processes: list[KvtierSubprocess] = []
    results: dict | None = None
    with NatsServer() as nats, RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        try:
            processes.append(KvtierSubprocess(["processor", "--nats", nats.url, "--redis", server.url, *quiet],
                                              work, "processor"))
            workers, sims, bridges = start_sim_workers(args.workers, work, nats.url, MODEL, PAGE_SIZE, tokenizer,
                                                       sim_flags=["--device-pages", "65536"])
            processes += [*sims, *bridges]
            wait_announced(client, MODEL, args.workers, processes, timeout=60)
            routers = []
            for i in range(args.replicas):
                port = free_port()
                processes.append(KvtierSubprocess(
                    ["router", "--redis", server.url, "--http-port", str(port), "--proxy", "--tokenizer",
                     f"{MODEL}={tokenizer}", "--max-request-tokens", str(max(args.prompt_tokens * 2, 1 << 18)),
                     *quiet], work, f"router-{i}"))
                routers.append(f"http://127.0.0.1:{port}")
            asyncio.run(_wait_up(routers, processes))
            results = asyncio.run(_measure(workers, routers, vocabulary, args))
        finally:
            for p in reversed(processes):
                p.stop()
            client.close()
            if results is not None:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"kvtier bench proxy failed; the processes' logs are in {work}", file=sys.stderr)
    _print(results)
    if args.json:
        print(json.dumps(results))
    return 0


async def _wait_up(routers: list[str], processes) -> None:
    import aiohttp

    from kvtier.bench.processes import wait_http

    async with aiohttp.ClientSession() as session:
        for router in routers:
            await wait_http(session, router + "/healthz", processes, timeout=60)


def _print(r: dict) -> None:
    print(f"{r['requests']} request pairs, {r['prompt_tokens']}-token prompts, {r['workers']} sim-workers, "
          f"{r['replicas']} router replica(s) in proxy mode")
    print(f"  TTFT direct to a worker (nothing added): p50 {r['direct_ttft_p50_ms']:.2f} ms, "
          f"p99 {r['direct_ttft_p99_ms']:.2f} ms")
    print(f"  TTFT through a router:                   p50 {r['routed_ttft_p50_ms']:.2f} ms, "
          f"p99 {r['routed_ttft_p99_ms']:.2f} ms")
    print(f"  added by the proxy, pair by pair:        p50 {r['added_ttft_p50_ms']:.2f} ms, "
          f"p99 {r['added_ttft_p99_ms']:.2f} ms (target p50 <= 2, p99 <= 5)")
    print(f"  the router's own time (X-Kvtier-Router-Ms): p50 {r['router_time_p50_ms']:.2f} ms, "
          f"p99 {r['router_time_p99_ms']:.2f} ms; of which tokenizing {r['tokenize_mean_ms']:.2f} ms and "
          f"deciding {r['decision_mean_ms']:.2f} ms on average")
    rates = ", ".join(f"{x:.0f}" for x in r["requests_per_s_per_replica"])
    print(f"  requests/s at concurrency {r['concurrency']}: per replica {rates}; all replicas "
          f"{r['requests_per_s_all_replicas']:.0f}; straight to the workers {r['direct_requests_per_s']:.0f}")
    print(f"  prompts counted differently by router and engine: {r['tokenizer_mismatches']:.0f}")
