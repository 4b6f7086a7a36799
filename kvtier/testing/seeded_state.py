"""Tier state in Redis for a router to read, written through the processor's own apply code
(`TierStateWriter`), for `kvtier bench route`: conversations held across tiers by many workers,
HiCache-shaped holdings at scale (~1M (page, tier) entries), and a processor-like writer
process applying a steady load of transitions."""

from __future__ import annotations

import random
import time
from typing import cast

import redis

from kvtier.consumers.apply import TierStateWriter
from kvtier.schemas.events import BridgeCursor, EventBatch, PagesRemoved, PagesStored, TierEvent, WorkerAnnounce
from kvtier.schemas.hashes import BlockHash, sglang_block_hashes
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

#: worker -> tier -> the pages it holds there
Holdings = dict[str, dict[Tier, list[BlockHash]]]


def _random_hashes(rng: random.Random, n: int) -> list[BlockHash]:
    """`n` random signed 64-bit page hashes (BlockHash is an int: no conversion needed)."""
    return cast("list[BlockHash]", [rng.getrandbits(64) - (1 << 63) for _ in range(n)])


class ConversationState:
    """`workers` workers, each holding `per_worker` of `conversations` conversations of `pages`
    pages (random token ids): a random device prefix, then a host continuation, then a disk
    one; so a conversation's tokens overlap a handful of workers and the rest are cold."""

    def __init__(self, rng: random.Random, page_size: int, pages: int, conversations: int, workers: int,
                 per_worker: int, noise_pages: int):
        self.page_size = page_size
        self.noise_pages = noise_pages
        self.conversations = [[rng.randrange(1, 150_000) for _ in range(pages * page_size)]
                              for _ in range(conversations)]
        self.hashes = [sglang_block_hashes(tokens, page_size) for tokens in self.conversations]
        # worker -> (conversation, device pages, host pages, disk pages)
        self.holdings: dict[str, list[tuple[int, int, int, int]]] = {}
        for w in range(workers):
            held = []
            for conv in rng.sample(range(conversations), per_worker):
                device = rng.randint(0, pages)
                host = rng.randint(0, pages - device)
                disk = rng.randint(0, pages - device - host)
                held.append((conv, device, host, disk))
            self.holdings[f"worker-{w:03d}"] = held

    def seed(self, client: redis.Redis, model: str, rng: random.Random, layout: MooncakeLayout | None) -> int:
        """Every worker announced and its holdings stored, with `noise_pages` unrelated pages
        per tier so the sets are of a realistic size; the (page, tier) entries written."""
        writer = TierStateWriter(client)
        entries = 0
        for worker, held in self.holdings.items():
            meta = WorkerMetadata(worker_id=worker, model=model, page_size=self.page_size, mooncake=layout)
            writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600.0,
                                           cursor=BridgeCursor(epoch=1, seq=0)))
            tiers: dict[Tier, list[BlockHash]] = {Tier.DEVICE: [], Tier.HOST: [], Tier.DISK: []}
            for conv, device, host, disk in held:
                h = self.hashes[conv]
                tiers[Tier.DEVICE] += h[:device]
                tiers[Tier.HOST] += h[device:device + host]
                tiers[Tier.DISK] += h[device + host:device + host + disk]
            for tier in tiers:
                tiers[tier] += [BlockHash(rng.randrange(-(1 << 63), 1 << 63)) for _ in range(self.noise_pages)]
            events: list[TierEvent] = [PagesStored(tier=t, hashes=pages) for t, pages in tiers.items()]
            entries += sum(len(p) for p in tiers.values())
            writer.apply(EventBatch(worker_id=worker, model=model, epoch=1, seq=1, ts=time.time(),
                                    source_ts=time.time(), events=events))
        return entries


def scale_holdings(rng: random.Random, workers: int, target_entries: int) -> Holdings:
    """worker -> tier -> pages, at least `target_entries` (page, tier) entries in all, shaped
    like HiCache with write-through: every worker holds 512 shared prefix pages (system prompts)
    on device and host; of its own pages 55% are on device and host (written through), 35% on
    host only (evicted from the GPU), 10% on disk only (evicted to storage)."""
    shared = _random_hashes(rng, 512)
    per_worker = -(-target_entries // workers) - 2 * len(shared)
    own = -(-per_worker * 100 // 155)  # 1.55 entries per own page
    both, host_only = own * 55 // 100, own * 35 // 100
    disk_only = max(0, per_worker - 2 * both - host_only)
    out: Holdings = {}
    for w in range(workers):
        pages = _random_hashes(rng, both + host_only + disk_only)
        device = shared + pages[:both]
        out[f"worker-{w:03d}"] = {Tier.DEVICE: device, Tier.HOST: device + pages[both:both + host_only],
                                  Tier.DISK: pages[both + host_only:]}
    return out


def seed_holdings(client: redis.Redis, model: str, holdings: Holdings, page_size: int, chunk: int = 16_384) -> None:
    """The state through the processor's apply code, one batch per worker (events of at most
    `chunk` pages)."""
    writer = TierStateWriter(client)
    for worker, by_tier in holdings.items():
        meta = WorkerMetadata(worker_id=worker, model=model, page_size=page_size)
        writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600.0,
                                       cursor=BridgeCursor(epoch=1, seq=0)))
        events: list[TierEvent] = [PagesStored(tier=tier, hashes=pages[i:i + chunk])
                                   for tier, pages in by_tier.items() for i in range(0, len(pages), chunk)]
        writer.apply(EventBatch(worker_id=worker, model=model, epoch=1, seq=1, ts=time.time(),
                                source_ts=time.time(), events=events))


def lag_writer(redis_url: str, model: str, rate: float, seconds: float, workers: int, batch_pages: int, seed: int,
               ready, go, out) -> None:
    """A processor-like writer (its own process, client and TierStateWriter): `rate` page
    transitions/s for `seconds`, as `batch_pages`-page batches of one store or remove each,
    sent when due (pipelined when several are), round robin over `workers` workers. Sets
    `ready` once its workers are announced, starts on `go`, puts its totals in `out`."""
    rng = random.Random(seed)
    client = redis.Redis.from_url(redis_url)
    writer = TierStateWriter(client)
    names = [f"lag-worker-{w:03d}" for w in range(workers)]
    seq = dict.fromkeys(names, 0)
    held: dict[str, list[tuple[Tier, list[BlockHash]]]] = {w: [] for w in names}

    def batch(worker: str, events: list[TierEvent]) -> EventBatch:
        seq[worker] += 1
        now = time.time()
        return EventBatch(worker_id=worker, model=model, epoch=1, seq=seq[worker], ts=now, source_ts=now,
                          events=events)

    for worker in names:
        meta = WorkerMetadata(worker_id=worker, model=model, page_size=64)
        writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600.0,
                                       cursor=BridgeCursor(epoch=1, seq=0)))
    writer.apply_many([batch(w, [PagesStored(tier=Tier.DEVICE, hashes=[BlockHash(rng.getrandbits(63))])])
                       for w in names])
    ready.set()
    go.wait()
    per_s = rate / batch_pages
    sent = transitions = 0
    statuses: dict[str, int] = {}
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        due = min(int(now * per_s) + 1 - sent, 64)
        if due <= 0:
            time.sleep(min(0.002, (sent / per_s) - now))
            continue
        batches = []
        for _ in range(due):
            worker = names[sent % workers]
            sent += 1
            if len(held[worker]) >= 8:  # steady state: a store, then a remove, of 128 pages each
                tier, pages = held[worker].pop(0)
                batches.append(batch(worker, [PagesRemoved(tier=tier, hashes=pages)]))
            else:
                tier = rng.choice((Tier.DEVICE, Tier.HOST))
                pages = _random_hashes(rng, batch_pages)
                held[worker].append((tier, pages))
                batches.append(batch(worker, [PagesStored(tier=tier, hashes=pages)]))
        for result in writer.apply_many(batches):
            transitions += result.transitions
            statuses[result.status.name] = statuses.get(result.status.name, 0) + 1
    out.put({"batches": sent, "transitions": transitions, "elapsed_s": time.perf_counter() - start,
             "statuses": statuses})
    client.close()
