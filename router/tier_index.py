"""One model's tier state in memory: which workers hold each page on which tier, and the
walk of docs/DESIGN.md over it for every worker at once. Pure: no I/O, no clock. Fed by
router/index_feed.py from the change feed (schemas/changes.py); the Redis pages sets stay the
authoritative state, this is a derived read view of them.

The walk here is a specialised copy of router/walk.py's (the spec), kept because it is on
every decision's path: walking all workers at once on bit masks takes about 2.5x less time
than the spec walked once per worker (32 workers, 64-page requests). tests/router/test_walk.py
checks it against the spec on random page sets and requests.

Layout: page hash -> one int, three bits per worker slot (device, host, disk: bit
3·slot + 0/1/2). One dict entry per page whatever the number of tiers and holders, so a
lookup is one dict probe per request page, and the walk moves every worker's phase with a
few integer operations per page: O(request pages + workers) for a request. The external tier
is not indexed (the walk never reads it; the shared pool answers for it).

Slots are reused: a worker whose last page goes gives its slot back, so the ints stay as
wide as the number of workers that hold pages now, not of every worker ever seen. Equal
masks are stored as one int object (most pages share a handful of holder patterns), which
saves an int's 28-40 bytes per page; the table of them is bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvtier.schemas.changes import ChangeKind, TierChange
from kvtier.schemas.hashes import BlockHash
from kvtier.schemas.routing import TierOverlap
from kvtier.schemas.tiers import Tier

#: Tier -> bit offset within a worker's three bits, in walk order.
TIER_OFFSET: dict[Tier, int] = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
_SLOT_BITS = 0b111
#: Distinct masks kept for sharing; past it the table starts over (stored masks stay valid).
_MAX_SHARED_MASKS = 1 << 16
#: The overlap of a worker that holds none of the request's pages: one object for all of them
#: (most candidates of a decision are cold), which the decision credits without computing.
NO_OVERLAP = TierOverlap()


class TierIndex:
    def __init__(self) -> None:
        self._pages: dict[BlockHash, int] = {}
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._entries_of: dict[str, int] = {}  # worker -> its (page, tier) entries
        self.entries = 0  # (page, tier) entries over every worker
        self._masks: dict[int, int] = {}

    # --- writes ---------------------------------------------------------------------------
    def apply(self, change: TierChange) -> None:
        worker = change.worker_id
        for op in change.ops:
            if op.kind is ChangeKind.CLEAR:
                self.clear(worker)
            elif op.tier in TIER_OFFSET:
                if op.kind is ChangeKind.STORE:
                    self.store(worker, op.tier, op.pages)
                else:
                    self.remove(worker, op.tier, op.pages)

    def store(self, worker: str, tier: Tier, pages: Iterable[BlockHash]) -> None:
        if tier not in TIER_OFFSET:
            return
        bit = 1 << (3 * self._slot(worker) + TIER_OFFSET[tier])
        table, added, shared = self._pages, 0, self._shared_mask
        for page in pages:
            old = table.get(page, 0)
            if not old & bit:
                table[page] = shared(old | bit)
                added += 1
        self._count(worker, added)

    def remove(self, worker: str, tier: Tier, pages: Iterable[BlockHash]) -> None:
        slot = self._slot_of.get(worker)
        if slot is None or tier not in TIER_OFFSET:
            return
        bit = 1 << (3 * slot + TIER_OFFSET[tier])
        table, removed = self._pages, 0
        for page in pages:
            old = table.get(page, 0)
            if old & bit:
                if old == bit:
                    del table[page]
                else:
                    table[page] = self._shared_mask(old ^ bit)
                removed += 1
        self._count(worker, -removed)

    def clear(self, worker: str) -> None:
        """Every page of the worker gone. Scans the table (rare: a new epoch, a rebase, an
        expiry), skipped when the worker holds nothing."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return
        if self._entries_of.get(worker, 0):
            mask = _SLOT_BITS << (3 * slot)
            table = self._pages
            for page in [p for p, bits in table.items() if bits & mask]:
                rest = table[page] & ~mask
                if rest:
                    table[page] = self._shared_mask(rest)
                else:
                    del table[page]
        self._count(worker, -self._entries_of.get(worker, 0))

    def _shared_mask(self, mask: int) -> int:
        masks = self._masks
        found = masks.get(mask)
        if found is None:
            if len(masks) >= _MAX_SHARED_MASKS:
                masks.clear()
            found = masks[mask] = mask
        return found

    def _slot(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._slot_of[worker] = slot
            self._entries_of[worker] = 0
        return slot

    def _count(self, worker: str, delta: int) -> None:
        if worker not in self._entries_of:
            return
        left = self._entries_of[worker] + delta
        self.entries += delta
        if left > 0:
            self._entries_of[worker] = left
            return
        # Nothing left: give the slot back (its bits are all zero everywhere).
        slot = self._slot_of.pop(worker)
        del self._entries_of[worker]
        heapq.heappush(self._free_slots, slot)

    # --- reads ----------------------------------------------------------------------------
    def workers(self) -> dict[str, int]:
        """worker -> its (page, tier) entries."""
        return dict(self._entries_of)

    def pages_of(self, worker: str) -> dict[BlockHash, set[Tier]]:
        """A worker's pages and tiers (a full scan: for tests and tools)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return {}
        shift = 3 * slot
        return {page: {tier for tier, offset in TIER_OFFSET.items() if bits >> (shift + offset) & 1}
                for page, bits in self._pages.items() if bits >> shift & _SLOT_BITS}

    def overlaps(self, pages: Sequence[BlockHash], workers: Iterable[str]) -> dict[str, TierOverlap]:
        """Each worker's tiered overlap with a request's pages (hashed at that worker's page
        size): router/walk.py's `walk` for every worker at once (the device prefix, then on
        host while the page is on host, then on disk, each page counted once at the stage that
        reaches it). Workers the index has no page of get a zero overlap."""
        slot_of = self._slot_of
        result = dict.fromkeys(workers, NO_OVERLAP)
        if not pages:
            return result
        get = self._pages.get
        # A worker without the first page on any tier leaves every stage at page 0: a zero
        # overlap, settled here. Most candidates of a decision are such cold workers, and the
        # walk then moves only the few that hold the prefix.
        first = get(pages[0], 0)
        slots = {w: slot_of[w] for w in result if w in slot_of and first >> (3 * slot_of[w]) & _SLOT_BITS}
        if not slots:
            return result
        n = len(pages)
        # end[slot] = [device end, host end, disk end]: the page position where the worker
        # left each stage of the walk (n: it never left).
        ends = {slot: [n, n, n] for slot in slots.values()}
        device_phase = 0
        for slot in slots.values():
            device_phase |= 1 << (3 * slot)
        host_phase = disk_phase = 0
        left: list[tuple[int, int, int]] = []  # (position, stage, bits of the workers that left)
        walking = device_phase  # every phase's bits together: a worker's bits are apart
        for position, page in enumerate(pages):
            bits = get(page, 0)
            if not walking & ~bits:
                continue  # every worker still walking has this page where its stage needs it
            if device_phase:
                out = device_phase & ~bits
                if out:
                    device_phase ^= out
                    host_phase |= out << 1
                    left.append((position, 0, out))
            if host_phase:
                out = host_phase & ~bits
                if out:
                    host_phase ^= out
                    disk_phase |= out << 1
                    left.append((position, 1, out))
            if disk_phase:
                out = disk_phase & ~bits
                if out:
                    disk_phase ^= out
                    left.append((position, 2, out))
            walking = device_phase | host_phase | disk_phase
            if not walking:
                break
        for position, stage, out in left:
            while out:
                low = out & -out
                ends[(low.bit_length() - 1) // 3][stage] = position
                out ^= low
        for worker, slot in slots.items():
            device, host, disk = ends[slot]
            result[worker] = TierOverlap(device=device, host=host - device, disk=disk - host) if disk else NO_OVERLAP
        return result

