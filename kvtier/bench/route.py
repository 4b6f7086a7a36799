"""`kvtier bench route`: decision latency and throughput of one router process.

State (seeded, through the processor's own apply code): `--workers` workers (64), each
caching `--conversations-per-worker` of `--conversations` 128-page conversations with a
random device prefix, a host continuation and a disk continuation, plus `--noise-pages`
unrelated pages per tier, so the sets are of a realistic size. Each request is one
conversation's tokens (page size 64, 128 pages), so a handful of workers overlap it and
the rest are cold.

Measured, side by side in one run:
  - in-process decisions (`Router.route`, hashing included, booking and releasing as in
    production), sequential: latency p50/p99; then concurrent: decisions/s;
  - the same with the shared-pool query (a real Mooncake master; only where this process
    runs in a private network namespace, see --shared-pool);
  - over HTTP to a `kvtier router` process: decisions/s at `--http-concurrency`;
  - Dynamo's `RadixTree.find_matches` on the same device pages (ai-dynamo-runtime, optional),
    single-tier and in-process.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

import msgspec
import redis

from kvtier.bench import clients
from kvtier.consumers.apply import TierStateWriter
from kvtier.harness.embedded import RedisServer
from kvtier.schemas.events import BridgeCursor, EventBatch, PagesStored, WorkerAnnounce
from kvtier.schemas.hashes import sglang_block_hashes, sglang_page_digests
from kvtier.schemas.routing import ReleaseStage, RouteRequest
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

MODEL = "bench-model"
U64 = 1 << 64


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {"p50_ms": round(statistics.median(ms), 4), "p99_ms": round(_quantile(ms, 0.99), 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


class BenchState:
    def __init__(self, args, rng: random.Random):
        self.args = args
        self.page_size = args.page_size
        self.conversations = [
            [rng.randrange(1, 150_000) for _ in range(args.request_pages * args.page_size)]
            for _ in range(args.conversations)]
        self.hashes = [sglang_block_hashes(tokens, args.page_size) for tokens in self.conversations]
        # worker -> (conversation, device pages, host pages, disk pages)
        self.holdings: dict[str, list[tuple[int, int, int, int]]] = {}
        for w in range(args.workers):
            held = []
            for conv in rng.sample(range(args.conversations), args.conversations_per_worker):
                device = rng.randint(0, args.request_pages)
                host = rng.randint(0, args.request_pages - device)
                disk = rng.randint(0, args.request_pages - device - host)
                held.append((conv, device, host, disk))
            self.holdings[f"worker-{w:03d}"] = held

    def seed(self, client: redis.Redis, rng: random.Random, layout: MooncakeLayout | None) -> int:
        writer = TierStateWriter(client)
        entries = 0
        for worker, held in self.holdings.items():
            meta = WorkerMetadata(worker_id=worker, model=MODEL, page_size=self.page_size, mooncake=layout)
            writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600.0,
                                           cursor=BridgeCursor(epoch=1, seq=0)))
            tiers: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: [], Tier.DISK: []}
            for conv, device, host, disk in held:
                h = self.hashes[conv]
                tiers[Tier.DEVICE] += h[:device]
                tiers[Tier.HOST] += h[device:device + host]
                tiers[Tier.DISK] += h[device + host:device + host + disk]
            for tier in tiers:
                tiers[tier] += [rng.randrange(-(1 << 63), 1 << 63) for _ in range(self.args.noise_pages)]
            events = [PagesStored(tier=t, hashes=pages) for t, pages in tiers.items()]
            entries += sum(len(p) for p in tiers.values())
            writer.apply(EventBatch(worker_id=worker, model=MODEL, epoch=1, seq=1, ts=time.time(),
                                    source_ts=time.time(), events=events))
        return entries


def _dynamo_find_matches(state: BenchState, requests: list[int]) -> dict[str, float] | None:
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        return None
    tree = RadixTree()
    for wid, (_worker, held) in enumerate(state.holdings.items()):
        for n, (conv, device, _host, _disk) in enumerate(held):
            if not device:
                continue
            h = [x % U64 for x in state.hashes[conv][:device]]
            body = {"stored": {"parent_hash": None, "blocks": [{"block_hash": x, "tokens_hash": x} for x in h]}}
            tree.apply_event(wid, json.dumps({"event_id": n, "data": body, "dp_rank": 0}).encode())
    tree.find_matches([1])  # returns once every queued event is applied
    queries = [[x % U64 for x in state.hashes[conv]] for conv in requests]
    latencies = []
    for q in queries:
        start = time.perf_counter()
        tree.find_matches(q)
        latencies.append(time.perf_counter() - start)
    out = _summary(latencies)
    return {"dynamo_find_matches_p50_ms": out["p50_ms"], "dynamo_find_matches_p99_ms": out["p99_ms"]}


async def _in_process(state: BenchState, redis_url: str, requests: list[int], concurrency: int,
                      shared_pool=None) -> dict[str, float]:
    import redis.asyncio

    from kvtier.router.core import Router, RouterSettings
    from kvtier.router.metrics import RouterMetrics

    client = redis.asyncio.Redis.from_url(redis_url)
    router = Router(client, RouterSettings(shared_cache=shared_pool is not None), RouterMetrics(),
                    shared_pool=shared_pool, rng=random.Random(1))
    try:
        warm = RouteRequest(model=MODEL, token_ids=state.conversations[0], book=False)
        for _ in range(20):
            await router.route(warm)
        hashing, latencies = [], []
        await client.config_resetstat()
        for i, conv in enumerate(requests):
            tokens = state.conversations[conv]
            start = time.perf_counter()
            outcome = await router.route(RouteRequest(model=MODEL, token_ids=tokens, request_id=f"seq-{i}"))
            latencies.append(time.perf_counter() - start)
            await router.release(MODEL, outcome.response.request_id, ReleaseStage.COMPLETE)
            if i < 200:
                start = time.perf_counter()
                sglang_page_digests(tokens, state.page_size)
                hashing.append(time.perf_counter() - start)
        result = _summary(latencies)
        result["hashing_p50_ms"] = round(statistics.median(hashing) * 1000, 4)
        # Redis CPU per decision (the walk, the selection and the release), from the server's
        # own accounting: what caps one model's decisions per Redis shard.
        stats = await client.info("commandstats")
        result["redis_ms_per_decision"] = round(
            sum(v["usec"] for k, v in stats.items() if k.startswith("cmdstat_")) / len(requests) / 1000, 4)

        queue = list(enumerate(requests))
        done = 0

        async def client_loop():
            nonlocal done
            while queue:
                i, conv = queue.pop()
                outcome = await router.route(RouteRequest(model=MODEL, token_ids=state.conversations[conv],
                                                          request_id=f"par-{i}"))
                await router.release(MODEL, outcome.response.request_id, ReleaseStage.COMPLETE)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        result["decisions_per_s"] = round(done / (time.perf_counter() - start))
        return result
    finally:
        await client.aclose()


def run_route_bench(args) -> int:
    rng = random.Random(args.seed)
    state = BenchState(args, rng)
    requests = [rng.randrange(args.conversations) for _ in range(args.decisions)]
    results: dict[str, object] = {
        "workers": args.workers, "request_pages": args.request_pages, "page_size": args.page_size,
        "decisions": args.decisions,
    }
    import uvloop

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        entries = state.seed(client, rng, MooncakeLayout() if args.shared_pool else None)
        results["page_tier_entries"] = entries
        print(f"seeded {args.workers} workers, {entries:,} page-tier entries", file=sys.stderr)
        plain = uvloop.run(_in_process(state, server.url, requests, args.concurrency))
        results.update(plain)
        print(f"in-process: p50 {plain['p50_ms']} ms, p99 {plain['p99_ms']} ms, "
              f"{plain['decisions_per_s']} decisions/s (hashing p50 {plain['hashing_p50_ms']} ms)", file=sys.stderr)
        if args.shared_pool:
            shared = _with_shared_pool(state, server.url, requests, args)
            results.update({f"shared_{k}": v for k, v in shared.items()})
        http = _http_rate(state, server.url, requests, args)
        results.update(http)
        client.close()
    dynamo = _dynamo_find_matches(state, requests)
    if dynamo:
        results.update(dynamo)
        results["p50_vs_dynamo"] = round(results["p50_ms"] / dynamo["dynamo_find_matches_p50_ms"], 2)
    else:
        print("Dynamo side-by-side skipped: pip install -e '.[bench-dynamo]'", file=sys.stderr)
    _print_table(results)
    if args.json:
        print(json.dumps(results))
    return 0


def _with_shared_pool(state: BenchState, redis_url: str, requests: list[int], args) -> dict[str, float]:
    from kvtier.harness.mooncake import MooncakeMaster, SharedPoolWriter, in_private_netns

    if not in_private_netns():
        raise SystemExit("kvtier bench route --shared-pool runs a Mooncake master, whose metadata server "
                         "binds 0.0.0.0: run it in a private network namespace, e.g.\n"
                         "  unshare -n sh -c 'ip link set lo up && kvtier bench route --shared-pool'")
    from kvtier.router.shared_pool import SharedPoolClient
    from kvtier.schemas.mooncake import mooncake_object_keys

    with MooncakeMaster() as master:
        writer = SharedPoolWriter(master.rpc_address, master.metadata_url)
        try:
            layout = MooncakeLayout()
            # half the conversations have their first half in the shared pool
            for conv in range(0, len(state.conversations), 2):
                digests = sglang_page_digests(state.conversations[conv], state.page_size)
                keys = [k for d in digests[: len(digests) // 2] for k in mooncake_object_keys(d, layout)]
                writer.put_many(keys, b"x" * 64)

            async def run():
                pool = SharedPoolClient(master.http_url, timeout_s=0.5)
                try:
                    return await _in_process(state, redis_url, requests, args.concurrency, shared_pool=pool)
                finally:
                    await pool.close()

            import uvloop

            result = uvloop.run(run())
        finally:
            writer.close()
    print(f"with shared pool: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
          f"{result['decisions_per_s']} decisions/s", file=sys.stderr)
    return {"p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "decisions_per_s": result["decisions_per_s"]}


def _http_rate(state: BenchState, redis_url: str, requests: list[int], args) -> dict[str, float]:
    """Decisions/s through a `kvtier router` process over loopback HTTP (booked, then released)."""
    import tempfile
    import urllib.request

    from kvtier.bench.processes import KvtierSubprocess
    from kvtier.harness.embedded import free_port

    port = free_port()
    proc = KvtierSubprocess(["router", "--redis", redis_url, "--http-port", str(port), "--log-level", "WARNING"],
                            tempfile.mkdtemp(prefix="kvtier-bench-route-"), "router")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=1).read()
                break
            except OSError:
                if proc.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"router did not start: {proc.tail()}") from None
                time.sleep(0.1)

        async def load():
            import aiohttp

            bodies = [msgspec.json.encode(RouteRequest(model=MODEL, token_ids=state.conversations[c],
                                                       request_id=f"h-{i}"))
                      for i, c in enumerate(requests)]
            queue = list(enumerate(bodies))
            latencies: list[float] = []
            async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=args.http_concurrency)) as s:
                async def loop():
                    while queue:
                        i, body = queue.pop()
                        t0 = time.perf_counter()
                        async with s.post("/v1/route", data=body, headers=clients.JSON_HEADERS) as r:
                            assert r.status == 200, await r.text()
                            await r.read()
                        latencies.append(time.perf_counter() - t0)
                        await clients.release(s, "", MODEL, f"h-{i}")  # the session's base URL

                start = time.perf_counter()
                await asyncio.gather(*(loop() for _ in range(args.http_concurrency)))
                elapsed = time.perf_counter() - start
            out = _summary(latencies)
            return {"http_decisions_per_s": round(len(latencies) / elapsed),
                    "http_p50_ms": out["p50_ms"], "http_p99_ms": out["p99_ms"]}

        import uvloop

        result = uvloop.run(load())
        print(f"over HTTP ({args.http_concurrency} concurrent): {result['http_decisions_per_s']} decisions/s "
              "(route + release each)", file=sys.stderr)
        return result
    finally:
        proc.stop()


def _print_table(results: dict) -> None:
    rows = [("decision p50 / p99 (ms)", f"{results['p50_ms']} / {results['p99_ms']}"),
            ("decisions/s (in-process, concurrent)", results["decisions_per_s"]),
            ("request hashing p50 (ms)", results["hashing_p50_ms"]),
            ("Redis CPU per decision (ms, incl. release)", results["redis_ms_per_decision"])]
    if "shared_p50_ms" in results:
        rows.append(("with shared pool p50 / p99 (ms)", f"{results['shared_p50_ms']} / {results['shared_p99_ms']}"))
        rows.append(("with shared pool decisions/s", results["shared_decisions_per_s"]))
    if "http_decisions_per_s" in results:
        rows.append(("over HTTP decisions/s", results["http_decisions_per_s"]))
        rows.append(("over HTTP p50 / p99 (ms)", f"{results['http_p50_ms']} / {results['http_p99_ms']}"))
    if "dynamo_find_matches_p50_ms" in results:
        rows.append(("Dynamo find_matches p50 / p99 (ms)",
                     f"{results['dynamo_find_matches_p50_ms']} / {results['dynamo_find_matches_p99_ms']}"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
