"""The event streams of `kvtier bench ingest`: kvtier batches from many simulated workers
(`IngestWorkload`), each worker's a HiCache-like mix of stores and removes on device and host
(`WorkerStream`), encoded as the bridge publishes them."""

from __future__ import annotations

import random
import time

from kvtier.schemas.events import EventBatch, PagesRemoved, PagesStored, encode_message, pack_token_ids
from kvtier.schemas.tiers import Tier


class WorkerStream:
    """A HiCache-like stream of tier events for one worker (write-through)."""

    def __init__(self, rng: random.Random, page_size: int, pages_per_event: int, token_ids: bool):
        self.rng = rng
        self.page_size = page_size
        self.k = pages_per_event
        self.token_ids = token_ids
        self.gpu_only: list[int] = []
        self.both: list[int] = []
        self.host_only: list[int] = []

    def _take(self, pool: list[int]) -> list[int]:
        n = min(self.k, len(pool))
        taken, pool[:] = pool[:n], pool[n:]
        return taken

    def event(self):
        r = self.rng.random()
        if r < 0.2 and len(self.gpu_only) >= self.k:
            pages = self._take(self.gpu_only)
            self.both += pages
            return PagesStored(tier=Tier.HOST, hashes=pages, page_size=self.page_size)
        if r < 0.4 and len(self.both) >= self.k:
            pages = self._take(self.both)
            self.host_only += pages
            return PagesRemoved(tier=Tier.DEVICE, hashes=pages)
        if r < 0.5 and len(self.host_only) >= self.k:
            pages = self._take(self.host_only)
            self.both += pages
            return PagesStored(tier=Tier.DEVICE, hashes=pages, page_size=self.page_size)
        if r < 0.6 and len(self.host_only) >= self.k:
            return PagesRemoved(tier=Tier.HOST, hashes=self._take(self.host_only))
        pages = [self.rng.randrange(-(1 << 63), 1 << 63) for _ in range(self.k)]
        self.gpu_only += pages
        tokens = [self.rng.randrange(0, 128_000) for _ in range(self.k * self.page_size)] if self.token_ids else []
        return PagesStored(tier=Tier.DEVICE, hashes=pages, page_size=self.page_size, token_ids=pack_token_ids(tokens))


class IngestWorkload:
    """Batches of `model` from `workers` workers (bw0, bw1, ...) taken in turn, each of
    `events_per_message` events and numbered per worker from 1, as epoch 1."""

    def __init__(self, model: str, workers: int, pages_per_event: int, events_per_message: int, token_ids: bool,
                 seed: int = 0):
        rng = random.Random(seed)
        self.model = model
        self.workers = [f"bw{i}" for i in range(workers)]
        self.streams = {w: WorkerStream(random.Random(rng.random()), 16, pages_per_event, token_ids)
                        for w in self.workers}
        self.seq = {w: 0 for w in self.workers}
        self.events_per_message = events_per_message
        self._next = 0

    def message(self, stamp: float | None = None) -> tuple[str, int, bytes, int]:
        """The next batch as (worker, seq, encoded message, pages it moves), stamped `stamp`
        (default: now)."""
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        self.seq[worker] += 1
        events = [self.streams[worker].event() for _ in range(self.events_per_message)]
        now = stamp if stamp is not None else time.time()
        batch = EventBatch(worker_id=worker, model=self.model, epoch=1, seq=self.seq[worker], ts=now, source_ts=now,
                           events=events)
        return worker, batch.seq, encode_message(batch), sum(len(e.hashes) for e in events)
