"""`kvtier sim-worker --l3` against a real Mooncake master: pages one rank copies to host are
written to the store under SGLang HiCache's key layout, another rank prefetches them from it,
and the master's own existence query sees them."""

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
