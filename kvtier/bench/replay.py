"""`kvtier bench replay`: a Mooncake-format trace replayed on a simulated HiCache cluster,
through the real pipeline and router, once per routing policy, side by side.

Per policy: a fresh `kvtier sim-worker` process (N ranks, same pool sizes for every policy,
a shared L3 pool among its ranks), and for the policies that route through kvtier a
`kvtier bridge --dp-size N` and two `kvtier router` replicas; one nats-server, one Redis and
one `kvtier processor` serve all policies (each policy is its own model name, so states and
bookings never mix). Requests are sent at their trace times divided by `--time-scale`; the
simulated clock is the trace's, so TTFTs are in trace seconds. Bookings are released when
the simulated request would reach its first token and its end.

The trace format is the Mooncake FAST'25 one: one JSON object per line with `timestamp`
(ms), `input_length`, `output_length`, `hash_ids` (512-token blocks, equal ids = equal
prefix). Token ids are derived deterministically from each hash id, so prefix sharing is
kept; the request is cut to `input_length`.
"""

from __future__ import annotations

import array
import asyncio
import gzip
import hashlib
import json
import pathlib
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from kvtier.bench.processes import KvtierSubprocess, wait_http

TRACE_BLOCK_TOKENS = 512
POLICIES = ("random", "round_robin", "least_load", "device_only", "tier_aware", "tier_aware_shared")
ROUTED = {"least_load", "device_only", "tier_aware", "tier_aware_shared"}
DEVICE_ONLY = {"host_cache_hit_weight": 0.0, "disk_cache_hit_weight": 0.0, "shared_cache_multiplier": 0.0}


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


#: Traces shipped inside the package (kvtier/data/README.md says where they come from).
DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "data"
#: The whole public Mooncake conversation trace (12,031 requests), gzipped.
CONVERSATION_TRACE = DATA_DIR / "mooncake_conversation_trace.jsonl.gz"
#: Its first 1,000 requests.
SAMPLE_TRACE = DATA_DIR / "mooncake_trace_sample.jsonl"


def load_trace(path: str | pathlib.Path, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake-format JSONL trace (plain, or gzipped when the name ends in .gz)."""
    decoder = msgspec.json.Decoder(TraceRequest)
    requests = []
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        f = opener(path, "rb")
    except FileNotFoundError:
        raise ValueError(f"trace file {path} not found (traces shipped with kvtier: {CONVERSATION_TRACE.name} "
                         f"and {SAMPLE_TRACE.name} in {DATA_DIR})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


_block_cache: dict[int, array.array] = {}


def block_tokens(hash_id: int) -> array.array:
    """512 token ids (< 65536) for one trace block, the same for the same id, every run."""
    block = _block_cache.get(hash_id)
    if block is None:
        block = array.array("H", hashlib.shake_128(hash_id.to_bytes(8, "little", signed=True)).digest(1024))
        if len(_block_cache) < 400_000:
            _block_cache[hash_id] = block
    return block


def trace_tokens(request: TraceRequest) -> list[int]:
    tokens = array.array("H")
    for hash_id in request.hash_ids:
        tokens.extend(block_tokens(hash_id))
    return tokens[: request.input_length].tolist()


def infinite_cache_bound(requests: list[TraceRequest], page_size: int) -> int:
    """Prefill tokens recomputed by one worker with unlimited memory: each request reuses its
    longest previously seen page prefix; nothing any policy does can recompute less."""
    from kvtier.schemas.hashes import sglang_page_digests

    seen: set[bytes] = set()
    recomputed = 0
    for request in requests:
        tokens = trace_tokens(request)
        digests = sglang_page_digests(tokens, page_size)
        hit = 0
        while hit < len(digests) and digests[hit] in seen:
            hit += 1
        seen.update(digests)
        recomputed += len(tokens) - hit * page_size
    return recomputed


@dataclass
class ClusterShape:
    workers: int = 4
    page_size: int = 64
    device_pages: int = 4096
    host_pages: int = 16384
    write_policy: str = "write_through"
    l3: bool = True
    l3_pages: int | None = None  # None: as many as the workers' host pools together
    decode_s_per_token: float = 0.02
    prefill_us_per_token: float = 25.0


@dataclass
class PolicyResult:
    policy: str
    requests: int = 0
    recomputed_tokens: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict = field(default_factory=lambda: {"device": 0, "host": 0, "l3": 0})
    ttft_s: list = field(default_factory=list)
    per_worker: dict = field(default_factory=dict)
    route_s: list = field(default_factory=list)
    wall_s: float = 0.0
    degraded: int = 0

    def summary(self, bound: int) -> dict:
        ttft = sorted(self.ttft_s) or [0.0]
        counts = list(self.per_worker.values()) or [0]
        mean = statistics.fmean(counts) if counts else 0
        return {
            "requests": self.requests,
            "recomputed_tokens": self.recomputed_tokens,
            "ratio_to_bound": round(self.recomputed_tokens / bound, 4) if bound else None,
            "hit_tokens": self.hit_tokens,
            "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
            "ttft_p99_ms": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1000, 1),
            "imbalance": round(max(counts) / mean, 3) if mean else None,
            "decisions_per_s": round(self.requests / self.wall_s, 1) if self.wall_s else None,
            "route_p50_ms": round(statistics.median(self.route_s) * 1000, 3) if self.route_s else None,
            "degraded_decisions": self.degraded,
        }


async def run_policy(policy: str, requests: list[TraceRequest], shape: ClusterShape, time_scale: float,
                     nats_url: str, redis_url: str, log_dir: str, seed: int,
                     progress: Callable[[str, int, int], None] | None = None) -> PolicyResult:
    import aiohttp
    import redis as redis_sync

    from kvtier.embedded import free_port
    from kvtier.producers.sim_worker import free_port_block
    from kvtier.schemas.state_keys import ModelKeys

    model = f"replay-{policy}"
    zmq_base = free_port_block(shape.workers)
    replay_base = free_port_block(shape.workers)
    sim_http = free_port()
    procs: list[KvtierSubprocess] = []
    result = PolicyResult(policy)
    rng = random.Random(seed)
    try:
        sim_args = ["sim-worker", "--ranks", str(shape.workers), "--port", str(zmq_base), "--replay-port",
                    str(replay_base), "--http-port", str(sim_http), "--page-size", str(shape.page_size),
                    "--device-pages", str(shape.device_pages), "--host-pages", str(shape.host_pages),
                    "--write-policy", shape.write_policy, "--prefill-us-per-token", str(shape.prefill_us_per_token),
                    "--log-level", "WARNING"]
        if shape.l3:
            sim_args += ["--l3", "--l3-pages", str(shape.l3_pages or shape.workers * shape.host_pages)]
        procs.append(KvtierSubprocess(sim_args, log_dir, f"{policy}-sim-worker"))
        sim_url = f"http://127.0.0.1:{sim_http}"
        routers: list[str] = []
        if policy in ROUTED:
            procs.append(KvtierSubprocess(["bridge", "--endpoint", f"tcp://127.0.0.1:{zmq_base}", "--replay-endpoint",
                                f"tcp://127.0.0.1:{replay_base}", "--worker-id", "sim", "--model", model,
                                "--page-size", str(shape.page_size), "--dp-size", str(shape.workers), "--nats",
                                nats_url, "--hicache-storage-backend", "mooncake", "--heartbeat", "1",
                                "--log-level", "WARNING"], log_dir, f"{policy}-bridge"))
            router_args = ["--redis", redis_url, "--nats", nats_url, "--log-level", "WARNING"]
            if policy == "least_load":
                router_args += ["--router-mode", "load"]
            if policy == "tier_aware_shared":
                router_args += ["--shared-cache-type", "hicache", "--mooncake-master", sim_url,
                                "--shared-cache-timeout-ms", "200"]
            for r in range(2):
                port = free_port()
                procs.append(KvtierSubprocess(["router", "--http-port", str(port), "--router-id", f"{policy}-{r}", *router_args],
                                   log_dir, f"{policy}-router{r}"))
                routers.append(f"http://127.0.0.1:{port}")
        # An overloaded machine makes requests late, not wrong (the simulated clock is the
        # trace's), so waits are generous rather than failures.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=300, sock_read=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as session:
            await wait_http(session, sim_url + "/healthz", procs)
            for url in routers:
                await wait_http(session, url + "/healthz", procs)
            if routers:
                client = redis_sync.Redis.from_url(redis_url)
                leases = ModelKeys.for_model(model).leases
                deadline = time.monotonic() + 30
                while client.zcard(leases) < shape.workers:
                    for p in procs:
                        p.check()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{policy}: workers did not announce within 30s")
                    await asyncio.sleep(0.1)
                client.close()
            await _replay(policy, requests, shape, time_scale, session, sim_url, routers, rng, result, progress)
    finally:
        for p in reversed(procs):
            p.stop()
    return result


async def _replay(policy, requests, shape, time_scale, session, sim_url, routers, rng, result, progress):
    t0 = requests[0].timestamp / 1000.0
    loop = asyncio.get_running_loop()
    wall0 = loop.time()
    done = 0
    pending: set[asyncio.Task] = set()
    stop_ticker = asyncio.Event()

    def sim_now() -> float:
        return t0 + (loop.time() - wall0) * time_scale

    async def ticker():
        # device->host copies complete in simulated time even while no request arrives
        while not stop_ticker.is_set():
            try:
                async with session.post(sim_url + "/advance", json={"now": sim_now()}) as r:
                    await r.read()
            except Exception:  # noqa: BLE001 - best effort; the next request advances too
                pass
            await asyncio.sleep(0.02)

    async def release_later(router: str, request_id: str, stage: str, delay_sim_s: float):
        await asyncio.sleep(delay_sim_s / time_scale)
        try:
            async with session.post(router + "/v1/release", json={"model": f"replay-{policy}", "request_id": request_id,
                                                                   "stage": stage}) as r:
                await r.read()
        except Exception:  # noqa: BLE001 - a lost release expires with its booking
            pass

    async def one(index: int, request: TraceRequest, arrival: float):
        nonlocal done
        tokens = trace_tokens(request)
        started = time.perf_counter()
        router = None
        request_id = f"req-{index}"
        if policy == "random":
            rank = rng.randrange(shape.workers)
        elif policy == "round_robin":
            rank = index % shape.workers
        else:
            router = routers[index % len(routers)]
            body = {"model": f"replay-{policy}", "token_ids": tokens, "request_id": request_id,
                    "max_new_tokens": request.output_length}
            if policy == "device_only":
                body["overrides"] = DEVICE_ONLY
            async with session.post(router + "/v1/route", json=body) as r:
                decision = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"{policy}: route failed ({r.status}): {decision}")
            if decision.get("degraded"):
                result.degraded += 1
            rank = int(decision["worker_id"].rsplit("-dp", 1)[1])
        result.route_s.append(time.perf_counter() - started)
        async with session.post(f"{sim_url}/w/{rank}/generate", json={"input_ids": tokens, "now": arrival}) as r:
            served = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{policy}: sim-worker refused a request ({r.status}): {served}")
        meta = served["meta_info"]
        result.requests += 1
        result.prompt_tokens += meta["prompt_tokens"]
        result.recomputed_tokens += meta["recomputed_tokens"]
        for tier in ("device", "host", "l3"):
            result.hit_tokens[tier] += meta["cached_tokens_details"][tier]
        result.ttft_s.append(meta["ttft_s"])
        result.per_worker[rank] = result.per_worker.get(rank, 0) + 1
        if router is not None:
            ttft = meta["ttft_s"]
            pending.add(asyncio.ensure_future(release_later(router, request_id, "first_token", ttft)))
            pending.add(asyncio.ensure_future(release_later(
                router, request_id, "complete", ttft + request.output_length * shape.decode_s_per_token)))
        done += 1
        if progress:
            progress(policy, done, len(requests))

    for p in range(shape.workers):
        result.per_worker[p] = 0
    tick = asyncio.ensure_future(ticker())
    tasks = []
    for index, request in enumerate(requests):
        arrival = request.timestamp / 1000.0
        delay = (arrival - t0) / time_scale - (loop.time() - wall0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index, request, arrival)))
    await asyncio.gather(*tasks)
    result.wall_s = loop.time() - wall0
    stop_ticker.set()
    await tick
    for task in pending:
        task.cancel()


def format_table(results: dict, bound: int) -> str:
    header = (f"{'policy':<18} {'recomputed tok':>15} {'x bound':>8} {'device hit':>11} {'host hit':>10} "
              f"{'L3 hit':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'imbal.':>7} {'dec/s':>7}")
    lines = [header, "-" * len(header)]
    for name, r in results.items():
        h = r["hit_tokens"]
        lines.append(f"{name:<18} {r['recomputed_tokens']:>15,} {r['ratio_to_bound']:>8.3f} {h['device']:>11,} "
                     f"{h['host']:>10,} {h['l3']:>9,} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
                     f"{r['imbalance']:>7.2f} {r['decisions_per_s']:>7.1f}")
    lines.append(f"{'infinite cache':<18} {bound:>15,} {1.0:>8.3f}")
    return "\n".join(lines)


def write_plot(results: dict, bound: int, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.bar(names, [results[n]["recomputed_tokens"] / 1e6 for n in names], color="#4C72B0")
    left.axhline(bound / 1e6, color="#C44E52", linestyle="--", label="infinite-cache bound")
    left.set_ylabel("recomputed prefill tokens (millions)")
    left.legend()
    right.bar(names, [results[n]["ttft_p50_ms"] for n in names], color="#55A868", label="p50")
    right.bar(names, [results[n]["ttft_p99_ms"] - results[n]["ttft_p50_ms"] for n in names],
              bottom=[results[n]["ttft_p50_ms"] for n in names], color="#8172B2", alpha=0.6, label="p99")
    right.set_ylabel("simulated TTFT (ms)")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle("kvtier: routing policies on a simulated HiCache cluster (Mooncake conversation trace)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def replay_all(requests, shape, time_scale, policies, nats_url, redis_url, log_dir, seed, progress=None):
    results = {}
    for policy in policies:
        result = await run_policy(policy, requests, shape, time_scale, nats_url, redis_url, log_dir, seed, progress)
        results[policy] = result
    return results


def run_stack_and_replay(requests, shape, time_scale, policies, seed, progress=None, log_dir=None):
    """Embedded nats-server + Redis + one processor, then every policy in turn."""
    import tempfile

    from kvtier.embedded import NatsServer, RedisServer

    log_dir = log_dir or tempfile.mkdtemp(prefix="kvtier-replay-")
    with NatsServer() as nats_server, RedisServer() as redis_server:
        processor = KvtierSubprocess(["processor", "--nats", nats_server.url, "--redis", redis_server.url, "--partitions",
                           "auto", "--log-level", "WARNING"], log_dir, "processor")
        try:
            import uvloop

            return uvloop.run(replay_all(requests, shape, time_scale, policies, nats_server.url,
                                         redis_server.url, log_dir, seed, progress)), log_dir
        finally:
            processor.stop()


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


def run_replay_bench(args) -> int:
    trace = args.trace or str(CONVERSATION_TRACE)
    requests = load_trace(trace, args.requests)
    shape = ClusterShape(workers=args.workers, page_size=args.page_size, device_pages=args.device_pages,
                         host_pages=args.host_pages, write_policy=args.write_policy, l3=not args.no_l3,
                         l3_pages=args.l3_pages)
    span = (requests[-1].timestamp - requests[0].timestamp) / 1000
    policies = args.policies.split(",") if args.policies else list(POLICIES)
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    print(f"{len(requests)} requests over {span:.0f}s of trace time, x{args.time_scale} -> ~{span / args.time_scale:.0f}s "
          f"per policy; {shape.workers} workers, page size {shape.page_size}, device {shape.device_pages} / host "
          f"{shape.host_pages} pages each", file=sys.stderr)
    bound = infinite_cache_bound(requests, shape.page_size)
    results, log_dir = run_stack_and_replay(requests, shape, args.time_scale, policies, args.seed, progress_bar())
    summary = {name: r.summary(bound) for name, r in results.items()}
    print(format_table(summary, bound))
    report = {"trace": trace, "requests": len(requests), "bound_tokens": bound,
              "cluster": shape.__dict__, "time_scale": args.time_scale, "policies": summary}
    if args.json:
        print(json.dumps(report))
    return 0
