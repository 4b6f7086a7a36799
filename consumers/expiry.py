"""Workers whose lease ran out: recording the decision in the stream, applying it when it comes
round, and forgetting workers gone longer than `--worker-retention`.

A lease is expired only by a `WorkerExpired` decision in the worker's subject, recorded once
the worker's partition has been applied past the lease's end (its consumer's ack floor), NATS
has been reachable for twice the longest lease and no model's state has been lost or
rebuilding for as long (consumers/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import nats.js.errors

from kvtier.consumers.apply import TierStateWriter
from kvtier.consumers.partitions import Durables
from kvtier.consumers.processor_metrics import EXPIRED, FORGOTTEN, PARTIAL_WORKERS, PENDING, STALE_WORKERS
from kvtier.schemas.events import WorkerExpired, encode_message
from kvtier.schemas.subjects import EVENTS_STREAM, events_subject, subject_token

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


def _timestamp(value) -> float:
    """A JetStream time (a datetime, or RFC 3339 text from some nats-py versions) in unix seconds."""
    if isinstance(value, str):
        text = value.rstrip("Z")
        whole, _, fraction = text.partition(".")
        parsed = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc)
        return parsed.timestamp() + (float("0." + fraction) if fraction else 0.0)
    return value.timestamp()


class LeaseExpiry:
    """The housekeeping of leases: each sweep records the leases that ran out, updates the
    workers' gauges and forgets the long dead. `forget(model_token, worker)` drops what the
    processor keeps in memory for a forgotten worker; `owned()`, the partitions it consumes now."""

    def __init__(self, nc: NATS, js: JetStreamContext, writer: TierStateWriter, durables: Durables, *,
                 worker_retention_s: float, forget: Callable[[str, str], None], owned: Callable[[], list[int]]):
        self.nc = nc
        self.js = js
        self.writer = writer
        self.durables = durables
        self.worker_retention_s = worker_retention_s
        self.forget = forget
        self.owned = owned
        self._recorded_expiry: dict[tuple[str, str], int] = {}  # (model token, worker) -> lease ms recorded
        self._reconnects_seen = 0
        self._stream_back_at = 0.0  # when the NATS connection last came back
        self._longest_lease_s = 0.0  # the longest lease any announce asked for

    def saw_lease(self, lease_s: float) -> None:
        """An announce asked for this lease (the waits before expiring are twice the longest)."""
        self._longest_lease_s = max(self._longest_lease_s, lease_s)

    async def sweep(self, total_partitions: int, state_unsettled_at: float) -> None:
        """One round of housekeeping; `state_unsettled_at`: when a model's state was last seen
        lost or rebuilding (recovery.py)."""
        if self._stream_reachable_long_enough() and self._state_settled_long_enough(state_unsettled_at):
            await self._record_expired_leases(total_partitions)
        STALE_WORKERS.set(await asyncio.to_thread(self.writer.count_stale_workers))
        PARTIAL_WORKERS.set(await asyncio.to_thread(self.writer.count_partial_workers))
        for model, worker in await asyncio.to_thread(self.writer.forget_dead_workers, self.worker_retention_s):
            FORGOTTEN.inc()
            self.forget(model, worker)
            log.info("%s/%s: gone for more than %.0fs; forgotten", model, worker, self.worker_retention_s)

    async def apply(self, msg, decision: WorkerExpired) -> None:
        """Apply a recorded decision as it is consumed, in stream order, then ack it."""
        removed = await asyncio.to_thread(self.writer.expire_worker, decision.model, decision.worker_id,
                                          decision.lease_expiry_ms)
        if removed >= 0:
            EXPIRED.inc()
            log.warning("%s/%s: lease expired; removed its %d pages", decision.model, decision.worker_id, removed)
        self._recorded_expiry.pop((subject_token(decision.model), decision.worker_id), None)
        await msg.ack()

    async def _record_expired_leases(self, total_partitions: int) -> None:
        """Record in the stream, as WorkerExpired decisions, the leases that ran out before
        their partition was settled. They take effect when consumed, in stream order (so a
        replay expires exactly the same workers); two processors recording the same decision
        store it once (same Nats-Msg-Id)."""
        settled = await self._settled_partitions(total_partitions)
        for token, worker, lease_ms, epoch, seq in await asyncio.to_thread(
                self.writer.expirable_workers, time.time(), settled, total_partitions):
            if self._recorded_expiry.get((token, worker)) == lease_ms:
                continue  # recorded already; waiting for it to come round
            decision = WorkerExpired(model=token, worker_id=worker, lease_expiry_ms=lease_ms, ts=time.time(),
                                     epoch=epoch, seq=seq)
            await self.js.publish(events_subject(token, worker), encode_message(decision),
                                  headers={"Nats-Msg-Id": decision.msg_id}, timeout=5.0)
            self._recorded_expiry[(token, worker)] = lease_ms

    def _stream_reachable_long_enough(self) -> bool:
        """Leases may be expired only once NATS has been reachable for twice the longest lease:
        while the broker was down no bridge could renew one, and a live worker's bridge
        reconnects and announces within a heartbeat or two of it coming back."""
        if not self.nc.is_connected:
            return False
        reconnects = self.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects_seen:
            self._reconnects_seen = reconnects
            self._stream_back_at = time.time()
        return time.time() >= self._stream_back_at + 2 * self._longest_lease_s

    def _state_settled_long_enough(self, state_unsettled_at: float) -> bool:
        """Leases may be expired only once no model has been lost or rebuilding for twice the
        longest lease: a rebuild replays old announces (leases that look run out) and may
        redeliver newer ones out of order, so until it settles an old lease proves nothing."""
        return time.time() >= state_unsettled_at + 2 * self._longest_lease_s

    async def _settled_partitions(self, total_partitions: int) -> dict[int, float]:
        """Per partition, the stream time up to which every message has been applied and
        acked (its consumer's ack floor): a lease that ran out before it is final, since any
        announce renewing it would have come earlier in the stream. A partition behind (its
        owner down or catching up, a gap held back) is settled only up to its floor. Every
        partition is looked at, owned or not, so a dead processor's workers are expired once
        its partitions are taken over and caught up."""
        settled: dict[int, float] = {}
        now = time.time()
        for partition in range(total_partitions):
            try:
                info = await self.js.consumer_info(EVENTS_STREAM, self.durables.name(partition))
            except nats.js.errors.NotFoundError:
                continue  # nobody has consumed it yet
            if partition in self.owned():
                PENDING.labels(str(partition)).set(info.num_pending)
            else:  # given up (or never owned): its backlog is its new owner's to report
                with contextlib.suppress(KeyError):
                    PENDING.remove(str(partition))
            if info.num_pending == 0 and info.num_ack_pending == 0:
                settled[partition] = now
                continue
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            if floor:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    settled[partition] = _timestamp((await self.js.get_msg(EVENTS_STREAM, floor)).time)
        return settled
