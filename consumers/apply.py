"""The one place where stream messages become tier state in Redis.

The processor, replay and the tests all call `TierStateWriter`; nothing else writes
`kvt:*` keys. Each EventBatch is applied by one server-side script call (`apply.lua`), so a
batch is atomic, and the script itself enforces (epoch, seq) order: a batch is applied only
if it is the next one, whoever sends it and however often.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import redis

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.schemas.changes import DEFAULT_CHANGES_MAXLEN
from kvtier.schemas.events import AllCleared, EventBatch, PagesRemoved, PagesStored, WorkerAnnounce, engine_queue_fields
from kvtier.schemas.hashes import BlockHash, block_hash_from_page_key, page_key, page_keys_blob
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys, as_text, models_key, page_member, split_member, store_key
from kvtier.schemas.subjects import partition_of
from kvtier.schemas.tiers import TIER_PRIORITY, Tier
from kvtier.schemas.worker import encode_worker_metadata


class ApplyStatus(enum.IntEnum):
    APPLIED = 0
    DUPLICATE = 1  # this seq was applied before (redelivery, duplicate publish)
    AHEAD = 2  # an earlier seq of this epoch has not been applied yet: a gap
    OLD_EPOCH = 3  # the worker has moved on to a newer epoch
    NOT_READY = 4  # the model's incarnation marker is missing or not ready: nothing applied
    GONE = 5  # the worker's lease expired and it has not announced since: a dead worker's late batch


class ApplyMode(str, enum.Enum):
    NEXT = "next"  # apply only if this is the next batch in (epoch, seq) order
    REBASE = "rebase"  # give up on missing batches: clear, mark stale, continue from here


@dataclass(frozen=True)
class RebuildPlan:
    """What a processor found in the stream for one worker of a model whose state was lost."""

    worker_id: str
    epoch: int  # the worker's current epoch
    last_seq: int  # its last seq in the stream when scanned
    start_stream_seq: int  # stream seq of the first message of the epoch the stream still holds
    before_seq: int  # the worker seq just before that message: 0 when it is the epoch's batch 1
    partition: int
    live: bool  # announced within its lease

    @property
    def complete(self) -> bool:
        """The stream holds the whole epoch: re-applying it rebuilds the worker exactly."""
        return self.before_seq == 0 and self.live


@dataclass(frozen=True)
class ApplyResult:
    status: ApplyStatus
    epoch: int
    seq: int
    transitions: int
    stale: bool
    rebased: bool = False  # this call cleared the worker and marked it stale (a gap given up on)


#: Every script that changes a pages set appends to the change feed with changes.lua's function.
_CHANGES_LUA = load_lua("kvtier.consumers", "changes.lua")
_APPLY_LUA = _CHANGES_LUA + load_lua("kvtier.consumers", "apply.lua")
_EXPIRE_LUA = _CHANGES_LUA + load_lua("kvtier.consumers", "expire.lua")
_FORGET_LUA = _CHANGES_LUA + load_lua("kvtier.consumers", "forget.lua")
_DROP_PAGES_LUA = _CHANGES_LUA + load_lua("kvtier.consumers", "drop_pages.lua")
_CLAIM_LUA = load_lua("kvtier.consumers", "claim_rebuild.lua")
_ADOPT_LUA = load_lua("kvtier.consumers", "adopt_model.lua")
_ANNOUNCE_LUA = load_lua("kvtier.consumers", "announce.lua")

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

    def __init__(self, client: redis.Redis, async_client=None, root: str = DEFAULT_ROOT, guarded: bool = False,
                 changes_maxlen: int = DEFAULT_CHANGES_MAXLEN):
        """`root`: the key root written under ("kvt", live state; `kvtier replay` passes a
        scratch namespace). `guarded` (the processor): never create a model's incarnation
        marker on the way; a batch for a model without a ready marker is refused
        (`NOT_READY`) and the processor rebuilds it. Unguarded writers (replay, tests,
        benches) build a state from scratch, so they create the marker when they first
        write a model. `changes_maxlen`: entries each model's change feed keeps (at least;
        trimmed approximately): a router index further behind than that bootstraps again."""
        if changes_maxlen < 1:
            raise ValueError(f"changes_maxlen must be at least 1, got {changes_maxlen}")
        self.client = client
        self.root = root
        self.changes_maxlen = changes_maxlen
        self.guarded = guarded
        self.models_key = models_key(root)
        self._apply = client.register_script(_APPLY_LUA)
        self._expire = client.register_script(_EXPIRE_LUA)
        self._forget = client.register_script(_FORGET_LUA)
        self._announce = client.register_script(_ANNOUNCE_LUA)
        self._claim = client.register_script(_CLAIM_LUA)
        self._adopt = client.register_script(_ADOPT_LUA)
        self._async_client = async_client
        self._apply_async = async_client.register_script(_APPLY_LUA) if async_client is not None else None
        self._registered_models: set[str] = set()

    def _register_models(self, batches: Sequence[EventBatch]) -> None:
        """Record each model in `kvt:models` once per process (outside the script: that key
        lives in another hash slot), so housekeeping and readers can find its workers."""
        self._register_tokens({ModelKeys.for_model(b.model).model_token for b in batches})

    def _register_tokens(self, tokens: set[str]) -> None:
        new = tokens - self._registered_models
        if new:
            self.client.sadd(self.models_key, *new)
            if not self.guarded:
                pipe = self.client.pipeline(transaction=False)
                for token in new:
                    marker = ModelKeys(token, self.root).incarnation
                    for name, value in (("id", secrets.token_hex(8)), ("created_ms", _now_ms()), ("ready", 1),
                                        ("rebuilding", 0), ("reason", "writer")):
                        pipe.hsetnx(marker, name, value)
                pipe.execute()
            self._registered_models |= new

    def forget_models(self) -> None:
        """Register models again on their next write (after the state store lost them)."""
        self._registered_models.clear()

    def _call_args(self, batch: EventBatch, mode: ApplyMode, now_ms: int) -> tuple[list[str], list[str | int]]:
        keys = ModelKeys.for_model(batch.model, self.root)
        return (
            [keys.state(batch.worker_id), keys.workers, keys.pages(batch.worker_id), keys.stale_workers,
             keys.incarnation, keys.partial_workers, keys.leases, keys.changes, keys.changes_counter],
            [batch.source_seq_last, batch.worker_id, batch.epoch, batch.seq, mode.value,
             batch.epoch_reason.value if batch.epoch_reason else "", now_ms, repr(batch.source_ts),
             "1" if batch.epoch_from_start else "0", self.changes_maxlen, *_script_ops(batch)],
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
        if _is_cluster(self.client):
            return [_result(r) for r in _cluster_evalsha_pipeline(self.client, self._apply, list(self._calls(batches)))]
        pipe = self.client.pipeline(transaction=False)
        for keys, args in self._calls(batches):
            self._apply(keys=keys, args=args, client=pipe)
        return [_result(r) for r in pipe.execute()]

    async def apply_many_async(self, batches: Sequence[EventBatch]) -> list[ApplyResult]:
        if self._apply_async is None:
            raise RuntimeError("TierStateWriter was created without an asyncio client")
        if not batches:
            return []
        if _is_cluster(self._async_client):
            calls = list(self._calls(batches))
            return [_result(r) for r in await _cluster_evalsha_pipeline_async(self._async_client, self._apply_async,
                                                                              calls)]
        async with self._async_client.pipeline(transaction=False) as pipe:
            for keys, args in self._calls(batches):
                await self._apply_async(keys=keys, args=args, client=pipe)
            return [_result(r) for r in await pipe.execute()]

    def _calls(self, batches: Sequence[EventBatch]):
        self._register_models(batches)
        now_ms = _now_ms()
        return (self._call_args(batch, ApplyMode.NEXT, now_ms) for batch in batches)

    def announce(self, announce: WorkerAnnounce, at: float | None = None) -> bool:
        """Record worker metadata and extend its lease from `at`: when the announce entered
        the stream (JetStream's timestamp, one clock for every bridge; default: now). So a
        backlog applied late gives a dead worker no fresh lease, and a bridge's clock skew
        cannot make a lease immortal or stillborn. Returns whether the worker's state is
        marked stale."""
        meta = announce.metadata
        keys = ModelKeys.for_model(meta.model, self.root)
        if not self.guarded:
            self._register_tokens({keys.model_token})
        expiry_ms = int(((at or time.time()) + announce.lease_ttl_s) * 1000)
        # `kvt:models` lives in another hash slot: a transaction over it and the model's keys
        # would be cross-slot on Redis Cluster, so it is added first, on its own.
        self.client.sadd(self.models_key, keys.model_token)
        # announce.lua: a redelivered older announce renews nothing. The page size is recorded
        # because routers walk each worker's pages with the request hashed at that size.
        _recorded, stale = self._announce(
            keys=[keys.meta(meta.worker_id), keys.leases, keys.workers, keys.page_sizes, keys.state(meta.worker_id)],
            args=[meta.worker_id, expiry_ms, encode_worker_metadata(meta), meta.page_size])
        if announce.engine_queue is not None:
            self.client.hset(keys.state(meta.worker_id), mapping=engine_queue_fields(announce.engine_queue))
        return stale not in (b"0", "0", 0)

    def forget_dead_workers(self, retention_s: float, now: float | None = None) -> list[tuple[str, str]]:
        """Remove every trace of workers without a lease that went (their lease expired, or
        their last batch, for one never leased) more than `retention_s` ago: state, meta,
        set members, page-size and hash-check fields. Returns (model token, worker)."""
        before_ms = int(((now or time.time()) - retention_s) * 1000)
        forgotten: list[tuple[str, str]] = []
        for token in sorted(self.client.smembers(self.models_key)):
            keys = ModelKeys(as_text(token), self.root)
            for worker in self.client.smembers(keys.workers):
                worker_id = as_text(worker)
                if int(self._forget(keys=[keys.state(worker_id), keys.leases, keys.workers, keys.stale_workers,
                                          keys.partial_workers, keys.page_sizes, keys.hash_check,
                                          keys.meta(worker_id), keys.pages(worker_id), keys.predicted(worker_id),
                                          keys.changes, keys.changes_counter],
                                    args=[worker_id, before_ms, self.changes_maxlen])):
                    forgotten.append((keys.model_token, worker_id))
        return forgotten

    def count_stale_workers(self) -> int:
        return self._count_members(lambda keys: keys.stale_workers)

    def count_partial_workers(self) -> int:
        return self._count_members(lambda keys: keys.partial_workers)

    def _count_members(self, key_of) -> int:
        pipe = self.client.pipeline(transaction=False)
        for token in self.client.smembers(self.models_key):
            pipe.scard(key_of(ModelKeys(as_text(token), self.root)))
        return sum(pipe.execute())

    def expire_dead_workers(self, now: float | None = None, settled: dict[int, float] | None = None,
                            partitions: int = 0) -> list[tuple[str, str, int]]:
        """Clear every worker whose lease ran out. With `settled` (per partition, the stream
        time up to which everything has been applied) and the stream's partition count, only
        a lease that ran out before its partition's settled time: a partition behind may
        still hold the announce that renews it. Returns (model token, worker, page-tier
        entries removed)."""
        now_ms = int((now or time.time()) * 1000)
        removed: list[tuple[str, str, int]] = []
        for token in sorted(self.client.smembers(self.models_key)):
            keys = ModelKeys(as_text(token), self.root)
            # withscores=True: (member, score) pairs, which redis-py's types do not tell apart from members
            for worker, expiry in cast("list[tuple[bytes | str, float]]",
                                       self.client.zrangebyscore(keys.leases, "-inf", now_ms, withscores=True)):
                worker_id = as_text(worker)
                if settled is not None and expiry > 1000 * settled.get(
                        partition_of(keys.model_token, worker_id, partitions), float("-inf")):
                    continue
                pages = self._expire_one(keys, worker_id, now_ms)
                if pages >= 0:
                    removed.append((keys.model_token, worker_id, pages))
        return removed

    def expirable_workers(self, now: float, settled: dict[int, float],
                          partitions: int) -> list[tuple[str, str, int, int, int]]:
        """(model token, worker, lease expiry ms, epoch, seq) of every lease that ran out
        before `now` and before its partition's settled time (`expire_dead_workers`): what a
        processor records as WorkerExpired decisions."""
        now_ms = int(now * 1000)
        found = []
        for token in sorted(self.client.smembers(self.models_key)):
            keys = ModelKeys(as_text(token), self.root)
            # withscores=True: (member, score) pairs, which redis-py's types do not tell apart from members
            for worker, expiry in cast("list[tuple[bytes | str, float]]",
                                       self.client.zrangebyscore(keys.leases, "-inf", now_ms, withscores=True)):
                worker_id = as_text(worker)
                if expiry <= 1000 * settled.get(partition_of(keys.model_token, worker_id, partitions), float("-inf")):
                    epoch, seq = self.client.hmget(keys.state(worker_id), "epoch", "seq")
                    found.append((keys.model_token, worker_id, int(expiry), int(epoch or 0), int(seq or 0)))
        return found

    def expire_worker(self, model: str, worker_id: str, lease_expiry_ms: int) -> int:
        """Apply a recorded WorkerExpired decision: clear the worker if its lease is still the
        one the decision was taken on. Returns the page-tier entries removed, -1 if renewed."""
        keys = ModelKeys.for_model(model, self.root)
        return self._expire_one(keys, worker_id, lease_expiry_ms, lease_expiry_ms)

    def _expire_one(self, keys: ModelKeys, worker_id: str, now_ms: int, lease_ms: int | None = None) -> int:
        return int(self._expire(
            keys=[keys.state(worker_id), keys.leases, keys.pages(worker_id), keys.stale_workers,
                  keys.predicted(worker_id), keys.changes, keys.changes_counter],
            args=[worker_id, now_ms, "" if lease_ms is None else lease_ms, self.changes_maxlen]))

    # --- the incarnation marker and rebuilds after a loss (processor) ---------------------
    def incarnation(self, token: str) -> dict[str, str]:
        """The model's marker fields ({} when missing: the state store lost the model)."""
        raw = self.client.hgetall(ModelKeys(token, self.root).incarnation)
        return {as_text(k): as_text(v) for k, v in raw.items()}

    def store_intact(self) -> bool:
        return bool(self.client.exists(store_key(self.root)))

    def mark_store_intact(self) -> None:
        self.client.set(store_key(self.root), _now_ms(), nx=True)

    def adopt_new_model(self, token: str) -> str | None:
        """The marker id if the model was new (no marker, no state) and is now ready, empty."""
        keys = ModelKeys(token, self.root)
        marker_id = secrets.token_hex(8)
        created = self._adopt(keys=[keys.incarnation, keys.workers], args=[_now_ms(), marker_id])
        return marker_id if created else None

    def claim_rebuild(self, token: str, owner: str, scan_timeout_s: float) -> tuple[str, str]:
        """('created' | 'takeover' | 'held', marker id): only a caller told 'created' or
        'takeover' prepares the rebuild; meanwhile batches of the model are refused."""
        outcome, marker_id = self._claim(keys=[ModelKeys(token, self.root).incarnation],
                                         args=[owner, _now_ms(), int(scan_timeout_s * 1000), secrets.token_hex(8)])
        return as_text(outcome), as_text(marker_id)

    def prime_rebuild(self, token: str, plans: Sequence[RebuildPlan]) -> None:
        """Set each worker's state so that the stream, redelivered from its epoch's start,
        rebuilds it exactly: a complete epoch stands just before its batch 1 (no epoch, and an
        `epoch_floor` under which apply.lua skips older epochs' batches). A worker whose epoch
        began before the stream's retention is cleared and marked stale just before the
        first batch the stream still holds (what `kvtier replay` gets by rebasing there); one
        whose lease ran out is cleared and marked stale at its last seq, as the lease sweep
        leaves it. One transaction."""
        keys = ModelKeys(token, self.root)
        now = _now_ms()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(keys.rebuild)
        for plan in plans:
            state = keys.state(plan.worker_id)
            pipe.sadd(keys.workers, plan.worker_id)
            if plan.complete:
                pipe.hdel(state, "epoch", "seq")
                pipe.hset(state, "epoch_floor", plan.epoch)
                pipe.hset(keys.rebuild, plan.worker_id, f"{plan.epoch}:{plan.last_seq}")
                continue
            reason = "lease_expired" if not plan.live else "history_truncated"
            # EVAL, not EVALSHA: a transaction cannot load a missing script, nor can cluster pipelines.
            pipe.execute_command("EVAL", _DROP_PAGES_LUA, 4, keys.pages(plan.worker_id), state, keys.changes,
                                 keys.changes_counter, plan.worker_id, self.changes_maxlen)
            seq = plan.before_seq if plan.live else plan.last_seq
            pipe.hset(state, mapping={"epoch": plan.epoch, "seq": seq, "stale": 1,
                                      "stale_reason": reason, "stale_since_ms": now})
            pipe.sadd(keys.stale_workers, plan.worker_id)
            if not plan.live:
                pipe.zrem(keys.leases, plan.worker_id)
                pipe.expire(state, 86400)
        pipe.execute()

    def finish_scan(self, token: str, rebuilding: bool, reason: str) -> None:
        """Let batches of the model be applied again (after the consumers were rewound)."""
        marker = ModelKeys(token, self.root).incarnation
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(marker, mapping={"ready": 1, "rebuilding": int(rebuilding), "reason": reason, "scan_by": "",
                                   "scan_ms": 0, "ready_ms": _now_ms()})
        pipe.execute()

    def rebuild_progress(self, token: str) -> int:
        """Drop from the model's rebuild list every worker that has reached its target (or has
        since moved on: a newer epoch, marked stale); when none is left, clear `rebuilding`.
        Returns how many are still behind."""
        keys = ModelKeys(token, self.root)
        targets = {as_text(w): as_text(t) for w, t in self.client.hgetall(keys.rebuild).items()}
        behind = []
        if targets:
            pipe = self.client.pipeline(transaction=False)
            for worker in targets:
                pipe.hmget(keys.state(worker), "epoch", "seq", "stale")
            done = []
            for (worker, target), (epoch, seq, stale) in zip(targets.items(), pipe.execute()):
                want_epoch, want_seq = (int(x) for x in target.split(":"))
                epoch, seq = int(epoch or 0), int(seq or 0)
                if epoch > want_epoch or (epoch == want_epoch and seq >= want_seq) or (stale or b"0") in (b"1", "1"):
                    done.append(worker)
                else:
                    behind.append(worker)
            if done:
                self.client.hdel(keys.rebuild, *done)
        if not behind:
            self.client.hset(keys.incarnation, mapping={"rebuilding": 0, "rebuilt_ms": _now_ms()})
        return len(behind)


# --- Redis Cluster ---------------------------------------------------------------------------
# redis-py's cluster pipelines refuse `evalsha` (the method), and a Script passed a pipeline
# calls it. Queued as a raw EVALSHA command it is routed by its keys (all in the model's
# slot) and pipelined per node like any other command. A node that does not have the script
# yet (a fresh or failed-over master) answers NOSCRIPT: the script is loaded on every
# primary and only the calls refused are sent again, in their order (a worker's batches all
# go to one node, so a refused batch and every later one of that worker were refused alike).
def _is_cluster(client) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def _queue_evalsha(pipe, script, calls, todo) -> None:
    for i in todo:
        keys, args = calls[i]
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)


def _sort_replies(replies, todo, results) -> list[int]:
    """Store replies; return the indexes refused with NOSCRIPT; raise any other error."""
    missing = []
    for i, reply in zip(todo, replies):
        if isinstance(reply, redis.exceptions.NoScriptError):
            missing.append(i)
        elif isinstance(reply, Exception):
            raise reply
        else:
            results[i] = reply
    return missing


def _cluster_evalsha_pipeline(client, script, calls: list) -> list:
    results: list = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(3):
        pipe = client.pipeline(transaction=False)
        _queue_evalsha(pipe, script, calls, todo)
        todo = _sort_replies(pipe.execute(raise_on_error=False), todo, results)
        if not todo:
            return results
        client.script_load(script.script)
    raise redis.exceptions.NoScriptError("the apply script could not be loaded on every cluster node")


async def _cluster_evalsha_pipeline_async(client, script, calls: list) -> list:
    results: list = [None] * len(calls)
    todo = list(range(len(calls)))
    for _attempt in range(3):
        pipe = client.pipeline(transaction=False)
        _queue_evalsha(pipe, script, calls, todo)
        todo = _sort_replies(await pipe.execute(raise_on_error=False), todo, results)
        if not todo:
            return results
        await client.script_load(script.script)
    raise redis.exceptions.NoScriptError("the apply script could not be loaded on every cluster node")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _result(raw) -> ApplyResult:
    status, epoch, seq, transitions, stale, rebased = raw
    return ApplyResult(ApplyStatus(int(status)), int(epoch), int(seq), int(transitions), bool(int(stale)),
                       bool(int(rebased)))


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
