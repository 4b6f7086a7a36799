"""`kvtier analytics`: tier statistics from the event and decision streams, on /metrics.

The numbers come from `analytics_model.TierAnalytics` (pure, no I/O); this module is its
edges: decoding stream messages into it (`MessageFeeder`, shared with `kvtier report`),
the durable consumers (read through consumers/pull.py, as the processor's), and the HTTP endpoint
(its /metrics families are rendered by analytics_metrics.py).

Delivery. Two durable pull consumers of its own, `<durable>-events` on KVTIER_EVENTS and
`<durable>-decisions` on KVTIER_DECISIONS (never the processors' consumers); each message is
acked after it has been counted, in order, so a restarted analytics continues after the last
message it counted. A consumer that still holds unacked messages when analytics starts (the
previous process died mid-batch) is rewound to its ack floor so they are counted now, in
order. A new durable starts from the first message the stream retains.

Restart. Counters are this process's own (Prometheus treats a restart as a counter reset),
so no message is counted by two processes unless one died between counting and its ack
reaching the server (at-least-once, at most one pull batch). The tier sets are not lost:
before consuming, analytics rebuilds them by reading the events stream from its first
retained message up to the durable's ack floor through an ephemeral consumer, applying every
message without counting. Resident-page gauges, lifetimes and demotion/eviction
classification are therefore right from the first message after a restart; the rebuild
reads what the stream retains (`--no-rebuild` skips it: state then starts empty and removals
of pages stored before are counted as no-ops).

Clock. Leases and write-back windows run on the stream's timestamps of the messages while
analytics is behind, and on the wall clock once it has caught up (clocks in sync, as for the
processors). Lifetimes use the engine's timestamps (`source_ts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from kvtier.consumers.analytics_config import AnalyticsConfig
from kvtier.consumers.analytics_metrics import AnalyticsCollector, ConsumerStats
from kvtier.consumers.analytics_model import TierAnalytics
from kvtier.consumers.pull import PullStream, consume, filter_config, read_stream
from kvtier.schemas.analytics_health import AnalyticsHealth
from kvtier.schemas.events import EventBatch, UnsupportedVersion, WorkerAnnounce, WorkerExpired, decode_message
from kvtier.schemas.routing import decode_decision
from kvtier.schemas.subjects import (
    DECISIONS_PREFIX,
    DECISIONS_STREAM,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    decisions_subject,
    subject_token,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

log = logging.getLogger("kvtier.analytics")

STREAMS = (EVENTS_STREAM, DECISIONS_STREAM)


def event_filters(models: list[str] | None) -> list[str]:
    """Subjects of the events stream to read (as stored: with the partition token)."""
    if not models:
        return [f"{EVENTS_PREFIX}.>"]
    return sorted({f"{EVENTS_PREFIX}.{subject_token(m)}.*.*" for m in models})


def decision_filters(models: list[str] | None) -> list[str]:
    if not models:
        return [f"{DECISIONS_PREFIX}.>"]
    return sorted({decisions_subject(m) for m in models})


class MessageFeeder:
    """Decodes stream messages into a `TierAnalytics`. `models`: only these (exact names)."""

    def __init__(self, analytics: TierAnalytics, models: list[str] | None = None):
        self.analytics = analytics
        self.models = set(models) if models else None
        self.last_time: dict[str, float] = {}

    def event(self, data: bytes, at: float) -> str:
        """Apply one events-stream message stored at `at`; returns its kind
        (batch, announce, skipped: another model, undecodable)."""
        self.last_time[EVENTS_STREAM] = at
        try:
            message = decode_message(data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
            self.analytics.undecodable[EVENTS_STREAM] += 1
            self.analytics.advance(at)
            return "undecodable"
        if isinstance(message, WorkerAnnounce):
            if self.models is not None and message.metadata.model not in self.models:
                return "skipped"
            self.analytics.announce(message, at)
            return "announce"
        if isinstance(message, WorkerExpired):
            return "expired"  # analytics judges leases on its own clock (consumers/analytics_model.py)
        assert isinstance(message, EventBatch)
        if self.models is not None and message.model not in self.models:
            return "skipped"
        self.analytics.apply_batch(message, at)
        return "batch"

    def decision(self, data: bytes, at: float) -> str:
        self.last_time[DECISIONS_STREAM] = at
        try:
            decision = decode_decision(data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
            self.analytics.undecodable[DECISIONS_STREAM] += 1
            return "undecodable"
        if self.models is not None and decision.model not in self.models:
            return "skipped"
        self.analytics.decision(decision)
        return "decision"


# --- the service -------------------------------------------------------------------------
class AnalyticsService:
    def __init__(self, config: AnalyticsConfig):
        from prometheus_client import CollectorRegistry, ProcessCollector

        self.cfg = config
        self.analytics = TierAnalytics(writeback_window_s=config.writeback_window_s)
        self.feeder = MessageFeeder(self.analytics, config.models)
        self.stats = {EVENTS_STREAM: ConsumerStats(), DECISIONS_STREAM: ConsumerStats()}
        self._rebuilding = False
        self.registry = CollectorRegistry()
        self.registry.register(AnalyticsCollector(self.analytics, self.stats, lambda: self._rebuilding))
        ProcessCollector(registry=self.registry)
        self.nc: NATS | None = None
        self.port = 0

    def durable_name(self, stream: str) -> str:
        return f"{self.cfg.durable}-{'events' if stream == EVENTS_STREAM else 'decisions'}"

    def filters(self, stream: str) -> list[str]:
        return event_filters(self.cfg.models) if stream == EVENTS_STREAM else decision_filters(self.cfg.models)

    async def run(self, stop: asyncio.Event, ready=None) -> None:
        from aiohttp import web

        from kvtier.plumbing.streams import (
            StreamSettings,
            connect_nats,
            ensure_decisions_stream,
            ensure_streams_when_ready,
        )

        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.http_port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site's server
        if ready is not None:
            ready(self.port)
        try:
            self.nc = await connect_nats(self.cfg.nats_url, "kvtier-analytics", stop)
            if self.nc is None:
                return
            js = self.nc.jetstream()
            if await ensure_streams_when_ready(js, StreamSettings(), stop) is None:
                return
            await ensure_decisions_stream(js)
            floors = {}
            for stream in STREAMS:
                floors[stream] = await self._durable(js, stream)
            if self.cfg.rebuild and floors[EVENTS_STREAM]:
                await self._rebuild(floors[EVENTS_STREAM], stop)
            if stop.is_set():
                return
            tasks = [asyncio.create_task(self._consume(stream, stop)) for stream in STREAMS]
            tasks.append(asyncio.create_task(self._tick(js, stop)))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stop.set()
            stopper.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        finally:
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await self.nc.flush(timeout=2)  # the last acks reach the server
                with contextlib.suppress(Exception):
                    await self.nc.close()
            await runner.cleanup()

    async def _metrics(self, request):
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.registry)  # in the loop's thread: the model is not mid-update
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request):
        from aiohttp import web

        ok = self.nc is not None and self.nc.is_connected
        body = AnalyticsHealth(status="ok" if ok else "degraded", nats=ok, rebuilding=self._rebuilding,
                               workers=len(self.analytics.workers))
        return web.Response(body=msgspec.json.encode(body), status=200, content_type="application/json")

    async def _durable(self, js, stream: str) -> int:
        """Create or resume this analytics' durable consumer on `stream`; returns the stream
        sequence up to which everything matching has been counted (its ack floor)."""
        import nats.js.errors
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        name, filters = self.durable_name(stream), self.filters(stream)
        config = ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT, ack_wait=self.cfg.ack_wait_s,
                                max_ack_pending=50_000, max_deliver=-1, deliver_policy=DeliverPolicy.ALL,
                                **filter_config(filters))
        try:
            info = await js.consumer_info(stream, name)
        except nats.js.errors.NotFoundError:
            info = None
        floor = 0
        if info is not None:
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            current = sorted(info.config.filter_subjects or ([info.config.filter_subject]
                                                             if info.config.filter_subject else []))
            if info.num_ack_pending or current != filters:
                why = (f"{info.num_ack_pending} unacked messages" if info.num_ack_pending
                       else f"filters {current} -> {filters}")
                log.info("%s: resuming consumer %s at stream seq %d (%s)", stream, name, floor + 1, why)
                await js.delete_consumer(stream, name)
                config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, floor + 1
                info = None
        if info is None:
            try:
                await js.add_consumer(stream, config)
            except nats.js.errors.BadRequestError:
                pass  # created meanwhile by another analytics with the same --durable
        return floor

    async def _rebuild(self, floor: int, stop: asyncio.Event) -> None:
        """Tier state up to `floor`, already counted before: applied without counting."""
        started = time.monotonic()
        self._rebuilding = True
        self.analytics.counting = False
        stats = self.stats[EVENTS_STREAM]
        try:
            async for msg in read_stream(self.nc, EVENTS_STREAM, self.filters(EVENTS_STREAM), end_seq=floor):
                if msg.seq > floor or stop.is_set():
                    break  # (the first retained message is past the floor when older ones aged out)
                self.feeder.event(msg.data, msg.time)
                stats.rebuilt += 1
        finally:
            self.analytics.counting = True
            self._rebuilding = False
        log.info("rebuilt tier state of %d workers from %d messages up to stream seq %d in %.1fs",
                 len(self.analytics.workers), stats.rebuilt, floor, time.monotonic() - started)

    async def _consume(self, stream: str, stop: asyncio.Event) -> None:
        import nats.js.errors

        durable = self.durable_name(stream)
        feed = self.feeder.event if stream == EVENTS_STREAM else self.feeder.decision
        stats = self.stats[stream]
        opened = False

        async def open_pull() -> PullStream:
            nonlocal opened
            if opened:  # re-opened after a failure: if the durable was deleted under us, recreate
                js = self.nc.jetstream()  # type: ignore[union-attr]  # run() connected first
                with contextlib.suppress(Exception):
                    try:
                        await js.consumer_info(stream, durable)
                    except nats.js.errors.NotFoundError:
                        await self._durable(js, stream)  # at its ack floor
            opened = True
            return await PullStream(self.nc, stream, durable, self.cfg.fetch_batch).start()

        async def count(msgs) -> None:
            for msg in msgs:
                meta = msg.metadata
                at = meta.timestamp.timestamp()
                feed(msg.data, at)
                stats.counted += 1
                stats.last_time = at
                stats.pending = meta.num_pending
                await msg.ack()  # after counting: a restart continues after it

        await consume(stream, open_pull, count, stop, log=log)

    async def _tick(self, js, stop: asyncio.Event) -> None:
        """Consumer positions for /metrics; once caught up, the wall clock drives leases and
        write-back windows."""
        import nats.errors
        import nats.js.errors

        while not stop.is_set():
            try:
                for stream in STREAMS:
                    info = await js.consumer_info(stream, self.durable_name(stream))
                    stats = self.stats[stream]
                    stats.pending, stats.ack_pending = info.num_pending, info.num_ack_pending
                events = self.stats[EVENTS_STREAM]
                if events.pending == 0 and events.ack_pending == 0:
                    self.analytics.advance(time.time())
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("consumer info unavailable: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.tick_s)
            except asyncio.TimeoutError:
                pass


async def run_analytics(config: AnalyticsConfig, stop: asyncio.Event, ready=None) -> None:
    await AnalyticsService(config).run(stop, ready)


