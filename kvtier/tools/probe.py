"""`kvtier probe hicache`: did HiCache serve a prefix from host RAM (L2), or only from the GPU?

The protocol of SGLang's HiCache guide, run against one worker:

  A  a long synthetic prefix (seeded random token ids, whole pages) + question 1: first sight;
  B  the same prefix + a new question: reuse, normally from device memory;
  C  other long prefixes push the test prefix out of device memory (server and host pool
     stay up), then A again.

A lower TTFT or a cache hit rate does not say which tier served a request. An L2 read is
proven only by telemetry: before the request the prefix pages were off device and on host,
and after it a host->device load (a device store of exactly those pages) was seen. kvtier
has that telemetry: the worker's tier state in Redis (read before each request, for the page
hashes of the prompt computed as SGLang computes them) and its event stream in JetStream
(watched by an ordered, ephemeral consumer opened before the first request). Where either is
missing the verdict says so rather than guessing.

The request is SGLang's native `POST <worker-url>/generate` with `input_ids` and
`sampling_params.max_new_tokens = 1`: a real server at http://host:port, a `kvtier
sim-worker` rank at http://host:port/w/<rank> (same body, same meta_info fields).

Layout: `judge()` and `collect_evidence()` are pure functions over typed structs (unit
tested); `Probe` does the I/O (HTTP, NATS, Redis).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import secrets
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtier.plumbing.connections import redact, redis_client
from kvtier.schemas.events import AllCleared, EventBatch, PagesStored, WorkerAnnounce, WorkerExpired, decode_message
from kvtier.schemas.hashes import BlockHash, page_key, sglang_block_hashes
from kvtier.schemas.sglang_server import GenerateBody, GenerateMetaInfo, SamplingParams, decode_generate_meta_info
from kvtier.schemas.state_keys import ModelKeys, as_text, page_member
from kvtier.schemas.subjects import EVENTS_STREAM, stored_events_subject_pattern
from kvtier.schemas.tiers import Tier
from kvtier.tools.settings import ProbeSettings

log = logging.getLogger("kvtier.probe")

#: Token ids are drawn from this range: inside any real vocabulary, clear of special tokens.
TOKEN_RANGE = (1000, 30000)
QUESTION_MIN_TOKENS = 32


class ProbeError(ValueError):
    """A condition the user can act on (unreachable worker, unknown page size): one line."""


class Verdict(str, enum.Enum):
    L2_READ_PROVEN = "L2 read proven"
    DEVICE_HIT = "device hit"
    RECOMPUTED = "recomputed"
    NOT_PROVEN = "consistent with reuse, not proven"
    #: Neither reuse nor recompute can be told: no cached-token count and no telemetry.
    INCONCLUSIVE = "inconclusive"


# --- what the worker says -------------------------------------------------------------------
class CachedTokens(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's own account of the prompt tokens it did not recompute.

    SGLang's meta_info: `cached_tokens` (total), and `cached_tokens_details` = {"device",
    "host"[, "storage", "storage_backend"]} or null (null/absent when nothing was cached,
    and on servers that do not report it). `kvtier sim-worker` names the L3 part "l3"."""

    total: int | None = None
    #: True when the worker broke the total down by tier.
    details: bool = False
    device: int | None = None
    host: int | None = None
    storage: int | None = None


def cached_tokens_of(meta_info: GenerateMetaInfo) -> CachedTokens:
    details = meta_info.cached_tokens_details
    total = meta_info.cached_tokens
    if details is not None:
        device = details.device or 0
        host = details.host or 0
        storage = details.storage if details.storage is not None else details.l3
        if total is None:
            total = device + host + (storage or 0)
        return CachedTokens(total=total, details=True, device=device, host=host, storage=storage)
    return CachedTokens(total=total)


def worker_ttft_of(meta_info: GenerateMetaInfo) -> tuple[float | None, str]:
    """The worker's own time to first token, and where it was read: `ttft_s` (sim-worker),
    else `e2e_latency` (SGLang; with max_new_tokens=1 the first token is the last)."""
    for key, value in (("ttft_s", meta_info.ttft_s), ("ttft", meta_info.ttft), ("e2e_latency", meta_info.e2e_latency)):
        if value is not None:
            return float(value), key
    return None, ""


# --- evidence and judgement -----------------------------------------------------------------
class Evidence(msgspec.Struct, frozen=True, kw_only=True):
    """Everything observed around one request of the protocol."""

    series: str
    page_size: int
    prompt_tokens: int
    prefix_pages: int
    #: The worker's events are on the stream: the watcher had seen its messages before the request.
    event_stream: bool
    #: Redis held trustworthy tier state for the worker just before the request (present, not
    #: stale, caught up with the stream).
    tier_state: bool
    #: Why telemetry is missing or doubtful ("" when complete).
    notes: list[str] = []
    #: Prefix pages before the request, from Redis: on device; on host; on host but not on device.
    before_device: int = 0
    before_host: int = 0
    before_host_only: int = 0
    #: After the request (events published once it was sent): device stores of prefix pages
    #: that were on host and off device before = host->device loads (load_back) ...
    load_back_pages: int = 0
    #: ... and of prefix pages that were on no tier before = fresh prefill.
    fresh_device_pages: int = 0
    #: Device stores of any page of the prompt, and the batches ("epoch:seq") that held the loads.
    device_store_pages: int = 0
    load_back_batches: list[str] = []
    batches_watched: int = 0
    cached: CachedTokens = CachedTokens()
    wall_ttft_s: float = 0.0
    worker_ttft_s: float | None = None
    worker_ttft_field: str = ""


class Judgement(msgspec.Struct, frozen=True):
    verdict: Verdict
    reasons: list[str]


def _cached_text(c: CachedTokens) -> str:
    if c.total is None:
        return "the worker does not report cached tokens"
    if not c.details:
        return f"the worker reports {c.total} cached tokens, not broken down by tier"
    storage = f", storage {c.storage}" if c.storage is not None else ""
    return f"the worker reports {c.total} cached tokens (device {c.device}, host {c.host}{storage})"


def judge(ev: Evidence) -> Judgement:
    """The verdict on one request, from its evidence alone (pure)."""
    cached = ev.cached
    told = _cached_text(cached)
    missing = list(ev.notes)
    if not ev.event_stream and not any("event stream" in n for n in missing):
        missing.append("no event stream for this worker")
    if not ev.tier_state and not any("tier state" in n for n in missing):
        missing.append("no tier state for this worker")

    # L2: off device and on host before, a host->device store of those pages after, and the
    # worker's own breakdown (if it gives one) agrees that tokens came from host.
    if ev.event_stream and ev.tier_state and ev.before_host_only > 0 and ev.load_back_pages > 0:
        where = (f"{ev.before_host_only} of {ev.prefix_pages} prefix pages were on host and not on device before "
                 f"the request; {ev.load_back_pages} of them were stored on device after it (host->device load, "
                 f"batch {', '.join(ev.load_back_batches[:3]) or '?'})")
        if cached.details and not cached.host:
            return Judgement(Verdict.NOT_PROVEN, [where, told + ": no tokens from host, which contradicts the load"])
        return Judgement(Verdict.L2_READ_PROVEN, [where, told])

    if cached.total == 0:
        if ev.load_back_pages:
            return Judgement(Verdict.NOT_PROVEN, [f"{ev.load_back_pages} prefix pages were loaded host->device", told
                                                  + ": no cached tokens, which contradicts the load"])
        reasons = [told]
        if ev.tier_state:
            reasons.append(f"prefix pages before: {ev.before_device} on device, {ev.before_host} on host")
        if ev.event_stream:
            reasons.append(f"{ev.fresh_device_pages} prefix pages freshly stored on device after the request")
        return Judgement(Verdict.RECOMPUTED, reasons)
    if (cached.total is None and ev.event_stream and ev.tier_state and ev.before_device == 0
            and ev.before_host == 0 and ev.fresh_device_pages > 0):
        return Judgement(Verdict.RECOMPUTED, [
            "the prefix pages were on no tier before the request",
            f"{ev.fresh_device_pages} of them were freshly stored on device after it", told])

    if cached.total:
        if (ev.tier_state and ev.before_device > 0 and ev.load_back_pages == 0
                and (not cached.details or (cached.device and not cached.host))):
            return Judgement(Verdict.DEVICE_HIT, [
                f"{ev.before_device} of {ev.prefix_pages} prefix pages were on device before the request", told,
                "no host->device load of prefix pages was seen" if ev.event_stream
                else "(no event stream: loads cannot be seen)"])
        why = []
        if cached.details and cached.host and ev.load_back_pages == 0:
            why.append("the worker says tokens came from host, but no host->device load of prefix pages was seen")
        elif not cached.details and ev.load_back_pages == 0:
            why.append("cached tokens are not broken down by tier and no host->device load was seen")
        if ev.tier_state and ev.before_device == 0 and ev.before_host_only == 0:
            why.append("the tier state showed the prefix on neither device nor host before the request")
        if ev.tier_state and ev.before_host_only > 0 and ev.event_stream and ev.load_back_pages == 0:
            why.append(f"{ev.before_host_only} prefix pages were on host only before, but none was loaded to device")
        return Judgement(Verdict.NOT_PROVEN, [told, *why, *missing])
    return Judgement(Verdict.INCONCLUSIVE, [told, *missing])


def collect_evidence(*, series: str, page_size: int, prompt: Sequence[int], prefix_pages: int,
                     before: dict[BlockHash, set[Tier]] | None, batches: Iterable[EventBatch],
                     event_stream: bool, meta_info: GenerateMetaInfo, wall_ttft_s: float,
                     notes: Sequence[str] = ()) -> Evidence:
    """Evidence of one request (pure): `before` is the prompt's pages in Redis before it
    (None: no trustworthy tier state), `batches` the worker's batches published after it was sent."""
    hashes = sglang_block_hashes(prompt, page_size)
    prefix = set(hashes[:prefix_pages])
    prompt_pages = set(hashes)
    tiers_before = before or {}
    on_device = {h for h in prefix if Tier.DEVICE in tiers_before.get(h, ())}
    on_host = {h for h in prefix if Tier.HOST in tiers_before.get(h, ())}
    host_only = on_host - on_device
    nowhere = prefix - on_device - on_host
    load_back: set[BlockHash] = set()
    fresh: set[BlockHash] = set()
    stored: set[BlockHash] = set()
    load_batches: list[str] = []
    extra_notes = list(notes)
    watched = 0
    for batch in batches:
        watched += 1
        loaded_here = False
        for event in batch.events:
            if isinstance(event, AllCleared):
                extra_notes.append(f"the worker cleared its cache (batch {batch.epoch}:{batch.seq})")
            if not isinstance(event, PagesStored) or event.tier is not Tier.DEVICE:
                continue
            for h in event.hashes:
                if h not in prompt_pages:
                    continue
                stored.add(h)
                if before is not None and h in host_only:
                    load_back.add(h)
                    loaded_here = True
                elif before is not None and h in nowhere:
                    fresh.add(h)
        if loaded_here:
            load_batches.append(f"{batch.epoch}:{batch.seq}")
    ttft, ttft_field = worker_ttft_of(meta_info)
    return Evidence(
        series=series, page_size=page_size, prompt_tokens=len(prompt), prefix_pages=prefix_pages,
        event_stream=event_stream, tier_state=before is not None, notes=extra_notes,
        before_device=len(on_device), before_host=len(on_host), before_host_only=len(host_only),
        load_back_pages=len(load_back), fresh_device_pages=len(fresh), device_store_pages=len(stored),
        load_back_batches=load_batches, batches_watched=watched, cached=cached_tokens_of(meta_info),
        wall_ttft_s=wall_ttft_s, worker_ttft_s=ttft, worker_ttft_field=ttft_field)


class SeriesReport(msgspec.Struct, kw_only=True):
    name: str
    what: str
    evidence: Evidence
    verdict: Verdict
    reasons: list[str]


class ProbeReport(msgspec.Struct, kw_only=True):
    worker_url: str
    worker_id: str
    model: str
    page_size: int
    seed: int
    prefix_tokens: int
    question_tokens: int
    evicting_prefixes_sent: int
    #: Prefix pages still on device (Redis) when series C was sent; None without tier state.
    prefix_pages_on_device_before_c: int | None
    series: list[SeriesReport]


# --- I/O ------------------------------------------------------------------------------------
@dataclass
class _Seen:
    stream_seq: int
    message: EventBatch | WorkerAnnounce | WorkerExpired


@dataclass
class EventWatcher:
    """An ordered, ephemeral consumer on one worker's subject of KVTIER_EVENTS, from the
    last message already there (for the bridge's cursor) onwards."""

    seen: list[_Seen] = field(default_factory=list)
    #: (epoch, seq) of the newest batch the stream holds for the worker, from batches and cursors.
    latest: tuple[int, int] | None = None
    last_arrival: float = 0.0
    note: str = ""
    _sub: Any = None

    async def start(self, js, model: str, worker_id: str) -> None:
        import nats.js.errors
        from nats.js.api import DeliverPolicy

        subject = stored_events_subject_pattern(model, worker_id)
        try:
            info = await js.stream_info(EVENTS_STREAM, subjects_filter=subject)
        except nats.js.errors.NotFoundError:
            self.note = f"no event stream: NATS has no {EVENTS_STREAM} stream (no bridge has run there)"
            return
        if not info.state.subjects:
            self.note = (f"no event stream: {EVENTS_STREAM} holds nothing on {subject} "
                         "(is a bridge forwarding this worker?)")
        self._sub = await js.subscribe(subject, stream=EVENTS_STREAM, cb=self._on_message, ordered_consumer=True,
                                       deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)

    async def _on_message(self, msg) -> None:
        try:
            message = decode_message(msg.data)
        except Exception as exc:  # noqa: BLE001 - one bad message must not end the watch
            log.warning("undecodable message on %s: %s", msg.subject, exc)
            return
        self.last_arrival = time.monotonic()
        self.seen.append(_Seen(msg.metadata.sequence.stream, message))
        position = ((message.epoch, message.seq) if isinstance(message, (EventBatch, WorkerExpired))
                    else (message.cursor.epoch, message.cursor.seq))
        if self.latest is None or position > self.latest:
            self.latest = position

    @property
    def has_stream(self) -> bool:
        return bool(self.seen)

    def batches_after(self, stream_seq: int) -> list[EventBatch]:
        return [s.message for s in self.seen if s.stream_seq > stream_seq and isinstance(s.message, EventBatch)]

    def touched(self, stream_seq: int, pages: set[BlockHash]) -> bool:
        return any(isinstance(e, PagesStored) and e.tier is Tier.DEVICE and any(h in pages for h in e.hashes)
                   for b in self.batches_after(stream_seq) for e in b.events)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - closing anyway
                pass


class Probe:
    def __init__(self, config: ProbeSettings):
        self.config = config
        self.url = config.worker_url.rstrip("/")
        self.watcher = EventWatcher()
        self.js: Any = None  # the JetStream context, once connected
        self.nc: Any = None  # the NATS connection, once connected
        self.redis: Any = None  # the Redis client, once connected
        self.redis_error = ""
        self.keys = ModelKeys.for_model(config.model)

    # -- Redis
    def _redis_state(self) -> dict[str, str]:
        try:
            state = self.redis.hgetall(self.keys.state(self.config.worker_id))
        except Exception as exc:  # noqa: BLE001 - telemetry missing, not fatal
            if not self.redis_error:
                log.warning("cannot read tier state from Redis: %s", exc)
            self.redis_error = f"{exc}"
            return {}
        self.redis_error = ""
        return {as_text(k): as_text(v) for k, v in state.items()}

    def _redis_position(self, state: dict[str, str]) -> tuple[int, int] | None:
        if "epoch" not in state:
            return None
        return int(state.get("epoch") or 0), int(state.get("seq") or 0)

    def _page_size(self) -> int:
        if self.config.page_size:
            return self.config.page_size
        try:
            raw = self.redis.hget(self.keys.page_sizes, self.config.worker_id)
        except Exception:  # noqa: BLE001
            raw = None
        if raw:
            return int(raw)
        raise ProbeError(f"the page size of worker {self.config.worker_id!r} is unknown (Redis has none announced "
                         f"for model {self.config.model!r}): give --page-size")

    def _tiers(self, hashes: Sequence[BlockHash]) -> dict[BlockHash, set[Tier]]:
        members = [page_member(t, page_key(h)) for t in (Tier.DEVICE, Tier.HOST) for h in hashes]
        present = self.redis.smismember(self.keys.pages(self.config.worker_id), members) if members else []
        tiers: dict[BlockHash, set[Tier]] = {}
        for i, flag in enumerate(present):
            if flag:
                tier = Tier.DEVICE if i < len(hashes) else Tier.HOST
                tiers.setdefault(hashes[i % len(hashes)], set()).add(tier)
        return tiers

    async def _settle(self, quiet_s: float = 0.3, timeout_s: float = 5.0) -> list[str]:
        """Wait until the worker's stream is quiet and Redis has applied its last batch.
        Returns notes on what did not settle."""
        deadline = time.monotonic() + timeout_s
        if self.watcher.has_stream:
            while time.monotonic() < deadline and time.monotonic() - self.watcher.last_arrival < quiet_s:
                await asyncio.sleep(0.05)
        while True:
            position = self._redis_position(self._redis_state())
            if self.watcher.latest is None or (position is not None and position >= self.watcher.latest):
                return []
            if time.monotonic() >= deadline:
                return [f"tier state lags the stream (Redis at {position}, stream at {self.watcher.latest}): "
                        "is a processor running?"]
            await asyncio.sleep(0.05)

    async def _before(self, hashes: Sequence[BlockHash]) -> tuple[dict[BlockHash, set[Tier]] | None, list[str]]:
        notes = await self._settle()
        state = self._redis_state()
        if self.redis_error:
            return None, notes + [f"no tier state: cannot read Redis at {redact(self.config.redis_url)} "
                                  f"({self.redis_error})"]
        if "epoch" not in state:
            return None, notes + [f"no tier state for this worker in Redis ({self.keys.state(self.config.worker_id)})"]
        if state.get("stale") == "1":
            return None, notes + [f"tier state is marked stale ({state.get('stale_reason', '')})"]
        if notes:
            return None, notes
        return self._tiers(hashes), []

    async def _stream_mark(self) -> int:
        if self.js is None:
            return 0
        try:
            return (await self.js.stream_info(EVENTS_STREAM)).state.last_seq
        except Exception:  # noqa: BLE001 - no stream: nothing will be watched anyway
            return 0

    # -- HTTP
    async def _generate(self, session, tokens: list[int]) -> tuple[GenerateMetaInfo, float]:
        import aiohttp

        body = msgspec.json.encode(GenerateBody(input_ids=tokens,
                                                sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)))
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        started = time.perf_counter()
        try:
            async with session.post(self.url + "/generate", data=body, headers=headers) as response:
                raw = await response.read()
                elapsed = time.perf_counter() - started
                if response.status != 200:
                    raise ProbeError(f"{self.url}/generate answered {response.status}: {raw[:300]!r}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ProbeError(f"cannot reach the worker at {self.url}/generate: {exc or type(exc).__name__}") from exc
        try:
            return decode_generate_meta_info(raw), elapsed
        except msgspec.ValidationError as exc:
            raise ProbeError(f"{self.url}/generate answered JSON that is not SGLang's reply ({exc}): "
                             f"{raw[:200]!r}") from exc
        except msgspec.DecodeError as exc:
            raise ProbeError(f"{self.url}/generate did not answer JSON: {raw[:200]!r}") from exc

    async def _series(self, session, name: str, what: str, prompt: list[int], prefix_pages: int,
                      page_size: int) -> SeriesReport:
        hashes = sglang_block_hashes(prompt, page_size)
        before, notes = await self._before(hashes)
        if self.watcher.note and not self.watcher.has_stream:
            notes = [self.watcher.note, *notes]
        event_stream = self.watcher.has_stream
        mark = await self._stream_mark()
        meta, wall = await self._generate(session, prompt)
        if event_stream:  # wait for this request's device stores, then for the stream to go quiet
            pages = set(hashes)
            deadline = time.monotonic() + self.config.watch_timeout_s
            while time.monotonic() < deadline and not self.watcher.touched(mark, pages):
                await asyncio.sleep(0.05)
            if not self.watcher.touched(mark, pages):
                notes.append(f"no device store of the prompt's pages arrived within {self.config.watch_timeout_s}s")
            while time.monotonic() < deadline and time.monotonic() - self.watcher.last_arrival < 0.3:
                await asyncio.sleep(0.05)
        evidence = collect_evidence(series=name, page_size=page_size, prompt=prompt, prefix_pages=prefix_pages,
                                    before=before, batches=self.watcher.batches_after(mark),
                                    event_stream=event_stream, meta_info=meta, wall_ttft_s=wall, notes=notes)
        judgement = judge(evidence)
        return SeriesReport(name=name, what=what, evidence=evidence, verdict=judgement.verdict,
                            reasons=judgement.reasons)

    async def _connect(self) -> None:
        self.redis = redis_client(self.config.redis_url, socket_timeout=5, socket_connect_timeout=5)
        from kvtier.plumbing.nats_options import NatsConnectError, connect_once, redact_nats

        try:  # with the process's NATS credentials and TLS (kvtier/plumbing/nats_options.py)
            self.nc = await connect_once(self.config.nats_url, "kvtier-probe", connect_timeout=3,
                                         reconnect_time_wait=0.5, allow_reconnect=False)
            self.js = self.nc.jetstream()
            await self.watcher.start(self.js, self.config.model, self.config.worker_id)
        except NatsConnectError as exc:  # its message names the URL (redacted) and the cause
            self.watcher.note = f"no event stream: {exc}"
            log.warning("%s", self.watcher.note)
        except Exception as exc:  # noqa: BLE001 - no stream is evidence missing, reported as such
            self.watcher.note = (f"no event stream: cannot watch NATS at {redact_nats(self.config.nats_url)} "
                                 f"({exc or type(exc).__name__})")
            log.warning("%s", self.watcher.note)

    async def run(self) -> ProbeReport:
        import aiohttp

        cfg = self.config
        await self._connect()
        try:
            page_size = self._page_size()
            seed = cfg.seed if cfg.seed is not None else secrets.randbelow(1 << 31)
            rng = random.Random(seed)
            prefix_pages = max(2, -(-cfg.prefix_tokens // page_size))
            question_tokens = page_size * max(1, -(-QUESTION_MIN_TOKENS // page_size))

            def draw(n: int) -> list[int]:
                return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

            prefix = draw(prefix_pages * page_size)
            question_1, question_2 = draw(question_tokens), draw(question_tokens)
            prefix_hashes = sglang_block_hashes(prefix, page_size)
            # A short wait for the watcher's first delivery (the last message already there).
            deadline = time.monotonic() + 1.0
            while self.watcher._sub is not None and not self.watcher.has_stream and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                series = [await self._series(session, "A", "prefix + question 1 (first sight)",
                                             prefix + question_1, prefix_pages, page_size),
                          await self._series(session, "B", "same prefix + question 2",
                                             prefix + question_2, prefix_pages, page_size)]
                # C: other prefixes until Redis shows no prefix page on device (at most K; all K
                # when there is no trustworthy tier state to watch).
                sent, on_device, watch = 0, None, self.watcher.has_stream
                for _ in range(cfg.evict_prefixes):
                    if on_device == 0:
                        break
                    await self._generate(session, draw(prefix_pages * page_size + question_tokens))
                    sent += 1
                    if watch:
                        before, _ = await self._before(prefix_hashes)
                        if before is None:
                            watch, on_device = False, None
                        else:
                            on_device = sum(1 for h in prefix_hashes if Tier.DEVICE in before.get(h, ()))
                series.append(await self._series(
                    session, "C", f"prefix + question 1 again, after {sent} other prefixes",
                    prefix + question_1, prefix_pages, page_size))
            return ProbeReport(worker_url=cfg.worker_url, worker_id=cfg.worker_id, model=cfg.model,
                               page_size=page_size, seed=seed, prefix_tokens=prefix_pages * page_size,
                               question_tokens=question_tokens, evicting_prefixes_sent=sent,
                               prefix_pages_on_device_before_c=on_device, series=series)
        finally:
            await self.watcher.stop()
            if self.nc is not None:
                try:
                    await self.nc.close()
                except Exception:  # noqa: BLE001
                    pass
            if self.redis is not None:
                self.redis.close()


# --- output ---------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def render(report: ProbeReport) -> str:
    first = report.series[0].evidence if report.series else None
    lines = [
        f"kvtier probe hicache: worker {report.worker_id} (model {report.model}) at {report.worker_url}",
        f"  page size {report.page_size}, prefix {report.prefix_tokens} tokens "
        f"({report.prefix_tokens // report.page_size} pages), questions {report.question_tokens} tokens, "
        f"seed {report.seed}; {report.evicting_prefixes_sent} evicting prefixes before C"
        + (f" (prefix pages still on device then: {report.prefix_pages_on_device_before_c})"
           if report.prefix_pages_on_device_before_c is not None else ""),
    ]
    if first is not None:
        lines.append(f"  telemetry: event stream {'yes' if first.event_stream else 'NO'}, "
                     f"tier state in Redis {'yes' if first.tier_state else 'NO'}")
    lines.append("")
    header = (f"{'series':<6} {'prompt':>6}  {'prefix before dev/host/host-only':>32}  {'load_back':>9} "
              f"{'fresh dev':>9}  {'cached total (dev/host/L3)':>26}  {'wall TTFT':>9} {'worker TTFT':>11}  verdict")
    lines += [header, "-" * len(header)]
    for s in report.series:
        e = s.evidence
        before = (f"{e.before_device}/{e.before_host}/{e.before_host_only} of {e.prefix_pages}" if e.tier_state
                  else "- (no tier state)")
        flow = f"{e.load_back_pages}" if e.event_stream else "-"
        fresh = f"{e.fresh_device_pages}" if e.event_stream and e.tier_state else "-"
        c = e.cached
        cached = _num(c.total) + (f" ({c.device}/{c.host}/{_num(c.storage)})" if c.details else "")
        lines.append(f"{s.name:<6} {e.prompt_tokens:>6}  {before:>32}  {flow:>9} {fresh:>9}  {cached:>26}  "
                     f"{_ms(e.wall_ttft_s):>9} {_ms(e.worker_ttft_s):>11}  {s.verdict.value}")
    lines.append("")
    for s in report.series:
        lines.append(f"{s.name}: {s.verdict.value.upper()}  [{s.what}]")
        for reason in s.reasons:
            lines.append(f"   - {reason}")
    if any(s.evidence.worker_ttft_field == "e2e_latency" for s in report.series):
        lines.append("(worker TTFT: SGLang's e2e_latency of a 1-token generation)")
    return "\n".join(lines)


def run_probe_cli(settings: ProbeSettings) -> int:
    report = asyncio.run(Probe(settings).run())
    print(render(report), flush=True)
    if settings.json:
        print(msgspec.json.encode(report).decode(), flush=True)
    sys.stdout.flush()
    return 0
