"""The processor's partitions: each one's durable pull consumer on the events stream (its name,
its settings, subscribing to it) and, under `--partitions auto`, holding a fair share of them
through the Redis leases of ownership.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

import nats.js.errors
import redis
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvtier.consumers.ownership import PartitionLeases, fair_share
from kvtier.consumers.pull import PullStream
from kvtier.schemas.subjects import EVENTS_STREAM, partition_filter

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


@dataclass(frozen=True)
class Durables:
    """The durable consumers, one per partition: names, settings, and pulls from them."""

    prefix: str
    ack_wait_s: float
    fetch_batch: int

    def name(self, partition: int) -> str:
        return f"{self.prefix}-p{partition}"

    def config(self, partition: int) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.name(partition), filter_subject=partition_filter(partition),
            ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_ack_pending=50_000, max_deliver=-1,
            deliver_policy=DeliverPolicy.ALL,
        )

    async def subscribe(self, nc: NATS, js: JetStreamContext, partition: int, rewind: bool) -> PullStream:
        durable = self.name(partition)
        config = self.config(partition)
        try:
            info = await js.consumer_info(EVENTS_STREAM, durable)
        except nats.js.errors.NotFoundError:
            info = None
        if info is not None and rewind and info.num_ack_pending:
            # A previous owner died holding unacked messages: redeliver them now, in order,
            # instead of after ack_wait behind newer ones.
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            await js.delete_consumer(EVENTS_STREAM, durable)
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = floor + 1
            info = None
            log.info("partition %d: rewinding consumer to stream seq %d", partition, floor + 1)
        if info is None:
            try:
                await js.add_consumer(EVENTS_STREAM, config)
            except nats.js.errors.BadRequestError:
                pass  # another processor created it meanwhile
        return await PullStream(nc, EVENTS_STREAM, durable, self.fetch_batch).start()

    async def resubscribe(self, nc: NATS, js: JetStreamContext, partition: int,
                          stop: asyncio.Event) -> PullStream | None:
        """A new pull on the partition, rewound to its ack floor: deliveries made to the pull
        that failed are redelivered at once, in order, instead of after ack_wait (which is
        longer than the gap timeout: they would arrive after their successors had rebased the
        worker). Retries until subscribed (a closed pull would wait forever) or until `stop`
        (then None)."""
        while not stop.is_set():
            try:
                return await self.subscribe(nc, js, partition, rewind=True)
            except Exception as exc:  # noqa: BLE001 - e.g. no consumer leader yet (NATS cluster)
                if stop.is_set():
                    return None
                log.warning("partition %d: re-subscribing failed (%r); retrying", partition, exc)
                await asyncio.sleep(0.5)
        return None


async def hold_fair_share(leases: PartitionLeases, lease_s: float, stop: asyncio.Event,
                          consume: Callable[[int, asyncio.Event], Coroutine[object, object, None]],
                          owned: Callable[[list[int]], None]) -> None:
    """Hold a fair share of the partitions, taking over those whose owner died. Each partition
    held is consumed by `consume(partition, its_own_stop)`; `owned` is told the partitions
    held after every round."""
    total = leases.partitions
    running: dict[int, tuple[asyncio.Event, asyncio.Task]] = {}

    async def stop_consuming(partition: int) -> None:
        partition_stop, task = running.pop(partition)
        partition_stop.set()
        await asyncio.gather(task, return_exceptions=True)  # finishes and acks its batch first

    try:
        while not stop.is_set():
            try:
                live = await asyncio.to_thread(leases.heartbeat)
                for partition in await asyncio.to_thread(leases.renew, set(running)):
                    log.warning("lost the lease on partition %d; stopping it", partition)
                    await stop_consuming(partition)
                share = fair_share(total, live)
                for partition in sorted(running, reverse=True)[: max(0, len(running) - share)]:
                    await stop_consuming(partition)
                    await asyncio.to_thread(leases.release, partition)
                    log.info("released partition %d", partition)
                for partition in range(total):
                    if len(running) >= share:
                        break
                    if partition not in running and await asyncio.to_thread(leases.try_claim, partition):
                        partition_stop = asyncio.Event()
                        running[partition] = (partition_stop, asyncio.create_task(consume(partition, partition_stop)))
                        log.info("claimed partition %d (%d live processors, share %d)", partition, live, share)
                owned(sorted(running))
            except redis.RedisError as exc:
                log.warning("partition leases unavailable (%s); keeping what is running", exc)
            try:
                await asyncio.wait_for(stop.wait(), lease_s / 5)
            except asyncio.TimeoutError:
                pass
    finally:
        for partition in list(running):
            running[partition][0].set()
        await asyncio.gather(*(task for _, task in running.values()), return_exceptions=True)
        with contextlib.suppress(redis.RedisError):
            await asyncio.to_thread(leases.leave, set(running))
