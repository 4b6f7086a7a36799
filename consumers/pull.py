"""A continuous pull on a durable JetStream consumer.

nats-py's `fetch(n)` waits, once it has a first message, for the other n-1 until its
timeout: under light load that adds up to the whole timeout to every batch's latency. This
keeps pull requests outstanding instead and hands over whatever has already arrived, so a
lone message is applied at once and a burst is still applied as one batch.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

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


class ConsumerGone(RuntimeError):
    """The server ended our pulls for good (consumer deleted, leadership change, ...)."""


class PullStream:
    def __init__(self, nc, stream: str, durable: str, max_batch: int = 256, expires_s: float = 5.0):
        self.nc = nc
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.max_batch = max_batch
        self.expires_ns = int(expires_s * 1e9)
        self.inbox = nc.new_inbox()
        self.sub: Subscription = None  # type: ignore[assignment]  # subscribed in start(), before any use
        self.outstanding = 0
        self.expires_s = expires_s
        self._last_heard = time.monotonic()

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
        # Two batches in flight: the next one is already requested while this one is applied.
        if self.outstanding <= self.max_batch:
            wanted = 2 * self.max_batch - self.outstanding
            request = json.dumps({"batch": wanted, "expires": self.expires_ns}).encode()
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
            return True
        if status == _HEARTBEAT:
            return False
        if status in (_TIMEOUT, _NO_MESSAGES):
            pending = headers.get(_PENDING)
            self.outstanding = max(0, self.outstanding - int(pending)) if pending else 0
            return False
        description = headers.get("Description", "")
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
