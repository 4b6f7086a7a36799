"""What kvtier bench peers sends and reads on its cluster: a trace's requests as text prompts
(`TracePrompts`), sent streamed by one client at their times (`paced`, each a `Sent`) through a
front door (`front_door`: the workers, a bare relay, smg, kvtier's routers; `measure`), and the
sim-workers' caches flushed, their L3 pool too if asked (`flush_and_settle`), and their reuse
counted (`served`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sent:
    ttft_s: float
    tpot_s: float | None
    ok: bool


class TracePrompts:
    """Text prompts for a trace's requests: each hash block its own seeded prose of
    `block_tokens` tokens, the blocks of a request joined by blank lines."""

    def __init__(self, tokenizer_folder: str, block_tokens: int, max_blocks: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(tokenizer_folder, "tokenizer.json"))
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self._blocks: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        from kvtier.testing.prose import Prose

        text = self._blocks.get(hash_id)
        if text is None:
            text = self._blocks[hash_id] = Prose(random.Random(hash_id), self.tokenizer).text(self.block_tokens)
        return text

    def prompt(self, hash_ids: list[int]) -> str:
        return "\n\n".join(self.block(h) for h in hash_ids[:self.max_blocks])


async def send_one(session, url: str, body: dict[str, Any]) -> Sent:
    started = time.perf_counter()
    first = last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as reply:
            if reply.status != 200:
                await reply.read()
                return Sent(time.perf_counter() - started, None, False)
            async for chunk in reply.content.iter_any():
                if chunk:
                    last = time.perf_counter()
                    first = first or last
    except Exception:  # noqa: BLE001 - a refused or broken answer is counted, not raised
        return Sent(time.perf_counter() - started, None, False)
    if first is None or last is None:
        return Sent(time.perf_counter() - started, None, False)
    tokens = body["max_tokens"]
    return Sent(first - started, (last - first) / (tokens - 1) if tokens > 1 else None, True)


async def paced(targets: list[str], requests: list[tuple[float, dict[str, Any]]]) -> tuple[list[Sent], float]:
    """Every request at its time (seconds from the start) to targets[i % len(targets)]."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def one(i: int, at: float, body: dict[str, Any]) -> Sent:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send_one(session, targets[i % len(targets)], body)

        sent = await asyncio.gather(*(one(i, at, body) for i, (at, body) in enumerate(requests)))
        return list(sent), time.perf_counter() - start


def sim_health(sim_bases: list[str]):
    import urllib.request

    import msgspec

    from kvtier.schemas.sim import SimHealth

    replies = []
    for base in sim_bases:
        with urllib.request.urlopen(base + "/healthz", timeout=10) as reply:
            replies.append(msgspec.json.decode(reply.read(), type=SimHealth))
    return replies


def flush_and_settle(sim_bases: list[str], settle_s: float, storage: bool = False) -> None:
    """Every worker's cache emptied and its counters zeroed; then `settle_s` for the engines'
    paced work to end and the cleared events to reach kvtier's state. `storage`: their L3 pool
    emptied too (`/flush_cache?storage=1`; a shared Mooncake pool is emptied by each worker in
    turn, so each one's count of pages written restarts at 0)."""
    import urllib.request

    path = "/flush_cache?storage=1" if storage else "/flush_cache"
    for base in sim_bases:
        urllib.request.urlopen(urllib.request.Request(base + path, method="POST"), timeout=10).read()
    time.sleep(settle_s)


def served(sim_bases: list[str]) -> dict[str, int]:
    totals = {"prompt": 0, "device": 0, "host": 0, "l3": 0}
    for health in sim_health(sim_bases):
        for key in totals:
            totals[key] += getattr(health.served, key)
    return totals


@dataclass
class DoorResult:
    """One front door's run: what each request got, the door's own CPU seconds and RSS (None
    for `direct`), and the prompt tokens the workers served and found cached by tier."""

    door: str
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    rss_mb: float | None = None
    served: dict[str, int] = field(default_factory=dict)
    note: str = ""


@contextlib.contextmanager
def front_door(door: str, workers: list[str], routers: dict[str, tuple[list[str], list]],
               work: str) -> Iterator[tuple[list[str], list[int | None]]]:
    """The URLs a client sends `door`'s requests to, and the PIDs of the processes that are the
    door: `direct` (the `workers` themselves, in turn), `bare-relay` and `smg-<policy>` (started
    here, stopped on the way out), or one of kvtier's already running `routers` (door -> their
    URLs and processes). Raises SmgMissing when smg is not installed."""
    from kvtier.testing.peers import start_smg, wait_smg
    from kvtier.testing.processes import start_bare_http
    from kvtier.testing.proxy_stack import wait_routers_up

    gateway = None
    try:
        if door == "direct":
            yield list(workers), []
        elif door == "bare-relay":
            gateway, url = start_bare_http(work, workers)
            asyncio.run(wait_routers_up([url], [gateway]))
            yield [url], [gateway.live_pid]
        elif door.startswith("smg-"):
            gateway, url = start_smg(work, door, workers, door[len("smg-"):])
            wait_smg(url, len(workers), gateway)
            yield [url], [gateway.live_pid]
        else:
            urls, procs = routers[door]
            yield list(urls), [p.live_pid for p in procs]
    finally:
        if gateway is not None:
            gateway.stop()


def measure(door: str, targets: list[str], pids: list[int | None], requests: list[tuple[float, dict[str, Any]]],
            sim_bases: list[str]) -> DoorResult:
    """`requests` sent through a door (on workers flushed before), with the door's CPU and RSS
    read by PID and the workers' reuse counted after."""
    from kvtier.testing.processes import rss_mb
    from kvtier.testing.samplers import cpu_seconds

    result = DoorResult(door)
    before = [cpu_seconds(pid) for pid in pids]
    result.sent, result.wall_s = asyncio.run(paced(targets, requests))
    after = [cpu_seconds(pid) for pid in pids]
    spent = [a - b for a, b in zip(after, before) if a is not None and b is not None]
    if pids and len(spent) == len(pids):
        result.cpu_s = sum(spent)
        result.rss_mb = sum(rss_mb(pid) or 0.0 for pid in pids if pid is not None)
    result.served = served(sim_bases)
    return result


#: A ramp's steps at most (the last at 2**(n-1) times the requests' own pace).
RAMP_STEPS = 7


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(result: DoorResult, floor_p50: float | None) -> dict[str, Any]:
    """A door's figures: TTFT p50/p99 and TPOT p99 (ms), the share of prompt tokens reused by
    tier, CPU ms per request; `floor_p50`: direct's TTFT p50, for the ratio to it."""
    ok = [s for s in result.sent if s.ok]
    ttfts = [s.ttft_s * 1000 for s in ok]
    tpots = [s.tpot_s * 1000 for s in ok if s.tpot_s is not None]
    served = result.served
    prompt = served.get("prompt", 0)
    p50 = statistics.median(ttfts) if ttfts else None
    return {
        "front_door": result.door, "requests": len(result.sent), "served": len(ok),
        "ttft_p50_ms": p50, "ttft_p99_ms": pct(ttfts, 0.99), "tpot_p99_ms": pct(tpots, 0.99),
        "ttft_p50_vs_direct": p50 / floor_p50 if p50 and floor_p50 else None,
        "reused_share": {tier: served.get(tier, 0) / prompt if prompt else None for tier in ("device", "host", "l3")},
        "prompt_tokens": prompt,
        "cpu_ms_per_request": result.cpu_s * 1000 / len(result.sent) if result.cpu_s is not None and result.sent
        else None,
        "rss_mb": result.rss_mb, "wall_s": result.wall_s, "note": result.note,
    }


class PeerCluster:
    """A proxy stack (kvtier/testing/proxy_stack.py) and kvtier's doors on it (door -> the
    replicas' URLs and processes): each door run on the flushed workers, or ramped. `l3`: the
    workers share an L3 pool, emptied too before each run."""

    def __init__(self, stack, routers: dict[str, tuple[list[str], list]], work: str, settle_s: float, l3: bool):
        self.stack, self.routers, self.work, self.settle_s, self.l3 = stack, routers, work, settle_s, l3
        self.sim_bases = [url.rsplit("/w/", 1)[0] for url in stack.workers]

    def run(self, door: str, requests: list[tuple[float, dict[str, Any]]]) -> DoorResult:
        from kvtier.testing.peers import SmgMissing

        flush_and_settle(self.sim_bases, self.settle_s, storage=self.l3)
        try:
            with front_door(door, self.stack.workers, self.routers, self.work) as (targets, pids):
                return measure(door, targets, pids, requests, self.sim_bases)
        except SmgMissing as exc:
            return DoorResult(door, note=str(exc))

    def ramp(self, door: str, requests: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
        """Steps of `requests` at 1, 2, 4, ... times their pace, until TTFT p99 passes twice the
        first step's or a request fails: each step's figures, the highest rate held."""
        from kvtier.testing.peers import SmgMissing

        steps: list[dict[str, Any]] = []
        try:
            with front_door(door, self.stack.workers, self.routers, self.work) as (targets, pids):
                for k in range(RAMP_STEPS):
                    paced = [(at / 2 ** k, body) for at, body in requests]
                    flush_and_settle(self.sim_bases, self.settle_s)
                    step = summarize(measure(door, targets, pids, paced, self.sim_bases), None)
                    step["rate_per_s"] = len(paced) / max(paced[-1][0], 1e-3)
                    light = steps[0]["ttft_p99_ms"] if steps else step["ttft_p99_ms"]
                    step["held"] = step["served"] == step["requests"] and step["ttft_p99_ms"] <= 2 * light
                    steps.append(step)
                    if not step["held"]:
                        break
        except SmgMissing as exc:
            return {"front_door": door, "steps": [], "note": str(exc)}
        held = [s for s in steps if s["held"]]
        best = held[-1] if held else None
        cpu = best and best["cpu_ms_per_request"]
        return {"front_door": door, "light_p99_ms": steps[0]["ttft_p99_ms"] if steps else None,
                "held_rate_per_s": best and best["rate_per_s"],
                "requests_per_router_core": 1000 / cpu if cpu else None, "steps": steps, "note": ""}
