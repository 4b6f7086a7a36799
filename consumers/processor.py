"""`kvtier processor`: JetStream -> ordered, exactly-once tier state in Redis.

Each owned partition has one durable pull consumer. Messages are decoded, then applied
through `TierStateWriter` (one atomic, order-checked script call per batch) and acked only
after Redis has them, so a crash at any point redelivers and the seq check drops repeats.
On start each consumer is rewound to its ack floor, so what a crashed processor held is
redelivered at once, in stream order, instead of after ack_wait.
A gap (a later seq arrives first) is held back (nak with delay) for `gap_timeout_s`; then
the worker is rebased: cleared, marked stale, and its bridge is asked to resync.

Beside consuming, the processor composes recovery.py (a state store that lost a model's
state: found, rebuilt from the stream), expiry.py (leases that ran out, workers long dead),
partitions.py (the durable consumers, a fair share under `--partitions auto`) and
dead_letters.py (messages it cannot apply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import msgspec
import nats
import nats.errors
import nats.js.errors
import redis

from kvtier.consumers.apply import ApplyMode, ApplyStatus, TierStateWriter
from kvtier.consumers.dead_letters import decode_or_dead_letter
from kvtier.consumers.expiry import LeaseExpiry
from kvtier.consumers.hash_check import HashValidator
from kvtier.consumers.ownership import PartitionLeases
from kvtier.consumers.partitions import Durables, hold_fair_share
from kvtier.consumers.processor_config import ProcessorConfig
from kvtier.consumers.processor_metrics import (
    ANNOUNCES,
    APPLIED_BATCHES,
    APPLIED_TRANSITIONS,
    GAPS,
    HASH_MISMATCHES,
    HASH_PAGES,
    LAG,
    RESYNCS,
    SKIPPED,
)
from kvtier.consumers.pull import consume
from kvtier.consumers.recovery import StateRecovery
from kvtier.plumbing.connections import redact, redis_async_client, redis_client
from kvtier.plumbing.streams import connect_nats, ensure_streams_when_ready
from kvtier.schemas.events import ControlRequest, EventBatch, WorkerAnnounce, WorkerExpired, encode_control
from kvtier.schemas.health import decode_hash_check, encode_hash_check
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import control_subject, parse_events_subject, subject_token

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


def stream_time(msg) -> float | None:
    """When the message entered the stream (JetStream's timestamp), if the delivery says."""
    try:
        return msg.metadata.timestamp.timestamp()
    except (AttributeError, ValueError, TypeError):
        return None


#: Page transitions sent to Redis per round trip: big enough to amortise the round trip,
#: small enough that the first batch of a burst is visible within a few milliseconds.
CHUNK_TRANSITIONS = 4096


def _really_cancelled() -> bool:
    """Whether the running task was cancelled (not a library cancelling one of its own
    futures, which reaches the awaiting code as the same CancelledError)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; on 3.10 every one is taken as real
    return task is None or cancelling is None or cancelling() > 0


class Processor:
    def __init__(self, config: ProcessorConfig):
        self.cfg = config
        self.redis = redis_client(config.redis_url, socket_timeout=10, health_check_interval=5)
        self.redis_async = redis_async_client(config.redis_url, socket_timeout=10, health_check_interval=5)
        self.writer = TierStateWriter(self.redis, self.redis_async, guarded=True,
                                      changes_maxlen=config.changes_maxlen)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.durables = Durables(config.durable_prefix, config.ack_wait_s, config.fetch_batch)
        self.nc: NATS = None  # type: ignore[assignment]  # connected in run(), before any use
        self.js: JetStreamContext = None  # type: ignore[assignment]  # likewise
        self.recovery: StateRecovery  # made in run(), once connected (_compose)
        self.expiry: LeaseExpiry  # likewise
        self.partitions: list[int] = []
        self.total_partitions = 0
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
        self._compose()
        try:
            total = await ensure_streams_when_ready(self.js, self.cfg.streams, stop,
                                                    partitions_explicit=self.cfg.partitions_explicit)
            if total is None:
                return
            self.total_partitions = total
            listed = self.cfg.listed_partitions
            self.partitions = listed if listed is not None else list(range(total))
            bad = [p for p in self.partitions if not 0 <= p < total]
            if bad:
                raise ValueError(f"partitions {bad} do not exist: the stream has {total} (0..{total - 1})")
            await self.recovery.prepare_models()
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
            await self.recovery.cancel()
            with contextlib.suppress(redis.RedisError):
                await self._persist_hash_checks()
            # close, not drain: draining pull subscriptions can wait forever in nats-py, and
            # every message we acked is already applied; unacked ones are redelivered.
            await self.nc.close()
            self.redis.close()
            await self.redis_async.aclose()

    def _compose(self) -> None:
        """The collaborators that use the stream, made once it is connected."""
        self.recovery = StateRecovery(self.js, self.writer, self.redis_async, self.durables, self.owner,
                                      scan_timeout_s=self.cfg.rebuild_scan_timeout_s,
                                      default_lease_s=self.cfg.default_lease_s, request_resync=self._request_resync,
                                      model_rebuilt=self._forget_gaps_of)
        self.expiry = LeaseExpiry(self.nc, self.js, self.writer, self.durables,
                                  worker_retention_s=self.cfg.worker_retention_s, forget=self._forget,
                                  owned=lambda: self.partitions)

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
    async def _own_partitions_dynamically(self, total: int, stop: asyncio.Event) -> None:
        """Hold a fair share of the partitions, taking over those whose owner died."""
        leases = PartitionLeases(self.redis, self.owner, total, self.cfg.partition_lease_s)

        def owned(partitions: list[int]) -> None:
            self.partitions = partitions

        await hold_fair_share(leases, self.cfg.partition_lease_s, stop, self._keep_consuming, owned)

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

        await consume(f"partition {partition}", lambda: self.durables.resubscribe(self.nc, self.js, partition, stop),
                      self.handle, stop, on_handle_error=redeliver, reopen_now=gap_held_back, log=log)

    async def handle(self, messages) -> None:
        """Decode and apply messages in arrival order. Batches go to Redis in chunks of about
        `CHUNK_TRANSITIONS`, and the next chunk is decoded while Redis applies the previous
        one: a burst neither waits for the whole burst to be decoded nor loses its order
        (a chunk is sent only after the one before it has been applied)."""
        chunk: list[tuple[object, EventBatch]] = []
        size = 0
        in_flight: tuple[list, asyncio.Task] | None = None
        for msg in messages:
            message = await decode_or_dead_letter(self.nc, self.js, msg)
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
                    await self.expiry.apply(msg, message)
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
        self.recovery.models_seen.add(subject_token(announce.metadata.model))
        self.expiry.saw_lease(announce.lease_ttl_s)
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
            self.recovery.models_seen.add(subject_token(batch.model))
            if result.status == ApplyStatus.NOT_READY:
                # The model's state is gone or being prepared for a rebuild: hand it back.
                SKIPPED.labels("not_ready").inc()
                self.recovery.start(subject_token(batch.model))
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

    async def _request_resync(self, model: str, worker_id: str, reason: str) -> None:
        key = (model, worker_id)
        now = time.monotonic()
        if now - self._last_resync.get(key, -1e9) < self.cfg.resync_min_interval_s:
            return
        self._last_resync[key] = now
        RESYNCS.inc()
        await self.nc.publish(control_subject(model, worker_id),
                              encode_control(ControlRequest(request="resync", reason=reason)))

    # --- housekeeping -----------------------------------------------------------------------
    async def _housekeeping(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.recovery.probe_incarnations()  # first: a lost store must hold expiries back
                await self.expiry.sweep(self.total_partitions, self.recovery.unsettled_at)
                await self._persist_hash_checks()
            except (redis.RedisError, nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("housekeeping failed: %s", exc)
            except Exception:  # housekeeping must outlive any one bad sweep
                log.exception("housekeeping sweep failed")
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.reap_interval_s)
            except asyncio.TimeoutError:
                pass

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

    def _forget_gaps_of(self, model_token: str) -> None:
        """A rebuilt model's batches come again from its epochs' starts: gaps timed before are void."""
        self._ahead_since = {k: v for k, v in self._ahead_since.items() if subject_token(k[0]) != model_token}
