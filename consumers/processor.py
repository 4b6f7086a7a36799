"""`kvtier processor`: JetStream -> ordered, exactly-once tier state in Redis.

Each owned partition has one durable pull consumer. Messages are decoded, then applied
through `TierStateWriter` (one atomic, order-checked script call per batch) and acked only
after Redis has them, so a crash at any point redelivers and the seq check drops repeats.
On start each consumer is rewound to its ack floor, so what a crashed processor held is
redelivered at once, in stream order, instead of after ack_wait.
A gap (a later seq arrives first) is held back (nak with delay) for `gap_timeout_s`; then
the worker is rebased: cleared, marked stale, and its bridge is asked to resync.

State-store loss: every model's state carries an incarnation marker (`kvt:{m}:incarnation`).
The apply script refuses batches of a model whose marker is missing (a Redis restart without
persistence, FLUSHALL, failover to an empty replica) and a housekeeping probe looks for it
every `reap_interval_s`. One processor claims the rebuild (the marker, re-created "not
ready", holds back every processor's batches and tells routers to route on load only); it
finds each worker's current epoch in the stream, primes the worker to stand just before the
epoch's first batch (or, where retention no longer holds it, clears it, marks it stale and
asks its bridge to resync), rewinds the partitions' durable consumers to the earliest epoch
start, and marks the marker ready; the stream then rebuilds the state through the ordinary
apply path, and the marker's `rebuilding` flag is cleared once every worker is back at the
seq it had reached when the loss was found.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import nats
import nats.errors
import nats.js.errors
import redis
import redis.asyncio
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter, Gauge, Histogram

from kvtier.consumers.apply import DEFAULT_CHANGES_MAXLEN, ApplyMode, ApplyStatus, RebuildPlan, TierStateWriter
from kvtier.consumers.hash_check import DEFAULT_BUDGET_PAGES_PER_S, HashValidator
from kvtier.consumers.ownership import PartitionLeases, fair_share
from kvtier.consumers.pull import PullStream, consume
from kvtier.plumbing.connections import redact, redis_async_client, redis_client
from kvtier.plumbing.streams import StreamSettings, connect_nats, dead_letter_headers, ensure_streams_when_ready
from kvtier.schemas.events import (
    ControlRequest,
    EventBatch,
    UnsupportedVersion,
    WorkerAnnounce,
    WorkerExpired,
    decode_message,
    encode_control,
    encode_message,
)
from kvtier.schemas.health import decode_hash_check, encode_hash_check
from kvtier.schemas.state_keys import MODELS_KEY, ModelKeys, as_text
from kvtier.schemas.subjects import (
    EVENTS_PREFIX,
    EVENTS_STREAM,
    control_subject,
    dlq_subject,
    events_subject,
    parse_events_subject,
    partition_filter,
    subject_token,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


def _timestamp(value) -> float:
    """A JetStream time (a datetime, or RFC 3339 text from some nats-py versions) in unix seconds."""
    if isinstance(value, str):
        import datetime

        text = value.rstrip("Z")
        whole, _, fraction = text.partition(".")
        parsed = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc)
        return parsed.timestamp() + (float("0." + fraction) if fraction else 0.0)
    return value.timestamp()


def stream_time(msg) -> float | None:
    """When the message entered the stream (JetStream's timestamp), if the delivery says."""
    try:
        return msg.metadata.timestamp.timestamp()
    except (AttributeError, ValueError, TypeError):
        return None

#: Page transitions sent to Redis per round trip: big enough to amortise the round trip,
#: small enough that the first batch of a burst is visible within a few milliseconds.
CHUNK_TRANSITIONS = 4096

APPLIED_BATCHES = Counter("kvtier_processor_applied_batches_total", "Batches applied to Redis")
APPLIED_TRANSITIONS = Counter("kvtier_processor_applied_transitions_total", "Page tier transitions applied")
SKIPPED = Counter("kvtier_processor_skipped_batches_total", "Batches skipped", ["reason"])
GAPS = Counter("kvtier_processor_gaps_total", "Seq gaps seen", ["outcome"])
DEAD_LETTERS = Counter("kvtier_processor_dead_letters_total", "Messages dead-lettered", ["reason"])
ANNOUNCES = Counter("kvtier_processor_announces_total", "Worker announcements (lease heartbeats) applied")
EXPIRED = Counter("kvtier_processor_expired_workers_total", "Workers cleared after their lease expired")
RESYNCS = Counter("kvtier_processor_resync_requests_total", "Resync requests sent to bridges")
FORGOTTEN = Counter("kvtier_processor_forgotten_workers_total",
                    "Dead workers removed for good once gone longer than --worker-retention")
STALE_WORKERS = Gauge("kvtier_processor_stale_workers", "Workers whose state is marked stale")
PARTIAL_WORKERS = Gauge("kvtier_processor_partial_workers",
                        "Workers whose state began after their engine's first batch (routed to, but missing what "
                        "the engine held before)")
PENDING = Gauge("kvtier_processor_consumer_pending", "Messages not yet delivered", ["partition"])
HASH_PAGES = Counter("kvtier_processor_hash_checked_pages_total",
                     "Stored pages whose hash was recomputed from their tokens, by outcome", ["outcome"])
HASH_MISMATCHES = Counter("kvtier_processor_hash_mismatch_pages_total",
                          "Stored pages whose published hash is not SGLang's chain over their tokens",
                          ["model", "worker", "kind"])
REBUILDS = Counter("kvtier_processor_state_rebuilds_total",
                   "Models whose tier state was rebuilt from the stream after its incarnation marker went "
                   "missing; reason lost (acked batches had to be re-applied) or new (nothing was lost)", ["reason"])
REBUILDING = Gauge("kvtier_processor_rebuilding_models", "Models whose state is being rebuilt from the stream")
LAG = Histogram("kvtier_processor_event_lag_seconds", "Engine emit -> visible in Redis",
                buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def _really_cancelled() -> bool:
    """Whether the running task was cancelled (not a library cancelling one of its own
    futures, which reaches the awaiting code as the same CancelledError)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; on 3.10 every one is taken as real
    return task is None or cancelling is None or cancelling() > 0


@dataclass
class ProcessorConfig:
    nats_url: str
    redis_url: str
    partitions: list[int] | None = None  # None: all partitions of the stream
    durable_prefix: str = "kvtier-processor"
    fetch_batch: int = 256
    gap_timeout_s: float = 10.0
    ack_wait_s: float = 30.0
    #: A worker gone (no lease) longer than this is forgotten: every key it left is removed.
    worker_retention_s: float = 3600.0
    #: A gap held back this long is taken for deliveries lost with a pull: the partition's
    #: consumer is rewound to its ack floor (once per gap), well within the gap timeout.
    lost_delivery_s: float = 1.0
    reap_interval_s: float = 1.0
    resync_min_interval_s: float = 2.0
    streams: StreamSettings = field(default_factory=StreamSettings)
    partitions_explicit: bool = False
    auto_partitions: bool = False  # claim a fair share of partitions through Redis leases
    partition_lease_s: float = 5.0
    #: Recompute SGLang's page hash of stored pages from their tokens (schemas/health.py).
    hash_check: bool = True
    #: At most this many pages recomputed per second (0: no limit).
    hash_check_budget: float = DEFAULT_BUDGET_PAGES_PER_S
    #: A rebuild claimed by a processor that then went silent this long is taken over.
    rebuild_scan_timeout_s: float = 10.0
    #: A worker whose last message is older than this (when it announced no lease) counts as dead.
    default_lease_s: float = 10.0
    #: Entries each model's change feed keeps (routers' indexes follow it; apply.py).
    changes_maxlen: int = DEFAULT_CHANGES_MAXLEN


class Processor:
    def __init__(self, config: ProcessorConfig):
        self.cfg = config
        self.redis = redis_client(config.redis_url, socket_timeout=10, health_check_interval=5)
        self.redis_async = redis_async_client(config.redis_url, socket_timeout=10, health_check_interval=5)
        self.writer = TierStateWriter(self.redis, self.redis_async, guarded=True,
                                      changes_maxlen=config.changes_maxlen)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        #: Model tokens seen in messages: probed for their incarnation marker even after the
        #: state store lost `kvt:models`.
        self._models_seen: set[str] = set()
        self._incarnations: dict[str, str] = {}  # model token -> marker id last seen
        self._recovering: dict[str, asyncio.Task] = {}
        self.nc: NATS = None  # type: ignore[assignment]  # connected in run(), before any use
        self.js: JetStreamContext = None  # type: ignore[assignment]  # likewise
        self.partitions: list[int] = []
        self.total_partitions = 0
        self._reconnects_seen = 0
        self._recorded_expiry: dict[tuple[str, str], int] = {}  # (model token, worker) -> lease ms recorded
        self._stream_back_at = 0.0  # when the NATS connection last came back
        self._state_unsettled_at = 0.0  # when a model's state was last seen lost or rebuilding
        self._longest_lease_s = 0.0  # the longest lease any announce asked for
        self._rewind_partitions: set[int] = set()  # partitions to rewind to their ack floor (lost deliveries)
        self._rewound_for: set[tuple[str, str]] = set()  # gaps a rewind was already tried for
        self._ahead_since: dict[tuple[str, str], float] = {}
        self._last_resync: dict[tuple[str, str], float] = {}
        self.hash_validator = (HashValidator(budget_pages_per_s=config.hash_check_budget or None)
                               if config.hash_check else None)
        #: Announced page size per (model, worker); 0 when Redis had none when asked.
        self._page_sizes: dict[tuple[str, str], int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        if not await self._wait_for_redis(stop):
            return
        self.nc = await connect_nats(self.cfg.nats_url, "kvtier-processor", stop)
        if self.nc is None:
            return
        self.js = self.nc.jetstream()
        try:
            total = await ensure_streams_when_ready(self.js, self.cfg.streams, stop,
                                                    partitions_explicit=self.cfg.partitions_explicit)
            if total is None:
                return
            self.total_partitions = total
            self.partitions = (self.cfg.partitions if self.cfg.partitions is not None and not self.cfg.auto_partitions
                               else list(range(total)))
            bad = [p for p in self.partitions if not 0 <= p < total]
            if bad:
                raise ValueError(f"partitions {bad} do not exist: the stream has {total} (0..{total - 1})")
            await self._prepare_models()
            if self.cfg.auto_partitions:
                tasks = [asyncio.create_task(self._own_partitions_dynamically(total, stop))]
            else:
                log.info("processor owns partitions %s of %d", self.partitions, total)
                tasks = [asyncio.create_task(self._keep_consuming(p, stop)) for p in self.partitions]
            tasks.append(asyncio.create_task(self._housekeeping(stop)))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            stopper.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            for task in self._recovering.values():
                task.cancel()  # a rebuild cut short is taken over (or redone) by the next probe
            await asyncio.gather(*self._recovering.values(), return_exceptions=True)
            with contextlib.suppress(redis.RedisError):
                await self._persist_hash_checks()
            # close, not drain: draining pull subscriptions can wait forever in nats-py, and
            # every message we acked is already applied; unacked ones are redelivered.
            await self.nc.close()
            self.redis.close()
            await self.redis_async.aclose()

    async def _wait_for_redis(self, stop: asyncio.Event) -> bool:
        """Wait until Redis answers, saying clearly what is wrong meanwhile. False if stopped."""
        while not stop.is_set():
            try:
                await self.redis_async.ping()
                return True
            except redis.RedisError as exc:
                log.warning("cannot reach Redis at %s (%s); retrying in 1s", redact(self.cfg.redis_url), exc)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        return False

    # --- consuming --------------------------------------------------------------------------
    def _consumer_config(self, partition: int) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=f"{self.cfg.durable_prefix}-p{partition}", filter_subject=partition_filter(partition),
            ack_policy=AckPolicy.EXPLICIT, ack_wait=self.cfg.ack_wait_s, max_ack_pending=50_000, max_deliver=-1,
            deliver_policy=DeliverPolicy.ALL,
        )

    async def _subscribe(self, partition: int, rewind: bool) -> PullStream:
        durable = f"{self.cfg.durable_prefix}-p{partition}"
        config = self._consumer_config(partition)
        try:
            info = await self.js.consumer_info(EVENTS_STREAM, durable)
        except nats.js.errors.NotFoundError:
            info = None
        if info is not None and rewind and info.num_ack_pending:
            # A previous owner died holding unacked messages: redeliver them now, in order,
            # instead of after ack_wait behind newer ones.
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            await self.js.delete_consumer(EVENTS_STREAM, durable)
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = floor + 1
            info = None
            log.info("partition %d: rewinding consumer to stream seq %d", partition, floor + 1)
        if info is None:
            try:
                await self.js.add_consumer(EVENTS_STREAM, config)
            except nats.js.errors.BadRequestError:
                pass  # another processor created it meanwhile
        return await PullStream(self.nc, EVENTS_STREAM, durable, self.cfg.fetch_batch).start()

    async def _own_partitions_dynamically(self, total: int, stop: asyncio.Event) -> None:
        """Hold a fair share of the partitions, taking over those whose owner died."""
        import os
        import socket

        leases = PartitionLeases(self.redis, f"{socket.gethostname()}:{os.getpid()}:{id(self):x}", total,
                                 self.cfg.partition_lease_s)
        running: dict[int, tuple[asyncio.Event, asyncio.Task]] = {}

        async def stop_consuming(partition: int) -> None:
            partition_stop, task = running.pop(partition)
            partition_stop.set()
            await asyncio.gather(task, return_exceptions=True)  # finishes and acks its batch first

        try:
            while not stop.is_set():
                try:
                    live = await asyncio.to_thread(leases.heartbeat)
                    for partition in await asyncio.to_thread(leases.renew, set(running)):
                        log.warning("lost the lease on partition %d; stopping it", partition)
                        await stop_consuming(partition)
                    share = fair_share(total, live)
                    for partition in sorted(running, reverse=True)[: max(0, len(running) - share)]:
                        await stop_consuming(partition)
                        await asyncio.to_thread(leases.release, partition)
                        log.info("released partition %d", partition)
                    for partition in range(total):
                        if len(running) >= share:
                            break
                        if partition not in running and await asyncio.to_thread(leases.try_claim, partition):
                            partition_stop = asyncio.Event()
                            running[partition] = (partition_stop, asyncio.create_task(
                                self._keep_consuming(partition, partition_stop)))
                            log.info("claimed partition %d (%d live processors, share %d)", partition, live, share)
                    self.partitions = sorted(running)
                except redis.RedisError as exc:
                    log.warning("partition leases unavailable (%s); keeping what is running", exc)
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.partition_lease_s / 5)
                except asyncio.TimeoutError:
                    pass
        finally:
            for partition in list(running):
                running[partition][0].set()
            await asyncio.gather(*(task for _, task in running.values()), return_exceptions=True)
            with contextlib.suppress(redis.RedisError):
                await asyncio.to_thread(leases.leave, set(running))

    async def _keep_consuming(self, partition: int, stop: asyncio.Event) -> None:
        """Consume the partition until `stop`; a consumer that fails unexpectedly is logged and
        started again (its unacked messages come back), never left dead while the process and
        its partition lease live on."""
        while not stop.is_set():
            try:
                await self._consume(partition, stop)
            except asyncio.CancelledError:
                if _really_cancelled():
                    raise
                log.error("partition %d: a stray cancellation ended the consumer; restarting it", partition)
            except Exception:  # see the docstring
                log.exception("partition %d: the consumer failed; restarting it", partition)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _consume(self, partition: int, stop: asyncio.Event) -> None:
        def gap_held_back() -> bool:
            # A gap held back past `lost_delivery_s`: the missing batches were most likely
            # delivered to a pull that is gone (they would come back only after ack_wait, later
            # than the gap timeout). Re-opening rewinds to the ack floor: they come back now.
            if partition not in self._rewind_partitions:
                return False
            self._rewind_partitions.discard(partition)
            log.warning("partition %d: a gap is held back; rewinding the consumer to its ack floor", partition)
            return True

        async def redeliver(messages, exc: Exception) -> None:
            if isinstance(exc, redis.RedisError):
                log.warning("partition %d: Redis unavailable (%s); redelivering %d messages", partition, exc,
                            len(messages))
            else:
                log.error("partition %d: applying %d messages failed; redelivering them", partition, len(messages),
                          exc_info=exc)
            # Acked ones refuse the nak. The rest come back after later messages may have been
            # applied: batches are put in order by their seq, announces by announce.lua.
            for msg in messages:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=1.0)
            await asyncio.sleep(1.0)

        await consume(f"partition {partition}", lambda: self._resubscribe(partition, stop), self.handle, stop,
                      on_handle_error=redeliver, reopen_now=gap_held_back, log=log)

    async def _resubscribe(self, partition: int, stop: asyncio.Event) -> PullStream | None:
        """A new pull on the partition, rewound to its ack floor: deliveries made to the pull
        that failed are redelivered at once, in order, instead of after ack_wait (which is
        longer than the gap timeout: they would arrive after their successors had rebased the
        worker). Retries until subscribed (a closed pull would wait forever) or until `stop`
        (then None)."""
        while not stop.is_set():
            try:
                return await self._subscribe(partition, rewind=True)
            except Exception as exc:  # noqa: BLE001 - e.g. no consumer leader yet (NATS cluster)
                if stop.is_set():
                    return None
                log.warning("partition %d: re-subscribing failed (%r); retrying", partition, exc)
                await asyncio.sleep(0.5)
        return None

    async def handle(self, messages) -> None:
        """Decode and apply messages in arrival order. Batches go to Redis in chunks of about
        `CHUNK_TRANSITIONS`, and the next chunk is decoded while Redis applies the previous
        one: a burst neither waits for the whole burst to be decoded nor loses its order
        (a chunk is sent only after the one before it has been applied)."""
        chunk: list[tuple[object, EventBatch]] = []
        size = 0
        in_flight: tuple[list, asyncio.Task] | None = None
        for msg in messages:
            message = await self._decode_or_dead_letter(msg)
            if message is None:
                continue
            if isinstance(message, (WorkerAnnounce, WorkerExpired)):
                # In stream order: the batches before it are applied first (an announce reads
                # the worker's stale flag, which an earlier batch of a new epoch may clear).
                if in_flight:
                    await self._settle(*in_flight)
                    in_flight = None
                if chunk:
                    await self._settle(chunk, asyncio.create_task(self._apply_chunk(chunk)))
                    chunk, size = [], 0
                if isinstance(message, WorkerAnnounce):
                    await self._announce(msg, message)
                else:
                    await self._expired(msg, message)
                continue
            chunk.append((msg, message))
            size += sum(len(getattr(e, "hashes", ())) for e in message.events) + 1
            if size >= CHUNK_TRANSITIONS:
                if in_flight:
                    await self._settle(*in_flight)
                in_flight = (chunk, asyncio.create_task(self._apply_chunk(chunk)))
                chunk, size = [], 0
        if in_flight:
            await self._settle(*in_flight)
        if chunk:
            await self._settle(chunk, asyncio.create_task(self._apply_chunk(chunk)))

    async def _apply_chunk(self, chunk):
        return await self.writer.apply_many_async([batch for _, batch in chunk])

    async def _announce(self, msg, announce: WorkerAnnounce) -> None:
        self._models_seen.add(subject_token(announce.metadata.model))
        self._longest_lease_s = max(self._longest_lease_s, announce.lease_ttl_s)
        stale = await asyncio.to_thread(self.writer.announce, announce, stream_time(msg))
        self._page_sizes[(announce.metadata.model, announce.metadata.worker_id)] = announce.metadata.page_size
        ANNOUNCES.inc()
        if stale:
            await self._request_resync(announce.metadata.model, announce.metadata.worker_id, "state is stale")
        await msg.ack()

    async def _settle(self, chunk, task: asyncio.Task) -> None:
        results = await task
        now = time.time()
        for (msg, batch), result in zip(chunk, results):
            key = (batch.model, batch.worker_id)
            self._models_seen.add(subject_token(batch.model))
            if result.status == ApplyStatus.NOT_READY:
                # The model's state is gone or being prepared for a rebuild: hand it back.
                SKIPPED.labels("not_ready").inc()
                self._start_recovery(subject_token(batch.model))
                await msg.nak(delay=0.5)
                continue
            if result.status == ApplyStatus.AHEAD:
                if await self._hold_back(msg, key, now):
                    continue
                applied_before = result.seq
                # The script decides again, atomically: the gap may have filled, or the worker
                # moved to a newer epoch, since the "ahead" above was read.
                result = await asyncio.to_thread(self.writer.apply, batch, ApplyMode.REBASE)
                if result.rebased:
                    GAPS.labels("rebased").inc()
                    log.error("%s/%s: batches %d:%d..%d never arrived; state cleared and marked stale, asking the "
                              "bridge to resync", batch.model, batch.worker_id, batch.epoch, applied_before + 1,
                              batch.seq - 1)
            if result.status == ApplyStatus.APPLIED:
                self._ahead_since.pop(key, None)
                self._rewound_for.discard(key)
                APPLIED_BATCHES.inc()
                APPLIED_TRANSITIONS.inc(result.transitions)
                LAG.observe(max(0.0, now - batch.source_ts))
                if self.hash_validator is not None:
                    await self._check_hashes(batch, self.hash_validator)
                if result.stale:
                    await self._request_resync(batch.model, batch.worker_id, "state is stale")
            else:
                SKIPPED.labels({ApplyStatus.DUPLICATE: "duplicate", ApplyStatus.OLD_EPOCH: "old_epoch",
                                ApplyStatus.GONE: "worker_gone"}.get(result.status, "other")).inc()
            await msg.ack()

    async def _check_hashes(self, batch: EventBatch, validator: HashValidator) -> None:
        key = (batch.model, batch.worker_id)
        keys = ModelKeys.for_model(batch.model)
        if not validator.knows(*key):
            recorded = await self.redis_async.hget(keys.hash_check, batch.worker_id)
            if recorded:
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    validator.seed(batch.model, decode_hash_check(recorded))
        if key not in self._page_sizes:
            announced = await self.redis_async.hget(keys.page_sizes, batch.worker_id)
            self._page_sizes[key] = int(announced) if announced else 0
        outcome = validator.check_batch(batch, self._page_sizes[key] or None, time.monotonic())
        if outcome.matched:
            HASH_PAGES.labels("matched").inc(outcome.matched)
        for label, pages in (("unverifiable", outcome.unverifiable), ("skipped", outcome.skipped),
                             ("known", outcome.known)):
            if pages:
                HASH_PAGES.labels(label).inc(pages)
        for kind, pages in outcome.mismatched.items():
            HASH_PAGES.labels("mismatched").inc(pages)
            HASH_MISMATCHES.labels(batch.model, batch.worker_id, kind.value).inc(pages)
        for mismatch in outcome.to_report:
            log.error("%s/%s: page hashes do not match (%s): %s", mismatch.model, mismatch.worker_id,
                      mismatch.kind.value, mismatch.explanation)

    async def _persist_hash_checks(self) -> None:
        if self.hash_validator is None:
            return
        changed = self.hash_validator.drain_changed()
        if changed:
            try:
                async with self.redis_async.pipeline(transaction=False) as pipe:
                    for model, check in changed:
                        pipe.hset(ModelKeys.for_model(model).hash_check, check.worker_id, encode_hash_check(check))
                    await pipe.execute()
            except redis.RedisError:
                self.hash_validator.mark_changed(changed)  # written at the next sweep
                raise

    async def _hold_back(self, msg, key: tuple[str, str], now: float) -> bool:
        """True if the batch is held back to wait for the missing ones."""
        first = self._ahead_since.setdefault(key, now)
        if now - first < self.cfg.gap_timeout_s:
            GAPS.labels("waiting").inc()
            if now - first >= self.cfg.lost_delivery_s and key not in self._rewound_for:
                self._rewound_for.add(key)  # once per gap: a real one waits out the gap timeout
                subject = parse_events_subject(msg.subject)
                if subject is not None and subject.partition is not None:
                    self._rewind_partitions.add(subject.partition)
            await msg.nak(delay=0.2)
            return True
        self._ahead_since.pop(key, None)
        self._rewound_for.discard(key)
        return False

    async def _decode_or_dead_letter(self, msg):
        try:
            message = decode_message(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion) as exc:
            await self._dead_letter(msg, f"undecodable message: {exc}", type(exc).__name__)
            return None
        meta = message.metadata if isinstance(message, WorkerAnnounce) else message
        subject = parse_events_subject(msg.subject)
        if subject is None or not subject.names(meta.model, meta.worker_id):
            await self._dead_letter(msg, f"message for {meta.model}/{meta.worker_id} arrived on subject "
                                         f"{msg.subject}: refusing to apply it to another worker", "subject_mismatch")
            return None
        return message

    async def _dead_letter(self, msg, reason: str, kind: str) -> None:
        DEAD_LETTERS.labels(kind).inc()
        subject = parse_events_subject(msg.subject)
        model, worker = (subject.model_token, subject.worker_token) if subject else ("unknown", "unknown")
        log.warning("dead-lettering message from %s: %s", msg.subject, reason)
        headers = dead_letter_headers(Kvtier_Reason=reason[:1024], Kvtier_Stage="processor",
                                      Kvtier_Source_Subject=msg.subject)
        if msg.metadata and msg.metadata.sequence:
            headers["Kvtier-Stream-Seq"] = str(msg.metadata.sequence.stream)
            # A message redelivered after its letter was stored (the ack was lost, or the pull
            # was rewound to the ack floor) is stored once: the id names the stored message.
            stored_at = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else 0.0
            headers["Nats-Msg-Id"] = f"kvtier-dlq:{msg.metadata.sequence.stream}:{stored_at:.6f}"
        data = msg.data
        # With these headers a message near max_payload would be over it (the server then drops
        # the connection): keep what fits, say how long it was (the stream still holds it all).
        limit = (self.nc.max_payload or 1 << 20) - (8 << 10)
        if len(data) > limit:
            headers["Kvtier-Truncated-From"] = str(len(data))
            data = data[:limit]
        await self.js.publish(dlq_subject("processor", model, worker), data, headers=headers, timeout=5.0)
        await msg.ack()  # only after the dead letter is stored: nothing is lost

    async def _request_resync(self, model: str, worker_id: str, reason: str) -> None:
        key = (model, worker_id)
        now = time.monotonic()
        if now - self._last_resync.get(key, -1e9) < self.cfg.resync_min_interval_s:
            return
        self._last_resync[key] = now
        RESYNCS.inc()
        await self.nc.publish(control_subject(model, worker_id),
                              encode_control(ControlRequest(request="resync", reason=reason)))

    # --- leases and gauges ------------------------------------------------------------------
    async def _housekeeping(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._probe_incarnations()  # first: a lost store must hold expiries back
                if self._stream_reachable_long_enough() and self._state_settled_long_enough():
                    await self._record_expired_leases()
                STALE_WORKERS.set(await asyncio.to_thread(self.writer.count_stale_workers))
                PARTIAL_WORKERS.set(await asyncio.to_thread(self.writer.count_partial_workers))
                for model, worker in await asyncio.to_thread(self.writer.forget_dead_workers,
                                                             self.cfg.worker_retention_s):
                    FORGOTTEN.inc()
                    self._forget(model, worker)
                    log.info("%s/%s: gone for more than %.0fs; forgotten", model, worker,
                             self.cfg.worker_retention_s)
                await self._persist_hash_checks()
            except (redis.RedisError, nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("housekeeping failed: %s", exc)
            except Exception:  # housekeeping must outlive any one bad sweep
                log.exception("housekeeping sweep failed")
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.reap_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _record_expired_leases(self) -> None:
        """Record in the stream, as WorkerExpired decisions, the leases that ran out before
        their partition was settled. They take effect when consumed, in stream order (so a
        replay expires exactly the same workers); two processors recording the same decision
        store it once (same Nats-Msg-Id)."""
        settled = await self._settled_partitions()
        for token, worker, lease_ms, epoch, seq in await asyncio.to_thread(
                self.writer.expirable_workers, time.time(), settled, self.total_partitions):
            if self._recorded_expiry.get((token, worker)) == lease_ms:
                continue  # recorded already; waiting for it to come round
            decision = WorkerExpired(model=token, worker_id=worker, lease_expiry_ms=lease_ms, ts=time.time(),
                                     epoch=epoch, seq=seq)
            await self.js.publish(events_subject(token, worker), encode_message(decision),
                                  headers={"Nats-Msg-Id": decision.msg_id}, timeout=5.0)
            self._recorded_expiry[(token, worker)] = lease_ms

    async def _expired(self, msg, decision: WorkerExpired) -> None:
        removed = await asyncio.to_thread(self.writer.expire_worker, decision.model, decision.worker_id,
                                          decision.lease_expiry_ms)
        if removed >= 0:
            EXPIRED.inc()
            log.warning("%s/%s: lease expired; removed its %d pages", decision.model, decision.worker_id, removed)
        self._recorded_expiry.pop((subject_token(decision.model), decision.worker_id), None)
        await msg.ack()

    def _stream_reachable_long_enough(self) -> bool:
        """Leases may be expired only once NATS has been reachable for twice the longest lease:
        while the broker was down no bridge could renew one, and a live worker's bridge
        reconnects and announces within a heartbeat or two of it coming back."""
        if not self.nc.is_connected:
            return False
        reconnects = self.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects_seen:
            self._reconnects_seen = reconnects
            self._stream_back_at = time.time()
        return time.time() >= self._stream_back_at + 2 * self._longest_lease_s

    def _state_settled_long_enough(self) -> bool:
        """Leases may be expired only once no model has been lost or rebuilding for twice the
        longest lease: a rebuild replays old announces (leases that look run out) and may
        redeliver newer ones out of order, so until it settles an old lease proves nothing."""
        return time.time() >= self._state_unsettled_at + 2 * self._longest_lease_s

    def _forget(self, model_token: str, worker: str) -> None:
        """Drop what this process keeps per worker (its dictionaries are keyed by model name)."""
        known = set(self._page_sizes) | set(self._ahead_since) | set(self._last_resync) | self._rewound_for
        for key in [k for k in known if subject_token(k[0]) == model_token and k[1] == worker]:
            self._page_sizes.pop(key, None)
            self._ahead_since.pop(key, None)
            self._last_resync.pop(key, None)
            self._rewound_for.discard(key)
            if self.hash_validator is not None:
                self.hash_validator.drop_worker(key[0], worker)

    async def _settled_partitions(self) -> dict[int, float]:
        """Per partition, the stream time up to which every message has been applied and
        acked (its consumer's ack floor): a lease that ran out before it is final, since any
        announce renewing it would have come earlier in the stream. A partition behind (its
        owner down or catching up, a gap held back) is settled only up to its floor. Every
        partition is looked at, owned or not, so a dead processor's workers are expired once
        its partitions are taken over and caught up."""
        settled: dict[int, float] = {}
        now = time.time()
        for partition in range(self.total_partitions):
            try:
                info = await self.js.consumer_info(EVENTS_STREAM, f"{self.cfg.durable_prefix}-p{partition}")
            except nats.js.errors.NotFoundError:
                continue  # nobody has consumed it yet
            if partition in self.partitions:
                PENDING.labels(str(partition)).set(info.num_pending)
            else:  # given up (or never owned): its backlog is its new owner's to report
                with contextlib.suppress(KeyError):
                    PENDING.remove(str(partition))
            if info.num_pending == 0 and info.num_ack_pending == 0:
                settled[partition] = now
                continue
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            if floor:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    settled[partition] = _timestamp((await self.js.get_msg(EVENTS_STREAM, floor)).time)
        return settled

    # --- state-store loss: detection and rebuild from the stream ---------------------------
    async def _probe_incarnations(self) -> None:
        """Check every known model's marker: missing -> rebuild; a rebuild claimed by a silent
        processor -> take it over; rebuilding -> note which workers have caught up."""
        tokens = self._models_seen | {as_text(t) for t in await self.redis_async.smembers(MODELS_KEY)}
        if not tokens:
            return
        ordered = sorted(tokens)
        async with self.redis_async.pipeline(transaction=False) as pipe:
            for token in ordered:
                pipe.hmget(ModelKeys(token).incarnation, "id", "ready", "rebuilding", "scan_ms", "created_ms", "reason")
            markers = await pipe.execute()
        now_ms = time.time() * 1000
        rebuilding = 0
        for token, fields in zip(ordered, markers):
            marker_id, ready, building, scan_ms, created_ms, reason = (
                as_text(f) if f is not None else None for f in fields)
            # Only a known model's lost state holds lease expiries back: a new model's first
            # "rebuild" (nothing acknowledged was lost) replays no lease that could look run out
            # but for the history it is applying anyway.
            known_model = token in self._incarnations
            if marker_id is None:
                if known_model:  # a model seen ready lost its state (a new one is no loss)
                    self._state_unsettled_at = time.time()
                self._start_recovery(token)
                continue
            if ready != "1":
                if known_model:
                    self._state_unsettled_at = time.time()
                rebuilding += 1
                if now_ms - float(scan_ms or 0) > self.cfg.rebuild_scan_timeout_s * 1000:
                    self._start_recovery(token)
                continue
            known = self._incarnations.get(token)
            if known != marker_id:
                if known is not None:
                    self._state_unsettled_at = time.time()
                    log.warning("model %s: its state store was re-created (incarnation %s -> %s)", token, known,
                                marker_id)
                    self.writer.forget_models()
                self._incarnations[token] = marker_id
            if building == "1":
                behind = await asyncio.to_thread(self.writer.rebuild_progress, token)
                if behind:
                    if reason == "lost":
                        self._state_unsettled_at = time.time()
                    rebuilding += 1
                else:
                    log.warning("model %s: tier state rebuilt from the stream, %.1fs after the loss was found",
                                token, (now_ms - float(created_ms or now_ms)) / 1000)
        REBUILDING.set(rebuilding)

    async def _prepare_models(self) -> None:
        """Before consuming: every model in the stream whose marker is missing (a first start,
        or a store that lost it while no processor ran) is prepared for its rebuild now,
        rather than after its first batches have been pulled only to be refused."""
        try:
            info = await self.js.stream_info(EVENTS_STREAM, subjects_filter=f"{EVENTS_PREFIX}.>")
            stored = (parse_events_subject(s) for s in (info.state.subjects or {}))
            tokens = sorted({s.model_token for s in stored if s is not None and s.partition is not None})
            self._models_seen.update(tokens)
            for token in tokens:
                if not await self.redis_async.exists(ModelKeys(token).incarnation):
                    await self._recover(token, may_be_new=False)
            # Every model the stream knows is accounted for: from now on a model without a
            # marker and without state is a new one (see store_key).
            await asyncio.to_thread(self.writer.mark_store_intact)
        except (redis.RedisError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("could not check the models' state before consuming (%s); the probe will", exc)

    def _start_recovery(self, token: str) -> None:
        task = self._recovering.get(token)
        if task is None or task.done():
            self._recovering[token] = asyncio.create_task(self._recover(token))

    async def _recover(self, token: str, may_be_new: bool = True) -> None:
        try:
            if may_be_new and token not in self._incarnations and await asyncio.to_thread(self.writer.store_intact):
                # A model this processor never saw ready, in a store that was not lost: if it
                # has no state either, it is new and starts empty now, without a rebuild (a
                # later batch than its first would still be caught by the seq check).
                new_marker_id = await asyncio.to_thread(self.writer.adopt_new_model, token)
                if new_marker_id is not None:
                    self._incarnations[token] = new_marker_id
                    log.info("model %s: first seen; its state starts empty", token)
                    return
            outcome, marker_id = await asyncio.to_thread(self.writer.claim_rebuild, token, self.owner,
                                                         self.cfg.rebuild_scan_timeout_s)
            if outcome == "held":
                return  # ready, or another processor is preparing the rebuild
            started = time.monotonic()
            self.writer.forget_models()
            plans = await self._scan_model(token)
            await asyncio.to_thread(self.writer.prime_rebuild, token, plans)
            starts: dict[int, int] = {}
            for plan in plans:
                if plan.live:
                    starts[plan.partition] = min(starts.get(plan.partition, plan.start_stream_seq),
                                                 plan.start_stream_seq)
            lost = await self._rewind(starts)
            reason = "lost" if lost else "new"
            await asyncio.to_thread(self.writer.finish_scan, token, any(p.complete for p in plans), reason)
            await asyncio.to_thread(self.writer.mark_store_intact)
            self._incarnations[token] = marker_id
            self._ahead_since = {k: v for k, v in self._ahead_since.items() if subject_token(k[0]) != token}
            REBUILDS.labels(reason if outcome == "created" else "takeover").inc()
            complete = sum(p.complete for p in plans)
            log_at = log.warning if lost or outcome != "created" else log.info
            log_at("model %s: no state in the store (incarnation marker missing%s); %s: %d workers rebuilt from "
                   "the stream (partitions %s rewound), %d marked stale; prepared in %.2fs", token,
                   ", taken over" if outcome == "takeover" else "",
                   "acknowledged batches were lost" if lost else "nothing acknowledged was lost", complete,
                   sorted(starts) or "none", len(plans) - complete, time.monotonic() - started)
            for plan in plans:
                if plan.live and not plan.complete:
                    log.error("%s/%s: the stream no longer holds the start of epoch %d (retention); marked stale, "
                              "asking its bridge to resync", token, plan.worker_id, plan.epoch)
                    await self._request_resync(token, plan.worker_id, "state store lost and history truncated")
        except (redis.RedisError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("model %s: preparing the rebuild failed (%s); retrying", token, exc)
        except Exception:  # the probe retries; the marker stays not ready meanwhile
            log.exception("model %s: preparing the rebuild failed", token)

    async def _scan_model(self, token: str) -> list[RebuildPlan]:
        """Each worker of the model in the stream: its current epoch, its last seq, where the
        epoch's batch 1 is (a binary search over stream seqs), and whether it is live."""
        info = await self.js.stream_info(EVENTS_STREAM, subjects_filter=f"{EVENTS_PREFIX}.{token}.*.*")
        first = info.state.first_seq
        now = time.time()
        plans: list[RebuildPlan] = []
        for subject in sorted(info.state.subjects or {}):
            parsed = parse_events_subject(subject)
            if parsed is None or parsed.partition is None:
                continue
            try:
                last = await self.js.get_last_msg(EVENTS_STREAM, subject)
            except nats.js.errors.NotFoundError:
                continue
            position = _position(last.data)
            if position is None or position[1] <= 0 or position[2] <= 0:
                continue  # no batch of an epoch yet: nothing to rebuild
            worker_id, epoch, seq, lease_s = position
            lease_s = self.cfg.default_lease_s if lease_s is None else lease_s
            live = last.time.timestamp() + lease_s >= now if last.time and lease_s > 0 else lease_s != 0
            # nats-py types a stored message's seq and data as Optional: get_last_msg and get_msg fill them.
            start, before = await self._epoch_start(subject, epoch, first, last.seq)  # type: ignore[arg-type]
            plans.append(RebuildPlan(worker_id, epoch, seq, start, before if before is not None else seq,
                                     parsed.partition, live))
        return plans

    async def _epoch_start(self, subject: str, epoch: int, lo: int, hi: int) -> tuple[int, int | None]:
        """(stream seq, worker seq just before it) of the first message of `epoch` on
        `subject` that the stream still holds: (seq of batch 1, 0) when it holds the whole
        epoch. A worker's epochs only grow along the stream, so that message is found by
        bisecting on "the next message of this worker from here is of `epoch` or later"."""
        found = None
        while lo < hi:
            mid = (lo + hi) // 2
            msg = await self.js.get_msg(EVENTS_STREAM, seq=mid, subject=subject, next=True)
            position = _position(msg.data)
            if position is not None and position[1] >= epoch:
                hi, found = mid, msg
            else:
                lo = msg.seq + 1  # type: ignore[operator]  # (seq and data: see _scan_model)
        if found is None:  # found is always the first message from `lo` on
            found = await self.js.get_msg(EVENTS_STREAM, seq=lo, subject=subject, next=True)
        try:
            message = decode_message(found.data)  # type: ignore[arg-type]
        except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
            return found.seq, None  # type: ignore[return-value]
        if isinstance(message, EventBatch):
            return found.seq, message.seq - 1  # type: ignore[return-value]
        if isinstance(message, WorkerExpired):
            return found.seq, message.seq  # type: ignore[return-value]
        # an announcement: the next batch follows its cursor
        return found.seq, message.cursor.seq  # type: ignore[return-value]

    async def _rewind(self, starts: dict[int, int]) -> bool:
        """Re-create each partition's durable consumer at its start (never past its ack floor:
        other workers' unacked messages are kept). True if acked messages are delivered again."""
        lost = False
        for partition, start in sorted(starts.items()):
            durable = f"{self.cfg.durable_prefix}-p{partition}"
            try:
                info = await self.js.consumer_info(EVENTS_STREAM, durable)
            except nats.js.errors.NotFoundError:
                continue  # created later from the stream's first message: nothing to rewind
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            if start > floor:
                # Nothing acknowledged is needed again; what is in flight was refused (not
                # ready) and comes back by itself. Re-creating the consumer here would pull it
                # from under the processor that owns the partition mid-delivery.
                continue
            lost = lost or start <= floor
            config = self._consumer_config(partition)
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = min(start, floor + 1)
            await self.js.delete_consumer(EVENTS_STREAM, durable)
            try:
                await self.js.add_consumer(EVENTS_STREAM, config)
            except nats.js.errors.BadRequestError:
                pass  # a consuming processor re-created it meanwhile, from the stream's start
            log.info("partition %d: consumer rewound to stream seq %d to rebuild lost state", partition,
                     config.opt_start_seq)
        return lost


def _position(data: bytes | None) -> tuple[str, int, int, float | None] | None:
    """(worker, epoch, seq, lease seconds or None) of a stream message, None if undecodable."""
    try:
        message = decode_message(data or b"")
    except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
        return None
    if isinstance(message, WorkerAnnounce):
        return message.metadata.worker_id, message.cursor.epoch, message.cursor.seq, message.lease_ttl_s
    if isinstance(message, WorkerExpired):
        return message.worker_id, message.epoch, message.seq, 0.0  # no lease left
    return message.worker_id, message.epoch, message.seq, None
