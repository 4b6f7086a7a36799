"""`kvtier bridge`: one SGLang worker's ZMQ KV events -> kvtier batches on NATS JetStream.

Per DP rank (port base + r) one `RankBridge` keeps the worker's order end to end:
- every engine batch is forwarded once, in engine seq order, inside gap-free (epoch, seq)
  kvtier batches published one at a time with `Nats-Msg-Id = model:worker:epoch:seq`;
- a seq gap is filled from SGLang's replay socket; if the buffer no longer has it, or the
  engine restarted (seq went back), a new epoch begins, which clears the worker's state
  downstream, and the replay buffer is forwarded to rebuild as much as it holds;
- a restarted bridge continues the old epoch when the engine's replay buffer still holds
  the last batch it forwarded (same seq, same ts): no state is dropped for a bridge restart;
- a heartbeat announces metadata and extends the worker's lease, only while the engine
  answers its health endpoint (with a worker URL): a dead engine's lease runs out.

Its settings are in bridge_config.py, the engine's health check in engine_health.py, and the
cutting of events into messages the server accepts in message_chunks.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import msgspec
import nats
import nats.errors
import nats.js.errors
import zmq.asyncio

from kvtier.plumbing.streams import connect_nats, dead_letter_headers, ensure_streams_when_ready
from kvtier.producers import bridge_metrics as metrics
from kvtier.producers.bridge_config import BridgeConfig, rank_configs
from kvtier.producers.convert import convert_batch, source_timestamp

# Re-exported: `kvtier bridge` builds its EngineHealthCheck from here, and the dashboards test reads
# the engine-health metrics from this module (the others from bridge_metrics.py).
from kvtier.producers.engine_health import (  # noqa: F401
    ENGINE_HEALTH_FAILURES,
    ENGINE_UP,
    EngineHealthCheck,
    EngineProbe,
)

# Under their old private names, which the fuzz bench and tests import from here.
from kvtier.producers.message_chunks import ENVELOPE_BYTES as _ENVELOPE_BYTES
from kvtier.producers.message_chunks import chunk_by_pages as _chunk_by_pages
from kvtier.producers.message_chunks import max_payload
from kvtier.producers.sglang_source import (
    RawBatch,
    ReplaySocketClient,
    ReplaySocketError,
    SglangSubscriber,
    SourceSequencer,
    batches_after,
    decode_raw,
    parse_pub_frames,
)
from kvtier.schemas.events import (
    BridgeCursor,
    EpochReason,
    EventBatch,
    TierEvent,
    WorkerAnnounce,
    WorkerExpired,
    decode_control,
    decode_message,
    encode_message,
)
from kvtier.schemas.sglang import DecodedBatch, MalformedBatch
from kvtier.schemas.subjects import (
    EVENTS_STREAM,
    control_subject,
    dlq_subject,
    events_subject,
    stored_events_subject_pattern,
)

log = logging.getLogger("kvtier.bridge")

#: Dead letters of one engine batch published concurrently (each acked by the stream).
DEAD_LETTERS_IN_FLIGHT = 256
#: Replay requests a starting bridge makes before it gives up and begins a partial epoch.
START_REPLAY_ATTEMPTS = 3


class RankBridge:
    def __init__(self, config: BridgeConfig, nc, zctx: zmq.asyncio.Context, engine: EngineProbe | None = None):
        self.cfg = config
        self.engine = engine
        self.nc = nc
        self.js = nc.jetstream()
        self.zctx = zctx
        self.subject = events_subject(config.model, config.worker_id)
        self.metadata = config.metadata()
        self.sequencer = SourceSequencer()
        self.replay = (ReplaySocketClient(zctx, config.replay_endpoint, config.replay_timeout_s)
                       if config.replay_endpoint else None)
        self.epoch = 0
        self.seq = 0
        self.pending_reason: EpochReason | None = None
        self.pending_from_start = False  # the pending epoch begins at the engine's first batch
        self.source_seq_last = -1
        self.source_ts_last = 0.0
        self.lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self._last_resync = 0.0
        self._failure: BaseException | None = None
        self._label = config.worker_id

    # --- lifecycle ------------------------------------------------------------------------
    async def run(self) -> None:
        sub = SglangSubscriber(self.zctx, self.cfg.endpoint, self.cfg.topic)
        control = await self.nc.subscribe(control_subject(self.cfg.model, self.cfg.worker_id), cb=self._on_control)
        try:
            async with self.lock:
                cursor = await self._load_cursor()
                # Renew the lease before catching up: that can take longer than a lease, and a
                # worker whose engine answers is alive all along. One whose engine has not
                # answered yet (still loading its model, or dead) is not announced at all, not
                # even for a moment: a live lease is what makes routers choose a worker, and what
                # they send there would wait or fail. Its events are forwarded all the same, so
                # its state is exact when the first heartbeat that finds it answering announces it.
                if await self._engine_answers():
                    await self._announce(cursor)
                await self._start(cursor)
                if await self._engine_answers():
                    await self._announce()
            tasks = [asyncio.create_task(self._live(sub)), asyncio.create_task(self._heartbeat())]
            stopper = asyncio.create_task(self.stopping.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in [stopper, *tasks]:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            # Crash-only: a failed loop ends the bridge (non-zero exit) rather than leaving it
            # half alive; restarted, it resumes its epoch from the stream.
            for result in [*results, self._failure]:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            await control.unsubscribe()
            sub.close()

    def stop(self) -> None:
        self.stopping.set()

    async def _load_cursor(self) -> BridgeCursor | None:
        try:
            last = await self.js.get_last_msg(EVENTS_STREAM,
                                              stored_events_subject_pattern(self.cfg.model, self.cfg.worker_id))
        except nats.js.errors.NotFoundError:
            return None
        try:
            message = decode_message(last.data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return None
        if isinstance(message, WorkerAnnounce):
            return message.cursor
        if isinstance(message, WorkerExpired):
            return None  # the worker was expired (its state cleared): nothing to continue
        return BridgeCursor(epoch=message.epoch, seq=message.seq, source_seq_last=message.source_seq_last,
                            source_ts_last=message.source_ts_last)

    async def _start(self, cursor: BridgeCursor | None) -> None:
        # At start nothing waits on the replay, and without it the epoch holds only what comes
        # next (partial): a busy engine gets three tries, the timeout doubling each time.
        buffered = await self._replay_from(0, attempts=START_REPLAY_ATTEMPTS) if self.replay else None
        if cursor is not None and buffered and cursor.source_seq_last >= 0:
            tail = batches_after(buffered, cursor.source_seq_last, cursor.source_ts_last)
            if tail is not None:
                self.epoch, self.seq = cursor.epoch, cursor.seq
                self.source_seq_last, self.source_ts_last = cursor.source_seq_last, cursor.source_ts_last
                self.sequencer.accepted(cursor.source_seq_last, cursor.source_ts_last)
                log.info("%s: resuming epoch %d at seq %d (engine seq %d)", self._label, self.epoch, self.seq,
                         cursor.source_seq_last)
                await self._forward(tail)
                return
        await self._rebuild_epoch(EpochReason.BRIDGE_START, buffered, cursor)
        if buffered == [] and self.sequencer.expected is None:
            # The engine has published nothing yet, so its next batch is seq 0. Batches it sends
            # before our subscription takes effect (ZMQ's slow joiner) then show up as a gap and
            # are fetched from the replay socket instead of being silently missed.
            self.sequencer.expect(0)

    async def _rebuild_epoch(self, reason: EpochReason, buffered: list[RawBatch] | None,
                             cursor: BridgeCursor | None = None) -> None:
        """Begin a new epoch holding what the engine's replay buffer still has."""
        self._begin_epoch(reason, cursor)
        # An empty buffer: the engine has published nothing since it started, so this epoch
        # will hold its whole history.
        self.pending_from_start = buffered == []
        await self._forward(buffered or [])
        if self.pending_reason is not None:
            await self._publish_events([], None)  # announce the epoch now: clears stale state

    def _begin_epoch(self, reason: EpochReason, cursor: BridgeCursor | None = None) -> None:
        floor = max(self.epoch, cursor.epoch if cursor else 0)
        self.epoch = max(int(time.time() * 1000), floor + 1)
        self.seq = 0
        self.pending_reason = reason
        self.pending_from_start = False
        self.sequencer.reset()
        self.source_seq_last, self.source_ts_last = -1, 0.0
        metrics.EPOCHS.labels(self._label, reason.value).inc()
        log.warning("%s: new epoch %d (%s)", self._label, self.epoch, reason.value)

    async def _replay_from(self, start: int, attempts: int = 1) -> list[RawBatch] | None:
        assert self.replay is not None
        timeout_s = self.replay.timeout_s
        for attempt in range(1, attempts + 1):
            try:
                return await self.replay.fetch(start, timeout_s)
            except ReplaySocketError as exc:
                if attempt == attempts:
                    log.warning("%s: replay failed: %s", self._label, exc)
                    return None
                log.warning("%s: replay failed (%s); asking again (try %d of %d)", self._label, exc, attempt + 1,
                            attempts)
                timeout_s *= 2
        return None

    # --- live path ------------------------------------------------------------------------
    async def _live(self, sub: SglangSubscriber) -> None:
        while not self.stopping.is_set():
            if self.replay and not await sub.wait(self.cfg.catch_up_s):
                await self._catch_up()
                continue
            messages = await sub.receive(self.cfg.max_batches_per_message)
            raws: list[RawBatch] = []
            for frames in messages:
                try:
                    raws.append(parse_pub_frames(frames))
                except MalformedBatch as exc:
                    await self._dead_letter(b"".join(frames), f"bad ZMQ frames: {exc}")
            async with self.lock:
                await self._forward(raws)

    async def _catch_up(self) -> None:
        """A quiet live path: forward what the replay socket holds past our last batch (a lost
        batch is otherwise noticed only when the next one comes). The probe asks from the next
        seq (only an end marker while nothing is new) without holding the lock; what it finds is
        fetched again from our last batch on, so `_forward` checks it is ours: a restarted
        engine is no continuation."""
        expected = self.sequencer.expected
        assert self.replay is not None
        if expected is None:
            return  # nothing to anchor on
        try:
            if not await self.replay.fetch(expected):
                return
            async with self.lock:
                if self.sequencer.expected != expected:
                    return  # the live path moved on meanwhile
                filled = await self.replay.fetch(max(0, expected - 1))
                if filled and filled[-1].seq >= expected:
                    metrics.CATCH_UPS.labels(self._label).inc()
                    log.info("%s: engine batches %d..%d missed on the live path, fetched from replay", self._label,
                             expected, filled[-1].seq)
                    await self._forward(filled)
        except ReplaySocketError:
            return  # asked again after the next quiet spell

    async def _forward(self, raws: list[RawBatch]) -> None:
        """Forward engine batches in order, handling duplicates, gaps and restarts."""
        ready: list[tuple[RawBatch, DecodedBatch | str]] = []
        index = 0
        while index < len(raws):
            raw = raws[index]
            decoded, ts = decode_raw(raw)
            verdict = self.sequencer.classify(raw.seq, ts)
            if verdict == SourceSequencer.DUPLICATE:
                metrics.BATCHES.labels(self._label, "duplicate").inc()
                index += 1
                continue
            if verdict == SourceSequencer.ACCEPT:
                ready.append((raw, decoded))
                self.sequencer.accepted(raw.seq, ts)
                index += 1
                continue
            await self._flush(ready)
            ready = []
            if verdict == SourceSequencer.GAP:
                missing_from = self.sequencer.expected
                assert missing_from is not None  # a gap is a seq past the one expected
                filled = await self._replay_from(max(0, missing_from - 1)) if self.replay else None
                continuation = self._continuation(filled, missing_from)
                if continuation is not None:
                    metrics.GAPS.labels(self._label, "true").inc()
                    log.info("%s: gap at engine seq %d..%d recovered from replay", self._label, missing_from,
                             raw.seq - 1)
                    # replayed batches come first; the live ones follow and dedupe by (seq, ts)
                    raws = continuation + raws[index:]
                    index = 0
                    continue
                if filled and filled[0].seq == missing_from - 1:
                    # The buffer holds our last seq with another ts: a new engine process that
                    # has already numbered past us. Its batches do not continue ours.
                    log.warning("%s: the engine restarted during a gap (seq %d is another batch now); new epoch",
                                self._label, missing_from - 1)
                    self._begin_epoch(EpochReason.PUBLISHER_RESTART)
                else:
                    metrics.GAPS.labels(self._label, "false").inc()
                    self._begin_epoch(EpochReason.UNRECOVERED_GAP)
            else:
                self._begin_epoch(EpochReason.PUBLISHER_RESTART)
            rebuilt = await self._replay_from(0) if self.replay else None
            raws = (rebuilt or []) + raws[index:]
            index = 0
        await self._flush(ready)

    def _continuation(self, filled: list[RawBatch] | None, missing_from: int) -> list[RawBatch] | None:
        """The replayed batches from `missing_from` on, if they provably continue what this
        bridge forwarded: the buffer must still hold our last batch, same seq and same ts
        (a restarted engine reuses seq numbers, never timestamps)."""
        if not filled:
            return None
        if missing_from == 0:
            # Nothing forwarded yet (an empty buffer at start): there is no batch to anchor on.
            return filled if filled[0].seq == 0 else None
        anchor, rest = filled[0], filled[1:]
        if anchor.seq == missing_from - 1 and self.sequencer.seen(anchor.seq, decode_raw(anchor)[1]) \
                and rest and rest[0].seq == missing_from:
            return rest
        return None

    async def _flush(self, ready: list[tuple[RawBatch, DecodedBatch | str]]) -> None:
        if not ready:
            return
        events: list[TierEvent] = []
        first_ts: float | None = None
        for raw, decoded in ready:
            if isinstance(decoded, str):
                metrics.BATCHES.labels(self._label, "dead_letter").inc()
                await self._dead_letter(raw.payload, decoded, raw.seq)
                continue
            metrics.BATCHES.labels(self._label, "forwarded").inc()
            converted = convert_batch(decoded, self.cfg.keep_token_ids)
            # Many at once, so a batch of thousands of bad events costs round trips in parallel,
            # not one after another (each dead letter is still acked by the stream).
            for start in range(0, len(converted.rejected), DEAD_LETTERS_IN_FLIGHT):
                await asyncio.gather(*(self._dead_letter(bad, reason, raw.seq)
                                       for bad, reason in converted.rejected[start:start + DEAD_LETTERS_IN_FLIGHT]))
            events.extend(converted.events)
            first_ts = source_timestamp(decoded.ts, time.time()) if first_ts is None else first_ts
        last_raw, last_decoded = ready[-1]
        self.source_seq_last = last_raw.seq
        self.source_ts_last = last_decoded.ts if not isinstance(last_decoded, str) else 0.0
        metrics.LAST_SEQ.labels(self._label).set(last_raw.seq)
        first_seq = ready[0][0].seq
        await self._publish_events(events, first_ts, first_seq)

    async def _publish_events(self, events: list[TierEvent], source_ts: float | None, first_seq: int = -1) -> None:
        chunks = _chunk_by_pages(events, self.cfg.max_pages_per_message, self._max_events_bytes()) or [[]]
        for chunk in chunks:
            self.seq += 1
            # The epoch's first batch says whether it begins at the engine's first batch.
            from_start = self.pending_reason is not None and (first_seq == 0 if first_seq >= 0
                                                             else self.pending_from_start)
            batch = EventBatch(
                worker_id=self.cfg.worker_id, model=self.cfg.model, dp_rank=self.cfg.dp_rank,
                epoch=self.epoch, seq=self.seq, ts=time.time(), source_ts=source_ts or time.time(),
                source_seq_first=first_seq, source_seq_last=self.source_seq_last,
                source_ts_last=self.source_ts_last, epoch_reason=self.pending_reason,
                epoch_from_start=from_start, events=chunk,
            )
            self.pending_reason = None
            await self._publish(self.subject, encode_message(batch), {"Nats-Msg-Id": batch.msg_id})
            metrics.PUBLISHED.labels(self._label).inc()
            metrics.EVENTS.labels(self._label).inc(len(chunk))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """Publish and wait for the stream's ack, retrying forever (same Nats-Msg-Id, so a
        retry after a lost ack is dropped as a duplicate by the broker): order is kept
        because nothing later is published before this one is stored."""
        delay = 0.05
        retried = False
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=headers, timeout=5.0)
                if ack.duplicate and not retried:
                    # Not a retry of ours: another publisher used this id (a second bridge for
                    # the same worker, or a copied stream): this batch was NOT stored.
                    metrics.DUPLICATES.labels(self._label).inc()
                    log.error("%s: the stream dropped %s as a duplicate of a message this bridge did not send "
                              "(is another bridge publishing for this worker?)", self._label,
                              (headers or {}).get("Nats-Msg-Id"))
                return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError,
                    nats.js.errors.APIError, nats.errors.ConnectionReconnectingError,
                    nats.js.errors.NoStreamResponseError) as exc:  # 503: no stream leader (NATS cluster election)
                if self.stopping.is_set() and isinstance(exc, nats.errors.ConnectionClosedError):
                    raise
                metrics.PUBLISH_RETRIES.labels(self._label).inc()
                retried = True
                log.warning("%s: publish to %s failed (%s); retrying in %.2fs", self._label, subject, exc, delay)
                await asyncio.sleep(delay)
                # Never back off longer than a heartbeat: once the broker is back, the worker's
                # lease must be renewed well within its length.
                delay = min(delay * 2, 2.0, self.cfg.heartbeat_s)

    def _max_events_bytes(self) -> int:
        """What a message's events may take: the server's max_payload less room for the rest
        of the batch (names of up to 256 characters) and the headers."""
        return max(64 << 10, max_payload(self.nc) - _ENVELOPE_BYTES)

    async def _dead_letter(self, data: bytes, reason: str, engine_seq: int | None = None) -> None:
        metrics.DEAD_LETTERS.labels(self._label).inc()
        log.warning("%s: dead-lettered engine input (seq %s): %s", self._label, engine_seq, reason[:1024])
        headers = dead_letter_headers(Kvtier_Reason=reason[:1024], Kvtier_Stage="bridge",
                                      Kvtier_Worker=self.cfg.worker_id, Kvtier_Model=self.cfg.model)
        # Its own id, kept by every retry: a letter whose ack was lost (a timeout while
        # hundreds are in flight on a busy broker) is stored once, not once per try.
        headers["Nats-Msg-Id"] = f"kvtier-dlq:bridge:{secrets.token_hex(12)}"
        if engine_seq is not None:
            headers["Kvtier-Engine-Seq"] = str(engine_seq)
        limit = max_payload(self.nc) - _ENVELOPE_BYTES
        if len(data) > limit:  # kept as far as the server takes it; the header says how long it was
            headers["Kvtier-Truncated-From"] = str(len(data))
            data = data[:limit]
        await self._publish(dlq_subject("bridge", self.cfg.model, self.cfg.worker_id), data, headers)

    # --- lease, metadata, control ---------------------------------------------------------
    async def _announce(self, cursor: BridgeCursor | None = None) -> None:
        """Metadata and lease, with where this bridge stands (or, before it has started,
        `cursor`: where the stream says the previous bridge stood)."""
        announce = WorkerAnnounce(
            metadata=self.metadata, ts=time.time(), lease_ttl_s=self.cfg.lease_ttl_s,
            cursor=cursor or BridgeCursor(epoch=self.epoch, seq=self.seq, source_seq_last=self.source_seq_last,
                                          source_ts_last=self.source_ts_last),
            engine_queue=self.engine.queue(self.cfg.dp_rank, self.cfg.dp_size) if self.engine is not None else None)
        await self._publish(self.subject, encode_message(announce))

    async def _engine_answers(self) -> bool:
        return self.engine is None or await self.engine.answers()

    async def _heartbeat(self) -> None:
        due = time.monotonic() + self.cfg.heartbeat_s
        while not self.stopping.is_set():
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            # The engine is asked right before each renewal, so a lease never rests on an old
            # answer; the time it takes to answer (SGLang's /health: a second or more) comes out
            # of the interval instead of stretching it towards the lease's end.
            if await self._engine_answers():
                async with self.lock:
                    await self._announce()
            due = max(due + self.cfg.heartbeat_s, time.monotonic())

    async def _on_control(self, msg) -> None:
        try:
            request = decode_control(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            request = None
        if request is None or request.request != "resync":
            log.warning("%s: ignoring unknown control message %r", self._label, msg.data[:200])
            return
        now = time.monotonic()
        if now - self._last_resync < self.cfg.resync_min_interval_s:
            return
        self._last_resync = now
        log.warning("%s: resync requested (%s)", self._label, request.reason[:200])
        try:
            async with self.lock:
                await self._rebuild_epoch(EpochReason.RESYNC_REQUESTED,
                                          await self._replay_from(0) if self.replay else None)
        except Exception as exc:  # a callback's errors would otherwise vanish
            log.exception("%s: resync failed", self._label)
            self._failure = exc
            self.stop()


async def run_bridge(config: BridgeConfig, stop: asyncio.Event) -> None:
    nc = await connect_nats(config.nats_url, f"kvtier-bridge-{config.worker_id}", stop)
    if nc is None:
        return
    zctx = zmq.asyncio.Context()
    engine = (EngineProbe(config.engine_health, config.engine_worker_id or config.worker_id,
                          reuse_s=config.heartbeat_s / 2) if config.engine_health else None)
    try:
        if await ensure_streams_when_ready(nc.jetstream(), config.streams, stop,
                                           partitions_explicit=config.partitions_explicit) is None:
            return
        bridges = [RankBridge(c, nc, zctx, engine) for c in rank_configs(config)]
        runs = [asyncio.create_task(b.run()) for b in bridges]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *runs], return_when=asyncio.FIRST_COMPLETED)
        for bridge in bridges:
            bridge.stop()
        results = await asyncio.gather(*runs, return_exceptions=True)
        stopper.cancel()
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
    finally:
        if engine is not None:
            await engine.close()
        await nc.drain()
        zctx.term()
