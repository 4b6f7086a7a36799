"""One routing decision, from a parsed request to a booked worker, with no HTTP in sight.

Order of work for a request: hash its tokens at every page size the model's workers use;
read every live worker's tiered overlap and load from Redis (one round trip) while the
shared pool is asked which pages it holds; compute each candidate's cache credit
(router/scoring.py); select and book atomically in Redis; re-score with the loads the
selection saw, for the answer and the decision log.

Degradation, never a stop: without the shared pool the decision scores without it; without
Redis it routes among the last known workers by this replica's own in-flight count, round
robin on ties, and says so (`degraded`). While a model's state is being rebuilt after the
store lost it (incarnation marker missing or rebuilding), no overlap is trusted: the live
workers (or, with no lease left, the last known ones) are chosen on load alone
(`state-store-rebuilding`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis.exceptions

from kvtier.schemas.health import HashCheck
from kvtier.schemas.routing import (
    AdmissionSettings,
    CandidateScore,
    ReleaseResponse,
    ReleaseStage,
    RouteDecision,
    RouteRequest,
    RouteResponse,
    ScoringWeights,
    TierOverlap,
)
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import name_of_token, subject_token
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

from . import scoring
from .booking import AlreadyBooked, Checked, LoadBook
from .breaker import CircuitBreaker
from .hashing import RequestPages
from .metrics import RouterMetrics
from .mirror import CATCH_UP_WAIT_S, MirroredOverlapReader, TierMirror
from .roster import Rosters
from .shared_pool import SharedPages, SharedPoolClient, SharedPoolUnavailable
from .state import (
    ModelDirectory,
    OverlapReader,
    TierStateReader,
    Views,
    WorkerDirectory,
    WorkerStatus,
    WorkerView,
    read_hash_mismatches,
    read_partial_workers,
)
from .tier_index import NO_OVERLAP

log = logging.getLogger("kvtier.router")

DEGRADED_STATE_STORE = "state-store-unavailable"
DEGRADED_SHARED_POOL = "shared-pool-unavailable"
DEGRADED_ONLY_STALE = "only-stale-workers"
DEGRADED_REBUILDING = "state-store-rebuilding"
#: Router modes that pick by a baseline rule instead of the score (RouterSettings.selection).
SELECTIONS = ("round-robin", "random")
#: How often housekeeping recomputes each model's booked load from its live bookings (seconds).
RECONCILE_INTERVAL_S = 10.0
#: How often housekeeping re-reads the processors' hash checks (seconds).
HASH_CHECK_REFRESH_S = 5.0
#: Tries of the lean decision (each a booking its copy of the state turned out stale for)
#: before the decision takes the full read instead.
LEAN_ATTEMPTS = 4
#: Why a decision read the full state instead of the replica's copies (router_full_reads).
FULL_READ_REASONS = ("index_not_ready", "index_behind", "rebuilding", "no_fresh_worker", "state_kept_moving")
#: Sessions whose worker a replica remembers (the oldest forgotten first; Redis keeps them all).
SESSIONS_REMEMBERED = 65_536


class RoutingError(Exception):
    status = 400


class UnknownModel(RoutingError):
    status = 404


class NoWorkers(RoutingError):
    status = 503


class DuplicateRequest(RoutingError):
    status = 409


class Busy(RoutingError):
    """Every candidate is at or over a busy threshold: the request should wait (the service's
    queue) or be refused with Retry-After."""

    status = 503


@dataclass
class RouterSettings:
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    shared_cache: bool = False  # --shared-cache-type hicache
    router_page_size: int | None = None  # --page-size: workers that differ get no shared credit
    booking_ttl_s: float = 600.0
    router_id: str = ""
    state_retry_s: float = 0.5  # after a Redis failure, how long to route without it before retrying
    #: How the worker is picked among the scored candidates: "score" (the formula), or a
    #: baseline for A/B tests, "round-robin" (one turn counter shared by every replica) or
    #: "random". Baselines still score (the answer shows what the formula would say) and book.
    selection: str = "score"
    #: Book each request's pages as predicted device pages on its worker until it completes
    #: (--predicted-pages), credited at `predicted_page_weight`.
    predicted_pages: bool = False
    #: Where decisions read tier overlaps (--state-source): "mirror", an in-memory index per
    #: model following the change feed (router/mirror.py), or "redis", the Lua walk in Redis
    #: for every decision. Predicted pages live in Redis only: with them on, the walk is used.
    state_source: str = "mirror"
    #: A worker failed this many times in a row before its first byte is left out for
    #: `breaker_backoff_s` (doubling while it keeps failing): router/breaker.py
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0
    #: Busy thresholds (a worker whose booked prefill tokens or decode pages are at or over
    #: them takes no new request; when every candidate is, the decision raises Busy) and the
    #: service's queue. Replaced at run time through the service's /v1/admission.
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    #: How long a session id keeps its worker (seconds since its last request).
    session_ttl_s: float = 600.0
    #: How long the index's XREAD waits for new feed entries (ms); below the client's socket
    #: timeout, so a quiet feed is not a failed read.
    index_block_ms: int = 100

    @property
    def reads_index(self) -> bool:
        return self.state_source == "mirror" and not self.predicted_pages


@dataclass(frozen=True)
class Outcome:
    response: RouteResponse
    decision: RouteDecision | None  # built only when a decision log is configured
    #: The request's full pages at the chosen worker's page size, as this router hashed them
    #: (None when it routed without tier state).
    pages: RequestPages | None = None


class _Fallback:
    """Routing without Redis: least in-flight on this replica, round robin among ties. The
    in-flight map is bounded: an entry leaves on its `complete` release, when it is older
    than `ttl_s` (a request whose release never came), or when `max_entries` newer ones
    came after it, so a long outage neither grows it nor skews the counts for good."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 100_000, clock=time.monotonic) -> None:
        self.in_flight: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._turn = itertools.count()

    def _prune(self) -> None:
        oldest = self._clock() - self.ttl_s
        while self.in_flight and (len(self.in_flight) > self.max_entries
                                  or next(iter(self.in_flight.values()))[1] < oldest):
            self.in_flight.popitem(last=False)

    def choose(self, workers: list[str]) -> str:
        self._prune()
        counts = {w: 0 for w in workers}
        for worker, _ in self.in_flight.values():
            if worker in counts:
                counts[worker] += 1
        low = min(counts.values())
        ties = [w for w in workers if counts[w] == low]
        return ties[next(self._turn) % len(ties)]

    def book(self, request_id: str, worker: str) -> None:
        self.in_flight[request_id] = (worker, self._clock())
        self.in_flight.move_to_end(request_id)
        self._prune()

    def release(self, request_id: str) -> bool:
        return self.in_flight.pop(request_id, None) is not None


class Router:
    def __init__(self, redis_client, settings: RouterSettings, metrics: RouterMetrics,
                 shared_pool: SharedPoolClient | None = None, decision_log=None, rng: random.Random | None = None):
        self.settings = settings
        self.metrics = metrics
        self.redis = redis_client
        self.directory = WorkerDirectory(redis_client)
        self.mirror: TierMirror | None = None
        walk = OverlapReader(redis_client)
        self.reader: TierStateReader = walk
        if settings.reads_index:
            self.mirror = TierMirror(redis_client, metrics, block_ms=settings.index_block_ms)
            self.reader = MirroredOverlapReader(redis_client, self.mirror, walk)
        self.book = LoadBook(redis_client, settings.booking_ttl_s)
        #: The lean decision's copies of each model's roster and loads (router/roster.py): with
        #: an index and the formula's selection; None otherwise (every decision reads Redis).
        self.rosters = Rosters(redis_client) if self.mirror is not None and settings.selection == "score" else None
        #: session id -> the worker this replica last booked it on, so a conversation's next
        #: request proposes its worker at once (book_checked.lua says when another replica moved it)
        self._sessions: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_backoff_s)
        self.shared_pool = shared_pool
        self.decision_log = decision_log
        self.rng = rng or random.Random()
        self.router_id = settings.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self._fallback = _Fallback(ttl_s=settings.booking_ttl_s)
        self._reconciled_at = -1e9  # when housekeeping last recomputed loads from bookings
        self._state_down_until = 0.0
        self._warned_page_size: set[tuple[str, str]] = set()
        self.last_state_error = ""
        self.last_shared_pool_error = ""
        self.models_seen: set[str] = set()
        self.hash_mismatches: list[tuple[str, HashCheck]] = []
        self.partial_workers: dict[str, list[str]] = {}
        self._hash_checks_read_at = -1e9
        self.decisions_made = 0

    # --- state-store health ------------------------------------------------------------
    def _state_available(self) -> bool:
        return time.monotonic() >= self._state_down_until

    def _state_failed(self, exc: Exception) -> None:
        if self._state_available():
            log.warning("state store unavailable (%s: %s); routing by load/round robin until it answers",
                        type(exc).__name__, exc)
        self.last_state_error = f"{type(exc).__name__}: {exc}"
        self._state_down_until = time.monotonic() + self.settings.state_retry_s
        self.metrics.state_store_up.set(0)

    def _state_ok(self) -> None:
        if self.last_state_error:
            log.warning("state store is answering again; tier-aware routing resumed")
            self.last_state_error = ""
        self.metrics.state_store_up.set(1)

    # --- the decision -------------------------------------------------------------------
    async def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Outcome:
        """`exclude`: workers this request already failed on (the proxy's migration); they are
        not candidates, nor are workers whose circuit is open (router/breaker.py) unless no
        other is left."""
        started = time.perf_counter()
        self.decisions_made += 1
        weights = request.overrides.applied_to(self.settings.weights) if request.overrides else self.settings.weights
        request_id = request.request_id or uuid.uuid4().hex
        u = self.rng.random()
        if not self._state_available():
            return self._route_without_state(request, request_id, weights, u, started, exclude=exclude)
        try:
            if self.rosters is not None:
                outcome = await self._route_lean(request, request_id, weights, u, started, exclude)
                if isinstance(outcome, Outcome):
                    return outcome
                self.metrics.full_reads_by_reason(outcome).inc()
            return await self._route_with_state(request, request_id, weights, u, started, exclude)
        except RoutingError:
            raise
        except redis.exceptions.ResponseError:
            raise  # Redis answered: a bug to see, not an outage to route around
        except (OSError, asyncio.TimeoutError, redis.exceptions.RedisError) as exc:
            self._state_failed(exc)
            return self._route_without_state(request, request_id, weights, u, started, exclude=exclude)

    async def _directory(self, model: str, refresh: bool = False) -> ModelDirectory:
        directory = await self.directory.get(model, refresh=refresh)
        if not directory.workers and model not in self.models_seen:
            known = await self.directory.known_models()
            if subject_token(model) not in known:
                raise UnknownModel(f"unknown model {model!r}: no worker has announced it "
                                   f"(known models: {', '.join(sorted(known)) or 'none'})")
        self.models_seen.add(model)
        return directory

    def _reachable(self, model: str, workers: list, exclude: frozenset[str], worker_of=lambda w: w) -> list:
        """`workers` less those excluded and those whose circuit is open; the open ones are
        kept when nothing else is left (better a worker that failed lately than none)."""
        left_out = self.breaker.left_out(model)
        if not exclude and not left_out:
            return workers
        untried = [w for w in workers if worker_of(w) not in exclude]
        if not untried:
            raise NoWorkers(f"no other worker of model {model!r} to try (tried: {', '.join(sorted(exclude))})")
        closed = [w for w in untried if worker_of(w) not in left_out]
        return closed or untried

    def _admitted(self, model: str, views: list[WorkerView]) -> list[WorkerView]:
        """The views of workers under both busy thresholds; Busy when none is."""
        under = self._under_thresholds(model, [v.page_size for v in views], [v.prefill_load for v in views],
                                       [v.decode_load for v in views])
        return views if len(under) == len(views) else [views[i] for i in under]

    def _under_thresholds(self, model: str, page_sizes: list[int], prefill: list[int], decode: list[int]) -> list[int]:
        """The indexes of the workers (given by columns) under both busy thresholds; Busy when none is."""
        admission = self.settings.admission
        busy_prefill, busy_decode = admission.busy_prefill_tokens, admission.busy_decode_pages
        if not busy_prefill and not busy_decode:
            return list(range(len(prefill)))
        under = [i for i in range(len(prefill))
                 if not (busy_prefill and prefill[i] * max(page_sizes[i], 1) >= busy_prefill)
                 and not (busy_decode and decode[i] >= busy_decode)]
        if not under:
            raise Busy(f"every worker of model {model!r} is at its busy threshold (booked prefill >= "
                       f"{busy_prefill} tokens or decode >= {busy_decode} pages)")
        return under

    async def _session_worker(self, model: str, session_id: str) -> str | None:
        raw = await self.redis.get(ModelKeys.for_model(model).session(session_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    # --- the lean decision --------------------------------------------------------------
    async def _route_lean(self, request: RouteRequest, request_id: str, weights: ScoringWeights, u: float,
                          started: float, exclude: frozenset[str]) -> Outcome | str:
        """The decision on this replica's copies: overlaps from the index, roster and loads from
        router/roster.py, chosen by router/scoring.py and booked with book_checked.lua, which
        books only while the copies are what Redis holds (one round trip when they are). When
        the decision needs the full read instead, why (FULL_READ_REASONS): the index is not
        ready or behind, the store's state is being rebuilt, no worker is live and fresh (the
        full read says what to do), or the copies kept moving."""
        assert self.rosters is not None and self.mirror is not None
        model = request.model
        directory = await self._directory(model)
        keys = ModelKeys.for_model(model)
        index = self.mirror.model(keys.model_token)
        held = self.rosters.model(model)
        # Set once a try found the feed past the index and the decision waited for it: changes
        # after that came after the decision began, as a read's would have.
        feed_checked = True
        pages_by_size: dict[int, RequestPages] = {}
        for _ in range(LEAN_ATTEMPTS):
            if not index.ready:
                return "index_not_ready"
            now_ms = int(time.time() * 1000)
            roster = held.current(now_ms) or await held.read(now_ms)
            if not roster.ready or roster.rebuilding or roster.marker_id != index.marker_id:
                return "rebuilding"
            if index.change < roster.change and not await index.reached(roster.change, CATCH_UP_WAIT_S):
                return "index_behind"
            ids = roster.candidates
            if not ids or 0 in roster.by_size:
                return "no_fresh_worker"
            if any(w not in directory.workers for w in ids):
                directory = await self._directory(model, refresh=True)  # a worker joined since the last read
            live = roster.live
            overlaps: dict[str, TierOverlap] = {}
            change = index.change
            for size, workers in roster.by_size.items():
                if size not in pages_by_size:
                    pages_by_size[size] = RequestPages.of(request.token_ids, size)
                overlaps.update(index.index.overlaps(pages_by_size[size].hashes, workers))
            degraded: list[str] = []
            shared = None
            if self.settings.shared_cache and self.shared_pool is not None:
                try:
                    shared = await self._query_shared_pool(directory, pages_by_size)
                except SharedPoolUnavailable:
                    degraded.append(DEGRADED_SHARED_POOL)
                if shared:
                    overlaps = {w: self._with_shared(w, live[w][0], o, directory, shared) for w, o in overlaps.items()}
            ids = self._reachable(model, ids, exclude)
            primary_size = (next(iter(roster.by_size)) if len(roster.by_size) == 1
                            else _most_common_page_size(live[w][0] for w in ids))
            n_pages = len(pages_by_size[primary_size]) if primary_size in pages_by_size else 0
            decode_pages = -(-(len(request.token_ids) + request.max_new_tokens) // primary_size)
            credits = [0.0 if overlaps[w] is NO_OVERLAP else scoring.cache_credit(overlaps[w], weights)
                       for w in ids]
            async with held.lock:
                booked = await self._book_lean(request, request_id, keys, held, ids, overlaps, credits, n_pages,
                                               decode_pages, weights, u, change if feed_checked else None)
            if booked is None:  # the roster moved: read it again
                held.forget()
                continue
            if isinstance(booked, int):  # the feed is past the index: once the index has it, decide again
                feed_checked = False
                if not await index.reached(booked, CATCH_UP_WAIT_S):
                    return "index_behind"
                continue
            chosen, logits, affinity, loads, pool = booked
            break
        else:
            return "state_kept_moving"
        self._state_ok()
        winner_id = ids[chosen]
        overlap = overlaps[winner_id]
        candidates: list[CandidateScore] = []
        if request.explain or self.decision_log is not None:
            candidates = [CandidateScore(worker_id=ids[i], logit=logits[i], overlap=overlaps[ids[i]],
                                         prefill_load=loads[0][i], decode_load=loads[1][i], page_size=live[ids[i]][0])
                          for i in pool]
        meta = directory.workers.get(winner_id)
        response = RouteResponse(
            request_id=request_id, worker_id=winner_id, logit=logits[chosen], overlap=overlap,
            candidates=candidates if request.explain else [], request_pages=n_pages, page_size=primary_size,
            degraded=degraded, booked=request.book, worker_url=meta.http_endpoint if meta else "", affinity=affinity)
        latency = time.perf_counter() - started
        self._observe(response, shared, n_pages, latency, "kv")
        decision = None
        if self.decision_log is not None:
            decision = RouteDecision(
                request_id=request_id, model=model, router_id=self.router_id, ts=time.time(), weights=weights,
                random_draw=u, page_hashes={size: list(p.hashes) for size, p in pages_by_size.items()},
                request_pages=n_pages, chosen=winner_id, candidates=candidates, degraded=degraded,
                latency_ms=latency * 1000, shared_pool_queried=shared is not None)
            self.decision_log.submit(decision)
        return Outcome(response, decision, pages_by_size.get(live[winner_id][0]))

    async def _book_lean(self, request: RouteRequest, request_id: str, keys: ModelKeys, held, ids: list[str],
                         overlaps: dict[str, TierOverlap], credits: list[float], n_pages: int, decode_pages: int,
                         weights: ScoringWeights, u: float, change: int | None):
        """Choose on the copy's loads and book (under the model's lock: this replica's load
        writes one at a time). When booked: (chosen index, logits, affinity, (prefill loads,
        decode loads), the indexes of the workers under the busy thresholds). None when the
        roster moved; the change counter when the feed is past `change`, the index's when it
        gave the overlaps (the index must apply it first)."""
        session = (request.model, request.session_id) if request.session_id else None
        # This replica's memory of the session's worker is a guess to propose; Redis's is the
        # session, which the booking checks (and answers with when it names another worker).
        kept = self._sessions.get(session) if session else None
        leave = False  # the session's worker (as Redis has it) is not a candidate: move the session
        checked_busy = False
        for _ in range(LEAN_ATTEMPTS):
            roster = held.roster
            if roster is None:
                return None
            prefill = [roster.prefill.get(w, 0) for w in ids]
            decode = [roster.decode.get(w, 0) for w in ids]
            try:
                pool = self._under_thresholds(request.model, [roster.live[w][0] for w in ids], prefill, decode)
            except Busy:
                # Every worker busy by the copy: a refusal (or a wait) rests on the loads Redis
                # holds, read again once, never on a copy another replica's releases left behind.
                if checked_busy:
                    raise
                checked_busy = True
                if (await held.read(int(time.time() * 1000))).candidates != roster.candidates:
                    return None  # who is live changed too: decide again from the top
                continue
            values = scoring.logits_of(n_pages, credits, prefill, decode, weights.prefill_load_scale)
            formula = pool[scoring.choose([values[i] for i in pool], weights.temperature, u)]
            chosen = formula
            if kept is not None and not leave and kept in ids and ids.index(kept) in pool:
                chosen = ids.index(kept)
            worker = ids[chosen]
            overlap = overlaps[worker]
            prefill_pages = max(n_pages - overlap.device - overlap.predicted, 0)
            answer = await self.book.book_checked(
                keys, request_id, worker, prefill_pages, decode_pages, load_version=roster.load_version,
                change=change, lease_count=roster.lease_count, stale_count=len(roster.stale),
                marker_id=roster.marker_id, book=request.book, session_id=request.session_id,
                session_ttl_ms=max(1, int(self.settings.session_ttl_s * 1000)), leave_session=leave)
            if answer.outcome is Checked.BOOKED:
                affinity = ""
                if session and answer.worker_id == worker:
                    affinity = "kept" if chosen == formula else "overrode"
                if request.book:
                    roster.add(worker, prefill_pages, decode_pages, answer.load_version)
                    if session:
                        self._remember_session(session, worker)
                return chosen, values, affinity, (prefill, decode), pool
            if answer.outcome is Checked.ALREADY_BOOKED:
                raise DuplicateRequest(str(AlreadyBooked(request_id, answer.worker_id)))
            if answer.outcome is Checked.LOADS_MOVED:
                roster.set_loads(answer.load_version, answer.prefill, answer.decode)
            elif answer.outcome is Checked.SESSION_ELSEWHERE:
                kept = answer.worker_id
                if session:
                    self._remember_session(session, kept)
                leave = not (kept in ids and ids.index(kept) in pool)
            elif answer.outcome is Checked.FEED_AHEAD:
                return answer.change
            else:
                return None
        return None

    def _remember_session(self, session: tuple[str, str], worker: str) -> None:
        self._sessions[session] = worker
        self._sessions.move_to_end(session)
        if len(self._sessions) > SESSIONS_REMEMBERED:
            self._sessions.popitem(last=False)

    async def _route_with_state(self, request: RouteRequest, request_id: str, weights: ScoringWeights,
                                u: float, started: float, exclude: frozenset[str] = frozenset()) -> Outcome:
        model = request.model
        directory = await self._directory(model)
        views = Views()
        pages_by_size: dict[int, RequestPages] = {}
        shared: dict | None = None
        shared_error = ""
        for attempt in range(2):
            sizes = directory.page_sizes or {self.settings.router_page_size or 1}
            for size in sizes:
                if size not in pages_by_size:
                    pages_by_size[size] = RequestPages.of(request.token_ids, size)
            want_shared = self.settings.shared_cache and self.shared_pool is not None and shared is None
            if want_shared:
                read, pool = await asyncio.gather(
                    self.reader.read(model, pages_by_size),
                    self._query_shared_pool(directory, pages_by_size), return_exceptions=True)
                if isinstance(read, BaseException):
                    raise read
                if isinstance(pool, BaseException):
                    shared_error = str(pool)
                else:
                    shared = pool
            else:
                read = await self.reader.read(model, pages_by_size)
            views = read
            if attempt == 0 and any(v.status is WorkerStatus.UNHASHED or v.worker_id not in directory.workers
                                    for v in views):
                directory = await self._directory(model, refresh=True)  # a worker joined since the last read
                continue
            break
        self._state_ok()

        fresh = [v for v in views if v.status is WorkerStatus.CANDIDATE]
        degraded: list[str] = []
        if views.degraded:
            degraded.append(views.degraded)
        if shared_error:
            degraded.append(DEGRADED_SHARED_POOL)
        if views.rebuilding:
            # The store lost this model's state and it is being rebuilt: what it holds is not
            # what the workers hold. Route on load alone, among every live worker.
            if not views:
                return self._route_without_state(request, request_id, weights, u, started, DEGRADED_REBUILDING,
                                                 exclude=exclude)
            fresh = [WorkerView(v.worker_id, v.status, v.page_size, TierOverlap(), v.prefill_load, v.decode_load)
                     for v in views]
            shared = None
            degraded.append(DEGRADED_REBUILDING)
        elif not fresh:
            stale = [v for v in views if v.status is WorkerStatus.STALE]
            if not stale:
                raise NoWorkers(f"no live worker for model {model!r} (no lease renewed recently)")
            # Their state may under-report pages: route among them by load alone.
            fresh = [WorkerView(v.worker_id, v.status, v.page_size, TierOverlap(), v.prefill_load, v.decode_load)
                     for v in stale]
            degraded.append(DEGRADED_ONLY_STALE)
        fresh = self._admitted(model, self._reachable(model, fresh, exclude, lambda v: v.worker_id))
        fresh.sort(key=lambda v: v.worker_id)

        inputs = [scoring.CandidateInputs(v.worker_id, self._with_shared(v.worker_id, v.page_size, v.overlap,
                                                                         directory, shared),
                                          v.prefill_load, v.decode_load) for v in fresh]
        primary_size = _most_common_page_size(v.page_size for v in fresh)
        n_pages = len(pages_by_size[primary_size]) if primary_size in pages_by_size else 0
        decode_pages = -(-(len(request.token_ids) + request.max_new_tokens) // primary_size)
        # Workers of one model share a page size in practice; with mixed sizes the request's
        # page count is taken at the most common one, and each worker's overlap at its own.
        credits = [scoring.cache_credit(c.overlap, weights) for c in inputs]
        affinity = ""
        if request.session_id:
            kept = await self._session_worker(model, request.session_id)
            index = next((i for i, c in enumerate(inputs) if c.worker_id == kept), None)
            if index is not None:
                would = inputs[scoring.score(n_pages, inputs, weights, u).chosen].worker_id
                affinity = "kept" if would == kept else "overrode"
                fresh, inputs, credits = [fresh[index]], [inputs[index]], [credits[index]]
        predict = (pages_by_size[primary_size].keys_blob
                   if self.settings.predicted_pages and primary_size in pages_by_size else "")
        try:
            selection = await self.book.select_and_book(
                model, request_id, n_pages, decode_pages,
                [(c.worker_id, credit, c.overlap.device + c.overlap.predicted) for c, credit in zip(inputs, credits)],
                weights.prefill_load_scale, weights.temperature, u, book=request.book,
                selection=self.settings.selection, predict=predict, devices=[c.overlap.device for c in inputs])
        except AlreadyBooked as exc:
            raise DuplicateRequest(str(exc)) from None
        booked_inputs = [scoring.CandidateInputs(c.worker_id, c.overlap, p, d)
                         for c, p, d in zip(inputs, selection.prefill_loads, selection.decode_loads)]
        scored = scoring.score(n_pages, booked_inputs, weights, u)
        if scored.chosen != selection.chosen and self.settings.selection == "score":
            self.metrics.scoring_mismatch.inc()
            log.error("selection in Redis chose %s, router/scoring.py %s, for request %s: please report",
                      inputs[selection.chosen].worker_id, inputs[scored.chosen].worker_id, request_id)
        chosen = selection.chosen
        candidates = [CandidateScore(worker_id=c.worker_id, logit=scored.logits[i], overlap=c.overlap,
                                     prefill_load=c.prefill_load, decode_load=c.decode_load,
                                     page_size=fresh[i].page_size)
                      for i, c in enumerate(booked_inputs)]
        winner = candidates[chosen]
        meta = directory.workers.get(winner.worker_id)
        response = RouteResponse(
            request_id=request_id, worker_id=winner.worker_id, logit=winner.logit, overlap=winner.overlap,
            candidates=candidates, request_pages=n_pages, page_size=primary_size, degraded=degraded,
            booked=request.book, worker_url=meta.http_endpoint if meta else "", affinity=affinity)
        if request.session_id and request.book:
            await self.redis.set(ModelKeys.for_model(model).session(request.session_id), winner.worker_id,
                                 px=max(1, int(self.settings.session_ttl_s * 1000)))
        latency = time.perf_counter() - started
        self._observe(response, shared, n_pages, latency, "kv" if self.settings.selection == "score"
                      else self.settings.selection)
        decision = None
        if self.decision_log is not None:
            decision = RouteDecision(
                request_id=request_id, model=model, router_id=self.router_id, ts=time.time(), weights=weights,
                random_draw=u, page_hashes={size: list(p.hashes) for size, p in pages_by_size.items()},
                request_pages=n_pages, chosen=winner.worker_id, candidates=candidates, degraded=degraded,
                latency_ms=latency * 1000, shared_pool_queried=shared is not None)
            self.decision_log.submit(decision)
        return Outcome(response, decision, pages_by_size.get(fresh[chosen].page_size))

    async def _query_shared_pool(self, directory: ModelDirectory, pages_by_size: dict[int, RequestPages]
                                 ) -> dict[int, dict[MooncakeLayout, SharedPages]]:
        """{page size: {layout: SharedPages}} for the workers that publish a Mooncake layout."""
        layouts_by_size: dict[int, set] = {}
        for meta in directory.workers.values():
            if meta.mooncake is not None and self._page_size_matches(meta):
                layouts_by_size.setdefault(meta.page_size, set()).add(meta.mooncake)
        result = {}
        try:
            for size, layouts in layouts_by_size.items():
                # only asked when the router has a shared pool (want_shared in route)
                result[size] = await self.shared_pool.pages_present(  # type: ignore[union-attr]
                    pages_by_size[size], list(layouts))
        except SharedPoolUnavailable as exc:
            self.metrics.shared_pool_errors.labels(exc.reason).inc()
            self.last_shared_pool_error = str(exc)
            log.warning("Shared cache query failed (%s); scoring without the shared pool", exc)
            raise
        self.last_shared_pool_error = ""
        return result

    def _page_size_matches(self, meta: WorkerMetadata) -> bool:
        expected = self.settings.router_page_size
        if expected is None or meta.page_size == expected:
            return True
        key = (meta.model, meta.worker_id)
        if key not in self._warned_page_size:
            self._warned_page_size.add(key)
            self.metrics.page_size_mismatch.inc()
            log.warning("worker %s/%s uses page size %d but the router's --page-size is %d: no shared-pool "
                        "credit for it (they must match)", meta.model, meta.worker_id, meta.page_size, expected)
        return False

    def _with_shared(self, worker_id: str, page_size: int, o: TierOverlap, directory: ModelDirectory,
                     shared) -> TierOverlap:
        if not shared:
            return o
        meta = directory.workers.get(worker_id)
        if meta is None or meta.mooncake is None:
            return o
        pages: SharedPages | None = shared.get(page_size, {}).get(meta.mooncake)
        if pages is None:
            return o
        return TierOverlap(device=o.device, host=o.host, disk=o.disk, predicted=o.predicted,
                           shared_beyond=pages.beyond(o.device + o.predicted))

    def _observe(self, response: RouteResponse, shared, n_pages: int, latency: float, mode: str) -> None:
        m = self.metrics
        m.decisions_by_mode(mode).inc()
        m.decision_latency.observe(latency)
        m.request_pages.observe(n_pages)
        o = response.overlap
        device, host, disk, beyond = m.chosen_overlap_by_tier
        device.observe(o.device)
        host.observe(o.host)
        disk.observe(o.disk)
        beyond.observe(o.shared_beyond)
        if shared:
            hits = max((p.hits for layouts in shared.values() for p in layouts.values()), default=0)
            if n_pages:
                m.shared_cache_hit_rate.observe(hits / n_pages)
            m.shared_cache_beyond_blocks.observe(o.shared_beyond)

    def _route_without_state(self, request: RouteRequest, request_id: str, weights: ScoringWeights,
                             u: float, started: float, reason: str = DEGRADED_STATE_STORE,
                             exclude: frozenset[str] = frozenset()) -> Outcome:
        directory = self.directory.cached(request.model)
        if directory is None or not directory.workers:
            self.metrics.fallbacks.labels("no_known_workers").inc()
            why = ("state store is rebuilding this model's state" if reason == DEGRADED_REBUILDING
                   else f"state store unavailable ({self.last_state_error})")
            raise NoWorkers(f"{why} and no worker of model {request.model!r} known to this router yet")
        workers = self._reachable(request.model, sorted(directory.workers), exclude)
        worker_id = self._fallback.choose(workers)
        if request.book:  # a dry run holds nothing
            self._fallback.book(request_id, worker_id)
        self.metrics.fallback_in_flight.set(len(self._fallback.in_flight))
        page_size = _most_common_page_size(meta.page_size for meta in directory.workers.values())
        n_pages = len(request.token_ids) // page_size
        candidates = [CandidateScore(worker_id=w, logit=0.0, overlap=TierOverlap(), prefill_load=0, decode_load=0,
                                     page_size=directory.workers[w].page_size) for w in workers]
        response = RouteResponse(
            request_id=request_id, worker_id=worker_id, logit=0.0, overlap=TierOverlap(), candidates=candidates,
            request_pages=n_pages, page_size=page_size, degraded=[reason], booked=False,
            worker_url=directory.workers[worker_id].http_endpoint)
        latency = time.perf_counter() - started
        self.metrics.fallbacks.labels(reason.replace("-", "_")).inc()
        self._observe(response, None, n_pages, latency, "fallback")
        decision = RouteDecision(
            request_id=request_id, model=request.model, router_id=self.router_id, ts=time.time(), weights=weights,
            random_draw=u, page_hashes={}, request_pages=n_pages, chosen=worker_id, candidates=candidates,
            degraded=[reason], latency_ms=latency * 1000)
        if self.decision_log is not None:
            self.decision_log.submit(decision)
        return Outcome(response, decision)

    # --- releases -----------------------------------------------------------------------
    async def release(self, model: str, request_id: str, stage: ReleaseStage) -> ReleaseResponse:
        if stage is ReleaseStage.COMPLETE and self._fallback.release(request_id):
            self.metrics.fallback_in_flight.set(len(self._fallback.in_flight))
            self.metrics.releases.labels(stage.value, "fallback").inc()
            return ReleaseResponse(request_id=request_id, released=True)
        held = self.rosters.models.get(model) if self.rosters is not None else None
        if held is None:
            released = await self.book.release(model, request_id, stage)
        else:
            # Under the lock this replica's bookings take, so its own writes never make its
            # copy of the loads stale; the answer's version keeps the copy exact.
            async with held.lock:
                released = await self.book.release(model, request_id, stage)
                if released.found and held.roster is not None:
                    held.roster.add(released.worker_id, -released.prefill_pages, -released.decode_pages,
                                    released.load_version)
        self.metrics.releases.labels(stage.value, str(released.found).lower()).inc()
        return ReleaseResponse(request_id=request_id, released=released.found, worker_id=released.worker_id,
                               prefill_pages=released.prefill_pages, decode_pages=released.decode_pages)

    async def close(self) -> None:
        """Stop the index followers and the bookings' own connection (the Redis client is the
        caller's)."""
        if self.mirror is not None:
            await self.mirror.close()
        await self.book.close()

    async def start_indexes(self, quiet: bool = False) -> None:
        """Begin building the index of every model the store knows (at start, before the first
        request; then from housekeeping, for models that appeared since)."""
        if self.mirror is None:
            return
        try:
            for model in await self.directory.known_models():
                self.mirror.model(model)  # starts the model's index once
        except Exception as exc:  # noqa: BLE001 - each index is built on first use instead
            if not quiet:
                log.warning("could not list the store's models (%s); indexes are built on first use", exc)

    async def housekeeping(self) -> None:
        """Refresh the directories of models in use and give back expired bookings."""
        if not self._state_available():
            return
        try:
            for model in list(self.models_seen):
                await self.directory.get(model, refresh=True)
                await self.book.sweep(model)
            now = time.monotonic()
            if now - self._reconciled_at >= RECONCILE_INTERVAL_S:
                # Every model in the store, not only those this replica has routed: a load left
                # behind by replicas that are all gone is found by the first one up again.
                self._reconciled_at = now
                for token in await self.directory.known_models():
                    model = name_of_token(token)
                    if await self.book.reconcile(model):
                        self.metrics.load_reconciled.inc()
                        log.warning("model %s: booked load had drifted from its live bookings; recomputed", model)
            if time.monotonic() - self._hash_checks_read_at >= HASH_CHECK_REFRESH_S:
                await self.refresh_hash_mismatches()
            self._state_ok()
        except Exception as exc:  # noqa: BLE001 - any Redis failure degrades the same way
            self._state_failed(exc)

    async def refresh_hash_mismatches(self) -> list[tuple[str, HashCheck]]:
        """Re-read the processors' hash checks; workers that fail them are in /healthz and
        `router_worker_hash_mismatch_pages`."""
        found = await read_hash_mismatches(self.redis)
        partial = await read_partial_workers(self.redis)
        self.metrics.replace_series(self.metrics.partial_workers,
                                    {(model,): len(workers) for model, workers in partial.items()})
        self.partial_workers = partial
        self._hash_checks_read_at = time.monotonic()
        self.metrics.replace_series(self.metrics.worker_hash_mismatch,
                                    {(model, check.worker_id): check.mismatched for model, check in found})
        for model, check in found:
            if all((model, check.worker_id) != (m, c.worker_id) for m, c in self.hash_mismatches):
                log.error("worker %s/%s publishes page hashes routers cannot match (%d of %d checked pages): %s",
                          model, check.worker_id, check.mismatched, check.checked, check.explanation)
        self.hash_mismatches = found
        return found


def _most_common_page_size(sizes: Iterable[int]) -> int:
    """The page size most workers use (the smallest among equals); 1 when none is known."""
    counts = Counter(size for size in sizes if size > 0)
    return max(sorted(counts), key=lambda size: counts[size]) if counts else 1
