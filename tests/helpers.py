"""Shared test machinery: a seeded HiCache-like event workload with its reference model,
kvtier CLI processes started and stopped by PID, and polling helpers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.schemas.hashes import BlockHash, sglang_block_hashes
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored, SglangEvent
from kvtier.schemas.tiers import Tier, tier_of_medium

GPU, HOST = "GPU", "CPU_PINNED"


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05,
               what: str | Callable[[], str] = "") -> object:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    detail = what() if callable(what) else (what or predicate)
    raise AssertionError(f"timed out after {timeout}s waiting for {detail}; last value {last!r}")


@dataclass
class ReferenceModel:
    """What a worker holds per tier, from the events it emitted, applied in order."""

    pages: dict[BlockHash, set[Tier]] = field(default_factory=dict)

    def apply(self, events: list[SglangEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.pages.setdefault(h, set()).add(tier_of_medium(event.medium))
            elif isinstance(event, BlockRemoved):
                tier = tier_of_medium(event.medium)
                for h in event.block_hashes:
                    tiers = self.pages.get(h)
                    if tiers is not None:
                        tiers.discard(tier)
                        if not tiers:
                            del self.pages[h]
            elif isinstance(event, AllBlocksCleared):
                self.pages.clear()

    def clear(self) -> None:
        self.pages.clear()


class HiCacheWorkload:
    """Seeded write-through HiCache event stream: prefill -> GPU, backup -> host (after the
    copy), device eviction, load back, host eviction. A page is always stored on its new tier
    before it leaves the old one, and a finally removed page never comes back; the sequences
    do not commute, so applying them out of order gives a different state."""

    def __init__(self, seed: int, page_size: int = 4, max_chain: int = 6):
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.max_chain = max_chain
        self.on_gpu: set[BlockHash] = set()
        self.on_host: set[BlockHash] = set()
        self.finally_removed: set[BlockHash] = set()
        self.parents: dict[BlockHash, BlockHash | None] = {}
        self._token = seed * 1_000_000

    def _pick(self, pool: set[BlockHash], k: int) -> list[BlockHash]:
        return self.rng.sample(sorted(pool), min(k, len(pool)))

    def next_batch(self) -> list[SglangEvent]:
        events: list[SglangEvent] = []
        for _ in range(self.rng.randint(1, 4)):
            op = self.rng.random()
            if op < 0.35 or not self.on_gpu:
                n = self.rng.randint(1, self.max_chain)
                tokens = list(range(self._token, self._token + n * self.page_size))
                self._token += n * self.page_size
                hashes = sglang_block_hashes(tokens, self.page_size)
                events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                          block_size=self.page_size, medium=GPU))
                self.on_gpu.update(hashes)
            elif op < 0.55:
                chosen = self._pick(self.on_gpu - self.on_host, 4)
                if chosen:
                    events.append(BlockStored(block_hashes=chosen, parent_block_hash=None, token_ids=[],
                                              block_size=self.page_size, medium=HOST))
                    self.on_host.update(chosen)
            elif op < 0.75:
                chosen = self._pick(self.on_gpu & self.on_host, 4)
                if chosen:
                    events.append(BlockRemoved(block_hashes=chosen, medium=GPU))
                    self.on_gpu.difference_update(chosen)
            elif op < 0.88:
                chosen = self._pick(self.on_host - self.on_gpu, 3)
                if chosen:
                    events.append(BlockStored(block_hashes=chosen, parent_block_hash=None, token_ids=[],
                                              block_size=self.page_size, medium=GPU))
                    self.on_gpu.update(chosen)
            else:
                chosen = self._pick(self.on_host - self.on_gpu, 3)
                if chosen:
                    events.append(BlockRemoved(block_hashes=chosen, medium=HOST))
                    self.on_host.difference_update(chosen)
                    self.finally_removed.update(chosen)
        return events or self.next_batch()


def state_matches(client: redis.Redis, model: str, worker: str, reference: ReferenceModel) -> bool:
    return read_worker_pages(client, model, worker) == reference.pages


def describe_diff(client: redis.Redis, model: str, worker: str, reference: ReferenceModel) -> str:
    actual = read_worker_pages(client, model, worker)
    missing = {h: t for h, t in reference.pages.items() if actual.get(h) != t}
    extra = {h: t for h, t in actual.items() if h not in reference.pages}
    return (f"{worker}: {len(actual)} pages in Redis vs {len(reference.pages)} expected; "
            f"wrong/missing {list(missing.items())[:5]}, extra {list(extra.items())[:5]}; "
            f"state {read_worker_state(client, model, worker)}")


class KvtierProcess:
    """A `kvtier` subcommand in its own process, stopped by PID."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", "kvtier.cli", *args]
        self.log = tempfile.NamedTemporaryFile(prefix="kvtier-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
                raise AssertionError(f"{self.args} ignored SIGTERM for {timeout}s:\n{self.output()[-3000:]}")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def bridge_process(publisher, nats_url: str, worker: str, model: str, page_size: int = 4, *extra: str) -> KvtierProcess:
    args = ["bridge", "--endpoint", publisher.endpoint, "--worker-id", worker, "--model", model,
            "--page-size", str(page_size), "--nats", nats_url, "--heartbeat", "0.5", *extra]
    if publisher.replay_endpoint:
        args += ["--replay-endpoint", publisher.replay_endpoint]
    return KvtierProcess(*args)


def processor_process(nats_url: str, redis_url: str, *extra: str) -> KvtierProcess:
    return KvtierProcess("processor", "--nats", nats_url, "--redis", redis_url, "--reap-interval", "0.2", *extra)


def worker_announced(client: redis.Redis, model: str, worker: str) -> bool:
    from kvtier.schemas.state_keys import ModelKeys

    return client.zscore(ModelKeys.for_model(model).leases, worker) is not None


def kvtier_batch(model: str, worker: str, epoch: int, seq: int, events: list[SglangEvent], reason=None):
    """Wrap engine events as the bridge would (for tests that play the bridge themselves)."""
    from kvtier.producers.convert import convert_batch
    from kvtier.schemas.events import EpochReason, EventBatch
    from kvtier.schemas.sglang import DecodedBatch

    converted = convert_batch(DecodedBatch(ts=time.time(), attn_dp_rank=None, events=events, rejected=[]))
    assert not converted.rejected
    return EventBatch(worker_id=worker, model=model, epoch=epoch, seq=seq, ts=time.time(), source_ts=time.time(),
                      epoch_reason=EpochReason(reason) if reason else None, events=converted.events)


async def publish_batches(nats_url: str, batches, msg_ids: list[str] | None = None) -> None:
    import nats

    from kvtier.schemas.events import encode_message
    from kvtier.schemas.subjects import events_subject
    from kvtier.streams import StreamSettings, ensure_streams

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_streams(js, StreamSettings())
    for i, batch in enumerate(batches):
        msg_id = msg_ids[i] if msg_ids else batch.msg_id
        await js.publish(events_subject(batch.model, batch.worker_id), encode_message(batch),
                         headers={"Nats-Msg-Id": msg_id})
    await nc.close()


async def read_dead_letters(nats_url: str, expected: int, timeout: float = 15.0) -> list[tuple[str, dict, bytes]]:
    """(subject, headers, data) of the first `expected` dead letters."""
    import asyncio

    import nats

    from kvtier.schemas.subjects import DLQ_STREAM

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = await js.stream_info(DLQ_STREAM)
        if info.state.messages >= expected:
            break
        await asyncio.sleep(0.1)
    info = await js.stream_info(DLQ_STREAM)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(DLQ_STREAM, seq)
        out.append((msg.subject, dict(msg.headers or {}), msg.data))
    await nc.close()
    return out
