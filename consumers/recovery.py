"""State-store loss: finding it and rebuilding the tier state from the stream.

Every model's state carries an incarnation marker (`kvt:{m}:incarnation`). The apply script
refuses batches of a model whose marker is missing (a Redis restart without persistence,
FLUSHALL, failover to an empty replica) and a housekeeping probe looks for it every
`reap_interval_s`. One processor claims the rebuild (the marker, re-created "not ready", holds
back every processor's batches and tells routers to route on load only); it finds each
worker's current epoch in the stream, primes the worker to stand just before the epoch's first
batch (or, where retention no longer holds it, clears it, marks it stale and asks its bridge to
resync), rewinds the partitions' durable consumers to the earliest epoch start, and marks the
marker ready; the stream then rebuilds the state through the ordinary apply path, and the
marker's `rebuilding` flag is cleared once every worker is back at the seq it had reached when
the loss was found.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import nats.errors
import nats.js.errors
import redis
import redis.asyncio
from nats.js.api import DeliverPolicy

from kvtier.consumers.apply import RebuildPlan, TierStateWriter
from kvtier.consumers.partitions import Durables
from kvtier.consumers.processor_metrics import REBUILDING, REBUILDS
from kvtier.schemas.events import EventBatch, UnsupportedVersion, WorkerAnnounce, WorkerExpired, decode_message
from kvtier.schemas.state_keys import MODELS_KEY, ModelKeys, as_text
from kvtier.schemas.subjects import EVENTS_PREFIX, EVENTS_STREAM, parse_events_subject

if TYPE_CHECKING:
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


class StateRecovery:
    """Probes every known model's incarnation marker and rebuilds the state of those that lost
    it. `request_resync(model, worker, reason)` asks a worker's bridge to resync;
    `model_rebuilt(token)` is called once a model's rebuild is prepared."""

    def __init__(self, js: JetStreamContext, writer: TierStateWriter, redis_async: redis.asyncio.Redis,
                 durables: Durables, owner: str, *, scan_timeout_s: float, default_lease_s: float,
                 request_resync: Callable[[str, str, str], Awaitable[None]],
                 model_rebuilt: Callable[[str], None]):
        self.js = js
        self.writer = writer
        self.redis_async = redis_async
        self.durables = durables
        self.owner = owner
        self.scan_timeout_s = scan_timeout_s
        self.default_lease_s = default_lease_s
        self.request_resync = request_resync
        self.model_rebuilt = model_rebuilt
        #: Model tokens seen in messages: probed for their incarnation marker even after the
        #: state store lost `kvt:models`.
        self.models_seen: set[str] = set()
        self._incarnations: dict[str, str] = {}  # model token -> marker id last seen
        self._recovering: dict[str, asyncio.Task] = {}
        #: When a model's state was last seen lost or rebuilding (lease expiries wait for it to settle).
        self.unsettled_at = 0.0

    async def cancel(self) -> None:
        """Stop the rebuilds under way: one cut short is taken over (or redone) by the next probe."""
        for task in self._recovering.values():
            task.cancel()
        await asyncio.gather(*self._recovering.values(), return_exceptions=True)

    async def probe_incarnations(self) -> None:
        """Check every known model's marker: missing -> rebuild; a rebuild claimed by a silent
        processor -> take it over; rebuilding -> note which workers have caught up."""
        tokens = self.models_seen | {as_text(t) for t in await self.redis_async.smembers(MODELS_KEY)}
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
                    self.unsettled_at = time.time()
                self.start(token)
                continue
            if ready != "1":
                if known_model:
                    self.unsettled_at = time.time()
                rebuilding += 1
                if now_ms - float(scan_ms or 0) > self.scan_timeout_s * 1000:
                    self.start(token)
                continue
            known = self._incarnations.get(token)
            if known != marker_id:
                if known is not None:
                    self.unsettled_at = time.time()
                    log.warning("model %s: its state store was re-created (incarnation %s -> %s)", token, known,
                                marker_id)
                    self.writer.forget_models()
                self._incarnations[token] = marker_id
            if building == "1":
                behind = await asyncio.to_thread(self.writer.rebuild_progress, token)
                if behind:
                    if reason == "lost":
                        self.unsettled_at = time.time()
                    rebuilding += 1
                else:
                    log.warning("model %s: tier state rebuilt from the stream, %.1fs after the loss was found",
                                token, (now_ms - float(created_ms or now_ms)) / 1000)
        REBUILDING.set(rebuilding)

    async def prepare_models(self) -> None:
        """Before consuming: every model in the stream whose marker is missing (a first start,
        or a store that lost it while no processor ran) is prepared for its rebuild now,
        rather than after its first batches have been pulled only to be refused."""
        try:
            info = await self.js.stream_info(EVENTS_STREAM, subjects_filter=f"{EVENTS_PREFIX}.>")
            stored = (parse_events_subject(s) for s in (info.state.subjects or {}))
            tokens = sorted({s.model_token for s in stored if s is not None and s.partition is not None})
            self.models_seen.update(tokens)
            for token in tokens:
                if not await self.redis_async.exists(ModelKeys(token).incarnation):
                    await self._recover(token, may_be_new=False)
            # Every model the stream knows is accounted for: from now on a model without a
            # marker and without state is a new one (see store_key).
            await asyncio.to_thread(self.writer.mark_store_intact)
        except (redis.RedisError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("could not check the models' state before consuming (%s); the probe will", exc)

    def start(self, token: str) -> None:
        """Recover the model's state in the background, unless that is under way already."""
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
                                                         self.scan_timeout_s)
            if outcome == "held":
                return  # ready, or another processor is preparing the rebuild
            await self._rebuild(token, outcome, marker_id)
        except (redis.RedisError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            log.warning("model %s: preparing the rebuild failed (%s); retrying", token, exc)
        except Exception:  # the probe retries; the marker stays not ready meanwhile
            log.exception("model %s: preparing the rebuild failed", token)

    async def _rebuild(self, token: str, outcome: str, marker_id: str) -> None:
        """Prime the claimed model's workers from the stream, rewind its partitions and mark it ready."""
        started = time.monotonic()
        self.writer.forget_models()
        plans = await self._scan_model(token)
        await asyncio.to_thread(self.writer.prime_rebuild, token, plans)
        starts: dict[int, int] = {}
        for plan in plans:
            if plan.live:
                starts[plan.partition] = min(starts.get(plan.partition, plan.start_stream_seq), plan.start_stream_seq)
        lost = await self._rewind(starts)
        reason = "lost" if lost else "new"
        await asyncio.to_thread(self.writer.finish_scan, token, any(p.complete for p in plans), reason)
        await asyncio.to_thread(self.writer.mark_store_intact)
        self._incarnations[token] = marker_id
        self.model_rebuilt(token)
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
                await self.request_resync(token, plan.worker_id, "state store lost and history truncated")

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
            lease_s = self.default_lease_s if lease_s is None else lease_s
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
            durable = self.durables.name(partition)
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
            config = self.durables.config(partition)
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
