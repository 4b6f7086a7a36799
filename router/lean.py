"""The lean decision's own pieces: checking this replica's copies of a model's state, reading
the overlaps from its index, and booking the choice with book_checked.lua, which books only
while the copies are what Redis holds. router/core.py `_route_lean` drives them.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from kvtier.schemas.routing import RouteRequest, ScoringWeights, TierOverlap
from kvtier.schemas.state_keys import ModelKeys

from . import rates, steps
from .booking import AlreadyBooked, Checked, LoadBook
from .errors import Busy, DuplicateRequest
from .hashing import RequestPages
from .index_feed import CATCH_UP_WAIT_S, ModelIndex
from .roster import ModelRoster, Roster
from .settings import RouterSettings

#: Tries of the lean decision (each a booking its copy of the state turned out stale for)
#: before the decision takes the full read instead.
LEAN_ATTEMPTS = 4
#: Sessions whose worker a replica remembers (the oldest forgotten first; Redis keeps them all).
SESSIONS_REMEMBERED = 65_536


class SessionMemory:
    """(model, session id) -> the worker this replica last booked the session on, so a
    conversation's next request proposes its worker at once (book_checked.lua says when
    another replica moved it)."""

    def __init__(self, limit: int = SESSIONS_REMEMBERED) -> None:
        self.limit = limit
        self._workers: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    def get(self, session: tuple[str, str]) -> str | None:
        return self._workers.get(session)

    def remember(self, session: tuple[str, str], worker: str) -> None:
        self._workers[session] = worker
        self._workers.move_to_end(session)
        if len(self._workers) > self.limit:
            self._workers.popitem(last=False)


@dataclass(frozen=True)
class LeanInputs:
    """What one try of the lean decision chooses on."""

    ids: list[str]  # the candidates, reachable ones only
    overlaps: dict[str, TierOverlap]
    live: dict[str, tuple[int, int]]  # the roster's live workers: worker -> (page size, ...)
    change: int  # the index's change counter when it gave the overlaps
    degraded: list[str]
    shared: steps.SharedAnswer | None
    primary_size: int
    n_pages: int
    decode_pages: int
    credits: list[float]  # the formula's
    #: `overlaps` with the shared pool's pages, credited or not: the work the rates learn from.
    priced: dict[str, TierOverlap]


@dataclass(frozen=True)
class LeanBooked:
    """A booked lean decision: the chosen candidate's index, and what the choice saw."""

    chosen: int
    logits: list[float]
    affinity: str
    prefill: list[int]  # the copy's loads, in candidate order
    decode: list[int]
    pool: list[int]  # the indexes of the candidates under the busy thresholds
    predicted_ttft_ms: float | None = None  # with predicted-ttft: the chosen one's, at its trusted fit


async def usable_roster(index: ModelIndex, held: ModelRoster) -> Roster | str:
    """The roster copy to decide on, or why the decision needs the full read instead
    (core.FULL_READ_REASONS)."""
    if not index.ready:
        return "index_not_ready"
    now_ms = int(time.time() * 1000)
    roster = held.current(now_ms) or await held.read(now_ms)
    if not roster.ready or roster.rebuilding or roster.marker_id != index.marker_id:
        return "rebuilding"
    if index.change < roster.change and not await index.reached(roster.change, CATCH_UP_WAIT_S):
        return "index_behind"
    if not roster.candidates or 0 in roster.by_size:
        return "no_fresh_worker"
    return roster


def read_overlaps(index: ModelIndex, roster: Roster, token_ids, pages_by_size: dict[int, RequestPages]
                  ) -> tuple[dict[str, TierOverlap], int]:
    """Every live worker's overlap as the index has it, and the index's change counter then.
    `pages_by_size` keeps the request's pages at each size hashed once across tries."""
    overlaps: dict[str, TierOverlap] = {}
    change = index.change
    for size, workers in roster.by_size.items():
        if size not in pages_by_size:
            pages_by_size[size] = RequestPages.of(token_ids, size)
        overlaps.update(index.index.overlaps(pages_by_size[size].hashes, workers))
    return overlaps, change


class CopyBooking:
    """Chooses on the roster copy's loads and books with book_checked.lua."""

    def __init__(self, book: LoadBook, settings: RouterSettings) -> None:
        self.book = book
        self.settings = settings
        self.sessions = SessionMemory()

    async def choose_and_book(self, request: RouteRequest, request_id: str, keys: ModelKeys, held: ModelRoster,
                              lean: LeanInputs, weights: ScoringWeights, u: float,
                              change: int | None, owner: str = "") -> LeanBooked | int | None:
        """Choose on the copy's loads and book (under the model's lock: this replica's load
        writes one at a time). None when the roster moved; the change counter when the feed is
        past `change`, the index's when it gave the overlaps (the index must apply it first)."""
        session = (request.model, request.session_id) if request.session_id else None
        # This replica's memory of the session's worker is a guess to propose; Redis's is the
        # session, which the booking checks (and answers with when it names another worker).
        kept = self.sessions.get(session) if session else None
        leave = False  # the session's worker (as Redis has it) is not a candidate: move the session
        checked_busy = False
        ids = lean.ids
        for _ in range(LEAN_ATTEMPTS):
            roster = held.roster
            if roster is None:
                return None
            prefill = [roster.prefill.get(w, 0) for w in ids]
            decode = [roster.decode.get(w, 0) for w in ids]
            try:
                pool = steps.under_thresholds(request.model, self.settings.admission,
                                              [roster.live[w][0] for w in ids], prefill, decode)
            except Busy:
                # Every worker busy by the copy: a refusal rests on the loads Redis holds, read again once.
                if checked_busy:
                    raise
                checked_busy = True
                if (await held.read(int(time.time() * 1000))).candidates != roster.candidates:
                    return None  # who is live changed too: decide again from the top
                continue
            chosen, formula, values, work = self._choose(roster, lean, pool, prefill, decode, weights, u,
                                                         None if leave else kept, len(request.token_ids))
            worker = ids[chosen]
            prefill_pages = steps.prefill_pages_needed(lean.n_pages, lean.overlaps[worker])
            answer = await self.book.book_checked(
                keys, request_id, worker, prefill_pages, lean.decode_pages, load_version=roster.load_version,
                change=change, lease_count=roster.lease_count, stale_count=len(roster.stale),
                marker_id=roster.marker_id, book=request.book, session_id=request.session_id,
                session_ttl_ms=max(1, int(self.settings.session_ttl_s * 1000)), leave_session=leave,
                work=work, with_rates=self.settings.faster_pick, owner=owner)
            if answer.outcome is Checked.BOOKED:
                if request.book:
                    self._follow_booking(roster, session, worker, prefill_pages, lean.decode_pages, answer.load_version)
                kept_by_redis = session is not None and answer.worker_id == worker
                affinity = ("kept" if chosen == formula else "overrode") if kept_by_redis else ""
                return LeanBooked(chosen, values, affinity, prefill, decode, pool, self._predict(roster, worker, work))
            if answer.outcome is Checked.ALREADY_BOOKED:
                raise DuplicateRequest(str(AlreadyBooked(request_id, answer.worker_id)))
            if answer.outcome is Checked.LOADS_MOVED:
                roster.set_loads(answer.load_version, answer.prefill, answer.decode, answer.rates)
            elif answer.outcome is Checked.SESSION_ELSEWHERE:
                kept = answer.worker_id
                if session:
                    self.sessions.remember(session, kept)
                leave = not steps.in_pool(kept, ids, pool)
            elif answer.outcome is Checked.FEED_AHEAD:
                return answer.change
            else:
                return None
        return None

    def _choose(self, roster: Roster, lean: LeanInputs, pool: list[int], prefill: list[int], decode: list[int],
                weights: ScoringWeights, u: float, kept: str | None, n_tokens: int
                ) -> tuple[int, int, list[float], rates.Work | None]:
        """steps.choose_on_copy; with --router-mode predicted-ttft, a worker clearly faster at
        the copy's rates instead of the formula's (rates.faster_than_formula; a kept session's
        worker stays), reported as the policy's own choice; and, with --learn-rates, the work the
        proposed worker's first token would wait for, for its rates to learn from."""
        chosen, formula, values = steps.choose_on_copy(lean.ids, pool, lean.n_pages, lean.credits, prefill, decode,
                                                       weights, u, kept)
        if self.settings.faster_pick and chosen == formula:
            ids = lean.ids
            columns = rates.ttft_columns(n_tokens, [lean.overlaps[w] for w in ids], [roster.live[w][0] for w in ids],
                                         [roster.rates.get(w) for w in ids], rates.RATE_PRIOR)
            chosen = formula = rates.faster_than_formula(formula, pool, columns, prefill, decode)
        if not self.settings.learn_rates:
            return chosen, formula, values, None
        worker = lean.ids[chosen]
        return chosen, formula, values, rates.predicted_work(n_tokens, lean.priced[worker], prefill[chosen],
                                                             roster.live[worker][0])

    def _predict(self, roster: Roster, worker: str, work: rates.Work | None) -> float | None:
        """With --router-mode predicted-ttft, what the chosen worker's trusted fit predicts for
        the work its first token waits for (ms)."""
        fit = roster.rates.get(worker)
        if not self.settings.faster_pick or work is None or fit is None or not rates.FASTER_PICK.trusted(fit):
            return None
        return rates.predict_s(fit, rates.RATE_PRIOR, work) * 1000

    def _follow_booking(self, roster: Roster, session: tuple[str, str] | None, worker: str, prefill_pages: int,
                        decode_pages: int, load_version: int) -> None:
        """This replica's copies take in its own booking, so they stay what Redis holds."""
        roster.add(worker, prefill_pages, decode_pages, load_version)
        if session:
            self.sessions.remember(session, worker)
