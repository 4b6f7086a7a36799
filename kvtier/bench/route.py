"""`kvtier bench route`: decision latency and throughput of one router process.

State (seeded, through the processor's own apply code): `--workers` workers (64), each
caching `--conversations-per-worker` of `--conversations` 128-page conversations with a
random device prefix, a host continuation and a disk continuation, plus `--noise-pages`
unrelated pages per tier, so the sets are of a realistic size. Each request is one
conversation's tokens (page size 64, 128 pages), so a handful of workers overlap it and
the rest are cold.

Measured, side by side in one run:
  - in-process decisions (`Router.route`, hashing included, booking and releasing as in
    production), sequential: latency p50/p99; then concurrent: decisions/s; Redis time per
    decision (INFO commandstats, each command sent counted once) and Redis process CPU per
    decision (INFO cpu). Twice, taking turns by blocks of requests: reading overlaps from the
    replica's in-memory index (`--state-source index`, the default: the keys without prefix;
    measured only once the index is ready, and decisions that still said `index-not-ready`
    are counted) and walking in Redis (`--state-source redis`: the same keys prefixed `redis_`);
  - the index lookup alone, no Redis: hashing the request + `TierIndex.overlaps` for every
    worker (`lookup_*`), and the walk alone on precomputed hashes (`walk_*`);
  - at scale (`--scale-entries`, 1M (page, tier) entries, HiCache-like shape): the index's
    memory per entry (tracemalloc), and a router's bootstrap from Redis holding that state
    (Router created -> first decision not `index-not-ready`);
  - index lag (`--lag-rate` transitions/s for `--lag-seconds`): a writer process applies
    128-page batches through `TierStateWriter`, a `ModelMirror` here follows the feed; lag =
    entry applied to the index - its stream id's time (milliseconds: ids have ms resolution);
  - `--replicas N` (N > 1): N router processes, each with its own index, deciding
    concurrently against the same Redis: aggregate decisions/s and Redis CPU per decision;
  - the same with the shared-pool query (a real Mooncake master; only where this process
    runs in a private network namespace, see --shared-pool);
  - over HTTP to a `kvtier router` process: decisions/s at `--http-concurrency`, beside the same
    client against a bare aiohttp + msgspec server of the same bodies (`bare_http_per_s`,
    kvtier/testing/bare_http.py), taking turns with it;
  - Dynamo's `RadixTree.find_matches` on the same device pages (ai-dynamo-runtime, optional),
    single-tier and in-process.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import struct
import sys
import time
import tracemalloc
from typing import Any

import msgspec
import redis

from kvtier.bench.settings import RouteBench
from kvtier.harness.embedded import RedisServer
from kvtier.plumbing.connections import redis_async_client
from kvtier.schemas.changes import TierChange
from kvtier.schemas.hashes import block_hashes_of_keys, sglang_page_digests
from kvtier.schemas.routing import ReleaseStage, RouteRequest, decode_route_response
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.worker import MooncakeLayout
from kvtier.testing import clients
from kvtier.testing.samplers import RedisCost
from kvtier.testing.seeded_state import ConversationState, Holdings, lag_writer, scale_holdings, seed_holdings

MODEL = "bench-model"
SCALE_MODEL = "bench-model-1m"
LAG_MODEL = "bench-model-lag"
U64 = 1 << 64
#: Why a decision walked in Redis although its router reads an index (router/index_feed.py).
NOT_READY = "index-not-ready"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {"p50_ms": round(statistics.median(ms), 4), "p99_ms": round(_quantile(ms, 0.99), 4),
            "mean_ms": round(statistics.fmean(ms), 4)}


def _dynamo_find_matches(state: ConversationState, requests: list[int]) -> dict[str, float] | None:
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


async def _wait_index_ready(router, tokens: list[int], model: str = MODEL, timeout_s: float = 120.0) -> int:
    """Decide (unbooked) until a decision reads the model's index, not the walk in Redis; how
    many did not."""
    not_ready = 0
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = await router.route(RouteRequest(model=model, token_ids=tokens, book=False))
        if NOT_READY not in outcome.response.degraded:
            return not_ready
        not_ready += 1
        if time.monotonic() > deadline:
            raise SystemExit(f"model {model}: the router's index was not ready after {timeout_s:.0f}s")
        await asyncio.sleep(0.005)


def _router(client, rng: random.Random, shared_pool=None, source: str = "index"):
    """A router core as a replica builds it, reading overlaps from `source` (index or redis)."""
    from kvtier.router.core import Router, RouterSettings
    from kvtier.router.metrics import RouterMetrics
    from kvtier.router.settings import StateSource

    return Router(client, RouterSettings(shared_cache=shared_pool is not None, state_source=StateSource(source)),
                  RouterMetrics(), shared_pool=shared_pool, rng=rng)


#: The first-token time the bench's requests report at their first-token release (it teaches
#: the worker's rates, as a client's release does).
FIRST_TOKEN_MS = 120.0


async def _decide(router, tokens: list[int], request_id: str) -> tuple[float, bool]:
    """One booked decision, released at once at its first token (with a client TTFT) and at
    completion, a client's whole lifecycle: its latency, and whether it walked in Redis for
    want of an index."""
    start = time.perf_counter()
    outcome = await router.route(RouteRequest(model=MODEL, token_ids=tokens, request_id=request_id))
    took = time.perf_counter() - start
    await router.release(MODEL, outcome.response.request_id, ReleaseStage.FIRST_TOKEN, FIRST_TOKEN_MS)
    await router.release(MODEL, outcome.response.request_id, ReleaseStage.COMPLETE)
    return took, NOT_READY in outcome.response.degraded


async def _in_process(state: ConversationState, redis_url: str, requests: list[int], concurrency: int,
                      shared_pool=None, sources: tuple[str, ...] = ("index",), keep: dict | None = None,
                      block: int = 250) -> dict[str, dict[str, float]]:
    """One in-process router per state source (`RouterSettings.state_source`), each measured on
    the same requests; with several, they take turns by blocks of `block` decisions (the first
    one alternating), so a machine whose load drifts weighs on each alike. Per source: the
    sequential latencies, the Redis time per decision over them, then decisions/s with
    `concurrency` concurrent loops. A router reading an index is measured only once its index
    is ready; decisions that still walked in Redis are counted. `keep`: receives the model's
    index (`"index"`) once measured."""
    client = redis_async_client(redis_url)
    routers = {source: _router(client, random.Random(1), shared_pool, source) for source in sources}
    try:
        results: dict[str, dict[str, float]] = {source: {} for source in sources}
        for source, router in routers.items():
            if router.indexes is not None:
                started = time.perf_counter()
                await _wait_index_ready(router, state.conversations[0])
                results[source]["index_ready_wait_s"] = round(time.perf_counter() - started, 3)
            warm = RouteRequest(model=MODEL, token_ids=state.conversations[0], book=False)
            for _ in range(20):
                await router.route(warm)
        cost = RedisCost(client)
        not_ready = dict.fromkeys(sources, 0)
        numbered = list(enumerate(requests))

        async def turns(size: int, loops: int, tag: str):
            """Every request decided once, in blocks of `size` the sources take in turn, by `loops`
            concurrent loops: per source the latencies, and the Redis time, Redis CPU and seconds spent."""
            took: dict[str, list[float]] = {source: [] for source in sources}
            spent = {source: [0.0, 0.0, 0.0] for source in sources}
            for k, first in enumerate(range(0, len(requests), size)):
                for source in (sources if k % 2 == 0 else sources[::-1]):
                    queue = numbered[first:first + size][::-1]

                    async def client_loop(source=source, queue=queue):
                        while queue:
                            i, conv = queue.pop()
                            latency, walked = await _decide(routers[source], state.conversations[conv],
                                                            f"{source}-{tag}-{i}")
                            took[source].append(latency)
                            not_ready[source] += walked

                    before = await cost.snapshot_async()
                    start = time.perf_counter()
                    await asyncio.gather(*(client_loop() for _ in range(loops)))
                    elapsed = time.perf_counter() - start
                    after = await cost.snapshot_async()
                    for n, value in enumerate((after[0] - before[0], after[1] - before[1], elapsed)):
                        spent[source][n] += value
            return took, spent

        latencies, spent = await turns(block, 1, "seq")
        hashing = []
        for conv in requests[:200]:
            start = time.perf_counter()
            sglang_page_digests(state.conversations[conv], state.page_size)
            hashing.append(time.perf_counter() - start)
        for source in sources:
            out = results[source]
            out.update(_summary(latencies[source]))
            out["hashing_p50_ms"] = round(statistics.median(hashing) * 1000, 4)
            # Redis time per decision (the read, the selection and both releases; with an index,
            # its follower's reads too): what caps one model's decisions per Redis shard.
            out.update(RedisCost.per_decision((spent[source][0], spent[source][1]), len(requests)))
            out["redis_ms_per_decision"] = round(out["redis_cpu_us_per_decision"] / 1000, 4)
        _, concurrent = await turns(max(2 * block, 20 * concurrency), concurrency, "par")
        for source, router in routers.items():
            results[source]["decisions_per_s"] = round(len(requests) / concurrent[source][2])
            # The same with `concurrency` decisions in flight, beside the sequential figure: what
            # Redis pays per decision when a replica is busy.
            results[source]["redis_cpu_us_per_decision_concurrent"] = round(concurrent[source][0] / len(requests), 1)
            if router.indexes is not None:
                results[source]["index_not_ready_decisions"] = not_ready[source]
                model_index = router.indexes.models[ModelKeys.for_model(MODEL).model_token]
                results[source]["index_entries"] = model_index.index.entries
                if keep is not None:
                    keep["index"] = model_index.index
        return results
    finally:
        for router in routers.values():
            await router.close()
        await client.aclose()


def _lookup(state: ConversationState, index, requests: list[int]) -> dict[str, float]:
    """The in-memory read alone, no Redis: the request's tokens hashed (router/hashing.py) and
    every worker's overlap walked in the index; then the walk alone, hashes precomputed."""
    from kvtier.router.hashing import RequestPages

    workers = list(state.holdings)
    lookups, walks = [], []
    for conv in requests[:5] + requests:  # the first few warm up
        tokens = state.conversations[conv]
        start = time.perf_counter()
        pages = RequestPages.of(tokens, state.page_size)
        index.overlaps(pages.hashes, workers)
        lookups.append(time.perf_counter() - start)
    for conv in requests[:5] + requests:
        hashes = RequestPages.of(state.conversations[conv], state.page_size).hashes
        start = time.perf_counter()
        index.overlaps(hashes, workers)
        walks.append(time.perf_counter() - start)
    lookup, walk = _summary(lookups[5:]), _summary(walks[5:])
    return {"lookup_p50_ms": lookup["p50_ms"], "lookup_p99_ms": lookup["p99_ms"],
            "walk_p50_ms": walk["p50_ms"], "walk_p99_ms": walk["p99_ms"]}


def _index_memory(holdings: Holdings) -> dict[str, float]:
    """The index's memory per (page, tier) entry, built the way a bootstrap builds it (page keys
    from the scan decoded, then stored), traced from before the first page int exists."""
    from kvtier.router.tier_index import TierIndex

    blobs = [(worker, tier, struct.pack(f">{len(pages)}q", *pages).hex())
             for worker, by_tier in holdings.items() for tier, pages in by_tier.items()]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        index = TierIndex()
        for worker, tier, blob in blobs:
            index.store(worker, tier, block_hashes_of_keys(blob))
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return {"index_scale_entries": index.entries, "index_scale_pages": len(index._pages),
            "index_bytes_per_entry": round((current - base) / index.entries, 1),
            "index_peak_bytes_per_entry": round((peak - base) / index.entries, 1),
            "index_scale_mib": round((current - base) / 2 ** 20, 1)}


async def _bootstrap(redis_url: str, tokens: list[int]) -> dict[str, float]:
    """A router created on the big state: time to its first decision read from its index."""
    client = redis_async_client(redis_url)
    started = time.perf_counter()
    router = _router(client, random.Random(1))
    try:
        not_ready = await _wait_index_ready(router, tokens, SCALE_MODEL)
        elapsed = time.perf_counter() - started
        assert router.indexes is not None
        health = router.indexes.health()[0]
        return {"bootstrap_s_1m": round(elapsed, 3), "bootstrap_last_s_1m": health.last_bootstrap_seconds,
                "bootstrap_entries_1m": health.entries, "bootstrap_not_ready_decisions": not_ready}
    finally:
        await router.close()
        await client.aclose()


# --- index lag under a write load ----------------------------------------------------------
async def _index_lag(redis_url: str, bench: RouteBench) -> dict[str, object]:

    from kvtier.router.index_feed import ModelIndex

    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=lag_writer, args=(redis_url, LAG_MODEL, bench.lag_rate, bench.lag_seconds, bench.workers,
                                                 bench.request_pages, bench.seed, ready, go, out), daemon=True)
    proc.start()
    client = redis_async_client(redis_url)
    lags_ms: list[float] = []

    def applied(change: TierChange) -> None:
        lags_ms.append(time.time() * 1000 - change.written_ms)

    follower = ModelIndex(client, ModelKeys.for_model(LAG_MODEL).model_token, on_applied=applied)
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise SystemExit("the lag writer did not start")
        follower.start()
        deadline = time.monotonic() + 30
        while not follower.ready:
            if time.monotonic() > deadline:
                raise SystemExit("the lag model's index was not ready after 30s")
            await asyncio.sleep(0.01)
        lags_ms.clear()
        go.set()
        written = await asyncio.to_thread(out.get, True, bench.lag_seconds + 60)
        last = await client.xrevrange(follower.keys.changes, count=1)
        last_id = last[0][0].decode() if last else "0-0"
        deadline = time.monotonic() + 10
        while follower.position != last_id and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        behind = follower.position != last_id
    finally:
        await follower.stop()
        await client.aclose()
        proc.join(10)
    if not lags_ms:
        raise SystemExit("the lag model's index applied no entry")
    return {"index_lag_p50_ms": round(statistics.median(lags_ms), 2),
            "index_lag_p99_ms": round(_quantile(lags_ms, 0.99), 2),
            "index_lag_max_ms": round(max(lags_ms), 2),
            "index_lag_entries": len(lags_ms),
            "index_lag_transitions_per_s": round(written["transitions"] / written["elapsed_s"]),
            "index_lag_target_per_s": bench.lag_rate,
            "index_lag_batches": written["batches"], "index_lag_batches_applied": written["statuses"].get("APPLIED", 0),
            "index_lag_behind_at_end": behind, "index_bootstraps_during_lag": follower.bootstraps - 1}


# --- several router replicas -----------------------------------------------------------------
def _replica(redis_url: str, conversations: list[list[int]], requests: list[int], concurrency: int,
             seconds: float, name: str, ready, go, out) -> None:
    import uvloop

    async def main():
        client = redis_async_client(redis_url)
        router = _router(client, random.Random(name))
        try:
            await _wait_index_ready(router, conversations[0])
            for _ in range(20):
                await router.route(RouteRequest(model=MODEL, token_ids=conversations[0], book=False))
            await asyncio.to_thread(ready.wait)
            await asyncio.to_thread(go.wait)
            done = not_ready = 0
            start = time.perf_counter()
            deadline = start + seconds
            turn = iter(range(1 << 62))

            async def client_loop():
                nonlocal done, not_ready
                while time.perf_counter() < deadline:
                    i = next(turn)
                    not_ready += (await _decide(router, conversations[requests[i % len(requests)]], f"{name}-{i}"))[1]
                    done += 1

            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
            out.put({"done": done, "elapsed_s": time.perf_counter() - start, "not_ready": not_ready})
        finally:
            await router.close()
            await client.aclose()

    uvloop.run(main())


def _replicas(state: ConversationState, redis_url: str, requests: list[int], bench: RouteBench) -> dict[str, object]:
    """`bench.replicas` router processes, each with its own index, deciding concurrently for
    `bench.replica_seconds` against the same Redis."""
    n = bench.replicas
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Barrier(n + 1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(redis_url, state.conversations, requests, bench.concurrency,
                                                bench.replica_seconds, f"r{k}", ready, go, out), daemon=True)
             for k in range(n)]
    for proc in procs:
        proc.start()
    client = redis.Redis.from_url(redis_url)
    try:
        ready.wait(300)  # every replica's index ready
        cost = RedisCost(client)
        before = cost.snapshot()
        go.set()
        results = [out.get(timeout=bench.replica_seconds + 120) for _ in procs]
        after = cost.snapshot()
        done = sum(r["done"] for r in results)
        spent = RedisCost.per_decision((after[0] - before[0], after[1] - before[1]), done)
    finally:
        for proc in procs:
            proc.join(10)
        client.close()
    return {"replicas": n, "replicas_decisions_per_s": round(done / max(r["elapsed_s"] for r in results)),
            "replicas_decisions_per_s_each": [round(r["done"] / r["elapsed_s"]) for r in results],
            **{f"replicas_{k}": v for k, v in spent.items()},
            "replicas_index_not_ready_decisions": sum(r["not_ready"] for r in results)}


def run_route_bench(bench: RouteBench) -> int:
    rng = random.Random(bench.seed)
    state = ConversationState(rng, bench.page_size, bench.request_pages, bench.conversations, bench.workers,
                              bench.conversations_per_worker, bench.noise_pages)
    requests = [rng.randrange(bench.conversations) for _ in range(bench.decisions)]
    results: dict[str, Any] = {
        "workers": bench.workers, "request_pages": bench.request_pages, "page_size": bench.page_size,
        "decisions": bench.decisions,
    }
    import uvloop

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    keep: dict = {}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        entries = state.seed(client, MODEL, rng, MooncakeLayout() if bench.shared_pool else None)
        results["page_tier_entries"] = entries
        say(f"seeded {bench.workers} workers, {entries:,} page-tier entries")
        both = uvloop.run(_in_process(state, server.url, requests, bench.concurrency, sources=("index", "redis"),
                                      keep=keep))
        plain, walked = both["index"], both["redis"]
        results.update(plain)
        say(f"in-process, index: p50 {plain['p50_ms']} ms, p99 {plain['p99_ms']} ms, "
            f"{plain['decisions_per_s']} decisions/s, Redis CPU {plain['redis_cpu_us_per_decision']} us/decision "
            f"(hashing p50 {plain['hashing_p50_ms']} ms; {plain['index_not_ready_decisions']} measured decisions "
            f"not from the index)")
        results.update({f"redis_{k}": v for k, v in walked.items()
                        if k in ("p50_ms", "p99_ms", "mean_ms", "decisions_per_s", "redis_cpu_us_per_decision",
                                 "redis_process_cpu_us_per_decision")})
        say(f"in-process, walk in Redis: p50 {walked['p50_ms']} ms, p99 {walked['p99_ms']} ms, "
            f"{walked['decisions_per_s']} decisions/s, Redis CPU {walked['redis_cpu_us_per_decision']} us/decision")
        results.update(_lookup(state, keep.pop("index"), requests))
        say(f"index lookup (hash + overlaps, {bench.workers} workers): p50 {results['lookup_p50_ms']} ms, "
            f"p99 {results['lookup_p99_ms']} ms; overlaps alone p50 {results['walk_p50_ms']} ms")
        if bench.replicas > 1:
            rep = _replicas(state, server.url, requests, bench)
            results.update(rep)
            say(f"{bench.replicas} router processes: {rep['replicas_decisions_per_s']} decisions/s in all "
                f"{rep['replicas_decisions_per_s_each']}, Redis CPU {rep['replicas_redis_cpu_us_per_decision']} "
                "us/decision")
        if bench.shared_pool:
            shared = _with_shared_pool(state, server.url, requests, bench)
            results.update({f"shared_{k}": v for k, v in shared.items()})
        if not bench.no_http:
            http = _http_rate(state, server.url, requests, bench)
            results.update(http)
        client.close()
    if bench.scale_entries or bench.lag_rate:
        _at_scale(bench, results, say)
    dynamo = _dynamo_find_matches(state, requests)
    if dynamo:
        results.update(dynamo)
        results["p50_vs_dynamo"] = round(results["p50_ms"] / dynamo["dynamo_find_matches_p50_ms"], 2)
        results["lookup_p50_vs_dynamo"] = round(results["lookup_p50_ms"] / dynamo["dynamo_find_matches_p50_ms"], 2)
    else:
        say("Dynamo side-by-side skipped: pip install -e '.[bench-dynamo]'")
    _print_table(results)
    if bench.json:
        print(json.dumps(results))
    return 0


def _at_scale(bench: RouteBench, results: dict, say) -> None:
    """The 1M-entry index (memory, bootstrap) and the lag under writes, on a Redis server of
    their own (the routers above never see these models)."""
    import uvloop

    if bench.scale_entries:
        holdings = scale_holdings(random.Random(bench.seed), bench.workers, bench.scale_entries)
        memory = _index_memory(holdings)
        results.update(memory)
        say(f"index at scale: {memory['index_scale_entries']:,} entries ({memory['index_scale_pages']:,} pages), "
            f"{memory['index_bytes_per_entry']} bytes/entry ({memory['index_scale_mib']} MiB; peak while "
            f"building {memory['index_peak_bytes_per_entry']} bytes/entry)")
    with RedisServer() as server:
        if bench.scale_entries:
            client = redis.Redis.from_url(server.url)
            started = time.perf_counter()
            seed_holdings(client, SCALE_MODEL, holdings, bench.page_size)
            client.close()
            del holdings
            say(f"seeded {SCALE_MODEL} in {time.perf_counter() - started:.1f}s")
            tokens = [random.Random(bench.seed).randrange(1, 150_000)
                      for _ in range(bench.request_pages * bench.page_size)]
            boot = uvloop.run(_bootstrap(server.url, tokens))
            results.update(boot)
            say(f"bootstrap: {boot['bootstrap_entries_1m']:,} entries, first decision from the index "
                f"{boot['bootstrap_s_1m']} s after Router() (the bootstrap itself {boot['bootstrap_last_s_1m']} s)")
        if bench.lag_rate:
            lag = uvloop.run(_index_lag(server.url, bench))
            results.update(lag)
            say(f"index lag at {lag['index_lag_transitions_per_s']:,} transitions/s: p50 {lag['index_lag_p50_ms']} "
                f"ms, p99 {lag['index_lag_p99_ms']} ms, max {lag['index_lag_max_ms']} ms over "
                f"{lag['index_lag_entries']} entries (stream ids: ms resolution)")


def _with_shared_pool(state: ConversationState, redis_url: str, requests: list[int],
                      bench: RouteBench) -> dict[str, float]:
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
                    return (await _in_process(state, redis_url, requests, bench.concurrency,
                                              shared_pool=pool))["index"]
                finally:
                    await pool.close()

            import uvloop

            result = uvloop.run(run())
        finally:
            writer.close()
    print(f"with shared pool: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
          f"{result['decisions_per_s']} decisions/s", file=sys.stderr)
    return {"p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "decisions_per_s": result["decisions_per_s"]}


async def _http_load(base: str, bodies: list[tuple[str, bytes]], concurrency: int) -> tuple[float, list[float]]:
    """Each body POSTed to /v1/route then its id released (/v1/release), by `concurrency`
    clients on one aiohttp session: (seconds, route latencies)."""
    import aiohttp

    queue = bodies[::-1]
    latencies: list[float] = []
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def loop():
            while queue:
                request_id, body = queue.pop()
                t0 = time.perf_counter()
                async with s.post("/v1/route", data=body, headers=clients.JSON_HEADERS) as r:
                    assert r.status == 200, await r.text()
                    answer = await r.read()
                latencies.append(time.perf_counter() - t0)
                owner = decode_route_response(answer).owner
                await clients.release(s, "", MODEL, request_id, owner=owner)  # the session's base URL

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies


def _http_rate(state: ConversationState, redis_url: str, requests: list[int], bench: RouteBench) -> dict[str, float]:
    """Decisions/s through a `kvtier router` process over loopback HTTP (booked, then released),
    and the same client against a bare aiohttp + msgspec server of the same bodies
    (kvtier/testing/bare_http.py): the router's rate as a fraction of what its HTTP stack can
    carry. They take turns (router, bare, bare, router), so a drifting machine weighs on both."""
    import tempfile

    from kvtier.testing.processes import QUIET, start_bare_http, start_router, wait_http, wait_index_ready

    logs = tempfile.mkdtemp(prefix="kvtier-bench-route-")
    proc, router_url = start_router(logs, "router", redis_url, QUIET)
    bare, bare_url = start_bare_http(logs)
    procs = [proc, bare]
    targets = {"router": router_url, "bare": bare_url}
    if bench.http_processes > 1:
        multi, targets["processes"] = start_router(logs, "router-processes", redis_url,
                                                   [*QUIET, "--processes", str(bench.http_processes)])
        procs.append(multi)
    token = ModelKeys.for_model(MODEL).model_token
    try:
        def bodies(tag: str) -> list[tuple[str, bytes]]:
            return [(f"{tag}-{i}", msgspec.json.encode(RouteRequest(model=MODEL, token_ids=state.conversations[c],
                                                                    request_id=f"{tag}-{i}")))
                    for i, c in enumerate(requests)]

        order = [name for name in ("router", "bare", "processes") if name in targets]
        order += order[::-1]  # each in turn, then back: a drifting machine weighs on all alike

        async def rounds():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                await wait_http(session, targets["bare"] + "/healthz", procs, timeout=80, interval=0.05)
                for name in ("router", "processes"):
                    if name in targets:
                        await wait_index_ready(session, targets[name], token, procs)
            spent: dict[str, list] = {name: [0.0, []] for name in targets}
            for k, name in enumerate(order):
                elapsed, latencies = await _http_load(targets[name], bodies(f"h{k}"), bench.http_concurrency)
                spent[name][0] += elapsed
                spent[name][1] += latencies
            return spent

        import uvloop

        spent = uvloop.run(rounds())
        rate = {name: round(len(latencies) / elapsed) for name, (elapsed, latencies) in spent.items()}
        out = _summary(spent["router"][1])
        result = {"http_decisions_per_s": rate["router"], "http_p50_ms": out["p50_ms"], "http_p99_ms": out["p99_ms"],
                  "bare_http_per_s": rate["bare"], "http_vs_bare": round(rate["router"] / rate["bare"], 3)}
        say = f"{rate['router']} decisions/s"
        if "processes" in rate:
            many = _summary(spent["processes"][1])
            result.update({"http_processes": bench.http_processes, "http_processes_decisions_per_s": rate["processes"],
                           "http_processes_p50_ms": many["p50_ms"], "http_processes_p99_ms": many["p99_ms"],
                           "http_processes_vs_one": round(rate["processes"] / rate["router"], 3)})
            say += f", {rate['processes']} with --processes {bench.http_processes}"
        print(f"over HTTP ({bench.http_concurrency} concurrent, route + release each): {say}; a bare aiohttp + "
              f"msgspec server of the same bodies {rate['bare']}/s (one process at {result['http_vs_bare']:.0%} "
              "of it)", file=sys.stderr)
        return result
    finally:
        for p in procs:
            p.stop()


#: The table's rows for the parts that ran: (a key they wrote, label, value), each formatted
#: with the results.
_MORE_ROWS = (
    ("lookup_p50_ms", "index lookup p50 / p99 (ms, hash + overlaps)", "{lookup_p50_ms} / {lookup_p99_ms}"),
    ("lookup_p50_ms", "index overlaps alone p50 / p99 (ms)", "{walk_p50_ms} / {walk_p99_ms}"),
    ("replicas_decisions_per_s", "{replicas} router processes: decisions/s (each)",
     "{replicas_decisions_per_s} {replicas_decisions_per_s_each}"),
    ("replicas_decisions_per_s", "  Redis time / process CPU per decision (us)",
     "{replicas_redis_cpu_us_per_decision} / {replicas_redis_process_cpu_us_per_decision}"),
    ("shared_p50_ms", "with shared pool p50 / p99 (ms)", "{shared_p50_ms} / {shared_p99_ms}"),
    ("shared_p50_ms", "with shared pool decisions/s", "{shared_decisions_per_s}"),
    ("http_decisions_per_s", "over HTTP decisions/s (bare aiohttp + msgspec server)",
     "{http_decisions_per_s} ({bare_http_per_s}/s, {http_vs_bare:.0%})"),
    ("http_processes_decisions_per_s", "over HTTP with --processes {http_processes} decisions/s (x one)",
     "{http_processes_decisions_per_s} ({http_processes_vs_one}x)"),
    ("http_processes_decisions_per_s", "over HTTP p50 / p99 (ms)", "{http_p50_ms} / {http_p99_ms}"),
    ("index_bytes_per_entry", "index bytes per entry (entries)", "{index_bytes_per_entry} ({index_scale_entries:,})"),
    ("bootstrap_s_1m", "bootstrap to first index decision (s, entries)",
     "{bootstrap_s_1m} ({bootstrap_entries_1m:,}; bootstrap {bootstrap_last_s_1m})"),
    ("index_lag_p50_ms", "index lag p50 / p99 (ms) at transitions/s",
     "{index_lag_p50_ms} / {index_lag_p99_ms} at {index_lag_transitions_per_s:,}"),
    ("dynamo_find_matches_p50_ms", "Dynamo find_matches p50 / p99 (ms)",
     "{dynamo_find_matches_p50_ms} / {dynamo_find_matches_p99_ms}"),
)


def _print_table(results: dict) -> None:
    def both(key: str) -> str:
        return f"{results[key]}  |  {results['redis_' + key]}" if "redis_" + key in results else f"{results[key]}"

    rows = [("in-process, state source:", "index  |  redis"),
            ("decision p50 (ms)", both("p50_ms")),
            ("decision p99 (ms)", both("p99_ms")),
            ("decisions/s (concurrent)", both("decisions_per_s")),
            ("Redis time per decision (us, commandstats, incl. both releases)", both("redis_cpu_us_per_decision")),
            ("  the same, with the concurrent loops", both("redis_cpu_us_per_decision_concurrent")),
            ("Redis process CPU per decision (us, INFO cpu)", both("redis_process_cpu_us_per_decision")),
            ("measured decisions not from the index", results.get("index_not_ready_decisions", "-")),
            ("request hashing p50 (ms)", results["hashing_p50_ms"])]
    rows += [(label.format(**results), value.format(**results)) for key, label, value in _MORE_ROWS if key in results]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
