"""Does a worker publish the page hashes kvtier computes from the same tokens?

A router hashes each request's tokens with SGLang's page chain (`schemas/hashes.py`) and looks
the results up in the workers' tier state. If an engine hashes differently (another SGLang
generation or engine, namespaced hashes, another page size) nothing ever matches and routing
to that worker silently becomes load balancing. So the processor recomputes the hash of every
stored page whose tokens it has and records the outcome per worker (`HashCheck`).

The chain needs the parent page's full digest, while an event names its parent only by the
64-bit hash. Digests of pages that checked out are kept (bounded, oldest dropped first), so a
child is verifiable when its parent was seen; otherwise it counts as unverifiable, never as
a mismatch. Pure and I/O-free: the processor decides when to persist what `drain_changed` gives.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import msgspec

from kvtier.schemas.events import EpochReason, EventBatch, PagesStored, token_ids_of
from kvtier.schemas.hashes import BlockHash, PageDigest, block_hash_of_digest, page_key, sglang_page_digests
from kvtier.schemas.health import HashCheck, HashMismatchKind

#: Digests remembered for verifying children (~200 bytes each, measured: ~20 MB at the cap).
DEFAULT_DIGEST_CAPACITY = 100_000
#: Pages recomputed per second per processor, at most: about 1.6 µs each here, so the check
#: costs a processor at most ~8% of a core however fast events arrive (BENCHMARKS.md).
DEFAULT_BUDGET_PAGES_PER_S = 50_000.0

#: Epochs that begin with a new engine process, whose hashing may differ from the last one's;
#: a resync of the same engine keeps the record.
_NEW_ENGINE = frozenset({EpochReason.PUBLISHER_RESTART, EpochReason.BRIDGE_START})


@dataclass(frozen=True)
class Mismatch:
    """The first mismatch of a worker of a given kind: what to tell the operator, once."""

    model: str
    worker_id: str
    kind: HashMismatchKind
    pages: int
    explanation: str


@dataclass
class HashOutcome:
    """What one batch's check found (counts of pages), and mismatches to report now."""

    matched: int = 0
    mismatched: dict[HashMismatchKind, int] = field(default_factory=dict)
    unverifiable: int = 0
    #: Pages not recomputed: over the budget, or already verified (a host copy, a load_back).
    skipped: int = 0
    known: int = 0
    to_report: list[Mismatch] = field(default_factory=list)


class HashValidator:
    def __init__(self, digest_capacity: int = DEFAULT_DIGEST_CAPACITY,
                 budget_pages_per_s: float | None = DEFAULT_BUDGET_PAGES_PER_S):
        self._capacity = digest_capacity
        self._budget = budget_pages_per_s
        self._allowance = budget_pages_per_s or 0.0
        self._refilled_at: float | None = None
        self._digests: dict[BlockHash, PageDigest] = {}
        self._checks: dict[tuple[str, str], HashCheck] = {}
        self._changed: set[tuple[str, str]] = set()
        self._explained: set[tuple[str, str, HashMismatchKind]] = set()

    def check_batch(self, batch: EventBatch, announced_page_size: int | None,
                    now: float | None = None) -> HashOutcome:
        """Check the stored pages of an applied batch, within the budget (`now`: a monotonic
        clock in seconds; None checks everything). `to_report` holds the mismatches not
        reported before (one per worker and kind)."""
        if batch.epoch_reason in _NEW_ENGINE:
            self.forget_worker(batch.model, batch.worker_id)
        self._refill(now)
        outcome = HashOutcome()
        for event in batch.events:
            if not isinstance(event, PagesStored):
                continue
            pages = len(event.hashes)
            if all(h in self._digests for h in event.hashes):
                outcome.known += pages
            elif now is not None and self._budget is not None and self._allowance < pages:
                outcome.skipped += pages
                self._check_of(batch.model, batch.worker_id).skipped += pages
            else:
                self._allowance -= pages
                self._check_stored(batch.model, batch.worker_id, event, announced_page_size, outcome)
        return outcome

    def _refill(self, now: float | None) -> None:
        if now is None or self._budget is None:
            return
        if self._refilled_at is not None:
            self._allowance = min(self._budget, self._allowance + (now - self._refilled_at) * self._budget)
        self._refilled_at = now

    def _check_stored(self, model: str, worker: str, event: PagesStored, announced_page_size: int | None,
                      outcome: HashOutcome) -> None:
        check = self._check_of(model, worker)
        pages = len(event.hashes)
        try:
            tokens = token_ids_of(event)
        except (msgspec.DecodeError, msgspec.ValidationError):
            tokens = []  # not a list of uint32 token ids (input from outside the bridge): nothing to recompute
        if not tokens:
            return self._unverifiable(check, model, pages, outcome)
        if len(tokens) != pages * event.page_size:
            return self._mismatch(check, model, outcome, HashMismatchKind.PAGE_SIZE, pages,
                                  f"a stored event carries {len(tokens)} tokens for {pages} pages of "
                                  f"{event.page_size}: the engine's pages are not the size it reports")
        if announced_page_size is not None and event.page_size != announced_page_size:
            return self._mismatch(check, model, outcome, HashMismatchKind.PAGE_SIZE, pages,
                                  f"the engine stores pages of {event.page_size} tokens but the worker announced "
                                  f"page size {announced_page_size}, so routers hash requests at "
                                  f"{announced_page_size} tokens per page and never match its pages; start its "
                                  f"bridge with --page-size {event.page_size} (or --sglang-url to read it)")
        parent: PageDigest | None = None
        if event.parent is not None:
            parent = self._digests.get(event.parent)
            if parent is None:
                return self._unverifiable(check, model, pages, outcome)
        digests = sglang_page_digests(tokens, event.page_size, parent)
        for index, (published, digest) in enumerate(zip(event.hashes, digests)):
            expected = block_hash_of_digest(digest)
            if published != expected:
                check.matched += index
                check.checked += index
                outcome.matched += index
                return self._mismatch(check, model, outcome, *self._explain_scheme(event, index, published, expected,
                                                                          pages - index))
            self._remember(published, digest)
        check.checked += pages
        check.matched += pages
        outcome.matched += pages
        self._changed.add((model, worker))

    @staticmethod
    def _explain_scheme(event: PagesStored, index: int, published: int, expected: int,
                        pages: int) -> tuple[HashMismatchKind, int, str]:
        where = (f"page {index} of a stored run: the engine published {page_key(BlockHash(published))}, "
                 f"SGLang's sha256 page chain over its tokens gives {page_key(BlockHash(expected))}")
        if event.namespace:
            return (HashMismatchKind.NAMESPACE, pages,
                    f"{where}; the engine namespaced these hashes ({event.namespace}), so they are opaque ids a "
                    f"router cannot compute from request tokens: requests using that adapter or salt are "
                    f"placed on load alone")
        return (HashMismatchKind.SCHEME, pages,
                f"{where}; the engine uses another hash scheme (SGLang older than 0.5.6, another engine, or a "
                f"patched build), so routers never match its pages and place its requests on load alone; run an "
                f"SGLang whose page hashes are the sha256 chain (0.5.6 or later)")

    def _mismatch(self, check: HashCheck, model: str, outcome: HashOutcome, kind: HashMismatchKind, pages: int,
                  explanation: str) -> None:
        outcome.mismatched[kind] = outcome.mismatched.get(kind, 0) + pages
        check.checked += pages
        check.mismatched += pages
        check.mismatch_kinds[kind.value] = check.mismatch_kinds.get(kind.value, 0) + pages
        if not check.explanation:
            check.explanation = explanation
        self._changed.add((model, check.worker_id))
        key = (model, check.worker_id, kind)
        if key not in self._explained:
            self._explained.add(key)
            outcome.to_report.append(Mismatch(model, check.worker_id, kind, pages, explanation))

    def _unverifiable(self, check: HashCheck, model: str, pages: int, outcome: HashOutcome) -> None:
        check.unverifiable += pages
        outcome.unverifiable += pages
        self._changed.add((model, check.worker_id))

    def seed(self, model: str, check: HashCheck) -> None:
        """Continue from counts recorded earlier (by this worker's previous processor)."""
        self._checks[(model, check.worker_id)] = check

    def knows(self, model: str, worker: str) -> bool:
        return (model, worker) in self._checks

    def forget_worker(self, model: str, worker: str) -> None:
        """Start the worker's record afresh: a new engine process may hash differently."""
        self._checks[(model, worker)] = HashCheck(worker_id=worker)
        self._changed.add((model, worker))
        self._explained = {key for key in self._explained if key[:2] != (model, worker)}

    def drop_worker(self, model: str, worker: str) -> None:
        """The worker is gone for good: keep nothing of it."""
        self._checks.pop((model, worker), None)
        self._changed.discard((model, worker))
        self._explained = {key for key in self._explained if key[:2] != (model, worker)}

    def _check_of(self, model: str, worker: str) -> HashCheck:
        check = self._checks.get((model, worker))
        if check is None:
            check = self._checks[(model, worker)] = HashCheck(worker_id=worker)
        return check

    def _remember(self, block_hash: BlockHash, digest: PageDigest) -> None:
        digests = self._digests
        if block_hash in digests:
            return
        if len(digests) >= self._capacity:
            # Drop the oldest tenth in one go (dicts keep insertion order): cheap, and an
            # evicted parent only makes its later children unverifiable, never wrong.
            for old in list(itertools.islice(digests, max(1, self._capacity // 10))):
                del digests[old]
        digests[block_hash] = digest

    def drain_changed(self) -> list[tuple[str, HashCheck]]:
        """(model, check) for every worker whose counts changed since the last call."""
        now_ms = int(time.time() * 1000)
        out = []
        for key in self._changed:
            check = self._checks[key]
            check.updated_ms = now_ms
            out.append((key[0], check))
        self._changed.clear()
        return out

    def mark_changed(self, checks: list[tuple[str, HashCheck]]) -> None:
        self._changed.update((model, check.worker_id) for model, check in checks)

    def check_of(self, model: str, worker: str) -> HashCheck | None:
        return self._checks.get((model, worker))
