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
import logging
import random
import time
import uuid
from dataclasses import dataclass

import redis.exceptions

from kvtier.schemas.routing import (
    CandidateScore,
    ReleaseResponse,
    ReleaseStage,
    RouteDecision,
    RouteRequest,
    RouteResponse,
    ScoringWeights,
)
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import name_of_token, subject_token

from . import lean, rates, steps
from .booking import AlreadyBooked, LoadBook, Selection
from .breaker import CircuitBreaker
from .cluster_checks import ClusterChecks
from .errors import Busy as Busy  # router/admission.py imports it from here
from .errors import DuplicateRequest, NotOwner, NoWorkers, RoutingError, UnknownModel
from .fallback import Fallback as _Fallback  # the name tests/consumers/test_restarts_and_lag.py imports
from .fallback import StateStoreWatch
from .hashing import RequestPages
from .index_feed import CATCH_UP_WAIT_S, IndexedOverlapReader, ModelIndex, TierIndexes
from .lean import LEAN_ATTEMPTS
from .metrics import RouterMetrics
from .recording import DecisionRecorder
from .roster import Roster, Rosters, read_fits
from .settings import RouterSettings
from .shared_pool import SharedPoolClient, SharedPoolUnavailable
from .shared_query import SharedPoolQuery
from .state import (
    ModelDirectory,
    OverlapReader,
    TierStateReader,
    Views,
    WorkerDirectory,
    WorkerStatus,
)
from .steps import DEGRADED_ONLY_STALE as DEGRADED_ONLY_STALE  # imported from here by the service and tools
from .steps import DEGRADED_REBUILDING, DEGRADED_SHARED_POOL, DEGRADED_STATE_STORE

log = logging.getLogger("kvtier.router")

#: Router modes that pick by a baseline rule instead of the score (RouterSettings.selection).
SELECTIONS = ("round-robin", "random")
#: How often housekeeping recomputes each model's booked load from its live bookings (seconds).
RECONCILE_INTERVAL_S = 10.0
#: How often housekeeping re-reads the processors' hash checks (seconds).
HASH_CHECK_REFRESH_S = 5.0
#: Why a decision read the full state instead of the replica's copies (router_full_reads).
FULL_READ_REASONS = ("index_not_ready", "index_behind", "rebuilding", "no_fresh_worker", "state_kept_moving")


@dataclass(frozen=True)
class Outcome:
    response: RouteResponse
    decision: RouteDecision | None  # built only when a decision log is configured
    #: The request's full pages at the chosen worker's page size, as this router hashed them
    #: (None when it routed without tier state).
    pages: RequestPages | None = None


@dataclass(frozen=True)
class _StateRead:
    """What the full read of a model's state found."""

    directory: ModelDirectory
    views: Views
    pages_by_size: dict[int, RequestPages]
    shared: steps.SharedAnswer | None
    shared_error: str  # why the shared pool did not answer ("" when it did, or was not asked)


class Router:
    def __init__(self, redis_client, settings: RouterSettings, metrics: RouterMetrics,
                 shared_pool: SharedPoolClient | None = None, decision_log=None, rng: random.Random | None = None):
        self.settings = settings
        self.metrics = metrics
        self.redis = redis_client
        self.directory = WorkerDirectory(redis_client)
        #: Each model's in-memory index (router/index_feed.py); None when decisions walk in Redis.
        self.indexes: TierIndexes | None = None
        walk = OverlapReader(redis_client)
        self.reader: TierStateReader = walk
        if settings.reads_index:
            self.indexes = TierIndexes(redis_client, metrics, block_ms=settings.index_block_ms)
            self.reader = IndexedOverlapReader(redis_client, self.indexes, walk)
        self.book = LoadBook(redis_client, settings.booking_ttl_s)
        #: The lean decision's copies of each model's roster and loads (router/roster.py): with
        #: an index and the formula's selection; None otherwise (every decision reads Redis).
        self.rosters = Rosters(redis_client) if self.indexes is not None and settings.selection == "score" else None
        self.copy_booking = lean.CopyBooking(self.book, settings)  # the lean decision's booking
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_backoff_s)
        self.shared_pool = shared_pool
        self.shared_query = SharedPoolQuery(shared_pool, settings, metrics)
        #: Asked where its pages are credited, or where the rates learn (a first token fetches them either way).
        self.asks_shared_pool = shared_pool is not None and (settings.shared_cache or settings.learn_rates)
        self.decision_log = decision_log
        self.rng = rng or random.Random()
        self.router_id = settings.router_id or f"router-{uuid.uuid4().hex[:8]}"
        self.recorder = DecisionRecorder(metrics, decision_log, self.router_id)
        self._fallback = _Fallback(ttl_s=settings.booking_ttl_s)
        self.state_store = StateStoreWatch(settings, metrics)
        self._reconciled_at = -1e9  # when housekeeping last recomputed loads from bookings
        self.models_seen: set[str] = set()
        self.checks = ClusterChecks(redis_client, metrics)  # hash checks, partial workers, rates
        self.decisions_made = 0

    @property
    def last_state_error(self) -> str:
        """The state store's last failure ("" once it answers again)."""
        return self.state_store.last_error

    @property
    def last_shared_pool_error(self) -> str:
        """Why the last shared-pool query failed ("" once one answers)."""
        return self.shared_query.last_error

    # --- the decision -------------------------------------------------------------------
    async def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset(), owner: str = "") -> Outcome:
        """`exclude`: workers this request already failed on (the proxy's migration) and, unless no
        other is left, workers whose circuit is open; `owner`: what a client's release must give."""
        started = time.perf_counter()
        self.decisions_made += 1
        weights = request.overrides.applied_to(self.settings.weights) if request.overrides else self.settings.weights
        request_id = request.request_id or uuid.uuid4().hex
        u = self.rng.random()
        if not self.state_store.available():
            return self._route_without_state(request, request_id, weights, u, started, exclude=exclude)
        try:
            if self.rosters is not None:
                outcome = await self._route_lean(request, request_id, weights, u, started, exclude, owner)
                if isinstance(outcome, Outcome):
                    return outcome
                self.metrics.full_reads_by_reason(outcome).inc()
            return await self._route_with_state(request, request_id, weights, u, started, exclude, owner)
        except RoutingError:
            raise
        except redis.exceptions.ResponseError:
            raise  # Redis answered: a bug to see, not an outage to route around
        except (OSError, asyncio.TimeoutError, redis.exceptions.RedisError) as exc:
            self.state_store.failed(exc)
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
        """steps.reachable with the workers whose circuit is open now."""
        return steps.reachable(model, workers, exclude, self.breaker.left_out(model), worker_of)

    async def _session_worker(self, model: str, session_id: str) -> str | None:
        raw = await self.redis.get(ModelKeys.for_model(model).session(session_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    # --- the lean decision --------------------------------------------------------------
    async def _route_lean(self, request: RouteRequest, request_id: str, weights: ScoringWeights, u: float,
                          started: float, exclude: frozenset[str], owner: str = "") -> Outcome | str:
        """The decision on this replica's copies: overlaps from the index, roster and loads from
        router/roster.py, chosen by router/scoring.py and booked with book_checked.lua, which
        books only while the copies are what Redis holds (one round trip when they are). When
        the decision needs the full read instead, why (FULL_READ_REASONS): the index is not
        ready or behind, the store's state is being rebuilt, no worker is live and fresh (the
        full read says what to do), or the copies kept moving."""
        assert self.rosters is not None and self.indexes is not None
        model = request.model
        directory = await self._directory(model)
        keys = ModelKeys.for_model(model)
        index = self.indexes.model(keys.model_token)
        held = self.rosters.model(model)
        # Set once a try found the feed past the index and the decision waited for it: changes
        # after that came after the decision began, as a read's would have.
        feed_checked = True
        pages_by_size: dict[int, RequestPages] = {}
        for _ in range(LEAN_ATTEMPTS):
            roster = await lean.usable_roster(index, held)
            if isinstance(roster, str):
                return roster
            if any(w not in directory.workers for w in roster.candidates):
                directory = await self._directory(model, refresh=True)  # a worker joined since the last read
            read = await self._lean_inputs(request, weights, index, roster, directory, pages_by_size, exclude)
            async with held.lock:
                booked = await self.copy_booking.choose_and_book(request, request_id, keys, held, read, weights, u,
                                                                 read.change if feed_checked else None, owner)
            if booked is None:  # the roster moved: read it again
                held.forget()
                continue
            if isinstance(booked, int):  # the feed is past the index: once the index has it, decide again
                feed_checked = False
                if not await index.reached(booked, CATCH_UP_WAIT_S):
                    return "index_behind"
                continue
            break
        else:
            return "state_kept_moving"
        self.state_store.answered()
        return self._lean_outcome(request, request_id, weights, u, started, read, booked, directory, pages_by_size)

    async def _lean_inputs(self, request: RouteRequest, weights: ScoringWeights, index: ModelIndex, roster: Roster,
                           directory: ModelDirectory, pages_by_size: dict[int, RequestPages],
                           exclude: frozenset[str]) -> lean.LeanInputs:
        """One try's candidates and what it chooses on: the index's overlaps (with the shared
        pool's pages when it answers), the reachable workers, the request's page counts."""
        live = roster.live
        overlaps, change = lean.read_overlaps(index, roster, request.token_ids, pages_by_size)
        degraded: list[str] = []
        shared = None
        priced = overlaps
        if self.asks_shared_pool:
            try:
                shared = await self.shared_query.pages(directory, pages_by_size)
            except SharedPoolUnavailable:
                degraded.append(DEGRADED_SHARED_POOL)
            if shared:
                priced = {w: steps.with_shared(w, live[w][0], o, directory, shared) for w, o in overlaps.items()}
                overlaps = priced if self.settings.shared_cache else overlaps
        ids = self._reachable(request.model, roster.candidates, exclude)
        primary_size = steps.lean_primary_size(roster.by_size, live, ids)
        n_pages = len(pages_by_size[primary_size]) if primary_size in pages_by_size else 0
        decode_pages = steps.decode_pages_of(len(request.token_ids), request.max_new_tokens, primary_size)
        return lean.LeanInputs(ids, overlaps, live, change, degraded, shared, primary_size, n_pages, decode_pages,
                               steps.lean_credits(ids, overlaps, weights), priced)

    def _lean_outcome(self, request: RouteRequest, request_id: str, weights: ScoringWeights, u: float,
                      started: float, read: lean.LeanInputs, booked: lean.LeanBooked, directory: ModelDirectory,
                      pages_by_size: dict[int, RequestPages]) -> Outcome:
        """The answer to a booked lean decision, observed and logged."""
        winner_id = read.ids[booked.chosen]
        candidates: list[CandidateScore] = []
        if request.explain or self.decision_log is not None:
            candidates = steps.pool_candidates(read.ids, booked.pool, booked.logits, read.overlaps, booked.prefill,
                                               booked.decode, read.live)
        meta = directory.workers.get(winner_id)
        response = RouteResponse(
            request_id=request_id, worker_id=winner_id, logit=booked.logits[booked.chosen],
            overlap=read.overlaps[winner_id], candidates=candidates if request.explain else [],
            request_pages=read.n_pages, page_size=read.primary_size, degraded=read.degraded, booked=request.book,
            worker_url=meta.http_endpoint if meta else "", affinity=booked.affinity,
            predicted_ttft_ms=booked.predicted_ttft_ms)
        latency = time.perf_counter() - started
        self.recorder.observe(response, read.shared, read.n_pages, latency, "kv")
        decision = self.recorder.log(
            request_id=request_id, model=request.model, weights=weights, u=u, pages_by_size=pages_by_size,
            n_pages=read.n_pages, chosen=winner_id, candidates=candidates, degraded=read.degraded, latency=latency,
            shared=read.shared, predicted_ttft_ms=booked.predicted_ttft_ms)
        return Outcome(response, decision, pages_by_size.get(read.live[winner_id][0]))

    # --- the full read ------------------------------------------------------------------
    async def _route_with_state(self, request: RouteRequest, request_id: str, weights: ScoringWeights,
                                u: float, started: float, exclude: frozenset[str] = frozenset(),
                                owner: str = "") -> Outcome:
        """The decision on a full read of the model's state: read, filter (circuits, busy
        thresholds), keep the session's worker, then select and book in Redis."""
        model = request.model
        read = await self._read_state(request)
        self.state_store.answered()
        found = steps.candidates_of(model, read.views, read.shared_error)
        if found is None:
            return self._route_without_state(request, request_id, weights, u, started, DEGRADED_REBUILDING,
                                             exclude=exclude)
        shared = read.shared if found.shared_trusted else None
        fresh = steps.admitted(model, self.settings.admission,
                               self._reachable(model, found.views, exclude, lambda v: v.worker_id))
        fresh.sort(key=lambda v: v.worker_id)
        scores = steps.score_inputs(fresh, read.directory, shared, read.pages_by_size, len(request.token_ids),
                                    request.max_new_tokens, weights, self.settings.shared_cache)
        columns = None
        if self.settings.faster_pick:
            fits = await read_fits(self.redis, model)  # the override decides on the formula's overlaps
            columns = rates.ttft_columns(len(request.token_ids), [c.overlap for c in scores.inputs],
                                         [v.page_size for v in fresh],
                                         [fits.get(c.worker_id) for c in scores.inputs], rates.RATE_PRIOR)
        affinity = ""
        if request.session_id:
            kept = await self._session_worker(model, request.session_id)
            index, affinity = steps.keep_session(scores.inputs, kept, scores.n_pages, weights, u)
            if index is not None:
                fresh, scores = [fresh[index]], steps.kept_only(scores, index)
                columns = None  # the session's worker stays
        selection = await self._select_and_book(request, request_id, scores, read.pages_by_size, weights, u, columns,
                                                [v.page_size for v in fresh], owner)
        booked_inputs = steps.with_loads(scores.inputs, selection.prefill_loads, selection.decode_loads)
        scored = rates.formula_then_faster(scores.n_pages, booked_inputs, weights, u, columns)
        if scored.chosen != selection.chosen and self.settings.selection == "score":
            self.metrics.scoring_mismatch.inc()
            log.error("selection in Redis chose %s, router/scoring.py %s, for request %s: please report",
                      scores.inputs[selection.chosen].worker_id, scores.inputs[scored.chosen].worker_id, request_id)
        chosen = selection.chosen
        predicted_ttft_ms = columns.predicted_ms(chosen, selection.prefill_loads[chosen]) if columns else None
        candidates = steps.scored_candidates(booked_inputs, scored.logits, [v.page_size for v in fresh])
        winner = candidates[chosen]
        meta = read.directory.workers.get(winner.worker_id)
        response = RouteResponse(
            request_id=request_id, worker_id=winner.worker_id, logit=winner.logit, overlap=winner.overlap,
            candidates=candidates, request_pages=scores.n_pages, page_size=scores.primary_size,
            degraded=found.degraded, booked=request.book, worker_url=meta.http_endpoint if meta else "",
            affinity=affinity, predicted_ttft_ms=predicted_ttft_ms)
        if request.session_id and request.book:
            await self.redis.set(ModelKeys.for_model(model).session(request.session_id), winner.worker_id,
                                 px=max(1, int(self.settings.session_ttl_s * 1000)))
        latency = time.perf_counter() - started
        mode = "kv" if self.settings.selection == "score" else self.settings.selection
        self.recorder.observe(response, shared, scores.n_pages, latency, mode)
        decision = self.recorder.log(
            request_id=request_id, model=model, weights=weights, u=u, pages_by_size=read.pages_by_size,
            n_pages=scores.n_pages, chosen=winner.worker_id, candidates=candidates, degraded=found.degraded,
            latency=latency, shared=shared, predicted_ttft_ms=predicted_ttft_ms)
        return Outcome(response, decision, read.pages_by_size.get(fresh[chosen].page_size))

    async def _read_state(self, request: RouteRequest) -> _StateRead:
        """Every live worker's view (one round trip) while the shared pool is asked which pages
        it holds; read again once when a worker joined since the directory was last read."""
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
            want_shared = self.asks_shared_pool and shared is None
            if want_shared:
                read, pool = await asyncio.gather(
                    self.reader.read(model, pages_by_size),
                    self.shared_query.pages(directory, pages_by_size), return_exceptions=True)
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
        return _StateRead(directory, views, pages_by_size, shared, shared_error)

    async def _select_and_book(self, request: RouteRequest, request_id: str, scores: steps.ScoreInputs,
                               pages_by_size: dict[int, RequestPages], weights: ScoringWeights,
                               u: float, columns: rates.TtftColumns | None, page_sizes: list[int], owner: str = ""
                               ) -> Selection:
        """select_and_book.lua: the choice and its booking, atomic in Redis. `columns`: the
        candidates' predicted first tokens, for the override of the formula's choice at the
        loads Redis holds (rates.faster_than_formula; None: the formula's). The booking keeps what
        the chosen one's first token waits for, for its rates to learn from."""
        inputs = scores.inputs
        works = [(rates.predicted_work(len(request.token_ids), overlap, 0, size), size)
                 for overlap, size in zip(scores.priced, page_sizes)] if self.settings.learn_rates else []
        primary_size = scores.primary_size
        predict = (pages_by_size[primary_size].keys_blob
                   if self.settings.predicted_pages and primary_size in pages_by_size else "")
        try:
            return await self.book.select_and_book(
                request.model, request_id, scores.n_pages, scores.decode_pages,
                steps.booking_offers(inputs, scores.credits),
                weights.prefill_load_scale, weights.temperature, u, book=request.book,
                selection=self.settings.selection, predict=predict, devices=[c.overlap.device for c in inputs],
                faster=columns, works=works, owner=owner)
        except AlreadyBooked as exc:
            raise DuplicateRequest(str(exc)) from None

    # --- without the state store --------------------------------------------------------
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
        response = steps.fallback_response(request_id, len(request.token_ids), worker_id, workers, directory, reason)
        n_pages, candidates = response.request_pages, response.candidates
        latency = time.perf_counter() - started
        self.metrics.fallbacks.labels(reason.replace("-", "_")).inc()
        self.recorder.observe(response, None, n_pages, latency, "fallback")
        decision = steps.decision_record(
            request_id=request_id, model=request.model, router_id=self.router_id, ts=time.time(), weights=weights,
            u=u, pages_by_size={}, n_pages=n_pages, chosen=worker_id, candidates=candidates, degraded=[reason],
            latency_s=latency, shared_queried=False)
        if self.decision_log is not None:
            self.decision_log.submit(decision)
        return Outcome(response, decision)

    # --- releases -----------------------------------------------------------------------
    async def release(self, model: str, request_id: str, stage: ReleaseStage, ttft_ms: float | None = None,
                      owner: str = "", client: str = "") -> ReleaseResponse:
        """`ttft_ms`: at first token, as the client measured it (None: the time since the
        booking); it teaches the worker's rates. `owner`, `client`: LoadBook.release's."""
        if stage is ReleaseStage.COMPLETE and self._fallback.release(request_id):
            self.metrics.fallback_in_flight.set(len(self._fallback.in_flight))
            self.metrics.releases.labels(stage.value, "fallback").inc()
            return ReleaseResponse(request_id=request_id, released=True)
        held = self.rosters.models.get(model) if self.rosters is not None else None
        if held is None:
            released = await self.book.release(model, request_id, stage, ttft_ms, owner, client)
        else:
            # under its bookings' lock: its own writes never stale its copy (the version keeps it exact)
            async with held.lock:
                released = await self.book.release(model, request_id, stage, ttft_ms, owner, client)
                if released.found and held.roster is not None:
                    held.roster.add(released.worker_id, -released.prefill_pages, -released.decode_pages,
                                    released.load_version, released.fit)
        if released.not_owner:
            raise NotOwner(f"the booking of {request_id!r} belongs to another client (give its answer's `owner`)")
        self.metrics.releases.labels(stage.value, str(released.found).lower()).inc()
        if released.sample_refused:
            self.metrics.rate_samples_refused.labels(released.sample_refused).inc()
        return ReleaseResponse(request_id=request_id, released=released.found, worker_id=released.worker_id,
                               prefill_pages=released.prefill_pages, decode_pages=released.decode_pages,
                               sample_refused=released.sample_refused,
                               predicted_ttft_ms=released.predicted_ttft_ms, ttft_error=released.ttft_error)

    async def close(self) -> None:
        """Stop the index followers and the bookings' own connection (the Redis client is the
        caller's)."""
        if self.indexes is not None:
            await self.indexes.close()
        await self.book.close()

    async def start_indexes(self, quiet: bool = False) -> None:
        """Begin building the index of every model the store knows (at start, before the first
        request; then from housekeeping, for models that appeared since)."""
        if self.indexes is None:
            return
        try:
            for model in await self.directory.known_models():
                self.indexes.model(model)  # starts the model's index once
        except Exception as exc:  # noqa: BLE001 - each index is built on first use instead
            if not quiet:
                log.warning("could not list the store's models (%s); indexes are built on first use", exc)

    async def housekeeping(self) -> None:
        """Refresh the directories of models in use and give back expired bookings."""
        if not self.state_store.available():
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
            if time.monotonic() - self.checks.read_at >= HASH_CHECK_REFRESH_S:
                await self.checks.refresh()
            self.state_store.answered()
        except Exception as exc:  # noqa: BLE001 - any Redis failure degrades the same way
            self.state_store.failed(exc)
