"""One tier-state interface (router/state.py `TierStateReader`), two implementations: the walk
in Redis over the authoritative pages sets (`OverlapReader`, read_overlap.lua) and the
in-memory index that follows the change feed (router/index_feed.py). Both are written by the
processor's own writer (consumers/apply.py) on a real Redis-protocol server; the same
behavioural tests run against both, and a property test checks that on random histories the
index holds exactly the pages sets, page for page, and reads the walk's overlaps."""

from __future__ import annotations

import asyncio
import struct
import threading
import time

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.consumers.apply import ApplyMode, TierStateWriter, read_worker_pages
from kvtier.router import index_feed
from kvtier.router.hashing import RequestPages
from kvtier.router.index_feed import IndexedOverlapReader, ModelIndex, TierIndexes
from kvtier.router.state import OverlapReader, WorkerStatus
from kvtier.router.walk import walk
from kvtier.schemas.events import AllCleared, BridgeCursor, EventBatch, PagesRemoved, PagesStored, WorkerAnnounce
from kvtier.schemas.hashes import BlockHash, page_key, page_keys_blob
from kvtier.schemas.routing import TierOverlap
from kvtier.schemas.state_keys import ModelKeys, page_member
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata

MODEL = "org/index-model"
TOKEN = ModelKeys.for_model(MODEL).model_token
WALKED = (Tier.DEVICE, Tier.HOST, Tier.DISK)


def request(hashes: list[int], page_size: int = 4) -> RequestPages:
    """A request's pages given as page hashes (the readers use only the keys)."""
    return RequestPages(page_size, tuple(struct.pack(">q", h) + bytes(24) for h in hashes),
                        page_keys_blob([BlockHash(h) for h in hashes]))


class History:
    """Tier state written as the processor writes it: announces and batches in seq order."""

    def __init__(self, client: redis.Redis, changes_maxlen: int = 50_000):
        self.writer = TierStateWriter(client, changes_maxlen=changes_maxlen)
        self.cursor: dict[str, tuple[int, int]] = {}  # worker -> (epoch, seq)

    def announce(self, worker: str, page_size: int = 4, lease_ttl_s: float = 600.0, at: float | None = None) -> None:
        epoch, seq = self.cursor.setdefault(worker, (1, 0))
        meta = WorkerMetadata(worker_id=worker, model=MODEL, page_size=page_size)
        self.writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=lease_ttl_s,
                                            cursor=BridgeCursor(epoch=epoch, seq=seq)), at=at)

    def batch(self, worker: str, *events, new_epoch: bool = False, mode: ApplyMode = ApplyMode.NEXT,
              skip: int = 0) -> None:
        epoch, seq = self.cursor.setdefault(worker, (1, 0))
        epoch, seq = (epoch + 1, 1) if new_epoch else (epoch, seq + 1 + skip)
        self.cursor[worker] = (epoch, seq)
        result = self.writer.apply(EventBatch(worker_id=worker, model=MODEL, epoch=epoch, seq=seq, ts=time.time(),
                                              source_ts=time.time(), events=list(events)), mode)
        assert result.status == 0, result

    def store(self, worker: str, tier: Tier, hashes: list[int]) -> None:
        self.batch(worker, PagesStored(tier=tier, hashes=list(hashes)))

    def remove(self, worker: str, tier: Tier, hashes: list[int]) -> None:
        self.batch(worker, PagesRemoved(tier=tier, hashes=list(hashes)))


class Reader:
    """One implementation under test, on its own asyncio loop and client."""

    def __init__(self, kind: str, url: str):
        self.kind, self.url = kind, url
        self.loop = asyncio.new_event_loop()
        self.client = redis.asyncio.Redis.from_url(url)
        # kind: the --state-source that reads it ("index": the in-memory index)
        self.indexes = TierIndexes(self.client, block_ms=50) if kind == "index" else None
        self.reader = (IndexedOverlapReader(self.client, self.indexes) if self.indexes is not None
                       else OverlapReader(self.client))

    def settle(self, sync_client: redis.Redis, timeout: float = 20.0) -> None:
        """The index has applied every entry the feed holds now."""
        if self.indexes is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            index = self.run(self._touch())
            head = int(sync_client.get(ModelKeys(TOKEN).changes_counter) or 0)
            marker = (sync_client.hget(ModelKeys(TOKEN).incarnation, "id") or b"").decode()
            if index.ready and index.change == head and index.marker_id == marker:
                return
            assert time.monotonic() < deadline, (f"index at {index.change} under {index.marker_id!r}, feed at "
                                                 f"{head} under {marker!r}, ready {index.ready}")
            self.run(asyncio.sleep(0.02))

    def start(self, index: ModelIndex) -> None:
        async def start():
            index.start()
        self.run(start())

    async def _touch(self):
        return self.indexes.model(TOKEN)  # type: ignore[union-attr]

    def read(self, pages: dict[int, RequestPages]):
        views = self.run(self.reader.read(MODEL, pages))
        return views

    def overlaps(self, pages: dict[int, RequestPages]) -> dict[str, tuple[WorkerStatus, TierOverlap]]:
        views = self.read(pages)
        assert not views.degraded, views.degraded
        return {v.worker_id: (v.status, v.overlap) for v in views}

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        if self.indexes is not None:
            self.run(self.indexes.close())
        self.run(self.client.aclose())
        self.loop.close()


@pytest.fixture(params=["redis", "index"])
def reader(request, redis_server):
    made = Reader(request.param, redis_server.url)
    yield made
    made.close()


def overlap(device=0, host=0, disk=0) -> TierOverlap:
    return TierOverlap(device=device, host=host, disk=disk)


# --- the shared behavioural suite ------------------------------------------------------------
def test_walk_counts_device_then_host_then_disk(reader, redis_client):
    h = list(range(101, 111))
    history = History(redis_client)
    for w in ("tiered", "gappy", "orphan", "cold"):
        history.announce(w)
    history.store("tiered", Tier.DEVICE, h[:3])
    history.store("tiered", Tier.HOST, h[3:5])
    history.store("tiered", Tier.DISK, h[5:6])
    history.store("gappy", Tier.DEVICE, [h[0], h[1], h[3]])
    history.store("gappy", Tier.HOST, h[2:5])
    history.store("gappy", Tier.DISK, [h[6]])
    history.store("orphan", Tier.HOST, h[1:])
    reader.settle(redis_client)
    got = reader.overlaps({4: request(h)})
    assert got == {"tiered": (WorkerStatus.CANDIDATE, overlap(3, 2, 1)),
                   "gappy": (WorkerStatus.CANDIDATE, overlap(2, 3, 0)),
                   "orphan": (WorkerStatus.CANDIDATE, overlap()),
                   "cold": (WorkerStatus.CANDIDATE, overlap())}


def test_removes_cut_the_prefix_and_clears_empty_the_worker(reader, redis_client):
    h = list(range(201, 209))
    history = History(redis_client)
    for w in ("a", "b", "c"):
        history.announce(w)
        history.store(w, Tier.DEVICE, h)
        history.store(w, Tier.HOST, h)
    history.remove("a", Tier.DEVICE, [h[4]])  # device prefix 4, then host carries on
    history.batch("b", AllCleared())  # the engine flushed its cache
    history.batch("c", PagesStored(tier=Tier.DEVICE, hashes=h[:2]), new_epoch=True)  # restarted engine
    reader.settle(redis_client)
    got = reader.overlaps({4: request(h)})
    assert got == {"a": (WorkerStatus.CANDIDATE, overlap(4, 4, 0)),
                   "b": (WorkerStatus.CANDIDATE, overlap()),
                   "c": (WorkerStatus.CANDIDATE, overlap(2, 0, 0))}


def test_stale_expired_and_forgotten_workers(reader, redis_client):
    h = list(range(301, 305))
    history = History(redis_client)
    for w in ("live", "stale", "dead", "gone"):
        history.announce(w, lease_ttl_s=600.0 if w != "dead" and w != "gone" else 1.0,
                         at=None if w in ("live", "stale") else time.time() - 3600)
        history.store(w, Tier.DEVICE, h)
    history.batch("stale", mode=ApplyMode.REBASE, skip=3)  # gave up on a gap: cleared, stale
    history.store("unannounced", Tier.DEVICE, h)  # batches, never a lease: forgotten, not expired
    reader.settle(redis_client)  # an index that holds the dead workers' pages
    expired = {w for _, w, _ in history.writer.expire_dead_workers()}
    assert expired == {"dead", "gone"}
    reader.settle(redis_client)
    if reader.indexes is not None:  # the expired workers' pages left the index with the sets
        index_equals_pages_sets(reader.indexes.models[TOKEN].index, redis_client, ("live", "stale", "dead", "gone"))
        assert reader.indexes.models[TOKEN].index.workers().keys() == {"live", "unannounced"}
    forgotten = history.writer.forget_dead_workers(retention_s=0.0, now=time.time() + 10)
    assert {w for _, w in forgotten} == {"dead", "gone", "unannounced"}
    reader.settle(redis_client)
    if reader.indexes is not None:
        assert reader.indexes.models[TOKEN].index.workers().keys() == {"live"}
    got = reader.overlaps({4: request(h)})
    assert got == {"live": (WorkerStatus.CANDIDATE, overlap(4)), "stale": (WorkerStatus.STALE, overlap())}
    # the dead worker comes back with a new lease: nothing of its old pages is left
    history.announce("dead")
    reader.settle(redis_client)
    assert reader.overlaps({4: request(h)})["dead"] == (WorkerStatus.CANDIDATE, overlap())


def test_each_worker_is_walked_at_its_own_page_size(reader, redis_client):
    history = History(redis_client)
    history.announce("small", page_size=4)
    history.announce("large", page_size=8)
    history.announce("other", page_size=16)
    history.store("small", Tier.DEVICE, [1, 2, 3])
    history.store("large", Tier.HOST, [11, 12])
    history.store("large", Tier.DEVICE, [1, 2, 3])  # keys of another page size never match
    reader.settle(redis_client)
    got = reader.overlaps({4: request([1, 2, 3, 4]), 8: request([11, 12], page_size=8)})
    assert got == {"small": (WorkerStatus.CANDIDATE, overlap(3)),
                   "large": (WorkerStatus.CANDIDATE, overlap(0, 2, 0)),
                   "other": (WorkerStatus.UNHASHED, overlap())}


def test_a_rebuild_that_drops_a_worker_drops_it_from_the_index(reader, redis_client):
    """A rebuild after a loss clears the workers the stream cannot restore (prime_rebuild)."""
    from kvtier.consumers.apply import RebuildPlan

    history = History(redis_client)
    for w in ("kept", "truncated"):
        history.announce(w)
        history.store(w, Tier.DEVICE, [1, 2])
    reader.settle(redis_client)
    history.writer.prime_rebuild(TOKEN, [RebuildPlan("truncated", epoch=1, last_seq=9, start_stream_seq=5,
                                                     before_seq=4, partition=0, live=True)])
    reader.settle(redis_client)
    got = reader.overlaps({4: request([1, 2])})
    assert got == {"kept": (WorkerStatus.CANDIDATE, overlap(2)), "truncated": (WorkerStatus.STALE, overlap())}
    if reader.indexes is not None:
        assert reader.indexes.models[TOKEN].index.workers().keys() == {"kept"}


def test_a_store_being_rebuilt_trusts_no_overlap(reader, redis_client):
    history = History(redis_client)
    history.announce("w")
    history.store("w", Tier.DEVICE, [1, 2])
    reader.settle(redis_client)
    redis_client.hset(ModelKeys(TOKEN).incarnation, "rebuilding", 1)
    views = reader.read({4: request([1, 2])})
    assert views.rebuilding and [(v.worker_id, v.overlap) for v in views] == [("w", overlap())]


# --- the property: the index is the pages sets ------------------------------------------------
PAGES = list(range(1, 13))
# Runs of pages in request order as often as scattered ones, so that walks go past page one.
page_run = st.tuples(st.integers(0, len(PAGES) - 1), st.integers(1, 8)).map(lambda r: PAGES[r[0]:r[0] + r[1]])
op = st.one_of(
    st.tuples(st.sampled_from(["store", "remove"]), st.sampled_from(["w0", "w1", "w2"]),
              st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL]),
              st.one_of(page_run, st.lists(st.sampled_from(PAGES), max_size=8))),
    st.tuples(st.sampled_from(["flush", "new_epoch", "rebase", "expire"]), st.sampled_from(["w0", "w1", "w2"]),
              st.none(), st.none()),
)


def index_equals_pages_sets(index, client: redis.Redis, workers) -> None:
    for w in workers:
        want = {int(p): {t for t in tiers if t in WALKED}
                for p, tiers in read_worker_pages(client, MODEL, w).items()}
        want = {p: t for p, t in want.items() if t}
        assert index.pages_of(w) == want, w


def walked_by_spec(client: redis.Redis, hashes: list[int], predicted: dict[str, set[int]] | None = None
                   ) -> dict[str, tuple[WorkerStatus, TierOverlap]]:
    """Every live worker's status and its overlap by router/walk.py (the spec), read off the
    authoritative pages sets (all workers here announce page size 4, as `request` hashes)."""
    keys = ModelKeys(TOKEN)
    out = {}
    for raw in client.zrangebyscore(keys.leases, f"({int(time.time() * 1000)}", "+inf"):
        w = raw.decode()
        if client.sismember(keys.stale_workers, w):
            out[w] = (WorkerStatus.STALE, overlap())  # a stale worker is not walked
            continue
        held = {page: sum(t.bit for t in tiers) for page, tiers in read_worker_pages(client, MODEL, w).items()}
        out[w] = (WorkerStatus.CANDIDATE, walk(hashes, held, (predicted or {}).get(w, set())))
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history_ops=st.lists(op, max_size=40),
       requests=st.lists(st.one_of(st.integers(1, len(PAGES)).map(lambda n: PAGES[:n]),
                                   st.lists(st.sampled_from(PAGES), min_size=1, max_size=10, unique=True)),
                         min_size=1, max_size=6),
       predicted=st.dictionaries(st.sampled_from(["w0", "w1", "w2"]), st.sets(st.sampled_from(PAGES), min_size=1)))
@pytest.mark.slow
def test_the_index_is_the_pages_sets_page_for_page(redis_server, redis_client, history_ops, requests, predicted):
    """Random histories through the processor's writer: an index that followed the feed
    throughout and one bootstrapped at the end both hold the pages sets exactly; both, and
    the Lua walk (read_overlap.lua, here with random predicted pages for some workers), read
    router/walk.py's overlaps for every worker."""
    redis_client.flushall()
    following, lua = Reader("index", redis_server.url), Reader("redis", redis_server.url)
    late = None
    try:
        history = History(redis_client)
        for w in ("w0", "w1", "w2"):
            history.announce(w)
        following.settle(redis_client)
        for kind, w, tier, pages in history_ops:
            if kind == "store":
                history.store(w, tier, pages)
            elif kind == "remove":
                history.remove(w, tier, pages)
            elif kind == "flush":
                history.batch(w, AllCleared())
            elif kind == "new_epoch":
                history.batch(w, PagesStored(tier=Tier.DEVICE, hashes=PAGES[:2]), new_epoch=True)
            elif kind == "rebase":
                history.batch(w, mode=ApplyMode.REBASE, skip=2)
            else:
                redis_client.zadd(ModelKeys(TOKEN).leases, {w: 1})  # its lease ran out long ago
                assert [x[1] for x in history.writer.expire_dead_workers()] == [w]
                history.announce(w)
                history.batch(w, new_epoch=True)  # back at once, with nothing
        following.settle(redis_client)
        late = Reader("index", redis_server.url)
        late.settle(redis_client)
        for r in (following, late):
            index_equals_pages_sets(r.indexes.model(TOKEN).index, redis_client, ("w0", "w1", "w2"))
        # Bookings' predictions (router/bookings.lua writes them so); the index never reads them.
        for w, held in predicted.items():
            redis_client.hset(ModelKeys(TOKEN).predicted(w), mapping={page_key(BlockHash(p)): 1 for p in held})
        for hashes in requests:
            assert lua.overlaps({4: request(hashes)}) == walked_by_spec(redis_client, hashes, predicted)
            want = walked_by_spec(redis_client, hashes)
            assert following.overlaps({4: request(hashes)}) == want
            assert late.overlaps({4: request(hashes)}) == want
    finally:
        for r in (following, lua, late):
            if r is not None:
                r.close()


held_pages = st.one_of(
    # dense: most pages held somewhere, so that walks run through every stage
    st.lists(st.integers(0, 15), min_size=len(PAGES), max_size=len(PAGES)).map(
        lambda bits: {p: b for p, b in zip(PAGES, bits) if b}),
    st.dictionaries(st.sampled_from(PAGES), st.integers(1, 15)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.fixed_dictionaries({w: held_pages for w in ("w0", "w1", "w2")}),
       predicted=st.dictionaries(st.sampled_from(["w0", "w1", "w2"]), st.sets(st.sampled_from(PAGES), min_size=1)),
       requests=st.lists(st.one_of(st.integers(1, len(PAGES)).map(lambda n: PAGES[:n]),
                                   st.permutations(PAGES).map(lambda p: p[:8])), min_size=1, max_size=4))
def test_the_lua_walk_is_the_spec(redis_server, redis_client, held, predicted, requests):
    """read_overlap.lua against router/walk.py on random pages sets (page -> tier bits, the
    external tier included) and predictions, written as the processor and the bookings
    write them; many more cases than the history above can afford."""
    redis_client.flushall()
    keys = ModelKeys(TOKEN)
    history = History(redis_client)
    for w, pages in held.items():
        history.announce(w)
        history.batch(w)  # the model's marker, made ready
        members = [page_member(t, page_key(BlockHash(p))) for p, bits in pages.items() for t in Tier if bits & t.bit]
        if members:
            redis_client.sadd(keys.pages(w), *members)
    for w, pages in predicted.items():
        redis_client.hset(keys.predicted(w), mapping={page_key(BlockHash(p)): 1 for p in pages})
    lua = Reader("redis", redis_server.url)
    try:
        for hashes in requests:
            want = {w: (WorkerStatus.CANDIDATE, walk(hashes, held[w], predicted.get(w, set()))) for w in held}
            assert lua.overlaps({4: request(hashes)}) == want, hashes
    finally:
        lua.close()


# --- bootstrap, trimming, loss --------------------------------------------------------------
class BackgroundWriter(threading.Thread):
    """Writes random batches for 8 workers until stopped (as a processor under load would)."""

    def __init__(self, url: str, changes_maxlen: int = 50_000, seed: int = 1):
        super().__init__(daemon=True)
        import random

        self.client = redis.Redis.from_url(url)
        self.history = History(self.client, changes_maxlen)
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.batches = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            workers = [f"bw{i}" for i in range(8)]
            for w in workers:
                self.history.announce(w)
            while not self.halt.is_set():
                w = self.rng.choice(workers)
                roll = self.rng.random()
                pages = [self.rng.randrange(1, 5000) for _ in range(self.rng.randint(1, 64))]
                tier = self.rng.choice(WALKED)
                if roll < 0.6:
                    self.history.store(w, tier, pages)
                elif roll < 0.97:
                    self.history.remove(w, tier, pages)
                else:
                    self.history.batch(w, AllCleared())
                self.batches += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        assert self.error is None, self.error


def test_bootstrap_while_the_processor_writes_loses_and_invents_nothing(redis_server, redis_client, monkeypatch):
    """A scan that spans many calls (60 members each) while batches keep landing: after the
    writes stop and the feed is applied, the index holds exactly the pages sets."""
    monkeypatch.setattr(index_feed, "SCAN_COUNT", 60)
    writer = BackgroundWriter(redis_server.url)
    writer.start()
    loop = asyncio.new_event_loop()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    indexes: list[ModelIndex] = []
    try:
        for _ in range(3):  # three bootstraps, each begun at another point of the stream
            while writer.batches < 150 * (len(indexes) + 1):
                time.sleep(0.01)
            indexes.append(ModelIndex(client, TOKEN))
            loop.run_until_complete(indexes[-1].bootstrap("start"))
            assert indexes[-1].ready
        writer.stop()
        head = int(redis_client.get(ModelKeys(TOKEN).changes_counter))
        workers = [f"bw{i}" for i in range(8)]
        for m in indexes:
            loop.run_until_complete(m._catch_up())
            assert m.change == head
            index_equals_pages_sets(m.index, redis_client, workers)
            assert m.index.entries == sum(len(t) for w in workers for t in m.index.pages_of(w).values())
    finally:
        writer.halt.set()
        loop.run_until_complete(client.aclose())
        loop.close()


def test_an_index_behind_a_trimmed_feed_builds_itself_again(redis_server, redis_client):
    history = History(redis_client, changes_maxlen=5)
    history.announce("w")
    history.store("w", Tier.DEVICE, [1, 2, 3])
    r = Reader("index", redis_server.url)
    try:
        r.settle(redis_client)
        index = r.indexes.model(TOKEN)
        assert index.bootstraps == 1
        r.run(index.stop())  # the replica stalls
        for i in range(600):  # trimmed by whole stream nodes (100 entries each): 600 leaves no doubt
            history.store("w", Tier.HOST, [1000 + i])
        history.remove("w", Tier.DEVICE, [2])
        first_kept = int(redis_client.xrange(ModelKeys(TOKEN).changes, count=1)[0][1][b"n"])
        assert first_kept > index.change + 1
        r.start(index)
        r.settle(redis_client)
        assert index.bootstraps == 2 and index.last_bootstrap_reason == "gap"
        index_equals_pages_sets(index.index, redis_client, ["w"])
        assert r.overlaps({4: request([1, 2])})["w"] == (WorkerStatus.CANDIDATE, overlap(1))
    finally:
        r.close()


def test_a_store_that_lost_the_model_is_followed_by_a_new_index(redis_server, redis_client):
    """FLUSHALL (the store lost everything), then the state is written again under a new
    marker: the index notices (change numbers start over, the marker's id changed) and builds
    itself from the new state; meanwhile decisions walk in Redis and say so."""
    history = History(redis_client)
    history.announce("w")
    history.store("w", Tier.DEVICE, [1, 2, 3])
    r = Reader("index", redis_server.url)
    try:
        r.settle(redis_client)
        index = r.indexes.model(TOKEN)
        old_marker = index.marker_id
        redis_client.flushall()
        history.writer.forget_models()
        history.cursor.clear()
        history.announce("w")
        history.store("w", Tier.HOST, [1, 2])
        r.settle(redis_client)
        assert index.marker_id != old_marker and index.bootstraps >= 2
        assert index.last_bootstrap_reason in ("gap", "marker")
        index_equals_pages_sets(index.index, redis_client, ["w"])
        assert r.overlaps({4: request([1, 2, 3])})["w"] == (WorkerStatus.CANDIDATE, overlap(0, 2, 0))
    finally:
        r.close()


def test_a_decision_waits_for_the_writes_its_read_saw_or_walks_in_redis(redis_server, redis_client, monkeypatch):
    """Read your writes: a decision uses the index only once it has applied the feed up to the
    change number its Redis read saw; an index that cannot get there in time is not used."""
    history = History(redis_client)
    history.announce("w")
    history.store("w", Tier.DEVICE, [1])
    r = Reader("index", redis_server.url)
    try:
        r.settle(redis_client)
        history.store("w", Tier.DEVICE, [2, 3])  # read at once: the index has not applied it yet
        views = r.read({4: request([1, 2, 3])})
        assert not views.degraded and [(v.worker_id, v.overlap) for v in views] == [("w", overlap(3))]
        index = r.indexes.model(TOKEN)
        r.run(index.stop())  # a follower that is stuck
        history.remove("w", Tier.DEVICE, [3])
        views = r.read({4: request([1, 2, 3])})
        assert views.degraded == index_feed.DEGRADED_INDEX_BEHIND
        assert [(v.worker_id, v.overlap) for v in views] == [("w", overlap(2))]  # the walk's answer
    finally:
        r.close()


def test_a_decision_that_sees_another_marker_walks_in_redis_and_says_so(redis_server, redis_client):
    history = History(redis_client)
    history.announce("w")
    history.store("w", Tier.DEVICE, [1, 2])
    r = Reader("index", redis_server.url)
    try:
        r.settle(redis_client)
        index = r.indexes.model(TOKEN)
        r.run(index.stop())  # so it cannot notice by itself first
        redis_client.hset(ModelKeys(TOKEN).incarnation, "id", "replaced")
        views = r.read({4: request([1, 2])})
        assert views.degraded == index_feed.DEGRADED_INDEX_NOT_READY
        assert [(v.worker_id, v.overlap) for v in views] == [("w", overlap(2))]  # the walk's answer
        assert not index.ready
        r.start(index)
        r.settle(redis_client)
        assert index.marker_id == "replaced" and index.last_bootstrap_reason == "marker"
    finally:
        r.close()
