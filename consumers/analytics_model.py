"""The analytics state model: what every worker holds on every tier, rebuilt from the event
stream alone, and the statistics derived from it. Pure: no I/O, no clock of its own (every
call says what time it is), so a test can feed it a crafted sequence and `kvtier analytics`
(live, from durable consumers) and `kvtier report` (a time window, from ephemeral ones) give
the same numbers for the same messages.

Semantics (the processor's, consumers/apply.lua): a worker's pages per tier are a set; a
store adds, a remove removes, `AllCleared` empties every tier. Batches apply in (epoch, seq)
order: a repeated seq or an older epoch is skipped; a new epoch starts from empty; a gap
(a later seq of the same epoch) clears the worker and applies the batch on the empty state,
as the processor's rebase does.

Transition kinds, counted per (model, worker, kind, tier); `tier` is the tier the page
landed on (stored, copy, promotion, demotion) or left (removed, eviction, dropped ones):
- `stored` / `removed`: a page entered / left a tier (an event that changes nothing --
  a store of a page already there, a remove of one not there -- is counted as a no-op);
- `copy`: a store on a lower tier of a page still on a higher one (write-through backup,
  e.g. a host store of a page on device); the page has not moved yet;
- `promotion`: a store on a tier of a page present on a lower one (load_back: a device
  store of a page on host), tier = where it landed;
- `demotion`: a page left a tier while a copy on a lower tier holds it (a device removal of
  a page on host, write-through order), or a page removed from its last tier is stored on a
  lower one within `writeback_window_s` (write-back order: SGLang emits remove(GPU) first
  and store(CPU_PINNED) once the copy lands); tier = the lower tier that holds it;
- `eviction`: a page removed from its last tier and not written back within the window
  (tier = the tier it left). Such removals wait in a small "limbo" until the window has
  passed (`advance()`), so `eviction` lags by at most the window;
- `cleared`, `new_epoch`, `gap`, `lease_expired`: pages dropped wholesale, by why.

Counting a write-through host copy as a demotion too would count every page that moves down
twice (once at the copy, once when the device copy goes), and every fresh page under
write-through as demoted at birth; so the copy is its own kind and the demotion is counted
when the page actually leaves the higher tier.

Leases: announcements (same subjects) carry `lease_ttl_s`; a worker whose last announcement
is older than that (by the caller's clock: stream time, or wall time once caught up) is
expired like the processor's sweep does: its pages are dropped (`lease_expired`). A worker
never announced has no lease and is never expired (only its own AllCleared/new epoch clear
it). Lifetimes (store -> remove on the same tier, engine time `source_ts`) are observed on
explicit removals only: a page dropped by a clear, a new epoch, a gap or an expiry has no
known end.

Memory: one dict entry (page hash -> store time) per page per tier it is on, about 110-150
bytes each in CPython (`bytes_per_page_tier()` measures it: 112 B here, so ~1.1-1.5 GB per
10M page-tiers; 64 workers x 20k device+host pages is ~150 MB), plus the
limbo (evictions of the last `writeback_window_s`) and small per-worker records. Pages of
cleared, restarted (new epoch) and expired workers are dropped at once; the size is therefore
bounded by what the cluster actually holds.
"""

from __future__ import annotations

import bisect
import collections
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.schemas.events import AllCleared, EventBatch, PagesRemoved, PagesStored, WorkerAnnounce
from kvtier.schemas.routing import RouteDecision
from kvtier.schemas.tiers import TIER_PRIORITY, Tier

TIERS: tuple[Tier, ...] = TIER_PRIORITY  # device, host, disk, external: index = depth
TIER_NAMES: tuple[str, ...] = tuple(t.value for t in TIERS)
_INDEX = {t: i for i, t in enumerate(TIERS)}

TRANSITION_KINDS = ("stored", "removed", "copy", "promotion", "demotion", "eviction",
                    "cleared", "new_epoch", "gap", "lease_expired")
DROP_REASONS = ("cleared", "new_epoch", "gap", "lease_expired")
NOOP_KINDS = ("store_present", "remove_absent")
#: Tiers of a decision's predicted hits: the walk's three plus the shared pool beyond the device prefix.
HIT_TIERS = ("device", "host", "disk", "shared_beyond")

#: Page lifetime histogram bounds (seconds): 10 ms .. 1 day.
LIFETIME_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                                       600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
HIT_RATE_BUCKETS: tuple[float, ...] = tuple(i / 10 for i in range(11))


class Histogram:
    """Cumulative-on-export bucket counts, sum and count (Prometheus' shape)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out


class Reservoir:
    """Up to `size` uniformly sampled values (deterministic seed), for exact-ish percentiles."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seen = size, 0
        self.values: list[float] = []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.size:
                self.values[j] = value


@dataclass
class WorkerPages:
    model: str
    worker: str
    epoch: int = 0
    seq: int = 0
    #: per tier (device, host, disk, external): page hash -> engine time it was stored there
    tiers: tuple[dict, ...] = field(default_factory=lambda: tuple({} for _ in TIERS))
    #: page hash -> (tier index it left, deadline, counted, removed at); removed from its last
    #: tier, maybe about to be written back below
    limbo: dict = field(default_factory=dict)
    #: the clock's time its lease runs out; None: never announced (no lease)
    lease_until: float | None = None
    expired: bool = False
    page_size: int = 0

    def pages(self) -> int:
        return sum(len(d) for d in self.tiers)


@dataclass
class AnalyticsApplyResult:
    """What `TierAnalytics.apply_batch` made of a batch (the processor's own result is
    `consumers/apply.py`'s `ApplyResult`)."""

    outcome: str  # applied | duplicate | old_epoch
    transitions: int = 0


class TierAnalytics:
    """Per-worker tier sets and the counters derived from them. `counting=False` (set by the
    caller while it rebuilds state it has already counted, or reads history before a report's
    window) keeps the state exact without counting anything."""

    def __init__(self, writeback_window_s: float = 2.0, lifetime_samples: int = 0, seed: int = 0):
        self.writeback_window_s = max(0.0, writeback_window_s)
        self.counting = True
        self.now = 0.0
        self.workers: dict[tuple[str, str], WorkerPages] = {}
        # (model, worker, kind, tier) -> pages
        self.transitions: collections.Counter = collections.Counter()
        # (model, worker, kind) -> pages
        self.noops: collections.Counter = collections.Counter()
        # (model, outcome) -> batches
        self.batches: collections.Counter = collections.Counter()
        # (model, worker, reason) -> epochs begun
        self.epochs: collections.Counter = collections.Counter()
        # (model, tier) -> Histogram of seconds; tier -> Reservoir when lifetime_samples > 0
        self.lifetimes: dict[tuple[str, str], Histogram] = {}
        self.lifetime_samples = {t: Reservoir(lifetime_samples, seed + i) for i, t in enumerate(TIER_NAMES)} \
            if lifetime_samples else None
        # decisions
        self.decisions: collections.Counter = collections.Counter()  # (model, worker)
        self.hit_tokens: collections.Counter = collections.Counter()  # (model, worker, hit tier)
        self.request_tokens: collections.Counter = collections.Counter()  # model
        self.degraded: collections.Counter = collections.Counter()  # (model, reason)
        self.shared_queried: collections.Counter = collections.Counter()  # model -> decisions
        self.shared_request_pages: collections.Counter = collections.Counter()  # model
        self.shared_beyond_pages: collections.Counter = collections.Counter()  # model
        self.shared_hit_rate: dict[str, Histogram] = {}
        self.undecodable: collections.Counter = collections.Counter()  # stream -> messages
        self._limbo_queue: collections.deque = collections.deque()  # (deadline, worker record, page)
        self._next_lease_check = 0.0
        self.timeline: collections.Counter | None = None  # (step, kind) -> pages; see keep_timeline
        self.timeline_origin, self.timeline_step = 0.0, 1.0

    # --- state ------------------------------------------------------------------------------
    def worker(self, model: str, worker_id: str) -> WorkerPages:
        key = (model, worker_id)
        record = self.workers.get(key)
        if record is None:
            record = self.workers[key] = WorkerPages(model, worker_id)
        return record

    def resident(self) -> dict[tuple[str, str, str], int]:
        """(model, worker, tier) -> pages on that tier now."""
        return {(w.model, w.worker, TIER_NAMES[i]): len(d)
                for w in self.workers.values() for i, d in enumerate(w.tiers)}

    def tracked_page_tiers(self) -> int:
        return sum(w.pages() for w in self.workers.values())

    def limbo_pages(self) -> int:
        return sum(len(w.limbo) for w in self.workers.values())

    # --- counting helpers -------------------------------------------------------------------
    def _count(self, w: WorkerPages, kind: str, tier: int, at: float, n: int = 1) -> None:
        if self.counting and n:
            self.transitions[(w.model, w.worker, kind, TIER_NAMES[tier])] += n
            if self.timeline is not None:
                self.timeline[(int((at - self.timeline_origin) // self.timeline_step), kind)] += n

    def keep_timeline(self, origin: float, step_s: float) -> None:
        """Also count transitions per kind in steps of `step_s` from `origin`, each at the time
        it happened (an eviction at its removal, not when its write-back window closed)."""
        self.timeline = collections.Counter()
        self.timeline_origin, self.timeline_step = origin, step_s

    def _lifetime(self, model: str, tier: int, seconds: float) -> None:
        if not self.counting:
            return
        key = (model, TIER_NAMES[tier])
        hist = self.lifetimes.get(key)
        if hist is None:
            hist = self.lifetimes[key] = Histogram(LIFETIME_BUCKETS)
        hist.observe(seconds)
        if self.lifetime_samples is not None:
            self.lifetime_samples[TIER_NAMES[tier]].add(seconds)

    # --- the clock --------------------------------------------------------------------------
    def advance(self, now: float) -> None:
        """Move the clock to `now` (never back): write-back windows that passed become
        evictions, workers whose lease ran out are expired."""
        if now <= self.now:
            return
        self.now = now
        queue = self._limbo_queue
        while queue and queue[0][0] <= now:
            _, w, page = queue.popleft()
            entry = w.limbo.get(page)
            if entry is not None and entry[1] <= now:
                del w.limbo[page]
                if entry[2]:
                    self._count(w, "eviction", entry[0], entry[3])
        if now >= self._next_lease_check:
            upcoming = []
            for w in self.workers.values():
                if w.lease_until is None or w.expired:
                    continue
                if w.lease_until <= now:
                    w.expired = True
                    self._drop_all(w, "lease_expired", w.lease_until)
                else:
                    upcoming.append(w.lease_until)
            self._next_lease_check = min(upcoming, default=float("inf"))

    def finish(self) -> None:
        """Resolve every pending write-back window now (end of a report): they are evictions."""
        for w in self.workers.values():
            self._flush_limbo(w)
        self._limbo_queue.clear()

    def _flush_limbo(self, w: WorkerPages) -> None:
        for tier, _deadline, counted, removed_at in w.limbo.values():
            if counted:
                self._count(w, "eviction", tier, removed_at)
        w.limbo.clear()

    def _drop_all(self, w: WorkerPages, reason: str, at: float) -> None:
        for i, d in enumerate(w.tiers):
            self._count(w, reason, i, at, len(d))
            d.clear()
        self._flush_limbo(w)

    # --- inputs -----------------------------------------------------------------------------
    def announce(self, message: WorkerAnnounce, at: float) -> None:
        """A lease heartbeat, received at `at` on the caller's clock."""
        self.advance(at)
        meta = message.metadata
        w = self.worker(meta.model, meta.worker_id)
        if w.lease_until is not None and not w.expired and at + message.lease_ttl_s <= w.lease_until:
            return  # an older announce delivered again: it renews nothing (consumers/announce.lua)
        w.page_size = meta.page_size
        w.lease_until = at + message.lease_ttl_s
        w.expired = False
        self._next_lease_check = min(self._next_lease_check, w.lease_until)

    def apply_batch(self, batch: EventBatch, at: float) -> AnalyticsApplyResult:
        """Apply one batch received at `at` (the caller's clock: stream or wall time)."""
        self.advance(at)
        w = self.worker(batch.model, batch.worker_id)
        count = self.counting
        if w.epoch:
            if batch.epoch < w.epoch:
                if count:
                    self.batches[(batch.model, "old_epoch")] += 1
                return AnalyticsApplyResult("old_epoch")
            if batch.epoch == w.epoch:
                if batch.seq <= w.seq:
                    if count:
                        self.batches[(batch.model, "duplicate")] += 1
                    return AnalyticsApplyResult("duplicate")
                if batch.seq > w.seq + 1:
                    self._drop_all(w, "gap", at)  # the processor's rebase: cleared, then this batch applied
            else:
                self._drop_all(w, "new_epoch", at)
                if count:
                    reason = batch.epoch_reason.value if batch.epoch_reason else "unmarked"
                    self.epochs[(w.model, w.worker, reason)] += 1
        elif batch.epoch_reason is not None and count:
            self.epochs[(w.model, w.worker, batch.epoch_reason.value)] += 1
        w.epoch, w.seq = batch.epoch, batch.seq
        if count:
            self.batches[(batch.model, "applied")] += 1
        t = batch.source_ts or batch.ts
        transitions = 0
        for event in batch.events:
            if isinstance(event, PagesStored):
                transitions += self._stored(w, _INDEX[event.tier], event.hashes, t, at)
            elif isinstance(event, PagesRemoved):
                transitions += self._removed(w, _INDEX[event.tier], event.hashes, t, at)
            elif isinstance(event, AllCleared):
                self._drop_all(w, "cleared", at)
        return AnalyticsApplyResult("applied", transitions)

    def _stored(self, w: WorkerPages, ti: int, hashes: Iterable[int], t: float, at: float) -> int:
        tiers, here, limbo = w.tiers, w.tiers[ti], w.limbo
        changed = 0
        for page in hashes:
            if page in here:
                if self.counting:
                    self.noops[(w.model, w.worker, "store_present")] += 1
                continue
            here[page] = t
            changed += 1
            self._count(w, "stored", ti, at)
            pending = limbo.pop(page, None) if limbo else None
            if pending is not None:
                left, _deadline, counted, removed_at = pending
                if left < ti:  # written back below the tier it left: a demotion, not an eviction
                    if counted:
                        self._count(w, "demotion", ti, removed_at)
                    continue
                if counted:  # stored again on its tier or above: it had been evicted
                    self._count(w, "eviction", left, removed_at)
            lower = next((j for j in range(ti + 1, len(tiers)) if page in tiers[j]), None)
            if lower is not None:
                self._count(w, "promotion", ti, at)
            elif any(page in tiers[j] for j in range(ti)):
                self._count(w, "copy", ti, at)
        return changed

    def _removed(self, w: WorkerPages, ti: int, hashes: Iterable[int], t: float, at: float) -> int:
        tiers, here = w.tiers, w.tiers[ti]
        window = self.writeback_window_s
        changed = 0
        for page in hashes:
            stored_at = here.pop(page, None)
            if stored_at is None:
                if self.counting:
                    self.noops[(w.model, w.worker, "remove_absent")] += 1
                continue
            changed += 1
            self._count(w, "removed", ti, at)
            self._lifetime(w.model, ti, max(0.0, t - stored_at))
            lower = next((j for j in range(ti + 1, len(tiers)) if page in tiers[j]), None)
            if lower is not None:
                self._count(w, "demotion", lower, at)
            elif any(page in tiers[j] for j in range(ti)):
                pass  # a lower copy of a page still held above went: nothing moved
            elif window > 0 and ti < len(tiers) - 1:
                deadline = at + window
                w.limbo[page] = (ti, deadline, self.counting, at)
                self._limbo_queue.append((deadline, w, page))
            else:
                self._count(w, "eviction", ti, at)
        return changed

    def decision(self, decision: RouteDecision) -> None:
        """Count one routing decision (the chosen candidate's predicted hits)."""
        if not self.counting:
            return
        model = decision.model
        self.decisions[(model, decision.chosen)] += 1
        for reason in decision.degraded:
            self.degraded[(model, reason)] += 1
        chosen = next((c for c in decision.candidates if c.worker_id == decision.chosen), None)
        page_size = chosen.page_size if chosen is not None else 0
        self.request_tokens[model] += decision.request_pages * page_size
        if chosen is None:
            return
        o = chosen.overlap
        for tier, pages in (("device", o.device), ("host", o.host), ("disk", o.disk),
                            ("shared_beyond", o.shared_beyond)):
            if pages:
                self.hit_tokens[(model, decision.chosen, tier)] += pages * page_size
        if decision.shared_pool_queried:
            self.shared_queried[model] += 1
            self.shared_request_pages[model] += decision.request_pages
            self.shared_beyond_pages[model] += o.shared_beyond
            if decision.request_pages:
                hist = self.shared_hit_rate.get(model)
                if hist is None:
                    hist = self.shared_hit_rate[model] = Histogram(HIT_RATE_BUCKETS)
                hist.observe(min(1.0, o.shared_beyond / decision.request_pages))

    # --- summaries (for reports and tests) ---------------------------------------------------
    def transition_totals(self, by: str = "kind") -> dict:
        """Sum of transitions by 'kind', by (kind, tier) ('kind_tier'), or by worker ('worker_kind')."""
        out: collections.Counter = collections.Counter()
        for (model, worker, kind, tier), n in self.transitions.items():
            if by == "kind":
                out[kind] += n
            elif by == "kind_tier":
                out[(kind, tier)] += n
            else:
                out[(model, worker, kind)] += n
        return dict(out)

    def shared_pool_hit_rate(self, model: str | None = None) -> float | None:
        """Shared-pool pages beyond the chosen worker's device prefix over request pages, for
        decisions that queried the pool (None: no such decision)."""
        models = [model] if model else list(self.shared_request_pages)
        pages = sum(self.shared_request_pages[m] for m in models)
        return sum(self.shared_beyond_pages[m] for m in models) / pages if pages else None


def bytes_per_page_tier(pages: int = 200_000) -> float:
    """Measured memory per tracked (page, tier) entry, for the docs and --help."""
    import tracemalloc

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    d = {}
    for i in range(pages):
        d[(i * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF] = 1.7e9 + i * 0.001
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / pages
