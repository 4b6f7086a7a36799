"""`kvtier replay`: tier state as it was at a point of the events stream, rebuilt through the
processor's own apply code, and compared with the live state.

The stream is the write model (consumers/README.md): reading KVTIER_EVENTS from its first
retained message up to a bound (a stream sequence or a time) and applying every message with
`TierStateWriter` -- batches through `apply.lua`, announcements through
`TierStateWriter.announce`, lease expiries through the WorkerExpired decisions the processors
recorded in the stream, where they recorded them -- gives the state the processors had then. It is
written into a scratch namespace: the same layout under another key root
(`<namespace>:{model}:...`, see schemas/state_keys.py), or with `--into-db N` under the
usual root in another Redis database (not on Redis Cluster, which has only database 0).

Scratch keys expire (`--ttl`, default one hour, 0 = never) and `kvtier replay --drop
NAMESPACE` removes them at once.

Where replay has to differ from a processor (said in its report):
- a gap (a batch whose predecessor is not in the stream) is rebased at once, where the
  processor waited `--gap-timeout` first; the state after it is the same;
- a worker whose epoch began before the first retained message cannot be rebuilt: its first
  retained batch is rebased (cleared, marked stale), exactly as a processor treats a gap;
- leases are measured from the message's stream timestamp, as processors measure them; a
  lease is expired only where a processor's decision is in the stream (streams written before
  processors recorded them show no expiry at all).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import cast

import msgspec
import redis

from kvtier.consumers.apply import ApplyMode, ApplyStatus, TierStateWriter
from kvtier.consumers.pull import StoredMessage, StreamReader
from kvtier.plumbing.connections import redact, redis_client
from kvtier.plumbing.timefmt import iso, parse_time  # re-exported for explain and events tail
from kvtier.schemas.events import EventBatch, UnsupportedVersion, WorkerAnnounce, WorkerExpired, decode_message
from kvtier.schemas.state_keys import DEFAULT_ROOT, ModelKeys, as_text, models_key, split_member
from kvtier.schemas.subjects import EVENTS_PREFIX, EVENTS_STREAM, parse_events_subject, subject_token
from kvtier.schemas.tiers import TIER_PRIORITY
from kvtier.tools.settings import ReplaySettings

#: Prefix of generated scratch namespaces.
SCRATCH_PREFIX = "kvtreplay-"
#: Page transitions per pipelined apply (as the processor's chunks).
CHUNK_TRANSITIONS = 4096
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


class StreamReplayError(ValueError):
    """A `kvtier replay` of the events stream that cannot be done as asked; the message says why
    and what to do. (An engine's replay socket failing is the bridge's `ReplaySocketError`.)"""


class RetentionBoundary(StreamReplayError):
    """The requested point is older than the first message the stream still holds."""


# --- reading a stream ----------------------------------------------------------------------
async def connect(url: str):
    from kvtier.plumbing.nats_options import NatsConnectError, connect_once

    try:  # with the process's NATS credentials and TLS (kvtier/plumbing/nats_options.py)
        return await connect_once(url, "kvtier-replay", connect_timeout=5, max_reconnect_attempts=2,
                                  allow_reconnect=True)
    except NatsConnectError as exc:  # one clear line, no secret in it
        raise StreamReplayError(str(exc)) from None


async def stream_bounds(js, stream: str) -> tuple[int, int, int]:
    """(first seq, last seq, messages) of a stream, or a clear error if it does not exist."""
    import nats.js.errors

    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        raise StreamReplayError(f"stream {stream} does not exist on this NATS server: nothing was ever published "
                          "to it (or it was deleted)") from None
    return info.state.first_seq, info.state.last_seq, info.state.messages


async def message_time(js, stream: str, seq: int) -> float | None:
    """The stored time of the message at `seq` (or the next one), None if there is none."""
    import nats.js.errors

    try:
        raw = await js.get_msg(stream, seq=seq, next=True)
    except nats.js.errors.NotFoundError:
        return None
    return raw.time.timestamp() if raw.time else None


def events_filter(model: str | None = None, worker: str | None = None) -> str:
    """The stored-subject filter of KVTIER_EVENTS (stored subjects end in a partition token)."""
    if model is None and worker is None:
        return f"{EVENTS_PREFIX}.>"
    m = subject_token(model) if model else "*"
    w = subject_token(worker) if worker else "*"
    return f"{EVENTS_PREFIX}.{m}.{w}.*"


def subject_matches(subject: str, message) -> bool:
    """The processor's check: a message is applied only to the worker its subject names."""
    meta = message.metadata if isinstance(message, WorkerAnnounce) else message
    parsed = parse_events_subject(subject)
    return parsed is not None and parsed.names(meta.model, meta.worker_id)


# --- the scratch namespace -----------------------------------------------------------------
@dataclass
class Scratch:
    client: redis.Redis
    root: str
    db: int | None  # None: the live database, under another root

    @property
    def label(self) -> str:
        return f"database {self.db} (root {self.root})" if self.db is not None else f"namespace {self.root}"

    def keys(self) -> Iterable[bytes]:
        return self.client.scan_iter(match=f"{self.root}:*", count=1000)

    def count(self) -> int:
        return sum(1 for _ in self.keys())

    def expire(self, ttl_s: int) -> int:
        n = 0
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys():
            pipe.expire(key, ttl_s)
            n += 1
            if n % 1000 == 0:
                pipe.execute()
        pipe.execute()
        return n

    def drop(self) -> int:
        n, batch = 0, []
        for key in self.keys():
            batch.append(key)
            if len(batch) >= 1000:
                n += self.client.unlink(*batch)
                batch = []
        if batch:
            n += self.client.unlink(*batch)
        return n


def _db_of(client: redis.Redis) -> int:
    return int(client.connection_pool.connection_kwargs.get("db", 0) or 0)


def _client_for_db(redis_url: str, db: int) -> redis.Redis:
    """A client on database `db` of the server `redis_url` names (a db in the URL would
    otherwise win over a db argument)."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(redis_url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "db"]
    if parts.scheme == "unix":
        parts = parts._replace(query=urlencode([*query, ("db", str(db))]))
    else:
        parts = parts._replace(path=f"/{db}", query=urlencode(query))
    client = redis_client(urlunsplit(parts), socket_timeout=10)
    if _db_of(client) != db:
        raise StreamReplayError(f"could not address database {db} through {redact(redis_url)}")
    return client


def _check_namespace(name: str) -> str:
    if not _NAMESPACE_RE.match(name):
        raise StreamReplayError(f"namespace {name!r} must be 1-64 letters, digits, '_' or '-'")
    return name


def scratch_target(redis_url: str, into: str | None = None, into_db: int | None = None) -> Scratch:
    """Where a replay writes. Refuses live state and a target that already holds keys."""
    live = redis_client(redis_url, socket_timeout=10)
    if into_db is not None:
        try:
            cluster = live.info("cluster").get("cluster_enabled", 0)
        except redis.ResponseError:
            cluster = 0
        if int(cluster or 0):
            raise StreamReplayError("--into-db needs SELECT, which Redis Cluster does not have (database 0 only); "
                              "use --into NAMESPACE instead")
        if into_db == _db_of(live):
            raise StreamReplayError(f"--into-db {into_db} is the live database of {redact(redis_url)}: "
                                    "pick another one")
        scratch = Scratch(_client_for_db(redis_url, into_db), _check_namespace(into or DEFAULT_ROOT), into_db)
    else:
        root = _check_namespace(into or SCRATCH_PREFIX + secrets.token_hex(4))
        if root == DEFAULT_ROOT:
            raise StreamReplayError(f"namespace {DEFAULT_ROOT!r} is the live tier state: replay into another one")
        scratch = Scratch(live, root, None)
    held = scratch.count()
    if held:
        raise StreamReplayError(f"{scratch.label} already holds {held} keys; drop it first "
                          f"(kvtier replay --drop {scratch.root}"
                          + (f" --into-db {into_db}" if into_db is not None else "") + ") or pick another")
    return scratch


def drop_namespace(redis_url: str, namespace: str, into_db: int | None = None) -> tuple[Scratch, int]:
    _check_namespace(namespace)
    if into_db is None and namespace == DEFAULT_ROOT:
        raise StreamReplayError(f"refusing to drop {DEFAULT_ROOT!r}: that is the live tier state")
    live = redis_client(redis_url, socket_timeout=10)
    if into_db is not None and into_db == _db_of(live):
        raise StreamReplayError(f"--into-db {into_db} is the live database of {redact(redis_url)}: refusing to drop it")
    client = live if into_db is None else _client_for_db(redis_url, into_db)
    scratch = Scratch(client, namespace, into_db)
    return scratch, scratch.drop()


# --- the rebuild ---------------------------------------------------------------------------
@dataclass
class ReplayReport:
    namespace: str
    db: int | None
    model: str | None
    worker: str | None
    stream_first_seq: int = 0
    stream_last_seq: int = 0
    stream_first_time: float | None = None
    bound_seq: int | None = None
    bound_time: float | None = None
    last_seq: int = 0  # the last message applied (0: none)
    last_time: float | None = None
    end_time: float | None = None  # the moment the state is as of (leases are judged then)
    messages: int = 0
    batches_applied: int = 0
    duplicates: int = 0
    superseded: int = 0  # batches of an epoch the worker had left (skipped, as by the processor)
    announces: int = 0
    undecodable: int = 0
    wrong_subject: int = 0
    rebased: list[dict] = field(default_factory=list)
    expired: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class _Rebuild:
    def __init__(self, writer: TierStateWriter, report: ReplayReport, truncated: bool):
        self.writer, self.report, self.truncated = writer, report, truncated
        self.chunk: list[EventBatch] = []
        self.size = 0
        self.epoch_seen: dict[tuple[str, str], tuple[int, int]] = {}
        self.incomplete: set[str] = set()

    def expired(self, decision: WorkerExpired, at: float) -> None:
        """A processor's recorded lease expiry, applied where the stream has it, as the
        processor applies it: so the replay expires exactly the workers the live state did."""
        self.flush()
        pages = self.writer.expire_worker(decision.model, decision.worker_id, decision.lease_expiry_ms)
        if pages >= 0:
            self.report.expired.append({"model": subject_token(decision.model), "worker": decision.worker_id,
                                        "pages": pages, "at": iso(at)})

    def announce(self, announce: WorkerAnnounce, at: float) -> None:
        self.flush()
        meta = announce.metadata
        self.writer.announce(announce, at=at)
        self.report.announces += 1
        cursor = announce.cursor
        applied = self.epoch_seen.get((meta.model, meta.worker_id), (0, 0))
        if cursor.seq > 0 and (applied[0] != cursor.epoch or applied[1] < cursor.seq):
            key = f"{meta.model}/{meta.worker_id}"
            if key not in self.incomplete:
                self.incomplete.add(key)
                self.report.warnings.append(
                    f"{key}: its bridge announced batches up to {cursor.epoch}:{cursor.seq}, but the replay has "
                    f"applied only up to {applied[0]}:{applied[1]}; the rest is not in the stream"
                    + (" (past retention)" if self.truncated else "") + ", so its replayed state is incomplete")

    def add(self, batch: EventBatch) -> None:
        self.chunk.append(batch)
        self.size += sum(len(getattr(e, "hashes", ())) for e in batch.events) + 1
        if self.size >= CHUNK_TRANSITIONS:
            self.flush()

    def flush(self) -> None:
        """Apply the chunk in order (one pipeline per pass). A batch the script finds ahead of
        its worker's state is rebased, as the processor does once its gap timeout passes, and
        the rest of the chunk is sent again: the script skips what it already applied."""
        batches, self.chunk, self.size = self.chunk, [], 0
        final: list[ApplyStatus | None] = [None] * len(batches)
        start = 0
        while start < len(batches):
            results = self.writer.apply_many(batches[start:])
            ahead = None
            for k, result in enumerate(results):
                j = start + k
                if result.status == ApplyStatus.APPLIED:
                    final[j] = ApplyStatus.APPLIED
                elif result.status == ApplyStatus.AHEAD:
                    if ahead is None:
                        ahead = (j, result)
                elif ahead is None and final[j] is None:
                    final[j] = result.status
            if ahead is None:
                break
            j, result = ahead
            batch = batches[j]
            self.writer.apply(batch, ApplyMode.REBASE)
            final[j] = ApplyStatus.APPLIED
            begins = result.epoch == 0 or result.epoch != batch.epoch
            reason = ("history truncated: the stream no longer holds the start of this epoch"
                      if begins and self.truncated else
                      "batches missing from the stream (a gap): the processor rebased after --gap-timeout")
            self.report.rebased.append({"model": batch.model, "worker": batch.worker_id, "epoch": batch.epoch,
                                        "seq": batch.seq, "applied_before": f"{result.epoch}:{result.seq}",
                                        "reason": reason})
            start = j + 1
        for batch, status in zip(batches, final):
            if status == ApplyStatus.APPLIED:
                self.report.batches_applied += 1
                key = (batch.model, batch.worker_id)
                if batch.epoch != self.epoch_seen.get(key, (0, 0))[0] or batch.seq > self.epoch_seen[key][1]:
                    self.epoch_seen[key] = (batch.epoch, batch.seq)
            elif status == ApplyStatus.DUPLICATE:
                self.report.duplicates += 1
            elif status == ApplyStatus.OLD_EPOCH:
                self.report.superseded += 1


async def rebuild(nats_url: str, scratch: Scratch, *, model: str | None = None, worker: str | None = None,
                  at_seq: int | None = None, at_time: float | None = None, nc=None) -> ReplayReport:
    """Rebuild tier state (one model, one worker or all) as of stream seq `at_seq` or time
    `at_time` (neither: the last message now in the stream) into `scratch`."""
    if at_seq is not None and at_time is not None:
        raise StreamReplayError("give --at-seq or --at-time, not both")
    report = ReplayReport(namespace=scratch.root, db=scratch.db, model=model, worker=worker)
    own = nc is None
    nc = nc or await connect(nats_url)
    try:
        js = nc.jetstream()
        first, last, count = await stream_bounds(js, EVENTS_STREAM)
        report.stream_first_seq, report.stream_last_seq = first, last
        report.stream_first_time = await message_time(js, EVENTS_STREAM, first) if count else None
        _check_bounds(report, at_seq, at_time, count)
        bound_seq = min(at_seq, last) if at_seq is not None else last
        report.bound_seq, report.bound_time = bound_seq, at_time
        writer = TierStateWriter(scratch.client, root=scratch.root)
        state = _Rebuild(writer, report, truncated=first > 1)
        if count and bound_seq >= first:
            async with StreamReader(nc, EVENTS_STREAM, events_filter(model, worker), start_seq=first) as reader:
                async for msg in reader.messages(end_seq=bound_seq):
                    if msg.seq > bound_seq or (at_time is not None and msg.time > at_time):
                        break
                    _apply_message(state, msg)
        state.flush()
        if at_time is not None:
            end = at_time
        elif at_seq is not None:
            end = await message_time(js, EVENTS_STREAM, bound_seq) or report.last_time or time.time()
        else:
            end = time.time()
        report.end_time = end
        state.flush()
        if first > 1:
            report.warnings.insert(0, f"the stream begins at seq {first} ({iso(report.stream_first_time)}): "
                                      "older messages are past retention, so a worker whose epoch began earlier "
                                      "cannot be rebuilt (rebased and marked stale)")
        return report
    finally:
        if own:
            await nc.close()


def _check_bounds(report: ReplayReport, at_seq: int | None, at_time: float | None, count: int) -> None:
    first, last, first_time = report.stream_first_seq, report.stream_last_seq, report.stream_first_time
    retained = (f"the stream's first retained message is seq {first} ({iso(first_time)}); it keeps events as "
                "long as its max age / max bytes allow (kvtier processor|bridge --stream-max-age, "
                "--stream-max-bytes)")
    if at_seq is not None:
        if at_seq < 1:
            raise StreamReplayError("--at-seq must be >= 1")
        if count == 0 or at_seq < first:
            raise RetentionBoundary(f"seq {at_seq} is older than the first retained message: {retained}"
                                    if count else f"the stream holds no messages (last seq was {last})")
        if at_seq > last:
            raise StreamReplayError(f"seq {at_seq} is past the stream's last message (seq {last})")
    if at_time is not None:
        if count == 0:
            raise RetentionBoundary(f"the stream holds no messages (last seq was {last}); nothing to replay")
        if first_time is not None and at_time < first_time:
            raise RetentionBoundary(f"{iso(at_time)} is older than the first retained message: {retained}")
        if at_time > time.time() + 1:
            raise StreamReplayError(f"{iso(at_time)} is in the future")


def _apply_message(state: _Rebuild, msg: StoredMessage) -> None:
    report = state.report
    report.messages += 1
    try:
        message = decode_message(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
        report.undecodable += 1  # the processor dead-letters it: never applied
        return
    if not subject_matches(msg.subject, message):
        report.wrong_subject += 1  # dead-lettered by the processor too
        return
    if isinstance(message, WorkerAnnounce):
        state.announce(message, msg.time)
    elif isinstance(message, WorkerExpired):
        state.expired(message, msg.time)
    else:
        state.add(message)
    report.last_seq, report.last_time = msg.seq, msg.time


# --- reading and comparing states ----------------------------------------------------------
@dataclass
class WorkerState:
    model: str  # model token
    worker: str
    epoch: int
    seq: int
    stale: bool
    lease_ms: float | None
    members: set[str]

    def pages(self) -> dict[str, int]:
        counts = {tier.value: 0 for tier in TIER_PRIORITY}
        for member in self.members:
            counts[split_member(member)[0].value] += 1
        return counts


def read_states(client: redis.Redis, root: str, model: str | None = None,
                worker: str | None = None) -> dict[tuple[str, str], WorkerState]:
    tokens = ([subject_token(model)] if model
              else sorted(as_text(t) for t in client.smembers(models_key(root))))
    states: dict[tuple[str, str], WorkerState] = {}
    for token in tokens:
        keys = ModelKeys(token, root)
        leased = cast("list[bytes]", client.zrange(keys.leases, 0, -1))  # members only: no scores asked
        workers = sorted({as_text(w) for w in client.smembers(keys.workers)} | {as_text(w) for w in leased})
        if worker is not None:
            workers = [w for w in workers if w == worker]
        for w in workers:
            pipe = client.pipeline(transaction=False)
            pipe.hmget(keys.state(w), "epoch", "seq", "stale")
            pipe.zscore(keys.leases, w)
            pipe.smembers(keys.pages(w))
            (epoch, seq, stale), lease, members = pipe.execute()
            states[(token, w)] = WorkerState(token, w, int(epoch or 0), int(seq or 0), (stale or b"0") in (b"1", "1"),
                                             lease, {as_text(m) for m in members})
    return states


@dataclass
class WorkerDiff:
    model: str
    worker: str
    live: str  # epoch:seq (or "absent")
    replay: str
    only_live: dict[str, list[str]]  # tier -> page keys
    only_replay: dict[str, list[str]]

    @property
    def pages(self) -> int:
        return sum(map(len, self.only_live.values())) + sum(map(len, self.only_replay.values()))


def diff_states(live: dict[tuple[str, str], WorkerState],
                replayed: dict[tuple[str, str], WorkerState]) -> list[WorkerDiff]:
    out = []
    for key in sorted(set(live) | set(replayed)):
        a, b = live.get(key), replayed.get(key)
        la, lb = (a.members if a else set()), (b.members if b else set())
        only_live: dict[str, list[str]] = {}
        only_replay: dict[str, list[str]] = {}
        for member in sorted(la - lb):
            tier, page = split_member(member)
            only_live.setdefault(tier.value, []).append(page)
        for member in sorted(lb - la):
            tier, page = split_member(member)
            only_replay.setdefault(tier.value, []).append(page)

        def position(s):
            return f"{s.epoch}:{s.seq}" + (" stale" if s.stale else "") if s else "absent"

        diff = WorkerDiff(key[0], key[1], position(a), position(b), only_live, only_replay)
        if diff.pages or diff.live != diff.replay:
            out.append(diff)
    return out


# --- the command ---------------------------------------------------------------------------
def _abbrev(pages: list[str], n: int = 4) -> str:
    shown = ", ".join(p[:12] + "…" for p in pages[:n])
    return shown + (f", +{len(pages) - n} more" if len(pages) > n else "")


def print_states(states: dict[tuple[str, str], WorkerState], now_ms: float) -> None:
    print(f"  {'model':<22} {'worker':<16} {'device':>7} {'host':>7} {'disk':>6} {'ext':>5} {'epoch:seq':>16} "
          f"{'lease':>6}  state")
    for (token, worker), s in sorted(states.items()):
        p = s.pages()
        lease = "dead" if s.lease_ms is None or s.lease_ms <= now_ms else f"{(s.lease_ms - now_ms) / 1000:.0f}s"
        print(f"  {token[:22]:<22} {worker[:16]:<16} {p['device']:>7} {p['host']:>7} {p['disk']:>6} "
              f"{p['external']:>5} {f'{s.epoch}:{s.seq}':>16} {lease:>6}  {'STALE' if s.stale else 'ok'}")


def run_replay(settings: ReplaySettings) -> int:
    """`kvtier replay` (kvtier/commands/replay.py sends `kvtier replay explain` to kvtier/tools/explain.py)."""
    if not settings.redis_url:
        raise StreamReplayError("kvtier replay needs --redis URL (or KVTIER_REDIS)")
    if settings.drop is not None:
        namespace = settings.drop or (DEFAULT_ROOT if settings.into_db is not None else "")
        if not namespace:
            raise StreamReplayError("--drop needs a NAMESPACE (or --into-db N to drop the kvt keys of database N)")
        scratch, n = drop_namespace(settings.redis_url, namespace, settings.into_db)
        print(f"dropped {n} keys of {scratch.label}")
        if settings.json:
            print(json.dumps({"dropped": n, "namespace": namespace, "db": settings.into_db}))
        return 0
    if not settings.nats_url:
        raise StreamReplayError("kvtier replay needs --nats URL (or KVTIER_NATS)")
    at_time = parse_time(settings.at_time) if settings.at_time is not None else None
    scratch = scratch_target(settings.redis_url, settings.into, settings.into_db)
    started = time.monotonic()
    try:
        report = asyncio.run(rebuild(settings.nats_url, scratch, model=settings.model, worker=settings.worker,
                                     at_seq=settings.at_seq, at_time=at_time))
    except BaseException:
        scratch.drop()  # nothing half-built is left behind
        raise
    if settings.ttl_s:
        scratch.expire(settings.ttl_s)
    elapsed = time.monotonic() - started
    replayed = read_states(scratch.client, scratch.root, settings.model, settings.worker)
    scope = ((f"model {settings.model}" if settings.model else "all models")
             + (f", worker {settings.worker}" if settings.worker else ""))
    point = (f"seq {settings.at_seq}" if settings.at_seq is not None else
             f"{iso(at_time)}" if at_time is not None else f"now (seq {report.bound_seq})")
    print(f"rebuilt tier state at {point} for {scope} into {scratch.label} in {elapsed:.2f}s")
    print(f"  read KVTIER_EVENTS seq {report.stream_first_seq}..{report.last_seq or '-'} "
          f"(last applied message {iso(report.last_time)}): {report.messages} messages, "
          f"{report.batches_applied} batches applied, {report.duplicates} duplicates, {report.superseded} superseded, "
          f"{report.announces} announcements, {len(report.expired)} leases expired, {len(report.rebased)} rebased"
          + (f", {report.undecodable} undecodable" if report.undecodable else "")
          + (f", {report.wrong_subject} on a wrong subject" if report.wrong_subject else ""))
    keep = (f"keys expire in {settings.ttl_s}s" if settings.ttl_s else "keys kept until dropped")
    print(f"  {keep}; drop now: kvtier replay --drop {scratch.root} --redis URL"
          + (f" --into-db {scratch.db}" if scratch.db is not None else ""))
    print_states(replayed, (report.end_time or time.time()) * 1000)
    for rebase in report.rebased:
        print(f"  rebased {rebase['model']}/{rebase['worker']} at {rebase['epoch']}:{rebase['seq']} "
              f"(applied before: {rebase['applied_before']}): {rebase['reason']}")
    for warning in report.warnings:
        print(f"  warning: {warning}", file=sys.stderr)
    result = {"replay": report.to_dict(),
              "workers": [{"model": s.model, "worker": s.worker, "epoch": s.epoch, "seq": s.seq, "stale": s.stale,
                           "pages": s.pages()} for s in replayed.values()],
              "elapsed_s": round(elapsed, 3)}
    code = 0
    if settings.diff:
        live_client = redis_client(settings.redis_url, socket_timeout=10)
        live = read_states(live_client, DEFAULT_ROOT, settings.model, settings.worker)
        diffs = diff_states(live, read_states(scratch.client, scratch.root, settings.model, settings.worker))
        diverging = sum(d.pages for d in diffs)
        print(f"diff against the live state ({DEFAULT_ROOT}): " + (
            f"{diverging} pages diverge on {sum(1 for d in diffs if d.pages)} worker(s)" if diverging
            else "no page diverges"))
        for d in diffs:
            print(f"  {d.model}/{d.worker}: live {d.live}, replay {d.replay}")
            for tier in (t.value for t in TIER_PRIORITY):
                if d.only_live.get(tier):
                    print(f"    {tier}: {len(d.only_live[tier])} only in live [{_abbrev(d.only_live[tier])}]")
                if d.only_replay.get(tier):
                    print(f"    {tier}: {len(d.only_replay[tier])} only in replay [{_abbrev(d.only_replay[tier])}]")
        if diverging and any(d.live != d.replay for d in diffs):
            print("  note: where live and replay stand at different epoch:seq, events may still be in flight "
                  "(or the live state was changed outside the stream)")
        result["diff"] = {"diverging_pages": diverging, "workers": [asdict(d) | {"pages": d.pages} for d in diffs]}
        code = 1 if diverging else 0
    if settings.json:
        print(json.dumps(result))
    return code
