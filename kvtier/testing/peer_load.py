"""What kvtier bench peers sends and reads on its cluster: a trace's requests as text prompts
(`TracePrompts`), sent streamed by one client at their times (`paced`, each a `Sent`), and the
sim-workers' caches flushed (`flush_and_settle`) and their reuse counted (`served`)."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
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


def flush_and_settle(sim_bases: list[str], settle_s: float) -> None:
    """Every worker's cache emptied and its counters zeroed; then `settle_s` for the engines'
    paced work to end and the cleared events to reach kvtier's state."""
    import urllib.request

    for base in sim_bases:
        urllib.request.urlopen(urllib.request.Request(base + "/flush_cache", method="POST"), timeout=10).read()
    time.sleep(settle_s)


def served(sim_bases: list[str]) -> dict[str, int]:
    totals = {"prompt": 0, "device": 0, "host": 0, "l3": 0}
    for health in sim_health(sim_bases):
        for key in totals:
            totals[key] += getattr(health.served, key)
    return totals
