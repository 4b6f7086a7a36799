"""Shared test machinery: a seeded HiCache-like event workload with its reference model,
kvtier CLI processes started and stopped by PID, and polling helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

import redis

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.producers.synthetic import HiCacheWorkload, ReferenceModel  # noqa: F401 - re-exported for tests
from kvtier.schemas.sglang import SglangEvent


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
