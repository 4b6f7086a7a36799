"""The real processes the fuzz suite feeds, each on a given nats-server and Redis (kvtier/harness/
embedded.py's servers): a bridge behind a raw SGLang-format PUB, a processor fed straight from
the events stream, and a `kvtier router --proxy` over seeded tier state. Each stack's `run`
checks what the processes made of the inputs against oracle.py; kvtier subcommands are started
and stopped by PID with kvtier/testing/processes.py."""

from __future__ import annotations

import asyncio
import http.client
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.harness.embedded import free_port
from kvtier.schemas.events import BridgeCursor, EventBatch, PagesStored, TierEvent, WorkerAnnounce, encode_message
from kvtier.schemas.hashes import BlockHash, sglang_block_hashes
from kvtier.schemas.sglang import AllBlocksCleared
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import DLQ_STREAM, EVENTS_STREAM, events_subject
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata
from kvtier.testing.processes import KvtierSubprocess, wait_announced, wait_http

from .oracle import (
    ROUTER_MAX_BODY,
    ROUTER_MAX_TOKENS,
    Violation,
    apply_tier_events,
    expect,
    expected_from_engine,
    processor_verdict,
)
from .valid_messages import MODEL


class Processes:
    """kvtier subcommands started here, each stopped by its PID."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtier-fuzz-")
        self.running: list[KvtierSubprocess] = []

    def start(self, name: str, *args: str) -> KvtierSubprocess:
        process = KvtierSubprocess(list(args), self.dir, name)
        self.running.append(process)
        return process

    def check(self) -> None:
        for process in self.running:
            process.check()

    def stop(self) -> None:
        for process in reversed(self.running):
            process.stop()
        self.running.clear()


def wait_for(predicate: Callable[[], Any], timeout: float, what: Callable[[], str] | str = "") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise Violation(f"timed out after {timeout}s waiting for {what() if callable(what) else what}; last {last!r}")


# --- dead letters --------------------------------------------------------------------------
def source_seq(headers: dict) -> int:
    """The events-stream sequence a dead letter was made from (0 when it does not say)."""
    try:
        return int(str(headers.get("Kvtier-Stream-Seq", 0)))
    except ValueError:
        return 0


async def dead_letters(js, after: int = 0) -> list[tuple[int, str, dict, bytes]]:
    """(stream seq, subject, headers, data) of the dead letters after stream seq `after`."""
    import nats.js.errors

    try:
        info = await js.stream_info(DLQ_STREAM)
    except nats.js.errors.NotFoundError:
        return []
    out = []
    for seq in range(max(after + 1, info.state.first_seq), info.state.last_seq + 1):
        msg = await js.get_msg(DLQ_STREAM, seq)
        out.append((seq, msg.subject, dict(msg.headers or {}), msg.data))
    return out


async def dead_letters_at(nats_url: str, after: int = 0) -> list[tuple[int, str, dict, bytes]]:
    """`dead_letters` over a connection of its own."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        return await dead_letters(nc.jetstream(), after)
    finally:
        await nc.close()


def last_dead_letter(nats_url: str) -> int:
    letters = asyncio.run(dead_letters_at(nats_url))
    return letters[-1][0] if letters else 0


def _nats_publish_raw(port: int, subject: bytes, data: bytes) -> None:
    """PUB with a subject nats-py would not send (not UTF-8); the server stores it as is."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n')
        sock.sendall(b"PUB " + subject + b" " + str(len(data)).encode() + b"\r\n" + data + b"\r\nPING\r\n")
        reply = b""
        while b"PONG" not in reply and b"-ERR" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        if b"-ERR" in reply:
            raise RuntimeError(f"nats-server refused the raw publish: {reply!r}")


def _worker_pages(client, model: str, worker: str) -> dict[BlockHash, set[Tier]]:
    from kvtier.consumers.apply import read_worker_pages

    return read_worker_pages(client, model, worker)


# --- the bridge ------------------------------------------------------------------------------
class BridgeStack:
    """A raw SGLang-format PUB (with its replay socket), one `kvtier bridge` on it, one
    `kvtier processor`, on the given NATS and Redis."""

    MODEL, WORKER = "fz-bridge", "w0"

    def __init__(self, nats_url: str, redis_url: str):
        import redis

        from kvtier.sim.sglang_publisher import SglangEventPublisher

        self.nats_url = nats_url
        self.client = redis.Redis.from_url(redis_url)
        self.publisher = SglangEventPublisher()
        self.processes = Processes()
        self.processor = self.processes.start("processor", "processor", "--nats", nats_url, "--redis", redis_url,
                                              "--reap-interval", "0.2")
        args = ["bridge", "--endpoint", self.publisher.endpoint, "--replay-endpoint", self.publisher.replay_endpoint,
                "--worker-id", self.WORKER, "--model", self.MODEL, "--page-size", "4", "--nats", nats_url,
                "--heartbeat", "0.5"]
        self.bridge = self.processes.start("bridge", *args)
        self._dlq_seen = 0
        try:
            wait_announced(self.client, self.MODEL, 1, self.processes.running, 30,
                           f"the bridge (log {self.bridge.log_path})")
            self._dlq_seen = last_dead_letter(nats_url)
        except BaseException:
            self.close()
            raise

    def state(self) -> dict[BlockHash, set[Tier]]:
        return _worker_pages(self.client, self.MODEL, self.WORKER)

    def send(self, items: list) -> tuple[dict[int, set[Tier]], int]:
        """Send `items` after a clearing batch: (the state they must leave, the dead letters they must make)."""
        reference: dict[int, set[Tier]] = {}
        expected_dead = 0
        self.publisher.publish([AllBlocksCleared()])
        for kind, data in items:
            if kind == "frames":
                self.publisher._pub.send_multipart(data)  # frames SGLang never sends: no public way
            else:
                self.publisher.publish_payload(data)
            events, dead = expected_from_engine((kind, data))
            apply_tier_events(reference, events)
            expected_dead += dead
        return reference, expected_dead

    def run(self, items: list, timeout: float = 30.0) -> int:
        """Send `items` after a clearing batch; check that Redis equals the reference of the
        valid events and that each bad payload/event/frame set left one dead letter with a
        reason, from the bridge (none from the processor). Returns the dead letters."""
        self._dlq_seen = last_dead_letter(self.nats_url)  # letters of an earlier, failed example do not count
        reference, expected_dead = self.send(items)
        got: list = []

        def settled() -> bool:
            self.processes.check()
            nonlocal got
            got = asyncio.run(self._letters())
            return len(got) >= expected_dead and self.state() == reference

        wait_for(settled, timeout, lambda: (f"Redis {sorted(self.state().items())[:8]} vs reference "
                                           f"{sorted(reference.items())[:8]}; {len(got)} of {expected_dead} dead "
                                           f"letters\nbridge: {self.bridge.tail(1500)}\nprocessor: "
                                           f"{self.processor.tail(1500)}"))
        time.sleep(0.2)  # nothing more may come
        got = asyncio.run(self._letters())
        self._dlq_seen = max([self._dlq_seen, *(seq for seq, *_ in got)])
        for _seq, subject, headers, _data in got:
            expect(subject == f"kvtier.dlq.bridge.{self.MODEL}.{self.WORKER}",
                   f"dead letter from {subject} ({headers.get('Kvtier-Reason')}): the processor refused what the "
                   "bridge forwarded")
            expect(bool(headers.get("Kvtier-Reason")), f"dead letter without a reason: {headers}")
        expect(len(got) == expected_dead, f"{len(got)} dead letters for {expected_dead} bad inputs: "
                                          f"{[h.get('Kvtier-Reason') for _, _, h, _ in got]}\n"
                                          f"bridge: {self.bridge.tail(3000)}")
        return len(got)

    async def _letters(self):
        return await self._letters_since(self._dlq_seen)

    async def _letters_since(self, after: int):
        return await dead_letters_at(self.nats_url, after)

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.publisher.close()
            self.client.close()


# --- the processor -----------------------------------------------------------------------------
class ProcessorStack:
    """One `kvtier processor`; messages published straight to the events stream."""

    MODEL, WORKER, FUZZ = "fz-proc", "good", "fz"

    def __init__(self, nats_url: str, redis_url: str, nats_port: int):
        import redis

        self.nats_url, self.nats_port = nats_url, nats_port
        self.client = redis.Redis.from_url(redis_url)
        self.processes = Processes()
        self.epoch, self.seq = int(time.time() * 1000), 0
        self._dlq_seen = 0
        self._events_from = 0
        asyncio.run(self._ensure_streams())
        self.processor = self.processes.start("processor", "processor", "--nats", nats_url, "--redis", redis_url,
                                              "--reap-interval", "0.2")
        self.reference: dict[int, set[Tier]] = {}

    async def _ensure_streams(self) -> None:
        import nats

        from kvtier.plumbing.streams import StreamSettings, ensure_streams

        nc = await nats.connect(self.nats_url)
        try:
            await ensure_streams(nc.jetstream(), StreamSettings())
            letters = await dead_letters(nc.jetstream(), 0)
            self._dlq_seen = letters[-1][0] if letters else 0
            # letters for messages published before this point belong to an earlier example,
            # however late the processor writes them (a slow machine, a timed-out example)
            self._events_from = (await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq
        finally:
            await nc.close()

    def state(self) -> dict[BlockHash, set[Tier]]:
        return _worker_pages(self.client, self.MODEL, self.WORKER)

    def good_batch(self, events: list[TierEvent]) -> EventBatch:
        self.seq += 1
        apply_tier_events(self.reference, events)
        return EventBatch(worker_id=self.WORKER, model=self.MODEL, epoch=self.epoch, seq=self.seq, ts=time.time(),
                          source_ts=time.time(), events=events)

    async def publish(self, items: list, good: list[list[TierEvent]]) -> None:
        """The fuzzed `items` interleaved with the good worker's batches of `good` events."""
        import nats

        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()
        try:
            for i in range(max(len(items), len(good))):
                if i < len(items):
                    tokens, data, raw = items[i]
                    if raw:
                        subject = b"kvtier.events." + tokens[0] + b"." + tokens[1]
                        await asyncio.to_thread(_nats_publish_raw, self.nats_port, subject, data)
                    else:
                        await js.publish(f"kvtier.events.{tokens[0]}.{tokens[1]}", data, timeout=5)
                if i < len(good):
                    batch = self.good_batch(good[i])
                    await js.publish(events_subject(self.MODEL, self.WORKER), encode_message(batch),
                                     headers={"Nats-Msg-Id": batch.msg_id}, timeout=5)
        finally:
            await nc.close()

    def run(self, items: list, good: list[list[TierEvent]], timeout: float = 30.0) -> int:
        """Publish the fuzzed `items` interleaved with good batches of events for the good
        worker; check that the good worker's state equals the reference and that each message
        the processor must refuse left one dead letter with a reason."""
        expected_dead = sum(processor_verdict(tokens, data) for tokens, data, _raw in items)
        asyncio.run(self._ensure_streams())  # letters of an earlier, failed example do not count
        asyncio.run(self.publish(items, good))
        got: list = []

        def settled() -> bool:
            self.processes.check()
            nonlocal got
            got = asyncio.run(self._letters())
            applied = self.client.hget(ModelKeys.for_model(self.MODEL).state(self.WORKER), "seq")
            return len(got) >= expected_dead and int(applied or 0) == self.seq and self.state() == self.reference

        wait_for(settled, timeout, lambda: (f"Redis {sorted(self.state().items())[:8]} vs "
                                           f"{sorted(self.reference.items())[:8]}; {len(got)} of {expected_dead} "
                                           f"dead letters\nprocessor: {self.processor.tail(2500)}"))
        time.sleep(0.2)
        got = asyncio.run(self._letters())
        self._dlq_seen = max([self._dlq_seen, *(seq for seq, *_ in got)])
        for _seq, subject, headers, _data in got:
            expect(subject.startswith("kvtier.dlq.processor."), f"dead letter on {subject}")
            expect(bool(headers.get("Kvtier-Reason")), f"dead letter without a reason: {headers}")
        expect(len(got) == expected_dead, f"{len(got)} dead letters for {expected_dead} bad messages: "
                                          f"{[(source_seq(h), h.get('Kvtier-Reason')) for _, _, h, _ in got]} "
                                          f"(events from stream seq {self._events_from})")
        return len(got)

    async def _letters(self):
        letters = await dead_letters_at(self.nats_url, self._dlq_seen)
        return [letter for letter in letters if source_seq(letter[2]) > self._events_from]

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.client.close()


# --- the router ------------------------------------------------------------------------------
class StubEngine:
    """SGLang's /generate as a proxying router reaches it (answers at once), in a thread."""

    def __init__(self):
        from aiohttp import web

        async def generate(request):
            await request.read()
            return web.json_response({"text": "", "meta_info": {}})

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", generate)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="stub-engine", daemon=True)
        self._thread.start()
        ready.wait(10)

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class RouterStack:
    """`kvtier router --proxy` with small limits (--max-request-tokens 256, --max-body-bytes
    16 KiB) over three live workers of MODEL whose engine is a StubEngine."""

    WORKERS = ("w0", "w1", "w2")

    def __init__(self, redis_url: str, model: str = MODEL):
        import redis

        self.model = model
        self.engine = StubEngine()
        self.client = redis.Redis.from_url(redis_url)
        self._seed_workers()
        self.processes = Processes()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router = self.processes.start(
            "router", "router", "--redis", redis_url, "--http-port", str(self.port), "--proxy", "--model", model,
            "--max-request-tokens", str(ROUTER_MAX_TOKENS), "--max-body-bytes", str(ROUTER_MAX_BODY))
        try:
            asyncio.run(self._wait_up())
        except BaseException:
            self.close()
            raise
        self.used_ids: set[str] = set()

    def _seed_workers(self) -> None:
        """Three announced workers, holding 2, 6 and 10 pages of one prompt on the GPU."""
        from kvtier.consumers.apply import TierStateWriter

        writer = TierStateWriter(self.client)
        tokens = list(range(1, 65))
        for i, worker in enumerate(self.WORKERS):
            meta = WorkerMetadata(worker_id=worker, model=self.model, page_size=4, http_endpoint=self.engine.url)
            writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600,
                                           cursor=BridgeCursor(epoch=1, seq=0)))
            hashes = [BlockHash(h) for h in sglang_block_hashes(tokens, 4)][: 4 * i + 2]
            result = writer.apply(EventBatch(worker_id=worker, model=self.model, epoch=1, seq=1, ts=time.time(),
                                             source_ts=time.time(),
                                             events=[PagesStored(tier=Tier.DEVICE, hashes=hashes)]))
            assert result.status == 0, result

    async def _wait_up(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await wait_http(session, f"{self.url}/healthz", self.processes.running, 30)

    def request(self, method: str, path: str, body: bytes, timeout: float = 15.0,
                content_type: str = "application/json") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body or None, headers={"Content-Type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.engine.close()
            self.client.close()
