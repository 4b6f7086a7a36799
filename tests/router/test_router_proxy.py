"""`kvtier router --proxy`: SGLang-native /generate requests are routed, forwarded to the
chosen worker's URL unchanged, streamed back, and their bookings released at the first
token and at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from kvtier.harness.embedded import free_port
from kvtier.schemas.rates import decode_fit
from kvtier.schemas.state_keys import ModelKeys

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, answers, http, request_tokens

MODEL = "proxied"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


class EngineProcess:
    def __init__(self, hold_file: str | None = None, fail: str = ""):
        self.port = free_port()
        args = [sys.executable, "-m", "tests.fake_engine", str(self.port)] + ([hold_file] if hold_file else [])
        args += ["--fail", fail] if fail else []
        self.proc = subprocess.Popen(args, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: answers(self.url + "/seen"), timeout=20, what="fake engine to answer")

    def seen(self) -> list[dict]:
        return http("GET", self.url + "/seen")[1]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def loads(client, model: str) -> tuple[dict, dict]:
    keys = ModelKeys.for_model(model)
    return client.hgetall(keys.prefill_load), client.hgetall(keys.decode_load)


def taught(client) -> dict[str, int]:
    """Samples each worker's learned rates were fitted on."""
    return {w.decode(): decode_fit(v).samples for w, v in client.hgetall(ModelKeys.for_model(MODEL).rates).items()}


def test_proxy_streams_and_releases_at_first_token_and_end(redis_client, redis_server, tmp_path):
    hold = str(tmp_path / "go")
    hot, cold = EngineProcess(hold), EngineProcess()
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("hot", 4, tokens, device=4, url=hot.url)
    seeder.worker("cold", 4, url=cold.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL)
    try:
        body = {"input_ids": tokens, "stream": True, "rid": "p-1", "sampling_params": {"max_new_tokens": 4}}
        request = urllib.request.Request(router.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=20) as response:
            assert response.headers["X-Kvtier-Worker"] == "hot"
            first = response.readline()
            assert first.startswith(b"data: ") and json.loads(first[6:])["index"] == 0
            # prefill (8 - 4 device pages) is released at the first token; decode
            # ((32 + 4 tokens) / 4 = 9 pages) stays booked until the end
            wait_until(lambda: loads(redis_client, MODEL) == ({}, {b"hot": b"9"}), timeout=10,
                       what=lambda: f"prefill released at first token, loads {loads(redis_client, MODEL)}")
            open(hold, "w").close()
            rest = response.read().decode()
        assert rest.strip().endswith("data: [DONE]") and rest.count("data: ") == 4
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10,
                   what=lambda: f"everything released at the end, loads {loads(redis_client, MODEL)}")
        assert hot.seen() == [body] and cold.seen() == []  # forwarded unchanged
        # the streamed answer's first byte taught the worker's rates, once
        assert taught(redis_client) == {"hot": 1}

        # non-streaming, no rid: routed by load to the idle worker, released at the end
        status, answer, headers = http("POST", router.url + "/generate", {"input_ids": tokens[:8]})
        assert status == 200 and answer["text"] == "xxx", answer
        assert headers["X-Kvtier-Worker"] in ("hot", "cold")
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)
        assert 'router_proxy_requests_total{outcome="ok"} 2.0' in router.metrics()
        assert taught(redis_client) == {"hot": 1}  # a whole answer's first byte is its last: no sample
    finally:
        stop_all(router)
        hot.stop()
        cold.stop()


def test_proxy_refuses_bad_requests_and_reports_dead_workers(redis_client, redis_server):
    tokens = request_tokens(4, 4)
    other = request_tokens(4, 4, seed=5)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("gone", 4, tokens, device=4, url=f"http://127.0.0.1:{free_port()}")
    seeder.worker("no-url", 4, other, device=4)
    router = RouterProcess(redis_server.url, "--proxy")
    try:
        assert http("POST", router.url + "/generate", {"input_ids": tokens})[:2] == (
            400, {"error": "no model: send \"model\" in the body or start the router with --model"})
        status, answer, _ = http("POST", router.url + "/generate", {"model": MODEL, "input_ids": [1, "x"]})
        assert status == 400 and "$.input_ids[1]" in answer["error"]
        # "gone" (its cache's worker) refuses, so the request migrates to "no-url", which cannot be
        # reached either: one 502 says what each did, and names no internal address
        status, answer, headers = http("POST", router.url + "/generate", {"model": MODEL, "input_ids": tokens})
        assert status == 502 and "gone failed before the first byte (refused)" in answer["error"], answer
        assert "no-url announced no HTTP endpoint" in answer["error"], answer
        assert "127.0.0.1" not in answer["error"] and headers["X-Kvtier-Tried"] == "gone,no-url"
        # the booking of a request that could not be forwarded is given back
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)
        status, answer, headers = http("POST", router.url + "/generate", {"model": MODEL, "input_ids": other})
        assert status == 502 and headers["X-Kvtier-Tried"] == "no-url,gone", (answer, headers)
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)
        metrics = router.metrics()
        assert 'router_proxy_requests_total{outcome="unreachable"} 2.0' in metrics
        assert 'router_upstream_failures_total{reason="refused"} 2.0' in metrics
        assert "router_migrations_total 2.0" in metrics
    finally:
        stop_all(router)


def test_openai_streams_end_cleanly_when_the_worker_dies_or_the_client_leaves(redis_client, redis_server, tmp_path):
    """Through the OpenAI path: a client that goes away mid-stream cancels the upstream request
    and gives its booking back; a worker that dies mid-stream ends the client's stream with an
    error event the `openai` client raises, and the booking is given back too."""
    import signal

    import openai

    hold = str(tmp_path / "never")  # the engines hold after their first chunk for good
    engine = EngineProcess(hold)
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("w", 4, tokens, device=2, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, stream=True)
        first = next(iter(stream))
        assert first.choices[0].text == " x"
        wait_until(lambda: loads(redis_client, MODEL)[1] == {b"w": b"10"}, timeout=10)  # decode still booked
        stream.close()  # the client goes away
        wait_until(lambda: http("GET", engine.url + "/cancelled")[1] == 1, timeout=10,
                   what="the upstream request to be cancelled")
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)

        stream = client.completions.create(model=MODEL, prompt=tokens, max_tokens=5, stream=True)
        chunks = iter(stream)
        assert next(chunks).choices[0].text == " x"
        engine.proc.send_signal(signal.SIGKILL)  # the worker dies mid-stream
        engine.proc.wait(10)
        with pytest.raises(openai.APIError, match="mid-stream"):
            next(chunks)
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)
    finally:
        stop_all(router)
        if engine.proc.poll() is None:
            engine.stop()
