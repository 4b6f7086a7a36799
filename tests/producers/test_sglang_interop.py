"""Interop: `kvtier bridge` fed by SGLang's OWN publisher code, not kvtier's stand-in.

Every batch here leaves through `sglang.srt.disaggregation.kv_events.ZmqEventPublisher` of the
installed SGLang wheel (made by SGLang's `EventPublisherFactory` from a `--kv-events-config`
JSON, i.e. SGLang's `KVEventsConfig`), which numbers the batches, encodes them with its own
msgspec encoder, sends `[topic, seq, payload]` on its PUB socket and serves its ROUTER replay
socket from its own buffer. The events are SGLang's `KVEventBatch`, `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` objects, carrying page hashes computed with kvtier's
`sglang_block_hashes` (SGLang's sha256 page chain), so a router hashing request tokens finds
them. Then: real `kvtier bridge`, nats-server (JetStream), `kvtier processor`, Redis and
`kvtier router`, each on free loopback ports, stopped by PID.

The expected tier state (`TierView`) is applied from the SGLang objects here, with the medium
table written out below, independently of kvtier's decoder. The wheel is loaded by
`tests/sglang_loader.py` (no torch); without it every test fails with the pip command.
"""

from __future__ import annotations

import atexit
import time

import msgspec
import pytest
import redis

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.harness.embedded import free_port, port_is_free
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.tiers import Tier

from ..helpers import KvtierProcess, RunningPipeline, processor_process, stop_all, wait_until, worker_announced
from ..router_helpers import RouterProcess, StateSeeder
from ..sglang_loader import load_kv_events

MODEL = "Qwen/Qwen3-8B"
PAGE = 4
#: SGLang's medium strings as HiRadixCache emits them; a store without medium is GPU.
TIER_OF_MEDIUM = {None: Tier.DEVICE, "GPU": Tier.DEVICE, "CPU_PINNED": Tier.HOST}
#: The fields of SGLang <= 0.5.19's events, in order (checked against that wheel's kv_events.py:
#: `KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True)`, no omit_defaults).
LEGACY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@pytest.fixture(scope="module")
def kv():
    return load_kv_events()  # raises with the pip command when the wheel is missing: a failure, not a skip


def legacy_array(event) -> list:
    """An SGLang 0.5.23 event as <= 0.5.19 laid it out: a tagged array of the old fields."""
    name = type(event).__name__
    return [name, *(getattr(event, f) for f in LEGACY_FIELDS[name])]


def chain(seed: int, pages: int) -> tuple[list[int], list[int]]:
    """Tokens of `pages` full pages and their SGLang page hashes."""
    tokens = [(seed * 104_729 + i * 7_919) % 150_000 + 1 for i in range(pages * PAGE)]
    return tokens, sglang_block_hashes(tokens, PAGE)


class TierView:
    """What the worker holds per tier, applied from SGLang's own event objects."""

    def __init__(self, kv):
        self.kv, self.pages = kv, {}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, self.kv.BlockStored):
                for h in event.block_hashes:
                    self.pages.setdefault(h, set()).add(TIER_OF_MEDIUM[event.medium])
            elif isinstance(event, self.kv.BlockRemoved):
                for h in event.block_hashes:
                    tiers = self.pages.get(h, set())
                    tiers.discard(TIER_OF_MEDIUM[event.medium])
                    if not tiers:
                        self.pages.pop(h, None)
            elif isinstance(event, self.kv.AllBlocksCleared):
                self.pages.clear()
            else:
                raise TypeError(type(event))


class DroppingPub:
    """Wraps SGLang's PUB socket and drops the frames of chosen seqs, as a PUB socket at its
    high-water mark drops silently; SGLang's replay buffer keeps them (it appends after send)."""

    def __init__(self, sock, drop: set[int]):
        self.sock, self.drop, self.dropped = sock, set(drop), []

    def send_multipart(self, frames, *args, **kwargs):
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.dropped.append(seq)
            return None
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


class SglangWorker:
    """One SGLang KV-event publisher, built the way the scheduler builds it:
    `EventPublisherFactory.create(--kv-events-config, attn_dp_rank)`; DP rank r binds base + r."""

    def __init__(self, kv, pub_base: int, replay_base: int, dp_rank: int = 0, topic: str = ""):
        self.kv, self.dp_rank = kv, dp_rank
        self.config = kv.KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_base}", bind=True,
                                        replay_endpoint=f"tcp://127.0.0.1:{replay_base}", topic=topic).model_dump_json()
        self.endpoint = f"tcp://127.0.0.1:{pub_base + dp_rank}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_base + dp_rank}"
        self.view = TierView(kv)
        self.publisher = self._start()

    def _start(self):
        publisher = self.kv.EventPublisherFactory.create(self.config, attn_dp_rank=self.dp_rank)
        assert isinstance(publisher, self.kv.ZmqEventPublisher)
        assert publisher.describe_local_source(PAGE)["endpoint"] == self.endpoint  # SGLang's own port rule
        return publisher

    def publish(self, *events, encoding: str = "map") -> None:
        if encoding == "map":  # 0.5.23's native layout: SGLang's structs as they are
            batch = self.kv.KVEventBatch(ts=time.time(), events=list(events))
        else:  # <= 0.5.19: same batch struct, events as tagged arrays
            batch = self.kv.EventBatch(ts=time.time(), events=[legacy_array(e) for e in events])
        self.publisher.publish(batch)  # SGLang fills in attn_dp_rank, seq, and encodes
        self.view.apply(events)

    def wait_sent(self) -> None:
        """Until SGLang's publisher thread has sent (and buffered) every queued batch."""
        wait_until(lambda: self.publisher._event_queue.unfinished_tasks == 0, timeout=10,
                   what="SGLang's publisher thread to drain its queue")

    def drop_on_pub(self, seqs: set[int]) -> DroppingPub:
        self.publisher._pub = DroppingPub(self.publisher._pub, seqs)
        return self.publisher._pub

    def close(self) -> None:
        self.publisher.shutdown()
        atexit.unregister(self.publisher.shutdown)  # else every publisher's shutdown runs again at exit

    def restart(self) -> None:
        """A new engine process on the same ports: SGLang's seq starts from 0, empty buffer."""
        self.close()
        ports = [int(e.rsplit(":", 1)[1]) for e in (self.endpoint, self.replay_endpoint)]
        wait_until(lambda: all(port_is_free(p) for p in ports), timeout=10, what=f"ports {ports} released")
        self.view = TierView(self.kv)
        self.publisher = self._start()


def free_run(n: int) -> int:
    """First of n consecutive free loopback ports."""
    for _ in range(50):
        base = free_port()
        if all(port_is_free(base + i) for i in range(n)):
            return base
    raise AssertionError(f"no {n} consecutive free ports")


def stored(kv, hashes, tokens, medium="GPU", parent=None, **extra):
    if medium is not None:  # left unset, SGLang omits it from the map (omit_defaults)
        extra["medium"] = medium
    return kv.BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                          block_size=PAGE, lora_id=None, **extra)


def removed(kv, hashes, medium="GPU"):
    return kv.BlockRemoved(block_hashes=list(hashes), medium=medium)


def converge(client: redis.Redis, worker: str, view: TierView, *processes: KvtierProcess, timeout: float = 30) -> None:
    def diff() -> str:
        actual = read_worker_pages(client, MODEL, worker)
        logs = "\n".join(p.output()[-1500:] for p in processes)
        return (f"{worker}: Redis {len(actual)} pages, expected {len(view.pages)}; missing/wrong "
                f"{[(h, t) for h, t in view.pages.items() if actual.get(h) != t][:4]}, extra "
                f"{[h for h in actual if h not in view.pages][:4]}; state "
                f"{read_worker_state(client, MODEL, worker)}\n{logs}")

    wait_until(lambda: read_worker_pages(client, MODEL, worker) == view.pages, timeout=timeout, what=diff)


def overlaps(router: RouterProcess, tokens: list[int]) -> tuple[str, dict[str, dict]]:
    status, body, _ = router.route(MODEL, tokens, book=False)
    assert status == 200, body
    return body["worker_id"], {c["worker_id"]: c["overlap"] for c in body["candidates"]}


def tiers(device=0, host=0, disk=0) -> dict:
    return {"device": device, "host": host, "disk": disk, "shared_beyond": 0, "predicted": 0}


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["map", "array"], ids=["map-0.5.23", "array-0.5.19"])
def test_sglang_publisher_state_and_routing(kv, nats_server, redis_server, redis_client, encoding):
    """(a) SGLang 0.5.23's map events and (b) the tagged arrays of <= 0.5.19, each through
    SGLang's own ZmqEventPublisher, end in exactly the published tier state, and a router sends
    a request sharing the stored prefix to that worker with the expected per-tier overlap.

    SGLang's in both cases: the publisher (factory, config, PUB socket, seq numbering, msgpack
    encoder, replay buffer) and the event objects the batch is made from. Reconstructed for (b):
    SGLang 0.5.23 has no switch back to arrays, so each event is handed to the publisher as
    `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`
    / `["BlockRemoved", block_hashes, medium]` / `["AllBlocksCleared"]` (the field order of
    0.5.19's array_like structs), inside SGLang's own `EventBatch`, so the outer
    `[ts, events, attn_dp_rank]` and the frames are still SGLang's encoder's output."""
    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    tokens, h = chain(1, 6)
    other_tokens, o = chain(2, 2)
    seeder = StateSeeder(redis_client, MODEL)
    seeder.worker("cold", PAGE)  # a live worker holding nothing: the request must not land there
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=worker) as run:
        router = RouterProcess(redis_server.url)
        try:
            publish = lambda *events: worker.publish(*events, encoding=encoding)  # noqa: E731
            publish(stored(kv, h[:4], tokens[:16]))                                     # prefill: 4 pages on GPU
            publish(stored(kv, h[4:], tokens[16:], parent=h[3]),                       # extended by 2 pages
                    stored(kv, o, other_tokens, medium=None))                          # medium omitted = GPU
            publish(stored(kv, h, tokens, medium="CPU_PINNED", session_id="s-1"))     # write-through backup
            publish(removed(kv, h[4:]), removed(kv, o))                                # device eviction
            converge(redis_client, "w0", worker.view, run.bridge, run.processor)
            sent = [e for _, p in worker.publisher._buffer for e in msgspec.msgpack.decode(p)[1]]
            assert len(sent) == 6 and all(isinstance(e, dict if encoding == "map" else list) for e in sent)
            assert worker.view.pages == {**{p: {Tier.DEVICE, Tier.HOST} for p in h[:4]},
                                         **{p: {Tier.HOST} for p in h[4:]}}
            chosen, by_worker = overlaps(router, tokens + [9, 9])  # + a partial page, never hashed
            assert chosen == "w0"
            assert by_worker == {"w0": tiers(device=4, host=2), "cold": tiers()}
            # the other prefix left the device: a request for it sees nothing anywhere
            assert overlaps(router, other_tokens)[1]["w0"] == tiers()

            publish(kv.AllBlocksCleared())                                             # flush_cache
            publish(stored(kv, h[:2], tokens[:8], medium="CPU_PINNED"))               # L3 -> host prefetch
            converge(redis_client, "w0", worker.view, run.bridge, run.processor)
            assert worker.view.pages == {p: {Tier.HOST} for p in h[:2]}
            assert overlaps(router, tokens)[1]["w0"] == tiers(host=2)
            state = run.state()
            assert state["stale"] == "0" and state["last_epoch_reason"] == "bridge_start", state
        finally:
            stop_all(router)


@pytest.mark.slow
def test_missed_batches_come_back_from_sglang_replay_socket(kv, nats_server, redis_server, redis_client):
    """(c) Batches the bridge never saw on SGLang's PUB socket are recovered from SGLang's ROUTER
    replay socket, in the same epoch (no clear, not stale): sent before any bridge subscribed,
    sent while the bridge was down, and one dropped on the PUB path while the bridge runs."""
    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    chains = [chain(10 + i, 3) for i in range(7)]
    # 1. before the bridge exists: SGLang's PUB has no subscriber, only its buffer keeps them
    worker.publish(stored(kv, chains[0][1], chains[0][0]))
    worker.publish(stored(kv, chains[0][1], chains[0][0], medium="CPU_PINNED"), stored(kv, chains[1][1], chains[1][0]))
    worker.wait_sent()
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=worker) as run:
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        first = run.state()
        assert first["stale"] == "0" and first["last_epoch_reason"] == "bridge_start", first

        # 2. the bridge is down while SGLang publishes; the restarted bridge resumes its epoch
        assert run.bridge.stop() == 0, run.bridge.output()[-3000:]
        worker.publish(removed(kv, chains[0][1]), stored(kv, chains[2][1], chains[2][0]))
        worker.publish(stored(kv, chains[3][1], chains[3][0], medium="CPU_PINNED"))
        worker.wait_sent()
        run.start_bridge()
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        assert len(worker.view.pages) == 12

        # 3. seq 4 is lost on the PUB path while the bridge runs: the gap is filled from replay
        dropper = worker.drop_on_pub({4})
        worker.publish(removed(kv, chains[1][1]), stored(kv, chains[4][1], chains[4][0]))  # seq 4: dropped
        worker.publish(stored(kv, chains[5][1], chains[5][0]))                              # seq 5
        worker.publish(stored(kv, chains[6][1], chains[6][0], medium="CPU_PINNED"))          # seq 6
        worker.wait_sent()
        assert dropper.dropped == [4]
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        assert set(chains[4][1]) <= set(read_worker_pages(redis_client, MODEL, "w0"))  # only replay had them
        state = run.state()
        # one epoch throughout: nothing was rebuilt, everything was recovered
        assert (state["epoch"], state.get("epochs")) == (first["epoch"], first.get("epochs")), (first, state)
        assert state["stale"] == "0" and state["last_epoch_reason"] == "bridge_start", state


@pytest.mark.slow
def test_dp_ranks_each_publish_on_base_plus_rank(kv, nats_server, redis_server, redis_client):
    """(d) Two SGLang publishers, attention-DP ranks 0 and 1, from one --kv-events-config with a
    topic (SGLang puts rank r on port base + r, PUB and replay), into one `kvtier bridge
    --dp-size 2 --topic`: each rank's state lands on its own kvtier worker, and the router tells
    them apart."""
    base = free_run(4)
    # the rank the scheduler hands the factory, by SGLang's own rule (attn_dp_size 2: attn_dp_rank)
    ranks = [SglangWorker(kv, base, base + 2, topic="kv-events",
                          dp_rank=kv.select_kv_publisher_dp_rank(attn_dp_size=2, attn_dp_rank=r, dp_rank=None))
             for r in range(2)]
    processor = processor_process(nats_server.url, redis_server.url)
    bridge = KvtierProcess("bridge", "--endpoint", f"tcp://127.0.0.1:{base}", "--replay-endpoint",
                           f"tcp://127.0.0.1:{base + 2}", "--worker-id", "engine7", "--model", MODEL,
                           "--page-size", str(PAGE), "--nats", nats_server.url, "--dp-size", "2",
                           "--topic", "kv-events", "--heartbeat", "0.5")
    router = None
    try:
        for r in range(2):
            wait_until(lambda r=r: worker_announced(redis_client, MODEL, f"engine7-dp{r}"), timeout=30,
                       what=lambda: f"rank announced\n{bridge.output()[-2000:]}")
        x_tokens, x = chain(30, 4)
        y_tokens, y = chain(31, 3)
        ranks[0].publish(stored(kv, x, x_tokens))
        ranks[1].publish(stored(kv, x, x_tokens, medium="CPU_PINNED"), stored(kv, y, y_tokens))
        ranks[1].publish(removed(kv, y[2:]))
        for r in range(2):
            converge(redis_client, f"engine7-dp{r}", ranks[r].view, bridge, processor)
        assert ranks[0].view.pages != ranks[1].view.pages
        assert [msgspec.msgpack.decode(w.publisher._buffer[0][1])[2] for w in ranks] == [0, 1]  # attn_dp_rank
        router = RouterProcess(redis_server.url)
        chosen, by_worker = overlaps(router, x_tokens)
        assert chosen == "engine7-dp0"
        assert by_worker == {"engine7-dp0": tiers(device=4), "engine7-dp1": tiers(host=4)}
        chosen, by_worker = overlaps(router, y_tokens)
        assert chosen == "engine7-dp1"
        assert by_worker == {"engine7-dp0": tiers(), "engine7-dp1": tiers(device=2)}
    finally:
        for rank in ranks:
            rank.close()
        stop_all(*[p for p in (router, bridge, processor) if p is not None])


@pytest.mark.slow
def test_sglang_publisher_restart_starts_a_new_epoch(kv, nats_server, redis_server, redis_client):
    """(e) SGLang's publisher shut down and a new one started on the same ports (its seq starts
    from 0 again): the bridge begins a new epoch, the old engine's pages are cleared and the new
    one's are present. Then the same while the bridge is down: the new engine's buffer holds a
    batch with the seq of the bridge's cursor but another ts, so the bridge must not resume."""
    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    old = [chain(40 + i, 2) for i in range(6)]
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=worker) as run:
        for tokens, hashes in old:  # seq 0..5
            worker.publish(stored(kv, hashes, tokens))
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        before = run.state()

        worker.restart()
        time.sleep(1.0)  # an engine restart takes longer than the bridge's ZMQ reconnect
        new = [chain(50 + i, 2) for i in range(3)]
        for tokens, hashes in new:  # seq 0..2: below the bridge's next expected seq (6)
            worker.publish(stored(kv, hashes, tokens, medium="CPU_PINNED"))
            time.sleep(0.2)
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        after = run.state()
        assert after["last_epoch_reason"] == "publisher_restart", after
        assert int(after["epoch"]) > int(before["epoch"]) and after["stale"] == "0", (before, after)
        assert not set(read_worker_pages(redis_client, MODEL, "w0")) & {h for _, hs in old for h in hs}

        # the bridge is down across the next restart; the new engine reaches the cursor's seq (2)
        assert run.bridge.stop() == 0, run.bridge.output()[-3000:]
        worker.restart()
        third = [chain(60 + i, 2) for i in range(4)]
        for tokens, hashes in third:  # seq 0..3, with other ts than the old seq 0..2
            worker.publish(stored(kv, hashes, tokens))
        worker.wait_sent()
        run.start_bridge()
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        final = run.state()
        assert int(final["epoch"]) > int(after["epoch"]) and final["last_epoch_reason"] == "bridge_start", final
        assert worker.view.pages == {h: {Tier.DEVICE} for _, hs in third for h in hs}


def test_sglang_replay_reply_layout_is_what_the_bridge_parses(kv):
    """The replay conversation itself, against SGLang's ROUTER socket: kvtier's ReplaySocketClient
    gets every buffered batch (seq, payload byte for byte) and stops at SGLang's end marker."""
    import asyncio

    import zmq.asyncio

    from kvtier.producers.sglang_source import ReplaySocketClient
    from kvtier.schemas.sglang import decode_payload

    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    try:
        tokens, h = chain(70, 2)
        worker.publish(stored(kv, h, tokens))
        worker.publish(removed(kv, h[1:]), encoding="array")
        worker.publish(kv.AllBlocksCleared())
        worker.wait_sent()
        ctx = zmq.asyncio.Context()
        try:
            batches = asyncio.run(ReplaySocketClient(ctx, worker.replay_endpoint, timeout_s=5).fetch(1))
        finally:
            ctx.term()
        assert [b.seq for b in batches] == [1, 2]
        assert [bytes(p) for _, p in worker.publisher._buffer][1:] == [b.payload for b in batches]
        decoded = [decode_payload(b.payload) for b in batches]
        assert [d.attn_dp_rank for d in decoded] == [0, 0] and not any(d.rejected for d in decoded)
        assert [type(e).__name__ for d in decoded for e in d.events] == ["BlockRemoved", "AllBlocksCleared"]
        assert decoded[0].events[0].block_hashes == h[1:] and decoded[0].events[0].medium == "GPU"
        assert msgspec.msgpack.decode(batches[0].payload)[1][0][0] == "BlockRemoved"  # really a tagged array
    finally:
        worker.close()


def test_loader_without_the_wheel_fails_naming_the_pip_command():
    """Where SGLang is not installed (here: `python -S`, no site-packages) the loader raises,
    so the interop tests fail (never skip) with the command that installs it."""
    import os
    import subprocess
    import sys

    code = "import sglang_loader; sglang_loader.load_kv_events()"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where sglang_loader.py is
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tests, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "SglangNotInstalled" in result.stderr, result.stderr
    assert "-m pip install --no-deps sglang==0.5.23" in result.stderr, result.stderr


@pytest.mark.slow
def test_restart_hidden_behind_a_gap_starts_a_new_epoch(kv, nats_server, redis_server, redis_client):
    """(e') The engine restarts while the bridge is cut off (a partition, a slow reconnect): the
    new engine's first batches never reach the bridge, which next sees a seq *above* the one it
    expects. Its replay buffer then holds the new engine's batches from that seq on, but not the
    last batch the bridge forwarded (same seq, same ts), so this is no gap to fill: the old
    engine's pages must go and the new engine's state be rebuilt from the whole buffer."""
    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=worker) as run:
        old = [chain(90 + i, 2) for i in range(2)]
        for tokens, hashes in old:  # old engine: seq 0, 1; the bridge expects 2 next
            worker.publish(stored(kv, hashes, tokens))
        converge(redis_client, "w0", worker.view, run.bridge, run.processor)
        before = run.state()
        worker.restart()
        dropper = worker.drop_on_pub({0, 1, 2})  # lost while the bridge was cut off
        for i, (tokens, hashes) in enumerate([chain(95 + i, 2) for i in range(4)]):  # new engine: seq 0..3
            if i == 3:
                time.sleep(1.0)  # the bridge's SUB is connected to the new engine again
            worker.publish(stored(kv, hashes, tokens, medium="CPU_PINNED"))
        worker.wait_sent()
        assert dropper.dropped == [0, 1, 2]
        converge(redis_client, "w0", worker.view, run.bridge, run.processor, timeout=15)
        after = run.state()
        assert int(after["epoch"]) > int(before["epoch"]) and after["stale"] == "0", (before, after)

@pytest.mark.slow
def test_eagle_bigram_pages_are_stored(kv, nats_server, redis_server, redis_client):
    """With speculative decoding (EAGLE) SGLang's radix keys are bigrams, and its event recorder
    (sglang/srt/mem_cache/events.py, `record_store`: "bigram pages expose tuples") publishes a
    page's token_ids as [a, b] pairs. The worker holds those pages all the same, so the tier
    state must hold them too (a router cannot match them by tokens; that is the hash check's
    business, not a reason to drop the event)."""
    base = free_run(2)
    worker = SglangWorker(kv, base, base + 1)
    tokens, h = chain(80, 2)
    after_tokens, after = chain(81, 1)
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, publisher=worker) as run:
        raw = tokens + [after_tokens[0]]  # a bigram key of N pairs spans N + 1 raw tokens
        pairs = [(raw[j], raw[j + 1]) for j in range(len(tokens))]  # as record_store builds page_tokens
        worker.publish(kv.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=pairs, block_size=PAGE,
                                      lora_id=None, medium="GPU"))
        worker.publish(stored(kv, after, after_tokens))  # a plain store after it: the batch was processed
        wait_until(lambda: set(after) <= set(read_worker_pages(redis_client, MODEL, "w0")), timeout=30,
                   what=lambda: run.bridge.output()[-2000:])
        assert read_worker_pages(redis_client, MODEL, "w0") == worker.view.pages, run.bridge.output()[-2000:]
