"""`kvtier sim-worker --l3` against a real Mooncake master: pages one rank copies to host are
written to the store under SGLang HiCache's key layout, another rank prefetches them from it,
and the master's own existence query sees them; two sim-worker processes share the one pool,
which `/flush_cache?storage=1` empties (a plain `/flush_cache` keeps it)."""

from __future__ import annotations

from kvtier.harness.embedded import free_port
from kvtier.harness.mooncake import query_keys
from kvtier.router.hashing import RequestPages
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.worker import MooncakeLayout
from kvtier.sim.sim_worker import free_port_block

from ..helpers import KvtierProcess, stop_all, wait_until
from ..router_helpers import answers, http, request_tokens


def test_ranks_share_pages_through_a_real_mooncake_store(mooncake_master):
    http_port = free_port()
    sim = KvtierProcess("sim-worker", "--ranks", "2", "--port", str(free_port_block(2)), "--replay-port",
                        str(free_port_block(2)), "--http-port", str(http_port), "--page-size", "4",
                        "--device-pages", "64", "--host-pages", "64", "--l3", "--mooncake-rpc",
                        mooncake_master.rpc_address, "--mooncake-metadata", mooncake_master.metadata_url)
    url = f"http://127.0.0.1:{http_port}"

    try:
        wait_until(lambda: answers(url + "/healthz"), timeout=30, what=lambda: sim.output()[-2000:])
        tokens = request_tokens(6, 4, seed=21)
        status, first, _ = http("POST", url + "/w/0/generate", {"input_ids": tokens, "now": 0.0})
        assert status == 200 and first["meta_info"]["recomputed_tokens"] == 24, first
        http("POST", url + "/advance", {"now": 1.0})  # host copies land -> written to the store
        pages = RequestPages.of(tokens, 4)
        keys = [k for d in pages.digests for k in mooncake_object_keys(d, MooncakeLayout())]
        assert all(query_keys(mooncake_master.http_url, keys).values())
        status, second, _ = http("POST", url + "/w/1/generate", {"input_ids": tokens, "now": 2.0})
        assert status == 200, second
        assert second["meta_info"]["cached_tokens_details"]["l3"] == 24, second
        assert second["meta_info"]["recomputed_tokens"] == 0
    finally:
        stop_all(sim)


def start_sim_worker(master) -> tuple[KvtierProcess, str]:
    """One rank on `master`'s pool, as each sim-worker of a proxy stack runs."""
    http_port = free_port()
    sim = KvtierProcess("sim-worker", "--port", str(free_port_block(1)), "--replay-port", str(free_port_block(1)),
                        "--http-port", str(http_port), "--page-size", "4", "--device-pages", "64",
                        "--host-pages", "64", "--l3", "--mooncake-rpc", master.rpc_address,
                        "--mooncake-metadata", master.metadata_url)
    return sim, f"http://127.0.0.1:{http_port}"


def test_two_sim_workers_share_one_master_until_a_storage_flush_empties_it(mooncake_master):
    """Separate sim-worker processes find each other's pages in the master's pool (the L3 tier a
    proxy stack's workers share); a plain /flush_cache keeps them there, `?storage=1` removes
    them, even those the master holds a lease on because they were just asked for."""
    from kvtier.schemas.sim import ServedTokens
    from kvtier.testing.peer_load import flush_and_settle, sim_health

    (a, url_a), (b, url_b) = start_sim_worker(mooncake_master), start_sim_worker(mooncake_master)
    try:
        for sim, url in ((a, url_a), (b, url_b)):
            wait_until(lambda url=url: answers(url + "/healthz"), timeout=30, what=lambda sim=sim: sim.output()[-2000:])
        tokens = request_tokens(6, 4, seed=33)
        keys = [k for d in RequestPages.of(tokens, 4).digests for k in mooncake_object_keys(d, MooncakeLayout())]
        assert http("POST", url_a + "/w/0/generate", {"input_ids": tokens, "now": 0.0})[1]["meta_info"][
            "recomputed_tokens"] == 24
        http("POST", url_a + "/advance", {"now": 1.0})  # A's host copies land: written to the master
        assert all(query_keys(mooncake_master.http_url, keys).values())
        reply = http("POST", url_b + "/w/0/generate", {"input_ids": tokens, "now": 0.0})[1]["meta_info"]
        assert reply["cached_tokens_details"] == {"device": 0, "host": 0, "l3": 24}, reply
        health_a, health_b = sim_health([url_a, url_b])
        assert (health_a.l3_pages, health_a.served.l3, health_b.served.l3) == (6, 0, 24)

        flush_and_settle([url_a, url_b], 0.0)  # device and host only: the pool keeps the pages
        assert all(query_keys(mooncake_master.http_url, keys).values())
        reply = http("POST", url_a + "/w/0/generate", {"input_ids": tokens, "now": 2.0})[1]["meta_info"]
        assert reply["cached_tokens_details"]["l3"] == 24, reply

        flush_and_settle([url_a, url_b], 0.0, storage=True)
        assert not any(query_keys(mooncake_master.http_url, keys).values())
        assert [(h.l3_pages, h.served) for h in sim_health([url_a, url_b])] == [(0, ServedTokens())] * 2
        for url, now in ((url_b, 1.0), (url_a, 3.0)):  # neither finds them in the pool any more
            reply = http("POST", url + "/w/0/generate", {"input_ids": tokens, "now": now})[1]["meta_info"]
            assert reply["cached_tokens"] == 0 and reply["recomputed_tokens"] == 24, reply
        assert [h.served.l3 for h in sim_health([url_a, url_b])] == [0, 0]
    finally:
        stop_all(a, b)
