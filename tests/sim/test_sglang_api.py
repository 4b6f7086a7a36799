"""The sim-worker answers what a gateway asks an SGLang worker before admitting it (kvtier/sim/
sglang_api.py), decoded with the same schemas/ types; SGLang's own gateway (`smg`, a real
process from PyPI) admits its ranks and routes chats to them; `kvtier bridge`'s discovery reads
a rank's `/server_info` as it reads SGLang's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import msgspec
import pytest

from kvtier.harness.embedded import free_port
from kvtier.producers.sglang_discovery import WorkerFlags, discover, fetch
from kvtier.schemas.sglang_server import LoadsReply, ModelInfo, ModelList, VersionReply, decode_server_info
from kvtier.schemas.sim import SimHealth
from kvtier.sim.sim_worker import free_port_block
from kvtier.testing.model_tokenizers import write_deepseek_tokenizer
from kvtier.testing.peers import start_smg, wait_smg

from ..helpers import KvtierProcess, wait_until
from ..router_helpers import answers, http

PAGE = 64
MODEL = "sim/sglang-api"


@pytest.fixture
def sim_worker(tmp_path):
    """Two ranks serving the OpenAI API with DeepSeek-V4's tokenizer: (base URL, ZMQ base, replay base)."""
    tokenizer = write_deepseek_tokenizer(str(tmp_path / "tokenizer"))
    zmq_base, replay_base, http_port = free_port_block(2), free_port_block(2), free_port()
    sim = KvtierProcess("sim-worker", "--ranks", "2", "--port", str(zmq_base), "--replay-port", str(replay_base),
                        "--http-port", str(http_port), "--page-size", str(PAGE), "--tokenizer", tokenizer,
                        "--model", MODEL)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: answers(url + "/healthz"), timeout=30, what=lambda: sim.output()[-2000:])
        yield url, zmq_base, replay_base
    finally:
        sim.stop()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_each_rank_answers_the_routes_a_gateway_reads(sim_worker):
    url, zmq_base, replay_base = sim_worker
    rank = f"{url}/w/1"
    models = msgspec.json.decode(get(rank + "/v1/models")[1], type=ModelList)
    assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "sglang")]  # how smg tells SGLang
    for path in ("/model_info", "/get_model_info"):
        info = msgspec.json.decode(get(rank + path)[1], type=ModelInfo)
        assert (info.model_path, info.served_model_name, info.is_generation) == (MODEL, MODEL, True)
    assert msgspec.json.decode(get(rank + "/version")[1], type=VersionReply).version.startswith("0.5.")
    assert get(rank + "/health_generate")[0] == 200
    for path in ("/server_info", "/get_server_info"):
        server = decode_server_info(get(rank + path)[1])
        assert (server.page_size, server.dp_size, server.enable_hierarchical_cache) == (PAGE, 1, True)
        assert server.hicache_write_policy == "write_through" and server.hicache_ratio == 2.0
    assert decode_server_info(get(url + "/server_info")[1]).dp_size == 2  # the whole process: both ranks
    # the bridge's own discovery finds rank 1's publisher from its URL, as it finds SGLang's
    settings = discover(rank, *fetch(rank, 5.0), WorkerFlags())
    assert (settings.endpoint, settings.replay_endpoint) == (f"tcp://127.0.0.1:{zmq_base + 1}",
                                                             f"tcp://127.0.0.1:{replay_base + 1}")
    assert (settings.model, settings.page_size, settings.dp_size) == (MODEL, PAGE, 1)
    # a rank that is not there is a 404 that says so, on every route
    for path in ("/v1/models", "/server_info", "/model_info", "/version", "/health_generate", "/v1/loads"):
        status, body = get(f"{url}/w/7{path}")
        assert status == 404 and b"no rank 7" in body, (path, status, body)


def test_loads_count_each_ranks_queue_and_pool(sim_worker):
    url, _, _ = sim_worker
    # three long prompts at one simulated moment on rank 0: seconds of prefill each, so the
    # wall time between them and the read below cannot finish any
    for seed in range(3):
        status, body, _ = http("POST", f"{url}/w/0/generate",
                               {"input_ids": [(seed * 7919 + i) % 50_000 for i in range(512 * PAGE)], "now": 0.0})
        assert status == 200, body
    reply = msgspec.json.decode(get(url + "/v1/loads?include=core,queues")[1], type=LoadsReply)
    by_rank = {load.dp_rank: load for load in reply.loads}
    busy, idle = by_rank[0], by_rank[1]
    assert (busy.num_waiting_reqs, busy.num_running_reqs, busy.queues.waiting) == (2, 1, 2)
    assert busy.num_used_tokens > 0 and 0 < busy.token_usage <= 1
    assert busy.num_waiting_uncached_tokens > 0
    assert (idle.num_waiting_reqs, idle.num_running_reqs, idle.num_used_tokens) == (0, 0, 0)
    only = msgspec.json.decode(get(url + "/w/1/v1/loads")[1], type=LoadsReply)
    assert [load.dp_rank for load in only.loads] == [1]


def chat(gateway: str, text: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(gateway + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_sglangs_gateway_admits_the_ranks_and_routes_chats_by_their_cache(sim_worker, tmp_path):
    url, _, _ = sim_worker
    smg, gateway = start_smg(str(tmp_path), "smg", [f"{url}/w/0", f"{url}/w/1"], "cache_aware")
    try:
        wait_smg(gateway, 2, smg)
        status, body = chat(gateway, "Hello there, how are you today?", stream=True)
        assert status == 200, body
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["id"].startswith("sim-")  # a sim-worker rank answered through the gateway
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        # a long prompt twice: smg's cache-aware policy sends the second to the rank that holds
        # its pages, which then reports them cached
        prose = " ".join(f"sentence {i} of a long shared document about tiered KV caches." for i in range(80))
        first, second = (json.loads(chat(gateway, prose, stream=False)[1]) for _ in range(2))
        assert first["usage"].get("prompt_tokens_details") is None
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= PAGE
        assert first["id"].split("-")[1] == second["id"].split("-")[1]  # the same rank
        # the sim-worker's own count of what it served, as a benchmark reads it around a run
        served = msgspec.json.decode(get(url + "/healthz")[1], type=SimHealth).served
        assert served.prompt == sum(r["usage"]["prompt_tokens"] for r in (first, second)) + chunks[-1]["usage"][
            "prompt_tokens"]
        assert served.device == second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert served.host == served.l3 == 0
        assert http("POST", url + "/flush_cache")[0] == 200
        assert msgspec.json.decode(get(url + "/healthz")[1], type=SimHealth).served.prompt == 0
    finally:
        smg.stop()
