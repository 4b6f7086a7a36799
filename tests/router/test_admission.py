"""Admission, drain and session affinity on a real router (real Redis, HTTP engines on
loopback): busy thresholds with a bounded queue and 429/503 + Retry-After, a measured drain on
SIGTERM, and a session kept on its worker by every replica."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.tiers import Tier

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens
from .test_router_proxy import EngineProcess, loads

MODEL = "admitted"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


class _Stream:
    """A streamed /generate held open by the engine after its first chunk (its hold file)."""

    def __init__(self, url: str, tokens: list[int], max_new_tokens: int = 8, headers: dict | None = None):
        body = {"model": MODEL, "input_ids": tokens, "stream": True, "sampling_params": {"max_new_tokens":
                                                                                         max_new_tokens}}
        request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        self.response = urllib.request.urlopen(request, timeout=30)
        self.first = self.response.readline()

    def rest(self) -> bytes:
        return self.response.read()


def _in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _queue_depth(router) -> int:
    return http("GET", router.url + "/healthz", token=router.token)[1]["queue"]["depth"]


def test_busy_workers_queue_requests_in_order_then_refuse_with_retry_after(redis_client, redis_server, tmp_path):
    hold = str(tmp_path / "go")
    engine = EngineProcess(hold)
    tokens = request_tokens(8, 4)  # 32 tokens; + 8 output: 10 decode pages
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--busy-decode-pages", "10", "--queue-size", "2",
                           "--queue-timeout", "20", "--auth-token", "t")
    auth = {"Authorization": "Bearer t"}

    def generate(headers=None):
        body = {"model": MODEL, "input_ids": tokens, "sampling_params": {"max_new_tokens": 8}}
        request = urllib.request.Request(router.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", **auth, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), dict(exc.headers)

    try:
        held = _Stream(router.url, tokens, headers=auth)  # books 10 decode pages: the worker is busy
        second, second_out = _in_thread(generate)
        wait_until(lambda: _queue_depth(router) == 1, timeout=10)
        third, third_out = _in_thread(generate)
        wait_until(lambda: _queue_depth(router) == 2, timeout=10)
        status, body, headers = generate()  # the queue is full
        assert status == 429 and headers["Retry-After"] == "1" and b"queue is full" in body, (status, body)
        open(hold, "w").close()  # the held stream ends: its pages are released, the queue drains
        held.rest()
        second.join(20)
        third.join(20)
        assert second_out["value"][0] == 200 and third_out["value"][0] == 200, (second_out, third_out)
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)
        metrics = router.metrics()
        assert 'router_admission_refusals_total{reason="queue_full"} 1.0' in metrics
        assert "router_queue_wait_seconds_count 2.0" in metrics
        assert http("GET", router.url + "/healthz", token=router.token)[1]["queue"]["peak"] == 2

        # thresholds change at run time, with the router's token only
        status, answer, _ = http("GET", router.url + "/v1/admission")
        assert status == 401
        request = urllib.request.Request(router.url + "/v1/admission", method="PUT", headers=auth, data=json.dumps(
            {"busy_decode_pages": 5, "queue_size": 0}).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
        settings = ("busy_prefill_tokens", "busy_decode_pages", "queue_size", "queue_timeout_s")
        assert [answer[k] for k in settings] == [0, 5, 0, 20.0]  # the rest kept
        # the answer says how far the change reached: this replica, not the deployment
        assert answer["scope"] == "replica" and answer["router_id"] and answer["applied"] == ["process 0"], answer
        assert answer["not_applied"] == []
        status, body, headers = generate()  # an idle worker is under any threshold: placed
        assert status == 200, body
        for wrong in (b'{"busy_decode_pages": -1}', b'{"busy_decode_pages": 18446744073709551616}',
                      b'{"busy_prefill_tokens": 1e23}', b'{"busy_prefill_tokens": 100000000000}'):
            request = urllib.request.Request(router.url + "/v1/admission", method="PUT", headers=auth, data=wrong)
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError(f"an out-of-bounds threshold was accepted: {wrong!r}")
            except urllib.error.HTTPError as exc:
                assert exc.code == 400 and b"busy_" in exc.read(), wrong
        assert http("GET", router.url + "/v1/admission", token=router.token)[1]["busy_decode_pages"] == 5
    finally:
        stop_all(router)
        engine.stop()


def test_a_request_that_waits_too_long_gets_503_with_retry_after(redis_client, redis_server, tmp_path):
    engine = EngineProcess(str(tmp_path / "never"))
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--busy-decode-pages", "1", "--queue-timeout", "0.5")
    try:
        held = _Stream(router.url, tokens)
        started = time.monotonic()
        status, answer, headers = http("POST", router.url + "/v1/completions",
                                       {"model": MODEL, "prompt": tokens, "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] == "1", (status, answer)
        assert answer["error"]["code"] == 503 and "--queue-timeout" in answer["error"]["message"]
        assert 0.4 < time.monotonic() - started < 5
        assert 'router_admission_refusals_total{reason="queue_timeout"} 1.0' in router.metrics()
        # without --auth-token the thresholds cannot be changed at run time
        status, answer, _ = http("PUT", router.url + "/v1/admission", {"busy_decode_pages": 0})
        assert status == 403 and "--auth-token" in answer["error"], answer
        held.response.close()
    finally:
        stop_all(router)
        engine.stop()


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0(redis_client, redis_server, tmp_path):
    hold = str(tmp_path / "go")
    engine = EngineProcess(hold)
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--drain-timeout", "20")
    try:
        held = _Stream(router.url, tokens)
        os.kill(router.pid, signal.SIGTERM)
        wait_until(lambda: http("GET", router.url + "/healthz", token=router.token)[0] == 503, timeout=10)
        assert http("GET", router.url + "/healthz", token=router.token)[1]["status"] == "draining"
        status, answer, headers = http("POST", router.url + "/generate", {"model": MODEL, "input_ids": tokens})
        assert status == 503 and headers["Retry-After"] == "1" and "shutting down" in answer["error"], answer
        assert router.alive()  # still waiting for the stream in flight
        open(hold, "w").close()
        rest = held.rest()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest  # finished, not cut
        router.proc.wait(10)
        assert router.proc.returncode == 0
        assert "drained in" in router.output() and "0 requests cut" in router.output()
        assert loads(redis_client, MODEL) == ({}, {})
    finally:
        stop_all(router)
        engine.stop()


def test_a_drain_that_times_out_cuts_what_is_left_releases_it_and_exits_0(redis_client, redis_server, tmp_path):
    engine = EngineProcess(str(tmp_path / "never"))
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--drain-timeout", "1")
    try:
        held = _Stream(router.url, tokens)  # kept open (a collected one would close its socket)
        started = time.monotonic()
        os.kill(router.pid, signal.SIGTERM)
        router.proc.wait(15)
        assert router.proc.returncode == 0 and time.monotonic() - started < 8
        assert "1 requests cut" in router.output()
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=5)  # its booking was given back
        held.response.close()
    finally:
        stop_all(router)
        engine.stop()


def test_a_session_stays_on_its_worker_across_replicas_while_it_is_live(redis_client, redis_server):
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("a", 4)
    seeder.worker("b", 4)
    routers = [RouterProcess(redis_server.url, "--session-ttl", "60") for _ in range(2)]
    try:
        def route(router, session=None, **extra):
            body = {"model": MODEL, "token_ids": tokens, **extra}
            if session:
                body["session_id"] = session
            status, answer, _ = http("POST", router.url + "/v1/route", body)
            assert status == 200, answer
            http("POST", router.url + "/v1/release", {"model": MODEL, "request_id": answer["request_id"],
                                                      "owner": answer["owner"]})
            return answer

        first = route(routers[0], "conv-1")
        kept = first["worker_id"]
        other = "b" if kept == "a" else "a"
        assert first["affinity"] == ""  # a new session: the formula chose
        # the other worker now holds the whole prompt on device: the formula would move the turn
        seeder.store(other, Tier.DEVICE, sglang_block_hashes(tokens, 4))
        for r in routers:
            r.wait_index_settled(redis_client, MODEL)
        assert route(routers[1])["worker_id"] == other  # without a session
        again = route(routers[1], "conv-1")  # the other replica honours the session
        assert again["worker_id"] == kept and again["affinity"] == "overrode", again
        # its worker leaves (no lease): the session goes where the formula says
        redis_client.zrem(ModelKeys.for_model(MODEL).leases, kept)
        moved = route(routers[0], "conv-1")
        assert moved["worker_id"] == other and moved["affinity"] == "", moved
        assert route(routers[1], "conv-1")["affinity"] == "kept"  # and stays there
        status, answer, _ = http("POST", routers[0].url + "/v1/route", {"model": MODEL, "token_ids": tokens,
                                                                         "session_id": "not a session id!"})
        assert status == 400 and "$.session_id" in answer["error"], answer
    finally:
        stop_all(*routers)
