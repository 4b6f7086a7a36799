"""Reading JetStream: every consumer of a kvtier stream reads through this module.

- `PullStream`: a continuous pull on a durable (or ephemeral) consumer. nats-py's
  `fetch(n)` waits, once it has a first message, for the other n-1 until its timeout: under
  light load that adds up to the whole timeout to every batch's latency. This keeps pull
  requests outstanding instead and hands over whatever has already arrived, so a lone
  message is applied at once and a burst is still applied as one batch.
- `consume`: the loop every durable consumer runs (the processor's partitions, analytics):
  batches handed over in delivery order, a pull that fails re-opened, a handler failure
  reported without ending the loop.
- `StreamReader`: an ephemeral, unacknowledged consumer that reads a stretch of a stream in
  stream order (`kvtier replay`, `explain`, `events tail`, `report`, analytics' rebuild).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvtier.schemas.jetstream import PullRequest, encode_pull_request
from kvtier.schemas.subjects import pull_next_subject

_STATUS = "Status"
_PENDING = "Nats-Pending-Messages"
_HEARTBEAT, _NO_MESSAGES, _TIMEOUT = "100", "404", "408"


def tolerate_undecodable_subjects(nc) -> None:
    """Let `nc` receive messages whose subject is not UTF-8. Anyone who may publish on
    `kvtier.events.*.*` can store such a subject in the stream, and nats-py decodes subjects
    strictly inside its read loop: one such message would break the connection at every
    redelivery, and no later message would ever be consumed. Here the undecodable bytes are
    written as backslash escapes (an ASCII subject that matches no worker's), so the message
    reaches its consumer, which dead-letters it."""
    if getattr(nc, "_kvtier_tolerant_subjects", False):
        return
    build = nc._build_message

    def build_message(sid, subject, reply, data, headers):
        try:
            return build(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            return build(sid, subject.decode(errors="backslashreplace").encode(),
                         reply.decode(errors="backslashreplace").encode(), data, headers)

    nc._build_message = build_message
    nc._kvtier_tolerant_subjects = True


#: A pull request nobody answered (nats-py turns a request with no responder into this status).
_NO_RESPONDERS = "503"
#: How long pulls nobody answers may go on before the consumer counts as gone (seconds).
NO_RESPONDERS_GRACE_S = 10.0


class ConsumerGone(RuntimeError):
    """The server ended our pulls for good (consumer deleted, leadership change, ...)."""


class PullStream:
    def __init__(self, nc, stream: str, durable: str, max_batch: int = 256, expires_s: float = 5.0):
        self.nc = nc
        self.next_subject = pull_next_subject(stream, durable)
        self.max_batch = max_batch
        self.expires_ns = int(expires_s * 1e9)
        self.inbox = nc.new_inbox()
        self.sub: Subscription = None  # type: ignore[assignment]  # subscribed in start(), before any use
        self.outstanding = 0
        self.expires_s = expires_s
        self._last_heard = time.monotonic()
        self._unanswered_since: float | None = None  # the first of the no-responder answers in a row
        self._ask_again_at = 0.0

    async def start(self) -> PullStream:
        tolerate_undecodable_subjects(self.nc)
        self.sub = await self.nc.subscribe(self.inbox, pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
        return self

    async def close(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def _top_up(self) -> None:
        # Requests lost with a broken connection never answer, not even with their expiry
        # status: past their expiry with nothing heard, count them as gone and ask again.
        if self.outstanding and time.monotonic() - self._last_heard > self.expires_s + 1.0:
            self.outstanding = 0
        if time.monotonic() < self._ask_again_at:
            return
        # Two batches in flight: the next one is already requested while this one is applied.
        if self.outstanding <= self.max_batch:
            wanted = 2 * self.max_batch - self.outstanding
            request = encode_pull_request(PullRequest(batch=wanted, expires=self.expires_ns))
            await self.nc.publish(self.next_subject, request, reply=self.inbox)
            if not self.outstanding:
                self._last_heard = time.monotonic()
            self.outstanding += wanted

    def _account(self, msg: Msg) -> bool:
        """True for a message to process; status messages update the outstanding count."""
        self._last_heard = time.monotonic()
        headers = msg.headers or {}
        status = headers.get(_STATUS)
        if not status:
            self.outstanding -= 1
            self._unanswered_since = None
            return True
        if status == _HEARTBEAT:
            return False
        if status in (_TIMEOUT, _NO_MESSAGES):
            pending = headers.get(_PENDING)
            self.outstanding = max(0, self.outstanding - int(pending)) if pending else 0
            return False
        description = headers.get("Description", "")
        if status == _NO_RESPONDERS:
            # Nobody took the request: in a cluster, the consumer's leader is moving (a node was
            # lost) and another answers within seconds. Ask again a little later; only a
            # consumer that stays unanswered for NO_RESPONDERS_GRACE_S is gone.
            now = time.monotonic()
            if self._unanswered_since is None:
                self._unanswered_since = now
            if now - self._unanswered_since <= NO_RESPONDERS_GRACE_S:
                self.outstanding = 0
                self._ask_again_at = now + 0.25
                return False
        if status == "409" and "Exceeded" in description:
            self.outstanding = 0  # the request was refused as a whole; ask again
            return False
        raise ConsumerGone(f"pull on {self.next_subject} ended: {status} {description}")

    async def next_batch(self, timeout: float) -> list[Msg]:
        """Wait up to `timeout` for a first message, then take what else has arrived."""
        await self._top_up()
        batch: list[Msg] = []
        try:
            first = await self.sub.next_msg(timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return batch
        if self._account(first):
            batch.append(first)
        while len(batch) < self.max_batch and self.sub.pending_msgs > 0:
            msg = await self.sub.next_msg(timeout=None)
            if self._account(msg):
                batch.append(msg)
        return batch


# --- the consume loop of durable consumers -------------------------------------------------
async def consume(name: str, open_pull: Callable[[], Awaitable[PullStream | None]],
                  handle: Callable[[list[Msg]], Awaitable[None]], stop: asyncio.Event, *,
                  on_handle_error: Callable[[list[Msg], Exception], Awaitable[None]] | None = None,
                  reopen_now: Callable[[], bool] | None = None, log: logging.Logger | None = None) -> None:
    """Hand each delivered batch to `handle` until `stop`. `open_pull` opens (or re-opens,
    where the consumer was lost or must be rewound) the pull; None means give up (stop was
    set meanwhile). A pull that fails is closed and re-opened after a short pause; so is one
    for which `reopen_now()` says so. A batch `handle` fails on goes to `on_handle_error`
    (its messages are not acked: they come back), and the loop goes on."""
    log = log or logging.getLogger("kvtier.pull")
    pull = await open_pull()
    try:
        while pull is not None and not stop.is_set():
            if reopen_now is not None and reopen_now():
                await pull.close()
                pull = await open_pull()
                continue
            try:
                messages = await pull.next_batch(timeout=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a consumer loop must survive broker hiccups
                if stop.is_set():
                    break
                if isinstance(exc, ConsumerGone) and "Deleted" in str(exc):
                    log.info("%s: its consumer was re-created (rewound); re-subscribing", name)
                else:
                    log.warning("%s: pull failed (%r); re-subscribing", name, exc)
                await asyncio.sleep(0.5)
                await pull.close()
                pull = await open_pull()
                continue
            if not messages:
                continue
            try:
                await handle(messages)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nothing unacked is lost: the handler decides how to retry
                if on_handle_error is None:
                    log.exception("%s: handling %d messages failed; they come back after the ack wait", name,
                                  len(messages))
                else:
                    await on_handle_error(messages, exc)
    finally:
        if pull is not None:
            await pull.close()


# --- reading a stretch of a stream in order ---------------------------------------------------
class StreamReadError(RuntimeError):
    """NATS did not let a stream be read (no answer creating the reader's consumer)."""


@dataclass(frozen=True)
class StoredMessage:
    seq: int
    time: float  # when the stream stored it (unix seconds, server clock)
    subject: str
    data: bytes
    pending: int  # matching messages after this one, when it was delivered


async def _add_consumer_patiently(js, stream: str, config, attempts: int = 3):
    """Create an ephemeral consumer, retrying API timeouts: right after a cluster node is lost
    the stream's new leader can take a few seconds to answer. A consumer created by an attempt
    whose reply was lost is dropped by the server after its inactive threshold."""
    for attempt in range(attempts):
        try:
            return await js.add_consumer(stream, config, timeout=10)
        except nats.errors.TimeoutError:
            if attempt == attempts - 1:
                raise StreamReadError(f"NATS did not answer creating a consumer on {stream} "
                                      f"({attempts} tries of 10 s)") from None
    raise AssertionError("unreachable")


class StreamReader:
    """An ephemeral, unacknowledged pull consumer over `stream`, filtered by one subject or
    several, read in stream order through `PullStream`. Deleted when done (or dropped by the
    server after a minute without reads). A stream that does not exist reads as empty."""

    def __init__(self, nc, stream: str, filters: str | Sequence[str], *, start_seq: int | None = None,
                 start_time: float | None = None, batch: int = 512):
        self.nc, self.js = nc, nc.jetstream()
        self.stream = stream
        self.filters = [filters] if isinstance(filters, str) else sorted(filters)
        self.start_seq, self.start_time, self.batch = start_seq, start_time, batch
        self.name = ""
        self.initial_pending = 0
        self._pull: PullStream | None = None

    async def __aenter__(self) -> StreamReader:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                                inactive_threshold=60.0, mem_storage=True, num_replicas=1,
                                **filter_config(self.filters))
        if self.start_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, max(1, self.start_seq)
        elif self.start_time is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = dt.datetime.fromtimestamp(self.start_time, dt.timezone.utc)
        try:
            info = await _add_consumer_patiently(self.js, self.stream, config)
        except nats.js.errors.NotFoundError:
            return self  # no such stream: nothing was ever published to it
        self.name, self.initial_pending = info.name, info.num_pending
        self._pull = await PullStream(self.nc, self.stream, self.name, self.batch).start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._pull is not None:
            await self._pull.close()
            with contextlib.suppress(Exception):  # it expires by itself (inactive_threshold)
                await self.js.delete_consumer(self.stream, self.name)

    async def messages(self, end_seq: int | None = None, end_time: float | None = None, follow: bool = False,
                       stop: asyncio.Event | None = None) -> AsyncIterator[StoredMessage]:
        """Messages in stream order. Without `follow`: up to `end_seq` / `end_time` or what
        was pending when the reader was opened; with it: until `stop` is set."""
        pull = self._pull
        remaining = self.initial_pending
        if pull is None or (not follow and remaining == 0):
            return
        idle = 0
        while stop is None or not stop.is_set():
            batch = await pull.next_batch(timeout=0.5)
            if not batch:
                idle += 1
                if not follow and idle >= 4:
                    info = await self.js.consumer_info(self.stream, self.name)
                    if info.num_pending == 0:
                        return  # what was pending is gone (aged out meanwhile)
                    idle = 0
                continue
            idle = 0
            for msg in batch:
                meta = msg.metadata
                item = StoredMessage(meta.sequence.stream, meta.timestamp.timestamp(), msg.subject, msg.data,
                                     meta.num_pending)
                if not follow and end_time is not None and item.time > end_time:
                    return
                yield item
                remaining -= 1
                if not follow and (item.pending == 0 or remaining <= 0
                                   or (end_seq is not None and item.seq >= end_seq)):
                    return


def filter_config(filters: Sequence[str]) -> dict:
    """ConsumerConfig arguments for one filter subject or several."""
    filters = list(filters)
    return {"filter_subject": filters[0]} if len(filters) == 1 else {"filter_subjects": filters}


async def read_stream(nc, stream: str, filters: str | Sequence[str], *, start_seq: int | None = None,
                      start_time: float | None = None, end_seq: int | None = None, end_time: float | None = None,
                      batch: int = 512) -> AsyncIterator[StoredMessage]:
    """The messages of `stream` matching `filters`, in stream order, from the first one (or
    `start_seq` / `start_time`) to `end_seq` / `end_time` or to what the stream held when
    the read began."""
    async with StreamReader(nc, stream, filters, start_seq=start_seq, start_time=start_time, batch=batch) as reader:
        async for msg in reader.messages(end_seq=end_seq, end_time=end_time):
            yield msg


async def read_backward(nc, stream: str, filters: str | Sequence[str], first: int, end: int,
                        enough: Callable[[list[StoredMessage]], bool], window: int = 1024) -> None:
    """Read `stream` in chunks from `end` back towards `first` (each chunk in stream order),
    calling `enough(messages of the chunk)` until it returns True: cheap when what is wanted
    is recent. Chunks grow 4x."""
    hi = end
    while hi >= first:
        lo = max(first, hi - window + 1)
        chunk = [msg async for msg in read_stream(nc, stream, filters, start_seq=lo, end_seq=hi) if msg.seq <= hi]
        if enough(chunk):
            return
        hi, window = lo - 1, window * 4
