"""Shared test machinery: a seeded HiCache-like event workload with its reference model,
kvtier CLI processes started and stopped by PID, and polling helpers."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.schemas.sglang import SglangEvent
from kvtier.sim.synthetic import HiCacheWorkload, ReferenceModel  # re-exported for tests
from kvtier.testing.processes import KvtierSubprocess


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


class KvtierProcess(KvtierSubprocess):
    """A `kvtier` subcommand in its own process for a test: its log in the temporary folder, and
    stopping it is strict (a process that ignores SIGTERM fails the test)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()):
        """`prefix`: a command that runs it (e.g. `prlimit --nofile=256`)."""
        super().__init__(args, None, args[0] if args else "kvtier", env=env, prefix=prefix)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.tail(None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0, strict: bool = True) -> int | None:
        return super().stop(timeout, strict)


def stop_all(*processes: KvtierProcess) -> list[int]:
    """Stop every process (SIGTERM, SIGKILL after a grace period) before reporting any that
    ignored SIGTERM, so one stuck process never leaves the others running."""
    codes, errors = [], []
    for process in processes:
        try:
            codes.append(process.stop())
        except AssertionError as exc:
            codes.append(None)
            errors.append(str(exc))
    assert not errors, "\n".join(errors)
    return codes


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


def model_ready(client: redis.Redis, model: str) -> bool:
    """The model's incarnation marker says batches are applied (a processor has set it up, or
    rebuilt it from the stream): until then a new model's batches wait (consumers/README.md)."""
    from kvtier.schemas.state_keys import ModelKeys

    marker = client.hgetall(ModelKeys.for_model(model).incarnation)
    return marker.get(b"ready") == b"1" and marker.get(b"rebuilding") != b"1"


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

    from kvtier.plumbing.streams import StreamSettings, ensure_streams
    from kvtier.schemas.events import encode_message
    from kvtier.schemas.subjects import events_subject

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


class RunningPipeline:
    """An SGLang-format publisher, one `kvtier bridge` on it and one `kvtier processor`,
    running until the `with` block ends (each process stopped by PID)."""

    def __init__(self, nats_url: str, redis_url: str, model: str, worker: str = "w0",
                 bridge_args: tuple[str, ...] = (), processor_args: tuple[str, ...] = (), publisher=None,
                 wait_announced: bool = True):
        from kvtier.sim.sglang_publisher import SglangEventPublisher

        self.nats_url, self.redis_url, self.model, self.worker = nats_url, redis_url, model, worker
        self.bridge_args, self.processor_args = bridge_args, processor_args
        self.publisher = publisher or SglangEventPublisher()
        self.client = redis.Redis.from_url(redis_url)
        self.processor = self.start_processor()
        self.bridge = self.start_bridge()
        if wait_announced:
            try:
                wait_until(lambda: worker_announced(self.client, model, worker) and model_ready(self.client, model),
                           timeout=30,
                           what=lambda: f"worker announced, model ready\nprocessor: {self.processor.output()[-1500:]}"
                                        f"\nbridge: {self.bridge.output()[-1500:]}")
            except BaseException:
                self.__exit__(None, None, None)  # no `with` block will run: stop what we started
                raise

    def start_processor(self) -> KvtierProcess:
        self.processor = processor_process(self.nats_url, self.redis_url, *self.processor_args)
        return self.processor

    def start_bridge(self) -> KvtierProcess:
        self.bridge = bridge_process(self.publisher, self.nats_url, self.worker, self.model, 4, *self.bridge_args)
        return self.bridge

    def publish(self, workload: HiCacheWorkload, reference: ReferenceModel, batches: int, deliver: bool = True):
        for _ in range(batches):
            events = workload.next_batch()
            self.publisher.publish(events, deliver=deliver)
            reference.apply(events)

    def converge(self, reference: ReferenceModel, timeout: float = 30, client: redis.Redis | None = None) -> None:
        client = client or self.client
        wait_until(lambda: state_matches(client, self.model, self.worker, reference), timeout=timeout,
                   what=lambda: describe_diff(client, self.model, self.worker, reference)
                   + f"\nprocessor: {self.processor.output()[-1500:]}\nbridge: {self.bridge.output()[-1500:]}")

    def state(self, client: redis.Redis | None = None) -> dict[str, str]:
        return read_worker_state(client or self.client, self.model, self.worker)

    def __enter__(self) -> RunningPipeline:
        return self

    def __exit__(self, *exc) -> None:
        try:
            bridge_rc = self.bridge.stop()
            processor_rc = self.processor.stop()
        finally:
            self.bridge.kill()
            self.processor.kill()
            self.publisher.close()
        if exc[0] is None:
            assert bridge_rc in (0, -9), self.bridge.output()[-3000:]
            assert processor_rc in (0, -9), self.processor.output()[-3000:]
