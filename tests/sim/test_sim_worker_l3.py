"""A sim-worker's L3 pool and the flushes: `/flush_cache` empties the ranks' device and host pools
and keeps the L3 pool, as SGLang keeps its storage backend; `/flush_cache?storage=1` (and
`flush_and_settle(..., storage=True)`) empties it too, and SGLang's own storage-clear routes empty
it alone. With the in-memory pool here; tests/netns/test_sim_worker_mooncake.py does the same
with two sim-worker processes sharing a real Mooncake master."""

from __future__ import annotations

import urllib.error
import urllib.request

import msgspec
import pytest

from kvtier.harness.embedded import free_port
from kvtier.router.hashing import RequestPages
from kvtier.schemas.hashes import sglang_page_digests
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.sim import ServedTokens, SimHealth
from kvtier.schemas.worker import MooncakeLayout
from kvtier.sim.hicache_sim import InMemorySharedPool
from kvtier.sim.sim_worker import free_port_block
from kvtier.testing.peer_load import flush_and_settle

from ..helpers import KvtierProcess, wait_until
from ..router_helpers import answers, http, request_tokens

PAGE = 4


def start(*flags: str) -> tuple[KvtierProcess, str]:
    http_port = free_port()
    sim = KvtierProcess("sim-worker", "--ranks", "2", "--port", str(free_port_block(2)), "--replay-port",
                        str(free_port_block(2)), "--http-port", str(http_port), "--page-size", str(PAGE),
                        "--device-pages", "64", "--host-pages", "64", *flags)
    url = f"http://127.0.0.1:{http_port}"
    wait_until(lambda: answers(url + "/healthz"), timeout=30, what=lambda: sim.output()[-2000:])
    return sim, url


@pytest.fixture
def l3_worker():
    sim, url = start("--l3")
    try:
        yield url
    finally:
        sim.stop()


def health(url: str) -> SimHealth:
    with urllib.request.urlopen(url + "/healthz", timeout=10) as reply:
        return msgspec.json.decode(reply.read(), type=SimHealth)


def text(method: str, url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def serve(url: str, rank: int, tokens: list[int], now: float) -> dict:
    status, reply, _ = http("POST", f"{url}/w/{rank}/generate", {"input_ids": tokens, "now": now})
    assert status == 200, reply
    return reply["meta_info"]


def in_pool(url: str, tokens: list[int]) -> list[bool]:
    """Each page's objects as the sim-worker's stand-in master answers for them."""
    keys = [k for d in RequestPages.of(tokens, PAGE).digests for k in mooncake_object_keys(d, MooncakeLayout())]
    status, reply, _ = http("GET", f"{url}/batch_query_keys?keys=" + ",".join(keys))
    assert status == 200 and reply["success"], reply
    return [reply["data"][k]["ok"] for k in keys]


def test_the_l3_pool_outlives_a_flush_unless_the_storage_is_flushed_too(l3_worker):
    url, tokens = l3_worker, request_tokens(6, PAGE, seed=5)
    assert serve(url, 0, tokens, 0.0)["recomputed_tokens"] == 24
    http("POST", url + "/advance", {"now": 1.0})  # the host copies land: written to the pool
    assert health(url).l3_pages == 6 and all(in_pool(url, tokens))
    assert serve(url, 1, tokens, 2.0)["cached_tokens_details"]["l3"] == 24  # another rank prefetches them

    flush_and_settle([url], 0.0)  # the default: device and host pools, not the L3 pool
    after = health(url)
    assert after.l3_pages == 6 and after.served == ServedTokens()
    assert serve(url, 0, tokens, 3.0)["cached_tokens_details"] == {"device": 0, "host": 0, "l3": 24}

    flush_and_settle([url], 0.0, storage=True)
    after = health(url)
    assert after.l3_pages == 0 and after.served.prompt == after.served.l3 == 0
    assert not any(in_pool(url, tokens))
    for rank, now in ((1, 4.0), (0, 5.0)):  # no rank finds the pages anywhere
        meta = serve(url, rank, tokens, now)
        assert meta["cached_tokens"] == 0 and meta["recomputed_tokens"] == 24, meta
    assert health(url).served.l3 == 0


def test_flush_reply_says_whether_the_storage_was_emptied(l3_worker):
    url = l3_worker
    assert http("POST", url + "/flush_cache")[1] == {"flushed": [0, 1], "storage": False}
    assert http("POST", url + "/flush_cache?storage=1")[1] == {"flushed": [0, 1], "storage": True}
    assert http("POST", url + "/w/1/flush_cache?storage=0")[1] == {"flushed": [1], "storage": False}


def test_sglangs_storage_clear_routes_empty_the_pool_alone(l3_worker):
    url, tokens = l3_worker, request_tokens(3, PAGE, seed=6)
    serve(url, 0, tokens, 0.0)
    http("POST", url + "/advance", {"now": 1.0})
    for method, path in (("POST", "/hicache/storage-backend/clear"), ("GET", "/clear_hicache_storage_backend"),
                         ("POST", "/clear_hicache_storage_backend")):
        assert text(method, url + path) == (200, "Hierarchical cache storage backend cleared.\n")
        assert health(url).l3_pages == 0 and not any(in_pool(url, tokens))
    after = health(url)
    assert after.served.prompt == 12  # SGLang's clear leaves the engine (and its counts) alone
    assert serve(url, 0, tokens, 2.0)["cached_tokens_details"]["device"] == 12  # still on rank 0's device


def test_without_l3_a_storage_flush_is_a_plain_flush_and_the_clear_is_refused():
    sim, url = start()
    try:
        assert http("POST", url + "/flush_cache?storage=1")[1] == {"flushed": [0, 1], "storage": False}
        status, body = text("POST", url + "/hicache/storage-backend/clear")
        assert status == 400 and "not enabled" in body
    finally:
        sim.stop()


def test_the_in_memory_pool_answers_a_run_and_empties():
    pool = InMemorySharedPool()
    d = sglang_page_digests(list(range(5 * PAGE)), PAGE)
    pool.put([d[0], d[1], d[3]])
    assert [pool.leading(d), pool.leading(d[1:]), pool.leading(d[2:]), pool.leading([])] == [2, 1, 0, 0]
    pool.clear()
    assert len(pool) == 0 and pool.leading(d) == 0 and not pool.contains(d[0])
