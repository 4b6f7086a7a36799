"""Reading tier state for a decision: every live worker's tiered overlap with the request
and its booked load, in one Redis round trip (`read_overlap.lua`), plus the worker directory
(metadata a router needs before that read: page sizes to hash at, Mooncake layouts, URLs)."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.schemas.events import ENGINE_QUEUE_FIELDS, engine_queue_from_fields
from kvtier.schemas.health import HashCheck, decode_hash_check
from kvtier.schemas.rates import PredictionError, decode_error, decode_fit
from kvtier.schemas.router_health import EngineQueueHealth, WorkerRatesHealth
from kvtier.schemas.routing import TierOverlap
from kvtier.schemas.state_keys import DEFAULT_ROOT, MODELS_KEY, ModelKeys, as_text
from kvtier.schemas.worker import WorkerMetadata, decode_worker_metadata

from .hashing import RequestPages

log = logging.getLogger("kvtier.router")

#: Pages asked by the first SMISMEMBER of each tier's walk after page 1; chunks then grow 4x.
FIRST_CHUNK = 4


class WorkerStatus(enum.IntEnum):
    CANDIDATE = 0
    STALE = 1  # its state was rebuilt after a gap and may under-report pages
    UNHASHED = 2  # the request was not hashed at its page size (directory out of date)


_STATUS_OF = {int(s): s for s in WorkerStatus}


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    status: WorkerStatus
    page_size: int
    overlap: TierOverlap  # device/host/disk; shared_beyond is filled in by the router
    prefill_load: int
    decode_load: int


class Views(list):
    """The live workers' views of one read; `rebuilding`: the model's state is being rebuilt
    after the state store lost it (its incarnation marker is missing or not ready, or the
    stream is still being re-applied): no overlap was read, route on load only.
    `marker_id`: the incarnation marker's id at the read ("" when missing). `degraded`: why
    the overlaps came from the Redis walk although this replica reads an in-memory index
    ("" when they did not, or when it does not)."""

    rebuilding: bool = False
    marker_id: str = ""
    #: The model's change counter at the read: an index that has applied the feed that far
    #: holds the pages sets as this read saw them.
    feed_change: int = 0
    degraded: str = ""


class TierStateReader(Protocol):
    """Where a decision reads tier state: every live worker's status, page size, booked load
    and tiered overlap with the request. Two implementations: `OverlapReader` (the walk in
    Redis, over the authoritative pages sets) and router/index_feed.py's `IndexedOverlapReader`
    (the same read without the walk, the overlaps from an in-memory index that follows the
    change feed). Both are written by the same writer (consumers/apply.py), and one test
    suite runs against both (tests/router/test_tier_state.py)."""

    async def read(self, model: str, pages_by_size: Mapping[int, RequestPages],
                   now_ms: int | None = None) -> Views: ...


class OverlapReader:
    def __init__(self, client, root: str = DEFAULT_ROOT):
        """`client`: a redis.asyncio client. `root`: the key root to read (live state; `kvtier
        replay explain` reads a rebuilt state under a scratch root)."""
        self._client = client
        self._script = client.register_script(load_lua("kvtier.router", "read_overlap.lua"))
        self._root = root

    async def read(self, model: str, pages_by_size: Mapping[int, RequestPages],
                   now_ms: int | None = None, walk: bool = True) -> Views:
        """`walk=False`: who is live, stale, at which page size and how loaded, with every
        overlap 0 (the in-memory index supplies them)."""
        if not walk:
            return await self._read_without_walk(model, pages_by_size, now_ms)
        keys = ModelKeys.for_model(model, self._root)
        args: list[str | int] = [keys.base, now_ms if now_ms is not None else int(time.time() * 1000), FIRST_CHUNK]
        for size, pages in pages_by_size.items():
            args += (size, pages.keys_blob if walk else "")
        flat = await self._script(keys=[keys.leases, keys.prefill_load, keys.decode_load, keys.stale_workers,
                                        keys.page_sizes, keys.incarnation, keys.changes_counter], args=args)
        status_of = _STATUS_OF
        views = Views(WorkerView(worker.decode() if isinstance(worker, bytes) else worker, status_of[status], size,
                           TierOverlap(device=device, host=host, disk=disk, predicted=predicted), prefill, decode)
                for worker, status, size, device, host, disk, prefill, decode, predicted
                in (flat[i:i + 9] for i in range(3, len(flat), 9)))
        views.rebuilding = bool(flat[0])
        views.marker_id = as_text(flat[1])
        views.feed_change = int(flat[2])
        return views

    async def _read_without_walk(self, model: str, pages_by_size: Mapping[int, RequestPages],
                                 now_ms: int | None) -> Views:
        """The same answer as the script's with nothing to walk, from plain commands in one
        round trip: a script pays for every value it passes in or out (BENCHMARKS.md), and
        without the walk nothing here needs to be atomic (the booking re-reads the loads
        atomically; leases, stale flags and page sizes change seldom)."""
        keys = ModelKeys.for_model(model, self._root)
        now = now_ms if now_ms is not None else int(time.time() * 1000)
        pipe = self._client.pipeline(transaction=False)
        pipe.zrangebyscore(keys.leases, f"({now}", "+inf")
        pipe.hgetall(keys.prefill_load)
        pipe.hgetall(keys.decode_load)
        pipe.smembers(keys.stale_workers)
        pipe.hgetall(keys.page_sizes)
        pipe.hmget(keys.incarnation, "ready", "rebuilding", "id")
        pipe.get(keys.changes_counter)
        live, prefill, decode, stale, sizes, (ready, rebuilding, marker_id), counter = await pipe.execute()
        views = Views()
        for raw in live:
            size = int(sizes.get(raw) or 0)
            status = (WorkerStatus.STALE if raw in stale
                      else WorkerStatus.CANDIDATE if size in pages_by_size else WorkerStatus.UNHASHED)
            views.append(WorkerView(as_text(raw), status, size, TierOverlap(), int(prefill.get(raw) or 0),
                                    int(decode.get(raw) or 0)))
        views.rebuilding = as_text(ready or b"") != "1" or as_text(rebuilding or b"") == "1"
        views.marker_id = as_text(marker_id or b"")
        views.feed_change = int(counter or 0)
        return views


@dataclass(frozen=True)
class ModelDirectory:
    workers: dict[str, WorkerMetadata]
    read_at: float

    @property
    def page_sizes(self) -> set[int]:
        return {meta.page_size for meta in self.workers.values()}


class WorkerDirectory:
    """Metadata of each model's live workers, cached for `max_age_s`. Only hashing and the
    shared-pool query use it; who is live, stale or loaded is read fresh for every decision."""

    def __init__(self, client, max_age_s: float = 2.0):
        self._client = client
        self._max_age_s = max_age_s
        self._models: dict[str, ModelDirectory] = {}
        self._last_known: dict[str, ModelDirectory] = {}  # the last directory that had workers

    async def known_models(self) -> set[str]:
        return {as_text(m) for m in await self._client.smembers(MODELS_KEY)}

    async def get(self, model: str, refresh: bool = False) -> ModelDirectory:
        cached = self._models.get(model)
        if cached is not None and not refresh and time.monotonic() - cached.read_at < self._max_age_s:
            return cached
        keys = ModelKeys.for_model(model)
        live = [as_text(w) for w in await self._client.zrangebyscore(
            keys.leases, f"({int(time.time() * 1000)}", "+inf")]
        workers: dict[str, WorkerMetadata] = {}
        if live:
            for worker_id, raw in zip(live, await self._client.mget([keys.meta(w) for w in live])):
                if raw is None:
                    continue
                try:
                    workers[worker_id] = decode_worker_metadata(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("worker %s/%s has unreadable metadata (%s); hashing it at the "
                                "other workers' page size", model, worker_id, exc)
        directory = ModelDirectory(workers, time.monotonic())
        # A name that has no worker is not kept: every unknown model a client asks would
        # otherwise stay here (and in each housekeeping pass) for good.
        if workers or model in self._models:
            self._models[model] = directory
        if workers:
            self._last_known[model] = directory
        return directory

    def cached(self, model: str) -> ModelDirectory | None:
        """The last directory read that had workers (for routing without the state store,
        which may be down or may have lost its leases), else the last one read."""
        return self._last_known.get(model) or self._models.get(model)


async def read_partial_workers(client) -> dict[str, list[str]]:
    """model token -> its partial workers (state begun after the engine's first batch)."""
    tokens = sorted(as_text(m) for m in await client.smembers(MODELS_KEY))
    if not tokens:
        return {}
    pipe = client.pipeline(transaction=False)
    for token in tokens:
        pipe.smembers(ModelKeys(token).partial_workers)
    return {token: sorted(as_text(w) for w in members)
            for token, members in zip(tokens, await pipe.execute()) if members}


async def read_engine_queues(client, now_ms: float) -> list[EngineQueueHealth]:
    """Every worker's engine queue as its last announce carried it (schemas/events.py
    `EngineQueue`), across all models; workers whose bridge cannot read it are left out."""
    tokens = sorted(as_text(m) for m in await client.smembers(MODELS_KEY))
    pipe = client.pipeline(transaction=False)
    for token in tokens:
        pipe.smembers(ModelKeys(token).workers)
    workers = [(token, as_text(w)) for token, members in zip(tokens, await pipe.execute()) for w in sorted(members)]
    pipe = client.pipeline(transaction=False)
    for token, worker in workers:
        pipe.hmget(ModelKeys(token).state(worker), *ENGINE_QUEUE_FIELDS)
    queues = [((token, worker), engine_queue_from_fields(values))
              for (token, worker), values in zip(workers, await pipe.execute())]
    return [EngineQueueHealth(model=token, worker_id=worker, waiting=queue.waiting, running=queue.running,
                              read_ago_s=round(now_ms / 1000 - queue.read_ts, 1))
            for (token, worker), queue in queues if queue is not None]


async def read_worker_rates(client) -> list[WorkerRatesHealth]:
    """Every worker's learned rates (`kvt:{model}:rates`), across all models; an unreadable
    fit is left out (and untrusted: no override among candidates that include it)."""
    tokens = sorted(as_text(m) for m in await client.smembers(MODELS_KEY))
    pipe = client.pipeline(transaction=False)
    for token in tokens:
        pipe.hgetall(ModelKeys(token).rates)
        pipe.hgetall(ModelKeys(token).ttft_errors)
    answers = await pipe.execute()
    found = []
    for token, held, held_errors in zip(tokens, answers[0::2], answers[1::2]):
        errors = {as_text(w): raw for w, raw in held_errors.items()}
        for worker, text in sorted(held.items()):
            try:
                fit = decode_fit(text)
            except ValueError:
                log.warning("unreadable rates for %s/%s", token, as_text(worker))
                continue
            error = PredictionError()
            if (raw := errors.get(as_text(worker))) is not None:
                try:
                    error = decode_error(raw)
                except ValueError:
                    log.warning("unreadable prediction error for %s/%s", token, as_text(worker))
            compute, host, l3, queued = fit.multipliers
            found.append(WorkerRatesHealth(model=token, worker_id=as_text(worker), compute=round(compute, 4),
                                           host_load=round(host, 4), l3_load=round(l3, 4),
                                           queued=round(queued, 4), samples=fit.samples,
                                           relative_error=round(fit.relative_error, 4),
                                           ttft_mape=round(error.mape, 4), ttft_bias=round(error.bias, 4),
                                           ttft_compared=error.samples))
    return found


async def read_hash_mismatches(client) -> list[tuple[str, HashCheck]]:
    """(model token, check) for every worker whose published page hashes failed the
    processor's check (schemas/health.py), across all models."""
    tokens = sorted(as_text(m) for m in await client.smembers(MODELS_KEY))
    if not tokens:
        return []
    pipe = client.pipeline(transaction=False)
    for token in tokens:
        pipe.hgetall(ModelKeys(token).hash_check)
    found: list[tuple[str, HashCheck]] = []
    for token, checks in zip(tokens, await pipe.execute()):
        for worker, raw in sorted(checks.items()):
            try:
                check = decode_hash_check(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("unreadable hash check for %s/%s", token, as_text(worker))
                continue
            if not check.ok:
                found.append((token, check))
    return found
