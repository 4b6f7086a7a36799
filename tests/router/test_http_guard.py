"""kvtier.router.http_guard against raw sockets on 127.0.0.1: idle and slowloris connections,
bodies shorter than their Content-Length, endless chunked bodies and idle keep-alive
connections are closed on time; a flood of idle sockets past max_connections (in a server
process with a low descriptor limit) does not starve normal requests; normal requests, keep-alive,
bodies, 413 and slow handlers work as before.

Each test is bounded in time and closes its sockets. The small app is served with the guard by
a thread with its own event loop (the descriptor-limit test: by a subprocess, on asyncio and on
uvloop). ``GUARDED = False`` serves the very same app with a plain ``web.AppRunner`` instead:
every test here then fails, which is how the tests were checked to test the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import select
import socket
import subprocess
import sys
import threading
import time

import pytest
from aiohttp import web

from kvtier.router import http_guard
from kvtier.router.http_guard import CLOSE_REASONS, BodyTimeout, GuardStats, HttpLimits

pytestmark = pytest.mark.timeout(60)

#: False: serve the tests' app without the guard (plain aiohttp); every test should then fail.
GUARDED = True

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_BODY = 64 * 1024
#: how much later than its deadline a close may come (two shared cores, a loaded CI box)
SLACK = 2.0
LIMITS = web.AppKey("limits", HttpLimits)
STATS = web.AppKey("stats", GuardStats)


# --- the app under test ----------------------------------------------------------------------
async def _read(request: web.Request) -> bytes:
    return await (http_guard.read_body(request, request.app[LIMITS]) if GUARDED else request.read())


def make_app(limits: HttpLimits) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"bytes": len(body)})

    async def echo_helper(request: web.Request) -> web.Response:
        body = await _read(request)
        return web.json_response({"bytes": len(body)})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "1")))
        return web.json_response({"slow": True})

    async def stats(request: web.Request) -> web.Response:
        guard = request.app.get(STATS)
        return web.json_response({} if guard is None else {"closed": guard.closed, "open": guard.open})

    @web.middleware
    async def edge(request: web.Request, handler):
        # As the router's own middleware: HTTP errors answered as {"error": exc.reason}.
        if not request.path.startswith("/edge/"):
            return await handler(request)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response({"error": exc.reason}, status=exc.status)

    app = web.Application(client_max_size=MAX_BODY, middlewares=[edge])
    app[LIMITS] = limits
    app.router.add_get("/ok", ok)
    app.router.add_post("/echo", echo)
    app.router.add_post("/edge/echo", echo)
    app.router.add_post("/helper", echo_helper)
    app.router.add_get("/slow", slow)
    app.router.add_get("/stats", stats)
    return app


def make_runner(app: web.Application, limits: HttpLimits, guarded: bool) -> web.AppRunner:
    kwargs = {"access_log": None, "handle_signals": False, "handler_cancellation": True}
    if not guarded:
        return web.AppRunner(app, **kwargs)
    runner = http_guard.guarded_runner(app, limits, **kwargs)
    app[STATS] = runner.stats
    return runner


class ThreadServer:
    """The app, served on 127.0.0.1 by an event loop in a thread."""

    def __init__(self, limits: HttpLimits, guarded: bool | None = None) -> None:
        self.limits = limits
        self.guarded = GUARDED if guarded is None else guarded
        self.stats: GuardStats | None = None
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http-guard-test-server", daemon=True)

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"test server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "test server did not stop"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported by __enter__
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = make_app(self.limits)
        runner = make_runner(app, self.limits, self.guarded)
        await runner.setup()
        self.stats = getattr(runner, "stats", None)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site.port
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()


@pytest.fixture
def serve():
    servers: list[ThreadServer] = []

    def start(guarded: bool | None = None, **limits) -> ThreadServer:
        server = ThreadServer(HttpLimits(**limits), guarded).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture
def sockets():
    """connect(port) -> a client socket, closed at the end of the test."""
    opened: list[socket.socket] = []

    def connect(port: int, timeout: float = 5.0) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        opened.append(sock)
        return sock

    yield connect
    for sock in opened:
        sock.close()


# --- raw HTTP over a socket --------------------------------------------------------------------
def wait_closed(sock: socket.socket, within: float) -> tuple[float | None, bytes]:
    """Read until the server closes the connection or `within` seconds pass: (seconds until the
    close, None if still open; everything read)."""
    started = time.monotonic()
    data = b""
    while True:
        left = within - (time.monotonic() - started)
        if left <= 0:
            return None, data
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            continue
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started, data
        if not chunk:
            return time.monotonic() - started, data
        data += chunk


def read_response(sock: socket.socket, within: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, headers in lower case, body)."""
    deadline = time.monotonic() + within
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, deadline)
    head, _, data = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(data) < length:
        data += _recv(sock, deadline)
    return status, headers, data[:length]


def _recv(sock: socket.socket, deadline: float) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no complete response in time")
    sock.settimeout(left)
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("connection closed before a complete response")
    return chunk


def request(method: str, path: str, body: bytes = b"", close: bool = False, headers: str = "") -> bytes:
    extra = "Connection: close\r\n" if close else ""
    length = f"Content-Length: {len(body)}\r\n" if body or method == "POST" else ""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}{length}{headers}\r\n".encode() + body


def assert_closed_on_time(closed_after: float | None, deadline: float, what: str) -> None:
    assert closed_after is not None, f"{what}: still open {deadline + SLACK:g} s later (deadline {deadline:g} s)"
    assert closed_after >= deadline * 0.8, f"{what}: closed after {closed_after:.2f} s, before its {deadline:g} s"


def closed_count(server: ThreadServer, reason: str) -> int:
    assert server.stats is not None
    return server.stats.closed[reason]


# --- (1) idle, (2) slowloris ------------------------------------------------------------------
def test_idle_connection_is_closed_after_header_timeout(serve, sockets):
    server = serve(header_timeout_s=0.6, keepalive_timeout_s=30)
    sock = sockets(server.port)
    closed_after, data = wait_closed(sock, 0.6 + SLACK)
    assert_closed_on_time(closed_after, 0.6, "a connection that sends nothing")
    assert data == b"", "nothing was asked, so nothing is answered"
    assert closed_count(server, "idle") == 1


@pytest.mark.slow
def test_slowloris_head_is_cut_after_header_timeout(serve, sockets):
    server = serve(header_timeout_s=1.0, keepalive_timeout_s=30)
    sock = sockets(server.port)
    head = request("GET", "/ok", headers="X-Padding: " + "a" * 200 + "\r\n")
    started = time.monotonic()
    closed_after = None
    data = b""
    for byte in head[:-4]:  # never the final blank line
        try:
            sock.send(bytes([byte]))
        except OSError:  # the server closed (or reset) the connection
            closed_after = time.monotonic() - started
            break
        after, more = wait_closed(sock, 0.2)
        data += more
        if after is not None:
            closed_after = time.monotonic() - started
            break
        if time.monotonic() - started > 1.0 + SLACK:
            break
    assert_closed_on_time(closed_after, 1.0, "a head sent one byte every 0.2 s")
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b'"error"' in data
    assert closed_count(server, "header_timeout") == 1


# --- (3) short body, (4) endless chunked body -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path", ["/echo", "/edge/echo", "/helper"])
def test_body_shorter_than_content_length_gets_408(serve, sockets, path):
    server = serve(header_timeout_s=5, body_timeout_s=0.6, keepalive_timeout_s=30)
    sock = sockets(server.port)
    sock.sendall(request("POST", path).replace(b"Content-Length: 0", b"Content-Length: 100") + b"x" * 10)
    closed_after, data = wait_closed(sock, 0.6 + SLACK)
    assert_closed_on_time(closed_after, 0.6, "a body 90 bytes short of its Content-Length")
    assert data.startswith(b"HTTP/1.1 408 "), data
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert "received 10 of 100 bytes" in error, error
    assert closed_count(server, "body_timeout") == 1


def test_read_body_bounds_the_read_on_a_plain_server(serve, sockets):
    # read_body's own bound, where no guarded protocol is there to cut the body
    server = serve(guarded=False, body_timeout_s=0.6)
    sock = sockets(server.port)
    sock.sendall(request("POST", "/helper").replace(b"Content-Length: 0", b"Content-Length: 100") + b"x" * 10)
    closed_after, data = wait_closed(sock, 0.6 + SLACK)
    assert_closed_on_time(closed_after, 0.6, "read_body of a body 90 bytes short of its Content-Length")
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert "received 10 of 100 bytes" in json.loads(data.partition(b"\r\n\r\n")[2])["error"]


def test_endless_chunked_body_is_cut_after_body_timeout(serve, sockets):
    server = serve(header_timeout_s=5, body_timeout_s=0.8, keepalive_timeout_s=30)
    sock = sockets(server.port)
    sock.sendall(request("POST", "/echo").replace(b"Content-Length: 0\r\n", b"Transfer-Encoding: chunked\r\n"))
    started = time.monotonic()
    data = b""
    closed_after = None
    while time.monotonic() - started < 0.8 + SLACK:
        try:
            sock.sendall(b"4\r\nabcd\r\n")  # a chunk every 0.1 s, and never the last one
        except OSError:  # the server closed (and reset) the connection
            closed_after = time.monotonic() - started
            break
        after, more = wait_closed(sock, 0.1)
        data += more
        if after is not None:
            closed_after = time.monotonic() - started
            break
    assert_closed_on_time(closed_after, 0.8, "an endless chunked body")
    # The client kept sending, so the close may arrive as a reset that discards the answer.
    if data:
        assert data.startswith(b"HTTP/1.1 408 "), data
        assert b"chunked request body not finished" in data
    assert closed_count(server, "body_timeout") == 1


# --- (5) idle keep-alive ----------------------------------------------------------------------
@pytest.mark.slow
def test_idle_keepalive_connection_is_closed_after_keepalive_timeout(serve, sockets):
    server = serve(header_timeout_s=0.5, keepalive_timeout_s=1.5)
    sock = sockets(server.port)
    sock.sendall(request("GET", "/ok"))
    status, headers, _ = read_response(sock)
    assert status == 200 and headers.get("connection", "").lower() != "close"
    finished = time.monotonic()
    # Idle between requests is the keep-alive timeout's business, not the head timeout's.
    still_open, _ = wait_closed(sock, 1.0)
    assert still_open is None, "an idle keep-alive connection was closed by the head timeout"
    closed_after, data = wait_closed(sock, 0.5 + SLACK)
    assert closed_after is not None, "an idle keep-alive connection is never closed"
    assert_closed_on_time(time.monotonic() - finished, 1.5, "an idle keep-alive connection")
    assert data == b""
    assert closed_count(server, "keepalive_timeout") == 1


# --- (6) a flood of idle sockets past max_connections -----------------------------------------
SERVER_SCRIPT = """
import asyncio, json, resource, sys
from aiohttp import web
from tests.router import test_http_guard as t

config = json.loads(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (config["nofile"], hard))
limits = t.HttpLimits(**config["limits"])

async def main():
    runner = t.make_runner(t.make_app(limits), limits, config["guarded"])
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test ends
    await runner.cleanup()

if config["loop"] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@contextlib.contextmanager
def process_server(limits: dict, nofile: int, loop: str):
    config = {"limits": limits, "nofile": nofile, "loop": loop, "guarded": GUARDED}
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, json.dumps(config)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline() if ready else b""
        assert line.strip().isdigit(), f"server process did not start (exit status {proc.poll()})"
        yield int(line)
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("loop", ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    sys.platform == "win32", reason="no uvloop"))])
@pytest.mark.slow
def test_idle_flood_past_max_connections_does_not_starve_requests(sockets, loop):
    pytest.importorskip(loop)
    cap = 20
    # A server process with 64 descriptors: 70 idle sockets would take them all (plain aiohttp
    # then never accepts another connection), and the head timeout is far too long to help.
    limits = {"header_timeout_s": 30, "keepalive_timeout_s": 30, "max_connections": cap}
    with process_server(limits, nofile=64, loop=loop) as port:
        flood = [sockets(port) for _ in range(cap + 50)]
        time.sleep(0.3)
        started = time.monotonic()
        sock = sockets(port, timeout=6)
        try:
            sock.sendall(request("GET", "/stats"))
            status, _, body = read_response(sock, within=6)
        except (TimeoutError, OSError) as exc:
            pytest.fail(f"a normal request behind {len(flood)} idle sockets got no answer: {exc!r}")
        assert status == 200
        assert time.monotonic() - started < 6
        stats = json.loads(body)
        # The server never held more than the cap (plus the one just accepted) ...
        assert stats["open"] <= cap + 1, stats
        # ... because idle sockets were evicted for new ones (or, while none was idle yet, refused).
        assert stats["closed"]["evicted"] + stats["closed"]["refused"] >= 50, stats
        # the flood's sockets: every one beyond the cap has been closed by the server
        still_open = sum(wait_closed(s, 0.01)[0] is None for s in flood)
        assert still_open <= cap, still_open


# --- (7) normal requests are untouched --------------------------------------------------------
@pytest.mark.slow
def test_normal_requests_still_work(serve, sockets):
    server = serve(header_timeout_s=0.6, body_timeout_s=0.6, keepalive_timeout_s=1.0)
    # keep-alive: two requests, then a POST, on one connection
    sock = sockets(server.port)
    for _ in range(2):
        sock.sendall(request("GET", "/ok"))
        assert read_response(sock)[0] == 200
    sock.sendall(request("POST", "/echo", b"y" * 5000))
    status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"bytes": 5000}
    # a head and a body sent in pieces, each well within its deadline
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    time.sleep(0.2)
    sock.sendall(b"Content-Length: 6\r\n\r\nabc")
    time.sleep(0.2)
    sock.sendall(b"def")
    status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"bytes": 6}
    # a complete chunked body
    sock.sendall(request("POST", "/helper").replace(b"Content-Length: 0\r\n", b"Transfer-Encoding: chunked\r\n")
                 + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    status, _, body = read_response(sock)
    assert status == 200 and json.loads(body) == {"bytes": 5}
    # a handler slower than every timeout, then another request on the same connection
    sock.sendall(request("GET", "/slow?s=1.5"))
    assert read_response(sock)[0] == 200
    sock.sendall(request("GET", "/ok"))
    assert read_response(sock)[0] == 200
    # without keep-alive
    other = sockets(server.port)
    other.sendall(request("GET", "/ok", close=True))
    status, headers, _ = read_response(other)
    assert status == 200 and headers.get("connection", "").lower() == "close"
    assert wait_closed(other, 2)[0] is not None
    # client_max_size still answers 413
    big = sockets(server.port)
    big.sendall(request("POST", "/echo", b"z" * (MAX_BODY + 1)))
    assert read_response(big)[0] == 413
    assert server.stats is not None
    assert server.stats.closed["body_timeout"] == 0 and server.stats.closed["header_timeout"] == 0


@pytest.mark.slow
def test_busy_connections_are_never_evicted(serve, sockets):
    server = serve(header_timeout_s=5, keepalive_timeout_s=30, max_connections=3)
    busy = [sockets(server.port) for _ in range(3)]
    for s in busy:
        s.sendall(request("GET", "/slow?s=1"))
    time.sleep(0.3)
    # All 3 connections are in a handler: a fourth is closed on accept and no handler is cancelled.
    refused = sockets(server.port)
    closed_after, data = wait_closed(refused, 1.0)
    assert closed_after is not None and data == b"", "a connection past the cap was kept"
    for s in busy:
        assert read_response(s)[0] == 200
    # Now they idle (keep-alive): a new connection evicts the least recently active one.
    fresh = sockets(server.port)
    fresh.sendall(request("GET", "/ok"))
    assert read_response(fresh)[0] == 200
    assert wait_closed(busy[0], 1.0)[0] is not None, "the least recently active idle connection was not evicted"
    for s in busy[1:]:
        s.sendall(request("GET", "/ok"))
        assert read_response(s)[0] == 200
    assert server.stats is not None
    assert server.stats.closed["refused"] == 1 and server.stats.closed["evicted"] == 1


# --- the module's own API ----------------------------------------------------------------------
def test_limits_defaults_and_validation():
    limits = HttpLimits()
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keepalive_timeout_s) == (10.0, 30.0, 20.0)
    assert limits.max_connections == 1024
    assert 1 <= limits.effective_max_connections() <= 1024
    assert HttpLimits(max_connections=0).effective_max_connections() == 0
    for bad in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"keepalive_timeout_s": 0}, {"max_connections": -1}):
        with pytest.raises(ValueError):
            HttpLimits(**bad)
    with pytest.raises(TypeError):
        http_guard.guarded_runner(web.Application(), limits, keepalive_timeout=5)
    stats = GuardStats()
    assert set(stats.closed) == set(CLOSE_REASONS) and not any(stats.closed.values())
    seen = []
    stats.on_close = seen.append
    stats.count_close("idle")
    assert seen == ["idle"] and stats.closed["idle"] == 1
    exc = BodyTimeout("request body incomplete")
    assert exc.status == 408 and json.loads(exc.text or "") == {"error": "request body incomplete"}
