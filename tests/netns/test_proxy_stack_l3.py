"""`proxy_stack(l3=True)`: the sim-workers share one real Mooncake master as their L3 tier and
the router replicas ask it, so a prompt one worker computed is credited as shared-pool pages to
every worker once their own pools are flushed, and a cold worker the router sends it to
prefetches it from L3; `flush_and_settle(..., storage=True)` then leaves nothing to find."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp

from kvtier.harness.mooncake import query_keys
from kvtier.plumbing.tokenizer import ModelTokenizer
from kvtier.router.hashing import RequestPages
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.routing import RouteRequest
from kvtier.schemas.worker import MooncakeLayout
from kvtier.testing.clients import metric_sum, route
from kvtier.testing.model_tokenizers import write_tokenizer
from kvtier.testing.peer_load import flush_and_settle, sim_health
from kvtier.testing.proxy_stack import proxy_stack

from ..helpers import wait_until
from ..router_helpers import http

MODEL, PAGE, PAGES = "test/l3-model", 64, 16


def completion(router: str, prompt: str) -> tuple[str, dict]:
    """The prompt through the router's proxy: (the worker it chose, the worker's usage)."""
    status, reply, headers = http("POST", router + "/v1/completions",
                                  {"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert status == 200, reply
    return headers["X-Kvtier-Worker"], reply["usage"]


def metrics(router: str) -> str:
    with urllib.request.urlopen(router + "/metrics", timeout=10) as reply:
        return reply.read().decode()


def overlaps(router: str, tokens: list[int]) -> dict[str, tuple[int, int]]:
    """Each worker's (device, shared-pool) pages for `tokens`, as the router scores them (a dry run)."""
    async def ask():
        async with aiohttp.ClientSession() as session:
            answer = await route(session, router, RouteRequest(model=MODEL, token_ids=tokens, book=False,
                                                               explain=True))
            return {c.worker_id: (c.overlap.device, c.overlap.shared_beyond) for c in answer.candidates}
    return asyncio.run(ask())


def test_the_router_credits_l3_pages_and_a_cold_worker_prefetches_them(tmp_path):
    folder = str(tmp_path / "tokenizer")
    words = write_tokenizer(folder)
    prompt = " ".join(words[i % 997 + 1] for i in range(PAGES * PAGE))
    tokens = ModelTokenizer.load(folder, encode_parts=1).encode_prompt(prompt)
    keys = [k for d in RequestPages.of(tokens, PAGE).digests for k in mooncake_object_keys(d, MooncakeLayout())]
    with proxy_stack(str(tmp_path), MODEL, PAGE, folder, workers=2, replicas=1, l3=True) as stack:
        assert stack.master is not None and stack.master.http_url in stack.l3_router_flags
        router, bases = stack.routers[0], [url.rsplit("/w/", 1)[0] for url in stack.workers]
        first, usage = completion(router, prompt)
        assert usage.get("prompt_tokens_details") is None  # computed
        base = bases[int(first.removeprefix("w"))]
        http("POST", base + "/advance", {"now": sim_health([base])[0].now + 1.0})  # its host copies land in L3
        assert all(query_keys(stack.master.http_url, keys).values())

        flush_and_settle(bases, 0.0)  # every device and host pool emptied; the L3 pool kept
        wait_until(lambda: all(device == 0 for device, _ in overlaps(router, tokens).values()), timeout=20,
                   what="the router to see the flushed workers cold")
        assert set(overlaps(router, tokens).values()) == {(0, PAGES)}  # every worker credited the L3 pages

        before = metrics(router)
        chosen, usage = completion(router, prompt)
        assert usage["prompt_tokens_details"]["cached_tokens"] == PAGES * PAGE
        served = sim_health([bases[int(chosen.removeprefix("w"))]])[0].served
        assert (served.device, served.host, served.l3) == (0, 0, PAGES * PAGE)
        after = metrics(router)
        beyond = "router_shared_cache_beyond_blocks_sum"  # the chosen worker's L3 pages, per decision
        assert metric_sum(after, beyond) - metric_sum(before, beyond) == PAGES
        assert metric_sum(after, "router_shared_pool_errors_total") == 0

        flush_and_settle(bases, 0.0, storage=True)
        assert not any(query_keys(stack.master.http_url, keys).values())
        assert all(json.loads(urllib.request.urlopen(b + "/healthz", timeout=10).read())["l3_pages"] == 0
                   for b in bases)
        wait_until(lambda: set(overlaps(router, tokens).values()) == {(0, 0)}, timeout=20,
                   what="the router to find nothing in the pool")
