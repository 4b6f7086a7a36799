"""No proxied request leaves load booked, however it ends: its client closes, its engine fails
mid-answer, its engine goes silent past the idle timeout, it is cancelled before the first
byte, or a drain cuts it. Each ending has its test, which asserts the worker's booked load is
back to 0 within a second of it (real router process, real Redis, engines on loopback).
And an engine that answers its health but fails requests (a 5xx, an answer with nothing in
it, a stream that is not one) is migrated away from and left out, like a refused one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens
from .test_router_proxy import EngineProcess, loads

MODEL = "leaks"
#: How soon after a request ends its worker's booked load must be 0 again.
RELEASED_WITHIN_S = 1.0

pytestmark = pytest.mark.slow


def _nothing_booked(redis_client) -> bool:
    return loads(redis_client, MODEL) == ({}, {})


def _send_generate(port: int, tokens: list[int], stream: bool = True) -> socket.socket:
    """A /generate sent on a socket of its own (Connection: close), its answer not read yet."""
    body = json.dumps({"input_ids": tokens, "stream": stream, "sampling_params": {"max_new_tokens": 5}}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _stream_head(port: int, tokens: list[int]) -> socket.socket:
    """A streamed /generate whose answer has begun: the socket, once its first event is read."""
    s = _send_generate(port, tokens)
    seen = b""
    while b"data:" not in seen:
        chunk = s.recv(65536)
        assert chunk, seen
        seen += chunk
    return s


def _read_to_end(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    seen = b""
    while chunk := s.recv(65536):
        seen += chunk
    s.close()
    return seen


class _Silent:
    """An 'engine' that takes the request and never answers (nor closes)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def held_engine(tmp_path):
    engine = EngineProcess(str(tmp_path / "never"))  # holds every stream after its first event
    yield engine
    if engine.proc.poll() is None:
        engine.stop()


def test_streams_their_clients_close_give_their_bookings_back(redis_client, redis_server, held_engine):
    """Streams closed by their clients at every moment: once their answer has begun, and at
    once after sending (while the router decides, books, or waits for the first byte), many
    at a time: every booking released within a second."""
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, tokens, device=2, url=held_engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL)
    try:
        streams = [_stream_head(router.port, tokens) for _ in range(10)]
        assert not _nothing_booked(redis_client)
        for delay_s in (0.0, 0.001, 0.002, 0.005, 0.01) * 6:
            early = _send_generate(router.port, tokens)
            time.sleep(delay_s)
            early.close()
        for s in streams:
            s.close()
        wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S,
                   what=lambda: f"bookings released; left: {loads(redis_client, MODEL)}")
        assert 'router_releases_lost_total 0.0' in router.metrics()
    finally:
        stop_all(router)


def test_a_stream_whose_engine_dies_mid_answer_gives_its_booking_back(redis_client, redis_server, held_engine):
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, tokens, device=2, url=held_engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL)
    try:
        s = _stream_head(router.port, tokens)
        held_engine.proc.send_signal(signal.SIGKILL)
        held_engine.proc.wait(10)
        body = _read_to_end(s)
        assert b"mid-stream" in body and b"data: [DONE]" in body, body[-300:]
        wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S,
                   what=lambda: f"booking released; left: {loads(redis_client, MODEL)}")
    finally:
        stop_all(router)


def test_a_stream_whose_engine_goes_silent_times_out_and_gives_its_booking_back(redis_client, redis_server,
                                                                                held_engine):
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, tokens, device=2, url=held_engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--upstream-idle-timeout", "0.5")
    try:
        s = _stream_head(router.port, tokens)
        body = _read_to_end(s)  # the idle timeout ends it
        assert b"mid-stream" in body and b"TimeoutError" in body, body[-300:]
        wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S,
                   what=lambda: f"booking released; left: {loads(redis_client, MODEL)}")
    finally:
        stop_all(router)


def test_a_request_cancelled_before_its_first_byte_gives_its_booking_back(redis_client, redis_server):
    """The client gives up while the router waits for the engine's first byte (aiohttp cancels
    the handler there), and while its request waits in the router's queue."""
    silent = _Silent()
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, tokens, device=2, url=silent.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--busy-decode-pages", "1",
                           "--queue-timeout", "30")
    try:
        waiting = [_send_generate(router.port, tokens, stream=False) for _ in range(3)]
        # one waits for the silent engine's first byte, the others in the queue (the worker is busy)
        wait_until(lambda: len(silent.accepted) == 1 and 'router_queue_depth 2.0' in router.metrics(), timeout=10)
        assert not _nothing_booked(redis_client)
        for s in waiting:
            s.close()
        wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S,
                   what=lambda: f"bookings released; left: {loads(redis_client, MODEL)}")
        wait_until(lambda: 'router_queue_depth 0.0' in router.metrics(), timeout=RELEASED_WITHIN_S)
    finally:
        stop_all(router)
        silent.close()


def test_a_drain_ends_cut_streams_with_the_error_event_releases_them_and_exits_in_time(redis_client, redis_server,
                                                                                       held_engine):
    """SIGTERM with streams that never finish: each ends with the error event and [DONE] once
    --drain-timeout has passed, their bookings are released, and the process is gone within
    --drain-timeout + 2 s of the signal."""
    tokens = request_tokens(8, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, tokens, device=2, url=held_engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--drain-timeout", "2")
    streams = [_stream_head(router.port, tokens) for _ in range(3)]
    ends: list[bytes] = [b""] * len(streams)

    def read(i: int) -> None:
        ends[i] = _read_to_end(streams[i])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for reader in readers:
        reader.start()
    signalled = time.monotonic()
    os.kill(router.pid, signal.SIGTERM)
    try:
        router.proc.wait(2 + 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the router was still running {time.monotonic() - signalled:.1f} s after SIGTERM "
                    f"with --drain-timeout 2:\n{router.output()[-3000:]}")
    exited_s = time.monotonic() - signalled
    for reader in readers:
        reader.join(10)
    for body in ends:
        assert b"shutting down" in body and b"data: [DONE]" in body, body[-400:]
    wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S,
               what=lambda: f"bookings released; left: {loads(redis_client, MODEL)}")
    assert exited_s < 4.0 and router.proc.returncode == 0, (exited_s, router.proc.returncode, router.output()[-2000:])


@pytest.mark.parametrize("fail", ["500", "empty", "garbage"])
def test_an_engine_that_fails_requests_is_migrated_away_from_then_left_out(redis_client, redis_server, fail):
    """Defect 3: an engine that answers its health check but fails every request (a 500, a 200
    with no answer in it, a stream that is not one) kept its traffic. Now each request moves to
    the healthy worker (X-Kvtier-Tried names the failing one), and after --breaker-failures in
    a row the failing engine is left out."""
    failing, healthy = EngineProcess(fail=fail), EngineProcess()
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("failing", 4, tokens, device=8, url=failing.url)  # holds the prefix: the formula's choice
    seeder.worker("healthy", 4, url=healthy.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--breaker-failures", "3",
                           "--breaker-backoff", "60")
    try:
        tried = []
        for _ in range(8):
            status, answer, headers = http("POST", router.url + "/generate",
                                           {"input_ids": tokens})
            assert status == 200 and headers["X-Kvtier-Worker"] == "healthy", (status, answer)
            tried.append(headers.get("X-Kvtier-Tried", ""))
        assert tried == ["failing"] * 3 + [""] * 5, tried
        reason = {"500": "status_500", "empty": "malformed", "garbage": "malformed"}[fail]
        metrics = router.metrics()
        assert f'router_upstream_failures_total{{reason="{reason}"}} 3.0' in metrics, metrics
        assert [c["worker_id"] for c in http("GET", router.url + "/healthz")[1]["open_circuits"]] == ["failing"]
        wait_until(lambda: _nothing_booked(redis_client), timeout=RELEASED_WITHIN_S)
    finally:
        stop_all(router)
        failing.stop()
        healthy.stop()
