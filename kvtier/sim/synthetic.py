"""A synthetic HiCache event source: a seeded write-through workload in SGLang's own event
types, and the reference model of what the worker holds per tier. Used by `kvtier demo`
and the tests until the simulated worker arrives; the reference model is how both check
that Redis holds exactly what the worker emitted."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvtier.schemas.hashes import BlockHash, sglang_block_hashes
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored, SglangEvent
from kvtier.schemas.tiers import Tier, tier_of_medium

GPU, HOST = "GPU", "CPU_PINNED"


@dataclass
class ReferenceModel:
    """What a worker holds per tier, from the events it emitted, applied in order."""

    pages: dict[BlockHash, set[Tier]] = field(default_factory=dict)

    def apply(self, events: list[SglangEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.pages.setdefault(h, set()).add(tier_of_medium(event.medium))
            elif isinstance(event, BlockRemoved):
                tier = tier_of_medium(event.medium)
                for h in event.block_hashes:
                    tiers = self.pages.get(h)
                    if tiers is not None:
                        tiers.discard(tier)
                        if not tiers:
                            del self.pages[h]
            elif isinstance(event, AllBlocksCleared):
                self.pages.clear()

    def clear(self) -> None:
        self.pages.clear()


class HiCacheWorkload:
    """Seeded write-through HiCache event stream: prefill -> GPU, backup -> host (after the
    copy), device eviction, load back, host eviction. A page is always stored on its new tier
    before it leaves the old one, and a finally removed page never comes back; the sequences
    do not commute, so applying them out of order gives a different state."""

    def __init__(self, seed: int, page_size: int = 4, max_chain: int = 6):
        self.rng = random.Random(seed)
        self.page_size = page_size
        self.max_chain = max_chain
        self.on_gpu: set[BlockHash] = set()
        self.on_host: set[BlockHash] = set()
        self.finally_removed: set[BlockHash] = set()
        self.parents: dict[BlockHash, BlockHash | None] = {}
        self._token = seed * 1_000_000

    def _pick(self, pool: set[BlockHash], k: int) -> list[BlockHash]:
        return self.rng.sample(sorted(pool), min(k, len(pool)))

    def next_batch(self) -> list[SglangEvent]:
        events: list[SglangEvent] = []
        for _ in range(self.rng.randint(1, 4)):
            op = self.rng.random()
            if op < 0.35 or not self.on_gpu:
                n = self.rng.randint(1, self.max_chain)
                tokens = list(range(self._token, self._token + n * self.page_size))
                self._token += n * self.page_size
                hashes = sglang_block_hashes(tokens, self.page_size)
                wire_tokens: list[int | list[int]] = [*tokens]
                events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=wire_tokens,
                                          block_size=self.page_size, medium=GPU))
                self.on_gpu.update(hashes)
            elif op < 0.55:
                chosen = self._pick(self.on_gpu - self.on_host, 4)
                if chosen:
                    events.append(BlockStored(block_hashes=chosen, parent_block_hash=None, token_ids=[],
                                              block_size=self.page_size, medium=HOST))
                    self.on_host.update(chosen)
            elif op < 0.75:
                chosen = self._pick(self.on_gpu & self.on_host, 4)
                if chosen:
                    events.append(BlockRemoved(block_hashes=chosen, medium=GPU))
                    self.on_gpu.difference_update(chosen)
            elif op < 0.88:
                chosen = self._pick(self.on_host - self.on_gpu, 3)
                if chosen:
                    events.append(BlockStored(block_hashes=chosen, parent_block_hash=None, token_ids=[],
                                              block_size=self.page_size, medium=GPU))
                    self.on_gpu.update(chosen)
            else:
                chosen = self._pick(self.on_host - self.on_gpu, 3)
                if chosen:
                    events.append(BlockRemoved(block_hashes=chosen, medium=HOST))
                    self.on_host.difference_update(chosen)
                    self.finally_removed.update(chosen)
        return events or self.next_batch()
