"""Each replica's in-memory index of the tier state it routes on: one `TierIndex` per model,
built from Redis and kept current from the model's change feed (schemas/changes.py).

Redis stays the one authoritative state; an index is a derived read view of it, exact at a
feed position. Bootstrap: note the feed's position (its last entry and change number) and
the marker's id in one script call (feed_position.lua), scan every worker's pages set, then
apply the feed from the noted position. Set operations are idempotent, so entries the scan already saw apply
again harmlessly, and the result is the state at the feed position reached. Then XREAD
BLOCK keeps it current.

An index is thrown away and built again when it can no longer be exact: a change number
skipped (entries trimmed away before it read them, or lost with the store), the marker's id
changed (the store lost the model and it was rebuilt), or an entry it cannot read. While a
model's index is not ready, decisions walk in Redis instead and say so (`degraded`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import redis.exceptions

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.schemas.changes import MalformedChange, TierChange, decode_change
from kvtier.schemas.hashes import block_hashes_of_keys
from kvtier.schemas.router_health import IndexHealth
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys, as_text
from kvtier.schemas.tiers import Tier

from .hashing import RequestPages
from .metrics import RouterMetrics
from .state import OverlapReader, Views, WorkerStatus, WorkerView
from .tier_index import TierIndex

log = logging.getLogger("kvtier.router")

#: Why a decision walked in Redis although the replica reads an in-memory index: the index
#: is being built, or it did not reach the read's change number within the wait.
DEGRADED_INDEX_NOT_READY = "index-not-ready"
DEGRADED_INDEX_BEHIND = "index-behind"
#: How long a decision waits for its index to reach the change number its read saw (seconds).
CATCH_UP_WAIT_S = 0.05

#: Members a bootstrap scan step asks SSCAN for (a few ms of Redis time at most).
SCAN_COUNT = 20_000
#: Entries read per XREAD.
READ_COUNT = 1_000
#: How often a following index checks the marker's id when the feed is quiet (seconds).
MARKER_CHECK_S = 1.0
#: Pause after a Redis error before the follower tries again (seconds).
RETRY_S = 0.5


class _Rebuild(Exception):
    """The index can no longer be exact: build it again (the reason is the message)."""


class ModelIndex:
    """One model's index and the task that keeps it current."""

    def __init__(self, client, model_token: str, metrics: RouterMetrics | None = None, root: str = DEFAULT_ROOT,
                 block_ms: int = 100, on_applied: Callable[[TierChange], None] | None = None):
        """`on_applied`: called with each feed entry right after the index applied it (the
        route bench times every entry's lag with it; None in the router)."""
        self._client = client
        self._on_applied = on_applied
        self.keys = ModelKeys(model_token, root)
        self.model_token = model_token
        self._metrics = metrics
        self._block_ms = block_ms
        self._position = client.register_script(load_lua("kvtier.router", "feed_position.lua"))
        self.index = TierIndex()
        self.ready = False
        self.marker_id = ""
        self.position = "0-0"
        self.change = 0
        self.lag_s = 0.0
        self.bootstraps = 0
        self.last_bootstrap_reason = ""
        self.last_bootstrap_s = 0.0
        self._rebuild_reason = "start"
        self._stopping = False
        self._advanced = asyncio.Event()  # set (and replaced) each time entries are applied
        self._task: asyncio.Task | None = None

    # --- the follower task -----------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self.run(), name=f"kvtier-index-{self.model_token}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        self._stopping = True
        # Cancelled until it ends: before Python 3.12, asyncio.wait_for (which redis-py's reads
        # go through) can drop a cancel that lands just as the reply arrives, and the follower
        # would go on reading while this waited for it.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.1)

    def request_rebuild(self, reason: str) -> None:
        """Called by a decision that found the marker's id changed: stop using the index."""
        if self.ready:
            log.warning("model %s: index built under marker %r, the store now has another; building it again",
                        self.model_token, self.marker_id)
            self._set_ready(False)
            self._rebuild_reason = reason

    async def run(self) -> None:
        while not self._stopping:
            try:
                if not self.ready:
                    await self.bootstrap(self._rebuild_reason)
                await self.follow()
            except asyncio.CancelledError:
                raise
            except _Rebuild as why:
                self._rebuild_reason = str(why)
                self._set_ready(False)
            except (redis.exceptions.RedisError, OSError) as exc:
                # The position is kept: the feed resumes from it when Redis answers again.
                if not self._stopping:
                    log.warning("model %s: reading the change feed failed (%s: %s); retrying", self.model_token,
                                type(exc).__name__, exc)
                    await asyncio.sleep(RETRY_S)
            except Exception:  # a follower that died would leave decisions walking in Redis for good
                log.exception("model %s: the index follower failed; building the index again", self.model_token)
                self._rebuild_reason = "error"
                self._set_ready(False)
                await asyncio.sleep(RETRY_S)

    # --- building -------------------------------------------------------------------------
    async def bootstrap(self, reason: str) -> None:
        started = time.perf_counter()
        keys = self.keys
        marker, counter, last_id, workers = await self._position(
            keys=[keys.incarnation, keys.changes_counter, keys.changes, keys.workers])
        index = TierIndex()
        # Each scan step is asked for before the previous step's members are stored, so Redis
        # scans while this process decodes.
        todo = sorted(as_text(w) for w in workers)
        step = asyncio.ensure_future(self._client.sscan(keys.pages(todo[0]), 0, count=SCAN_COUNT)) if todo else None
        try:
            while step is not None:
                worker = todo[0]
                cursor, members = await step
                if int(cursor) == 0:
                    todo.pop(0)
                step = (asyncio.ensure_future(self._client.sscan(keys.pages(todo[0]), int(cursor), count=SCAN_COUNT))
                        if todo else None)
                _store_members(index, worker, members)
        finally:
            if step is not None and not step.done():
                step.cancel()
        self.index = index
        self.marker_id = as_text(marker)
        self.position = as_text(last_id)
        self.change = int(counter)
        await self._catch_up()
        self.bootstraps += 1
        self.last_bootstrap_reason = reason
        self.last_bootstrap_s = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.index_bootstraps.labels(reason).inc()
        self._set_ready(True)
        log.info("model %s: index built (%s) from %d worker(s), %d (page, tier) entries at change %d in %.3fs",
                 self.model_token, reason, len(workers), index.entries, self.change, self.last_bootstrap_s)

    async def _catch_up(self) -> None:
        while await self._read(block=False):
            pass

    async def follow(self) -> None:
        checked = time.monotonic()
        while self.ready and not self._stopping:
            await self._read(block=True)
            if time.monotonic() - checked >= MARKER_CHECK_S:
                checked = time.monotonic()
                marker = as_text(await self._client.hget(self.keys.incarnation, "id") or b"")
                if marker != self.marker_id:
                    raise _Rebuild("marker")

    async def _read(self, block: bool) -> int:
        """Apply the next entries of the feed; how many there were."""
        reply = await self._client.xread({self.keys.changes: self.position}, count=READ_COUNT,
                                         block=self._block_ms if block else None)
        if not self.ready and block:
            return 0  # a decision asked for a rebuild meanwhile
        entries = reply[0][1] if reply else []
        now_ms = time.time() * 1000
        for entry_id, fields in entries:
            try:
                change = decode_change(entry_id, fields)
            except MalformedChange as exc:
                log.error("model %s: unreadable change feed entry (%s); building the index again",
                          self.model_token, exc)
                raise _Rebuild("malformed") from None
            if change.n != self.change + 1:
                log.warning("model %s: change feed went from %d to %d (entries trimmed before this replica "
                            "read them, or lost with the store); building the index again",
                            self.model_token, self.change, change.n)
                raise _Rebuild("gap")
            self.index.apply(change)
            if self._on_applied is not None:
                self._on_applied(change)
            self.position, self.change = change.entry_id, change.n
            self.lag_s = max(0.0, now_ms - change.written_ms) / 1000
            if self._metrics is not None:
                self._metrics.index_lag.observe(self.lag_s)
        if entries:
            self._advanced.set()
            self._advanced = asyncio.Event()
            if self._metrics is not None:
                self._metrics.index_entries.labels(self.model_token).set(self.index.entries)
        return len(entries)

    async def reached(self, change: int, timeout_s: float) -> bool:
        """Whether the index has applied the feed up to `change`, waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.ready and self.change < change:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except asyncio.TimeoutError:
                return False
        return self.ready and self.change >= change

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        if self._metrics is not None:
            self._metrics.index_ready.labels(self.model_token).set(1 if ready else 0)
            self._metrics.index_entries.labels(self.model_token).set(self.index.entries)

    def health(self) -> IndexHealth:
        return IndexHealth(model=self.model_token, ready=self.ready, position=self.position, change=self.change,
                           marker_id=self.marker_id, entries=self.index.entries, lag_seconds=round(self.lag_s, 6),
                           bootstraps=self.bootstraps, last_bootstrap_reason=self.last_bootstrap_reason,
                           last_bootstrap_seconds=round(self.last_bootstrap_s, 4))


#: Walked tiers and the first byte of their members in a pages set (schemas/state_keys.py).
_MEMBER_TAGS = tuple((tier, ord(format(tier.bit, "x"))) for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK))


def _store_members(index: TierIndex, worker: str, members) -> None:
    """Pages-set members (tier digit + page key) as SSCAN returns them, into the index; the
    external tier is left out (the walk never reads it)."""
    if not members:
        return
    if isinstance(members[0], str):
        members = [m.encode() for m in members]
    for tier, tag in _MEMBER_TAGS:
        blob = b"".join([m[1:] for m in members if m[0] == tag])
        if blob:
            index.store(worker, tier, block_hashes_of_keys(blob))


class TierIndexes:
    """Every model's index in one replica, each started when the model is first routed."""

    def __init__(self, client, metrics: RouterMetrics | None = None, root: str = DEFAULT_ROOT, block_ms: int = 100):
        self._client = client
        self._metrics = metrics
        self._root = root
        self._block_ms = block_ms
        self.models: dict[str, ModelIndex] = {}

    def model(self, model_token: str) -> ModelIndex:
        index = self.models.get(model_token)
        if index is None:
            index = self.models[model_token] = ModelIndex(self._client, model_token, self._metrics, self._root,
                                                          self._block_ms)
            index.start()
        return index

    async def close(self) -> None:
        for index in self.models.values():
            await index.stop()

    def health(self) -> list[IndexHealth]:
        return [m.health() for _, m in sorted(self.models.items())]


class IndexedOverlapReader:
    """The decision's read with an index: who is live, stale and loaded from Redis (one round
    trip of plain commands, `OverlapReader.read(walk=False)`), the overlaps from the model's
    index once it has applied the feed up to the change number that read saw, so a decision
    sees every write Redis had when it was read, as the walk does (waiting up to `catch_up_s`
    for the follower; the feed's lag is a few ms). Until the index is ready, when it stays
    behind, or when the store's marker is not the one it was built under: the walk in Redis,
    said in `degraded`."""

    def __init__(self, client, indexes: TierIndexes, walk: OverlapReader | None = None,
                 catch_up_s: float = CATCH_UP_WAIT_S):
        self.indexes = indexes
        self._redis = walk or OverlapReader(client)
        self._catch_up_s = catch_up_s

    async def read(self, model: str, pages_by_size: Mapping[int, RequestPages], now_ms: int | None = None) -> Views:
        index = self.indexes.model(ModelKeys.for_model(model).model_token)
        if not index.ready:
            return await self._walk(model, pages_by_size, now_ms, DEGRADED_INDEX_NOT_READY)
        views = await self._redis.read(model, pages_by_size, now_ms, walk=False)
        if views.marker_id != index.marker_id:
            index.request_rebuild("marker")
            return await self._walk(model, pages_by_size, now_ms, DEGRADED_INDEX_NOT_READY)
        if views.rebuilding:
            return views  # no overlap is trusted while the store's state is rebuilt
        if index.change < views.feed_change and not await index.reached(views.feed_change, self._catch_up_s):
            return await self._walk(model, pages_by_size, now_ms,
                                    DEGRADED_INDEX_BEHIND if index.ready else DEGRADED_INDEX_NOT_READY)
        by_size: dict[int, list[str]] = {}
        for view in views:
            if view.status is WorkerStatus.CANDIDATE and view.page_size in pages_by_size:
                by_size.setdefault(view.page_size, []).append(view.worker_id)
        overlaps = {}
        for size, workers in by_size.items():
            overlaps.update(index.index.overlaps(pages_by_size[size].hashes, workers))
        out = Views(WorkerView(v.worker_id, v.status, v.page_size, overlaps[v.worker_id], v.prefill_load,
                               v.decode_load) if v.worker_id in overlaps else v for v in views)
        out.rebuilding, out.marker_id, out.feed_change = views.rebuilding, views.marker_id, views.feed_change
        return out

    async def _walk(self, model: str, pages_by_size: Mapping[int, RequestPages], now_ms: int | None,
                    why: str) -> Views:
        """The walk in Redis, for a decision the index cannot serve, saying why."""
        views = await self._redis.read(model, pages_by_size, now_ms)
        views.degraded = why
        return views
