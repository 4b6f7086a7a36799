"""The router's front door under load, failure and abuse: each test is one defect found by
probing a real router (real Redis, real HTTP engines on loopback), and fails without its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest

from kvtier.harness.embedded import free_port
from kvtier.schemas.subjects import subject_token

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens
from .test_router_proxy import EngineProcess, loads

MODEL = "door"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def _post_all(url: str, bodies: list[dict], headers: dict | None = None) -> list[tuple[int, dict, dict]]:
    """POST every body at once (one connection each), as a burst of clients would."""

    async def burst():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one(body):
                async with session.post(url, json=body, headers=headers) as response:
                    return response.status, await response.json(content_type=None), dict(response.headers)
            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(burst())


def test_a_burst_larger_than_the_redis_pool_waits_for_connections_instead_of_routing_blind(
        redis_client, redis_server):
    """Defect 1: a full Redis pool raised at once and was taken for an outage (decisions made
    without tier state, releases lost). Now a request waits for a connection."""
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    for w in ("w0", "w1", "w2", "w3"):
        seeder.worker(w, 4, tokens, device=2)
    router = RouterProcess(redis_server.url, "--redis-max-connections", "8")
    try:
        bodies = [{"model": MODEL, "token_ids": tokens, "request_id": f"burst-{i}"} for i in range(300)]
        answers = _post_all(router.url + "/v1/route", bodies)
        assert [a[0] for a in answers] == [200] * 300, {a[0] for a in answers}
        degraded = [a[1]["degraded"] for a in answers if a[1]["degraded"]]
        assert not degraded, degraded[:3]
        releases = _post_all(router.url + "/v1/release", [
            {"model": MODEL, "request_id": a[1]["request_id"], "stage": "complete", "owner": a[1]["owner"]}
            for a in answers])
        assert [r[0] for r in releases] == [200] * 300, {r[0] for r in releases}
        assert loads(redis_client, MODEL) == ({}, {})  # nothing left booked
        assert "state_store_unavailable" not in router.metrics()
    finally:
        stop_all(router)


def test_slow_streams_on_one_worker_do_not_hold_back_another(redis_client, redis_server, tmp_path):
    """Defect 2: one upstream pool of 100 for every worker: 100 slow streams on one model's
    worker made a chat for another model hang. Each worker now has a pool of its own."""
    hold = str(tmp_path / "go")
    slow, other = EngineProcess(hold), EngineProcess()
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, "slow-model").worker("slow", 4, url=slow.url)
    StateSeeder(redis_client, "other-model").worker("other", 4, url=other.url)
    router = RouterProcess(redis_server.url, "--proxy")

    async def scenario():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            streams = []
            for _ in range(110):
                response = await session.post(router.url + "/generate", json={
                    "model": "slow-model", "input_ids": tokens, "stream": True,
                    "sampling_params": {"max_new_tokens": 3}})
                assert response.status == 200
                await response.content.readline()  # its first chunk: the stream is open and held
                streams.append(response)
            started = time.monotonic()
            async with session.post(router.url + "/generate", json={"model": "other-model", "input_ids": tokens},
                                    timeout=aiohttp.ClientTimeout(total=10)) as response:
                assert response.status == 200, await response.text()
                took = time.monotonic() - started
            open(hold, "w").close()
            for response in streams:
                await response.read()
                response.release()
            return took

    try:
        took = asyncio.run(scenario())
        assert took < 5, took
    finally:
        stop_all(router)
        slow.stop()
        other.stop()


def test_a_dead_engine_is_migrated_away_from_then_left_out(redis_client, redis_server):
    """Defect 3 (the router's half) and migration: the worker holding the request's pages is
    dead (connection refused). Each request migrates to the live worker (X-Kvtier-Tried names
    the dead one); after --breaker-failures in a row the dead worker is left out (no more
    tries), shown in /healthz and the metrics."""
    live = EngineProcess()
    tokens = request_tokens(8, 4)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("dead", 4, tokens, device=8, url=f"http://127.0.0.1:{free_port()}")
    seeder.worker("live", 4, url=live.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--breaker-failures", "3",
                           "--breaker-backoff", "60")
    try:
        tried = []
        for _ in range(10):
            status, answer, headers = http("POST", router.url + "/generate", {"input_ids": tokens})
            assert status == 200 and headers["X-Kvtier-Worker"] == "live", (status, answer)
            tried.append(headers.get("X-Kvtier-Tried", ""))
        assert tried == ["dead"] * 3 + [""] * 7, tried
        health = http("GET", router.url + "/healthz")[1]
        assert [(c["model"], c["worker_id"], c["failures"]) for c in health["open_circuits"]] == [(MODEL, "dead", 3)]
        # kvtier doctor reads the same from the real router and warns
        from kvtier.tools.doctor import judge, observe, views

        findings = judge.check_router_front_door([observe.observe_router(router.url, 3.0)])
        assert [(f.check, f.status, f.subject) for f in findings] == [
            ("router_circuit", views.Status.WARN, f"{router.url} {MODEL}/dead")], findings
        wait_until(lambda: f'router_worker_circuit_open{{model="{MODEL}",worker="dead"}} 1.0' in router.metrics(),
                   timeout=5)
        metrics = router.metrics()
        assert 'router_upstream_failures_total{reason="refused"} 3.0' in metrics
        assert "router_migrations_total 3.0" in metrics
        wait_until(lambda: loads(redis_client, MODEL) == ({}, {}), timeout=10)  # no booking left behind
    finally:
        stop_all(router)
        live.stop()


class _Dropper:
    """An 'engine' that reads a request and closes the connection without a byte of answer
    (an engine dying mid-request), or after `head` bytes of one."""

    def __init__(self, head: bytes = b""):
        self.head = head
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    if self.head:
                        conn.sendall(self.head)
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.sock.close()


def test_an_engine_dropping_the_connection_gets_a_502_or_an_error_event_never_a_500(redis_client, redis_server):
    """Defect 7: aiohttp's ServerDisconnectedError was not caught: a text/plain 500. Before the
    first byte the request migrates (and, with no other worker, gets a JSON 502); after it, the
    stream ends with an error event."""
    event = b'data: {"text": "x", "i": 0}\n\n'
    before, after = _Dropper(), _Dropper(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                         b"Transfer-Encoding: chunked\r\n\r\n"
                                         + f"{len(event):x}\r\n".encode() + event + b"\r\n")
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, "drop-before").worker("w", 4, url=before.url)
    StateSeeder(redis_client, "drop-after").worker("w", 4, url=after.url)
    router = RouterProcess(redis_server.url, "--proxy")
    try:
        status, answer, headers = http("POST", router.url + "/v1/completions",
                                       {"model": "drop-before", "prompt": tokens, "max_tokens": 2})
        assert status == 502 and headers["Content-Type"].startswith("application/json"), (status, answer)
        assert answer["error"]["type"] == "server_error" and "disconnected" in answer["error"]["message"]
        status, body, _ = _raw_post(router.port, "/generate", {"model": "drop-after", "input_ids": tokens,
                                                                "stream": True})
        assert status == 200 and b'data: {"text": "x"' in body and b"mid-stream" in body and \
            body.rstrip().endswith(b"data: [DONE]"), body
        wait_until(lambda: loads(redis_client, "drop-before") == ({}, {}) and
                   loads(redis_client, "drop-after") == ({}, {}), timeout=10)
    finally:
        stop_all(router)
        before.close()
        after.close()


def _raw_post(port: int, path: str, body: dict, headers: bytes = b"") -> tuple[int, bytes, bytes]:
    """(status, body, head) of one HTTP/1.0 POST read to its end."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
                  b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        rest = _unchunk(rest)
    return int(head.split()[1]), rest, head


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def test_output_budgets_are_bounded_on_every_path(redis_client, redis_server):
    """Defect 6: max_tokens was unbounded on the OpenAI paths: >= 2^65 gave a 500 and leaked
    prefill load; near 2^63 it was booked as real load. Every path now refuses a budget over
    --max-new-tokens with a 400, and books nothing."""
    engine = EngineProcess()
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--max-new-tokens", "100000")
    try:
        for huge in (2 ** 65, 2 ** 63 - 1, 100001):
            for path, body in (("/v1/completions", {"prompt": tokens, "max_tokens": huge}),
                               ("/generate", {"input_ids": tokens, "sampling_params": {"max_new_tokens": huge}}),
                               ("/v1/route", {"model": MODEL, "token_ids": tokens, "max_new_tokens": huge})):
                status, answer, _ = http("POST", router.url + path, {"model": MODEL, **body})
                assert status == 400, (path, huge, status, answer)
                message = answer["error"]["message"] if path == "/v1/completions" else answer["error"]
                assert "max" in message, message
        assert loads(redis_client, MODEL) == ({}, {})
        assert _raw_post(router.port, "/v1/completions", {"prompt": tokens, "max_tokens": 3})[0] == 200
        status, answer, _ = http("POST", router.url + "/v1/route", {"model": MODEL, "token_ids": tokens,
                                                                     "max_new_tokens": 100000, "book": False})
        assert status == 200, answer  # the cap itself is accepted
    finally:
        stop_all(router)
        engine.stop()


def test_a_non_utf8_authorization_header_gets_a_401_not_a_500(redis_server):
    """Defect 11: a byte that is not UTF-8 in Authorization gave an unauthenticated 500."""
    router = RouterProcess(redis_server.url, "--auth-token", "s3cret")
    try:
        status, body, _ = _raw_post(router.port, "/v1/route", {"model": "m", "token_ids": [1]},
                                    headers=b"Authorization: Bearer \xff\xfe\r\n")
        assert status == 401 and json.loads(body)["error"] == "invalid bearer token", (status, body)
        assert "Traceback" not in router.output()
    finally:
        stop_all(router)


def test_model_names_keep_apart_and_unknown_aliases_are_refused(redis_client, redis_server):
    """Defects 8 and 9: 'org/chat-model', 'org_chat-model' and 'org chat-model' mapped to one
    state, so aliases were routed (and kept in the models routed for good)."""
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, "org/chat-model").worker("w", 4, tokens, device=1)
    router = RouterProcess(redis_server.url)
    try:
        assert http("POST", router.url + "/v1/route", {"model": "org/chat-model", "token_ids": tokens})[0] == 200
        for alias in ("org_chat-model", "org chat-model", "org.chat-model"):
            status, answer, _ = http("POST", router.url + "/v1/route", {"model": alias, "token_ids": tokens})
            assert status == 404 and "unknown model" in answer["error"], (alias, status, answer)
        assert http("GET", router.url + "/healthz")[1]["models"] == ["org/chat-model"]
        assert subject_token("org/chat-model") != subject_token("org_chat-model")
    finally:
        stop_all(router)


def test_proxied_bookings_belong_to_the_proxy(redis_client, redis_server):
    """Defect 10: the proxy's booking ids (in X-Kvtier-Request-Id) could be released by any
    client, and pre-booking a victim's /generate rid got the victim a 409."""
    engine = EngineProcess()
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL)
    try:
        # pre-book the victim's rid through the routing API: the victim is still served
        assert http("POST", router.url + "/v1/route", {"model": MODEL, "token_ids": tokens,
                                                         "request_id": "victim-1"})[0] == 200
        status, _, headers = http("POST", router.url + "/generate", {"input_ids": tokens, "rid": "victim-1"})
        assert status == 200 and headers["X-Kvtier-Request-Id"].startswith("proxy:"), headers
        for path, body in (("/v1/release", {"model": MODEL, "request_id": headers["X-Kvtier-Request-Id"],
                                            "stage": "complete", "owner": "a-guess"}),
                           ("/v1/route", {"model": MODEL, "token_ids": tokens, "request_id": "proxy:mine"})):
            status, answer, _ = http("POST", router.url + path, body)
            assert status == 400 and "proxy's own bookings" in answer["error"], (path, answer)
    finally:
        stop_all(router)
        engine.stop()


def test_tracing_headers_and_the_engine_key_reach_the_worker_the_client_token_does_not(redis_client, redis_server):
    """Defect 14: the proxy forwarded no header: no traceparent / X-Request-Id, and no way to
    send an engine API key."""
    engine = EngineProcess()
    tokens = request_tokens(4, 4)
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--auth-token", "router-token",
                           env={"KVTIER_ENGINE_API_KEY": "engine-key"})
    try:
        trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        status, body, _ = _raw_post(router.port, "/generate", {"input_ids": tokens}, headers=(
            f"Authorization: Bearer router-token\r\ntraceparent: {trace}\r\nX-Request-Id: req-42\r\n"
            "X-Secret: no\r\n").encode())
        assert status == 200, body
        seen = {k.lower(): v for k, v in http("GET", engine.url + "/headers")[1][-1].items()}
        assert seen["traceparent"] == trace and seen["x-request-id"] == "req-42", seen
        assert seen["authorization"] == "Bearer engine-key" and "x-secret" not in seen, seen
        # a session id the router cannot keep is refused, with what is wrong
        status, body, _ = _raw_post(router.port, "/generate", {"input_ids": tokens}, headers=(
            b"Authorization: Bearer router-token\r\nX-Session-Id: not a session id!\r\n"))
        assert status == 400 and b"X-Session-Id" in body, body
    finally:
        stop_all(router)
        engine.stop()


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from .test_openai_proxy import SPECIAL, TEMPLATE, WORDS

    vocab = {token: i for i, token in enumerate(["[UNK]", *SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return tmp_path


def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(redis_client, redis_server, tokenizer_dir):
    """Defect 4: text was tokenized whole before the size check (a 30 MB prompt: 26 s of CPU
    and +3 GB). A prompt over --max-prompt-bytes is refused at once, untokenized."""
    engine = EngineProcess()
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--tokenizer", f"{MODEL}={tokenizer_dir}",
                           "--max-prompt-bytes", "100000")
    try:
        huge = "hello " * 200_000  # 1.2 MB
        for path, body in (("/v1/completions", {"prompt": huge}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
            status, answer, _ = http("POST", router.url + path, body)
            assert status == 413 and "--max-prompt-bytes" in answer["error"]["message"], (path, answer)
        assert "router_tokenize_seconds_count 0.0" in router.metrics()
        assert _raw_post(router.port, "/v1/completions", {"prompt": "hello there", "max_tokens": 2})[0] == 200
    finally:
        stop_all(router)
        engine.stop()


def test_a_chat_of_many_empty_messages_is_refused_before_it_is_rendered(redis_client, redis_server, tokenizer_dir):
    """Defect 4 of issue 34: 900k empty messages (0 bytes of text) were rendered and tokenized
    whole before any limit (413 after 15.5 s, +1 GB). The message count, and the bytes a chat
    renders to (each message counted with what the template wraps it in), are checked before
    rendering; and rendering plus tokenizing is bounded in time (--tokenize-timeout)."""
    engine = EngineProcess()
    StateSeeder(redis_client, MODEL).worker("w", 4, url=engine.url)
    tokenizer = f"{MODEL}={tokenizer_dir}"
    router = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--tokenizer", tokenizer,
                           "--max-prompt-bytes", "100000")
    slow = RouterProcess(redis_server.url, "--proxy", "--model", MODEL, "--tokenizer", tokenizer,
                         "--tokenize-timeout", "0.001")
    try:
        url = router.url + "/v1/chat/completions"
        for count, flag in ((200_000, "--max-chat-messages"), (4000, "--max-prompt-bytes")):
            started = time.monotonic()
            status, answer, _ = http("POST", url, {"messages": [{"role": "user", "content": ""}] * count})
            assert status == 413 and flag in answer["error"]["message"], (count, answer)
            assert time.monotonic() - started < 5, "refused only after rendering"
        assert "router_tokenize_seconds_count 0.0" in router.metrics()
        # a normal chat is rendered and forwarded (this engine has no chat path: its 404 comes back)
        status, _, headers = http("POST", url, {"messages": [{"role": "user", "content": "hello there"}],
                                                "max_tokens": 2})
        assert status == 404 and headers.get("X-Kvtier-Worker") == "w", (status, headers)
        prose = " ".join(f"w{i % 400}" for i in range(20_000))  # ~100 KB of words: far more than a millisecond
        status, answer, _ = http("POST", slow.url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": prose}], "max_tokens": 2})
        assert status == 413 and "--tokenize-timeout" in answer["error"]["message"], answer
        assert "router_tokenize_timeouts_total 1.0" in slow.metrics()
    finally:
        stop_all(router, slow)
        engine.stop()


def test_a_flood_of_bad_requests_does_not_grow_the_log_without_bound(redis_server):
    """Defect 12: each bad request wrote 0.5-3.2 KB of log (aiohttp's traceback for a bad HTTP
    message), with no limit. Now at most --log-rate-limit records of a kind a minute."""
    router = RouterProcess(redis_server.url)
    try:
        before = len(router.output())
        for _ in range(600):
            with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
                s.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                s.settimeout(5)
                try:
                    s.recv(65536)
                except OSError:
                    pass
        time.sleep(0.5)
        grown = len(router.output()) - before
        assert 0 < grown < 30_000, grown  # ~200 KB without the limit
        assert http("GET", router.url + "/healthz")[0] == 200
    finally:
        stop_all(router)


def test_idle_and_slow_sockets_cannot_starve_normal_requests(redis_client, redis_server):
    """Defect 5: no server-side timeouts: idle sockets, slowloris heads and short bodies stayed
    open; under a 256-descriptor limit 300 of them made 10 of 10 normal requests fail. Now they
    are cut (--header-timeout, --body-timeout) and capped (--max-connections, under the limit)."""
    router = RouterProcess(redis_server.url, "--header-timeout", "2", "--body-timeout", "2",
                           prefix=("prlimit", "--nofile=256:256"))
    sockets = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
            if i % 3 == 1:  # slowloris: a head begun, never finished
                s.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\n")
            elif i % 3 == 2:  # a body shorter than its Content-Length
                s.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            sockets.append(s)
        ok = 0
        for _ in range(10):
            try:
                ok += http("GET", router.url + "/healthz", timeout=5)[0] == 200
            except OSError:
                pass
        assert ok == 10, ok
        # and every one of them is closed by the router within its timeouts
        deadline = time.monotonic() + 10
        for s in sockets:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while s.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        metrics = router.metrics()
        for reason in ("evicted", "header_timeout", "body_timeout"):
            assert f'router_connections_closed_total{{reason="{reason}"}} 0.0' not in metrics, reason
    finally:
        for s in sockets:
            s.close()
        stop_all(router)
