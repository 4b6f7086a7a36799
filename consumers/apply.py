"""The one place where stream messages become tier state in Redis.

The processor, replay and the tests all call `TierStateWriter`; nothing else writes
`kvt:*` keys. Each EventBatch is applied by one server-side script call (`apply.lua`), so a
batch is atomic, and the script itself enforces (epoch, seq) order: a batch is applied only
if it is the next one, whoever sends it and however often.
"""

from __future__ import annotations

import enum
import importlib.resources
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import msgspec
import redis

from kvtier.schemas.events import AllCleared, EventBatch, PagesRemoved, PagesStored, WorkerAnnounce
from kvtier.schemas.hashes import BlockHash, block_hash_from_page_key, page_key, page_keys_blob
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys, models_key, page_member, split_member
from kvtier.schemas.tiers import TIER_PRIORITY, Tier


class ApplyStatus(enum.IntEnum):
    APPLIED = 0
    DUPLICATE = 1  # this seq was applied before (redelivery, duplicate publish)
    AHEAD = 2  # an earlier seq of this epoch has not been applied yet: a gap
    OLD_EPOCH = 3  # the worker has moved on to a newer epoch


class ApplyMode(str, enum.Enum):
    NEXT = "next"  # apply only if this is the next batch in (epoch, seq) order
    REBASE = "rebase"  # give up on missing batches: clear, mark stale, continue from here


@dataclass(frozen=True)
class ApplyResult:
    status: ApplyStatus
    epoch: int
    seq: int
    transitions: int
    stale: bool


def _load_script(name: str) -> str:
    return importlib.resources.files("kvtier.consumers").joinpath(name).read_text()


_APPLY_LUA = _load_script("apply.lua")
_EXPIRE_LUA = _load_script("expire.lua")
_STORE, _REMOVE, _CLEAR = "S", "R", "C"


def _script_ops(batch: EventBatch) -> list[str | int]:
    ops: list[str | int] = []
    for event in batch.events:
        if isinstance(event, PagesStored):
            ops += (_STORE, event.tier.bit, page_keys_blob(event.hashes))
        elif isinstance(event, PagesRemoved):
            ops += (_REMOVE, event.tier.bit, page_keys_blob(event.hashes))
        elif isinstance(event, AllCleared):
            ops += (_CLEAR, 0, "")
    return ops


class TierStateWriter:
    """Writes tier state. `apply_many_async` is the same apply through an asyncio client, so
    a processor can decode the next messages while Redis applies these."""

    def __init__(self, client: redis.Redis, async_client=None, root: str = DEFAULT_ROOT):
        """`root`: the key root written under ("kvt", live state; `kvtier replay` passes a
        scratch namespace)."""
        self.client = client
        self.root = root
        self.models_key = models_key(root)
        self._apply = client.register_script(_APPLY_LUA)
        self._expire = client.register_script(_EXPIRE_LUA)
        self._async_client = async_client
        self._apply_async = async_client.register_script(_APPLY_LUA) if async_client is not None else None
        self._registered_models: set[str] = set()

    def _register_models(self, batches: Sequence[EventBatch]) -> None:
        """Record each model in `kvt:models` once per process (outside the script: that key
        lives in another hash slot), so housekeeping and readers can find its workers."""
        new = {ModelKeys.for_model(b.model).model_token for b in batches} - self._registered_models
        if new:
            self.client.sadd(self.models_key, *new)
            self._registered_models |= new

    def _call_args(self, batch: EventBatch, mode: ApplyMode, now_ms: int) -> tuple[list[str], list[str | int]]:
        keys = ModelKeys.for_model(batch.model, self.root)
        return (
            [keys.state(batch.worker_id), keys.workers, keys.pages(batch.worker_id), keys.stale_workers],
            ["", batch.worker_id, batch.epoch, batch.seq, mode.value,
             batch.epoch_reason.value if batch.epoch_reason else "", now_ms, repr(batch.source_ts),
             *_script_ops(batch)],
        )

    def apply(self, batch: EventBatch, mode: ApplyMode = ApplyMode.NEXT) -> ApplyResult:
        self._register_models([batch])
        keys, args = self._call_args(batch, mode, _now_ms())
        return _result(self._apply(keys=keys, args=args))

    def apply_many(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        """Apply batches in the given order in one round trip (a pipeline of script calls;
        each call is still atomic and order-checked on its own)."""
        if not batches:
            return []
        pipe = self.client.pipeline(transaction=False)
        for keys, args in self._calls(batches):
            self._apply(keys=keys, args=args, client=pipe)
        return [_result(r) for r in pipe.execute()]

    async def apply_many_async(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        if self._apply_async is None:
            raise RuntimeError("TierStateWriter was created without an asyncio client")
        if not batches:
            return []
        pipe = self._async_client.pipeline(transaction=False)
        for keys, args in self._calls(batches):
            await self._apply_async(keys=keys, args=args, client=pipe)
        return [_result(r) for r in await pipe.execute()]

    def _calls(self, batches: Sequence[EventBatch]):
        self._register_models(batches)
        now_ms = _now_ms()
        return (self._call_args(batch, ApplyMode.NEXT, now_ms) for batch in batches)

    def announce(self, announce: WorkerAnnounce, received_at: float | None = None) -> bool:
        """Record worker metadata and extend its lease (measured from receipt, so bridge
        clock skew cannot make a lease immortal or stillborn). Returns whether the worker's
        state is marked stale."""
        meta = announce.metadata
        keys = ModelKeys.for_model(meta.model, self.root)
        expiry_ms = int(((received_at or time.time()) + announce.lease_ttl_s) * 1000)
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.models_key, keys.model_token)
        pipe.set(keys.meta(meta.worker_id), msgspec.json.encode(meta))
        pipe.zadd(keys.leases, {meta.worker_id: expiry_ms})
        pipe.sadd(keys.workers, meta.worker_id)
        # Routers walk each worker's pages with the request hashed at the worker's page size.
        pipe.hset(keys.page_sizes, meta.worker_id, meta.page_size)
        pipe.hget(keys.state(meta.worker_id), "stale")
        return (pipe.execute()[-1] or b"0") not in (b"0", "0")

    def count_stale_workers(self) -> int:
        pipe = self.client.pipeline(transaction=False)
        for token in self.client.smembers(self.models_key):
            pipe.scard(ModelKeys(as_text(token), self.root).stale_workers)
        return sum(pipe.execute())

    def expire_dead_workers(self, now: float | None = None) -> list[tuple[str, str, int]]:
        """Clear every worker whose lease ran out. Returns (model token, worker, page-tier
        entries removed)."""
        now_ms = int((now or time.time()) * 1000)
        removed: list[tuple[str, str, int]] = []
        for token in sorted(self.client.smembers(self.models_key)):
            keys = ModelKeys(as_text(token), self.root)
            for worker in self.client.zrangebyscore(keys.leases, "-inf", now_ms):
                worker_id = as_text(worker)
                pages = int(self._expire(
                    keys=[keys.state(worker_id), keys.leases, keys.pages(worker_id), keys.stale_workers],
                    args=[worker_id, now_ms],
                ))
                if pages >= 0:
                    removed.append((keys.model_token, worker_id, pages))
        return removed


def as_text(value: bytes | str) -> str:
    """A Redis reply as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value


def _now_ms() -> int:
    return int(time.time() * 1000)


def _result(raw) -> ApplyResult:
    status, epoch, seq, transitions, stale = raw
    return ApplyResult(ApplyStatus(int(status)), int(epoch), int(seq), int(transitions), bool(int(stale)))


# --- readers used by tests, replay and debugging tools -------------------------------------
def read_worker_pages(client: redis.Redis, model: str, worker_id: str,
                      root: str = DEFAULT_ROOT) -> dict[BlockHash, set[Tier]]:
    """A worker's pages and the tiers each is on (one SMEMBERS: a consistent snapshot)."""
    pages: dict[BlockHash, set[Tier]] = {}
    for member in client.smembers(ModelKeys.for_model(model, root).pages(worker_id)):
        tier, page = split_member(as_text(member))
        pages.setdefault(block_hash_from_page_key(page), set()).add(tier)
    return pages


def read_worker_state(client: redis.Redis, model: str, worker_id: str, root: str = DEFAULT_ROOT) -> dict[str, str]:
    raw = client.hgetall(ModelKeys.for_model(model, root).state(worker_id))
    return {as_text(k): as_text(v) for k, v in raw.items()}


def read_page_holders(client: redis.Redis, model: str, worker_ids: Iterable[str],
                      hashes: Sequence[BlockHash]) -> list[dict[str, int]]:
    """For each page, worker -> tier bits, over the given workers (one SMISMEMBER each)."""
    keys = ModelKeys.for_model(model)
    pages = [page_key(h) for h in hashes]
    members = [page_member(tier, p) for tier in TIER_PRIORITY for p in pages]
    workers = list(worker_ids)
    holders: list[dict[str, int]] = [{} for _ in hashes]
    if not pages or not workers:
        return holders
    pipe = client.pipeline(transaction=False)
    for worker_id in workers:
        pipe.smismember(keys.pages(worker_id), members)
    for worker_id, present in zip(workers, pipe.execute()):
        for t, tier in enumerate(TIER_PRIORITY):
            for i in range(len(pages)):
                if present[t * len(pages) + i]:
                    holders[i][worker_id] = holders[i].get(worker_id, 0) | tier.bit
    return holders
