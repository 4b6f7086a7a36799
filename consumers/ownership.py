"""Partition ownership for `kvtier processor --partitions auto`.

Processors announce themselves in `kvt:processors` (member -> expiry) and hold partition
k through a lease key `kvt:partition:<k>` (value: owner id, with a TTL they keep renewing).
Each claims up to ceil(partitions / live processors); one with more than its share releases
the extra ones after it has stopped consuming them. A dead processor's leases run out and the
others take its partitions. Correctness never depends on this: the apply script orders every
worker's batches, so even two owners of one partition for a moment cannot reorder them.
"""

from __future__ import annotations

import math
import time

import redis

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.schemas.state_keys import as_text

PROCESSORS_KEY = "kvt:processors"

_RENEW = load_lua("kvtier.consumers", "renew_partition.lua")
_RELEASE = load_lua("kvtier.consumers", "release_partition.lua")


def partition_key(partition: int) -> str:
    return f"kvt:partition:{partition}"


def fair_share(partitions: int, processors: int) -> int:
    return math.ceil(partitions / max(1, processors))


class PartitionLeases:
    def __init__(self, client: redis.Redis, owner: str, partitions: int, ttl_s: float = 5.0):
        self.client = client
        self.owner = owner
        self.partitions = partitions
        self.ttl_ms = int(ttl_s * 1000)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    def heartbeat(self) -> int:
        """Say this processor is alive; return how many processors are."""
        now_ms = int(time.time() * 1000)
        pipe = self.client.pipeline(transaction=True)
        pipe.zadd(PROCESSORS_KEY, {self.owner: now_ms + self.ttl_ms})
        pipe.zremrangebyscore(PROCESSORS_KEY, "-inf", now_ms)
        pipe.zcard(PROCESSORS_KEY)
        return int(pipe.execute()[-1])

    def renew(self, owned: set[int]) -> set[int]:
        """Extend the leases we hold; return the partitions whose lease we lost."""
        return {p for p in sorted(owned) if not self._renew(keys=[partition_key(p)], args=[self.owner, self.ttl_ms])}

    def try_claim(self, partition: int) -> bool:
        return bool(self.client.set(partition_key(partition), self.owner, nx=True, px=self.ttl_ms))

    def release(self, partition: int) -> None:
        self._release(keys=[partition_key(partition)], args=[self.owner])

    def leave(self, owned: set[int]) -> None:
        for partition in owned:
            self.release(partition)
        self.client.zrem(PROCESSORS_KEY, self.owner)

    def owners(self) -> dict[int, str | None]:
        # one GET per key, pipelined: the lease keys sit in different hash slots, so an MGET
        # over them is refused by Redis Cluster
        pipe = self.client.pipeline(transaction=False)
        for p in range(self.partitions):
            pipe.get(partition_key(p))
        values = pipe.execute()
        return {p: as_text(v) if v is not None else None for p, v in enumerate(values)}
