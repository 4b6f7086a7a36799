"""`kvtier router`: the HTTP edge of a stateless router replica.

  POST /v1/route      {"model", "token_ids", "request_id"?, "overrides"?, "max_new_tokens"?, "book"?}
  POST /v1/release    {"model", "request_id", "stage": "first_token" | "complete"}
  POST /generate      (--proxy) SGLang's native API with input_ids: routed, forwarded, streamed back
  POST /v1/completions, /v1/chat/completions, GET /v1/models
                      (--proxy) the OpenAI-compatible API: text is tokenized here with the model's
                      own tokenizer and chat template (--tokenizer), then as /generate
  GET  /healthz       what this replica can reach, and whether it routes degraded
  GET  /metrics       Prometheus

Every refusal is a 4xx/5xx with {"error": "<what is wrong>"} (on the OpenAI paths, OpenAI's
shape: {"error": {"message", "type", "param", "code"}}); a decision made without some
input says so in the `X-Kvtier-Degraded` header and the body's `degraded` list.
With --auth-token every endpoint but /healthz (and /metrics, unless --protect-metrics) needs
`Authorization: Bearer <token>`: 401 without it or with another one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.plumbing.tokenizer import ChatTemplateError, ModelTokenizer
from kvtier.schemas.hashes import PageKey
from kvtier.schemas.limits import guarded
from kvtier.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorBody,
    Usage,
    completion_with_prompt_ids,
    reported_usage,
)
from kvtier.schemas.router_health import (
    DecisionLogHealth,
    HashSchemeHealth,
    MismatchedWorker,
    PartialWorker,
    ProcessHealth,
    QueueHealth,
    RouterHealth,
    SharedPoolHealth,
    StateStoreHealth,
    decode_router_health,
)
from kvtier.schemas.routing import (
    AdmissionChange,
    AdmissionSettings,
    ErrorBody,
    GenerateRequest,
    ReleaseRequest,
    ReleaseStage,
    RouteRequest,
    RouteResponse,
    ScoringWeights,
    SessionId,
)
from kvtier.schemas.state_keys import ModelKeys, page_member
from kvtier.schemas.subjects import name_of_token
from kvtier.schemas.tiers import Tier

from .admission import SHUTTING_DOWN, AdmissionQueue, Refusal
from .core import (
    DEGRADED_ONLY_STALE,
    DEGRADED_REBUILDING,
    DEGRADED_STATE_STORE,
    SELECTIONS,
    Outcome,
    Router,
    RoutingError,
)
from .hashing import RequestPages
from .http_guard import CLOSE_REASONS, GuardStats, HttpLimits, guarded_runner
from .metrics import replica_registry
from .processes import SIBLING_TIMEOUT_S, ProcessSlot
from .tokenization_check import TokenizationCheck

log = logging.getLogger("kvtier.router.http")

_json = msgspec.json.Encoder()


@dataclass
class ServiceSettings:
    #: This process's place in a replica of several (--processes); None: a replica of one.
    process: ProcessSlot | None = None
    max_request_tokens: int = 1 << 18
    max_body_bytes: int = 32 << 20
    proxy: bool = False
    default_model: str = ""  # for proxied requests that name no model
    #: the longest output budget (max_tokens, max_new_tokens) accepted on any path: a budget
    #: is booked as decode load, so an absurd one would push every other request elsewhere
    max_new_tokens: int = 1 << 20
    #: the largest text prompt (UTF-8 bytes, all of a chat's messages together) tokenized here;
    #: checked before tokenizing, which costs ~1 s of CPU and ~100 MB per MB of text
    max_prompt_bytes: int = 2 << 20
    #: connections kept open to one worker: its own pool, so slow streams on one worker never
    #: hold back requests to another (past it a request waits, up to the connect timeout)
    upstream_connections_per_worker: int = 256
    #: reaching a worker (a free connection of its pool included); past it the request migrates
    upstream_connect_timeout_s: float = 5.0
    #: the longest silence from a worker (no byte of an answer); past it the request fails
    upstream_idle_timeout_s: float = 600.0
    #: the longest whole proxied request; 0: no limit (a long generation is never cut)
    upstream_timeout_s: float = 0.0
    #: sent to workers as `Authorization: Bearer <key>` (an SGLang started with --api-key);
    #: the client's own Authorization (the router's token) is never forwarded
    engine_api_key: str = field(default="", repr=False)
    #: a request whose worker fails before the first byte of its answer is routed again among
    #: the other candidates, at most this many times
    migration_limit: int = 2
    #: on SIGTERM, how long in-flight requests may take to finish before they are cut
    drain_timeout_s: float = 30.0
    #: how long each phase of a client connection may take, and how many there may be
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    housekeeping_s: float = 1.0
    #: non-empty: every endpoint but /healthz (and /metrics, unless protect_metrics) requires
    #: `Authorization: Bearer <auth_token>`
    auth_token: str = field(default="", repr=False)
    protect_metrics: bool = False
    #: model name -> folder of its tokenizer files (tokenizer.json, tokenizer_config.json)
    tokenizers: dict[str, str] = field(default_factory=dict)
    #: the most each model's tokenizer keeps of pieces seen before (bytes; 0: none), so a
    #: conversation's next turn encodes only its new text (kvtier/plumbing/piece_cache.py)
    tokenizer_cache_bytes: int = 256 << 20
    #: a text completion (/v1/completions) goes to the engine as the router's token ids, so the
    #: engine does not tokenize it again; the ids are then the engine's by construction
    hand_over_token_ids: bool = False
    #: the router's --router-mode, the `mode` label of the proxy's latency histograms
    routing_mode: str = "kv"
    #: seconds after a proxied text request to check its worker stored its last page under the
    #: router's hash (the events' way through the pipeline takes milliseconds); 0: never
    stored_page_check_s: float = 3.0


#: A decision degraded by one of these saw no true state of its worker's pages.
_UNTRUSTED_STATE = frozenset({DEGRADED_STATE_STORE, DEGRADED_REBUILDING, DEGRADED_ONLY_STALE})

#: Request headers a proxied request carries to its worker: tracing, and the client's request id.
_FORWARDED_HEADERS = ("traceparent", "tracestate", "baggage", "X-Request-Id")
#: Booking ids of proxied requests start with this; /v1/route and /v1/release refuse such ids,
#: so no client can release (or pre-book) a proxied request's booking.
PROXY_BOOKING_PREFIX = "proxy:"
#: Worker answers that mean "not now" before any byte of an answer: the request migrates.
_RETRY_STATUSES = frozenset({502, 503, 504})
#: Text prompts longer than this (bytes) are tokenized in a pool of their own, so a few long
#: prompts never hold back the short ones.
_LONG_PROMPT_BYTES = 64 << 10

#: Paths served while draining and not counted as in flight: health, metrics, and releases
#: (a client's booking must still be given back).
_ALWAYS_SERVED = frozenset({"/healthz", "/metrics", "/v1/release"})

#: The least a drain lasts (seconds, within --drain-timeout): new requests are refused for at
#: least this long before the listener closes.
_DRAIN_LINGER_S = 1.0

#: How long /healthz reuses its read of the processors' hash checks.
_STORE_HEALTH_S = 1.0

#: Paths whose refusals take OpenAI's error shape.
_OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
_OPENAI_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                       429: "rate_limit_error"}


def _error(status: int, message: str, metrics=None, openai: bool = False) -> web.Response:
    if metrics is not None and 400 <= status < 500:
        metrics.bad_requests.labels(str(status)).inc()
    if openai:
        kind = _OPENAI_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        body: msgspec.Struct = OpenAIErrorBody(error=OpenAIError(message=message, type=kind, code=status))
    else:
        body = ErrorBody(message)
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


class Refused(Exception):
    """A request this router will not serve, with the status and the reason to send back."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


#: One decoder per request type, built once (msgspec.json.decode(data, type=...) looks the type up on
#: every call, and a lambda per request wrapped it).
_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (RouteRequest, ReleaseRequest, GenerateRequest,
                                                            CompletionRequest, ChatCompletionRequest)}


def _decode(body: bytes, kind):
    """Decode a request body straight into its struct; errors name the offending path."""
    if not body:
        raise Refused(400, "empty body: send a JSON object")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return guarded(decoder.decode, body)


class RouterService:
    def __init__(self, router: Router, settings: ServiceSettings):
        self.router = router
        self.settings = settings
        self.metrics = router.metrics
        self._session: ClientSession | None = None
        self._housekeeping: asyncio.Task | None = None
        # Loaded at start (a bad folder stops the router there, not at the first request).
        self._tokenizers = {model: ModelTokenizer.load(path, cache_bytes=settings.tokenizer_cache_bytes)
                            for model, path in settings.tokenizers.items()}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-tokenize")
        self._long_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                thread_name_prefix="kvtier-tokenize-long")
        self.tokenization = TokenizationCheck()
        for model in self._tokenizers:  # exported as 0 from the start: "no mismatch", not "no data"
            for outcome in ("match", "mismatch"):
                self.metrics.tokenizer_checks.labels(model, outcome)
            for outcome in ("found", "missing"):
                self.metrics.stored_page_checks.labels(model, outcome)
        self._mismatch_logged: dict[str, float] = {}
        self._page_checks: set[asyncio.Task] = set()
        self._hash_checks_read = -1e9
        self.queue = AdmissionQueue(on_depth=self.metrics.queue_depth.set, on_wait=self.metrics.queue_wait.observe)
        self._apply_admission(router.settings.admission)
        self.draining = False
        self.in_flight = 0

    def app(self) -> web.Application:
        # One middleware (auth, then refusals as JSON errors): aiohttp wraps each in a coroutine
        # layer on every request.
        app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._edge])
        app.router.add_post("/v1/route", self.route)
        app.router.add_post("/v1/release", self.release)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/admission", self.admission)
        app.router.add_put("/v1/admission", self.admission)
        if self.settings.proxy:
            app.router.add_post("/generate", self.generate)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/v1/chat/completions", self.chat_completions)
            app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app) -> None:
        self._housekeeping = asyncio.create_task(self._housekeeping_loop(), name="router-housekeeping")
        await self.router.start_indexes()

    async def _on_cleanup(self, app) -> None:
        if self._housekeeping is not None:
            # awaited, so no housekeeping pass runs on after the Redis client is closed
            self._housekeeping.cancel()
            await asyncio.gather(self._housekeeping, return_exceptions=True)
        await self.router.close()
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._long_pool.shutdown(wait=False, cancel_futures=True)
        for task in list(self._page_checks):
            task.cancel()

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.housekeeping_s)
            await self.router.housekeeping()
            self._export_circuits()
            self._export_tokenizer_caches()
            await self.router.start_indexes(quiet=True)  # models that appeared since

    def _export_tokenizer_caches(self) -> None:
        for model, tokenizer in self._tokenizers.items():
            if (cache := tokenizer.piece_cache) is not None:
                self.metrics.tokenizer_cache_bytes.labels(model).set(cache.bytes)

    def _refuse_unauthorized(self, request: web.Request, token: str) -> web.Response | None:
        """Bearer-token check before anything else (the body is not even read): every path but
        the open ones needs it when the router has a token. Compared in constant time; the
        answer never repeats what was sent. None: let the request through."""
        path = request.path
        if path == "/healthz" or (path == "/metrics" and not self.settings.protect_metrics):
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            message, error = ("missing bearer token: this router requires 'Authorization: Bearer <token>' "
                              "(its --auth-token)"), "invalid_request"
        elif scheme.lower() != "bearer" or not given.strip():
            message, error = "the Authorization header must be 'Bearer <token>'", "invalid_request"
        # surrogateescape: a header byte that is not UTF-8 (aiohttp keeps it as a surrogate)
        # compares as itself instead of failing the encode
        elif hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode()):
            return None
        else:
            message, error = "invalid bearer token", "invalid_token"
        response = _error(401, message, self.metrics)
        response.headers["WWW-Authenticate"] = f'Bearer realm="kvtier-router", error="{error}"'
        return response

    @web.middleware
    async def _edge(self, request: web.Request, handler):
        """The bearer-token check (with --auth-token), then the handler, with its refusals (and
        aiohttp's own: unknown path, wrong method, body too large) answered as JSON errors."""
        token = self.settings.auth_token
        if token:
            refused = self._refuse_unauthorized(request, token)
            if refused is not None:
                return refused
        openai = request.path in _OPENAI_PATHS
        counted = request.path not in _ALWAYS_SERVED
        if counted and self.draining:
            self.metrics.admission_refusals.labels("draining").inc()
            response = _error(503, SHUTTING_DOWN, None, openai)
            response.headers["Retry-After"] = "1"
            response.force_close()  # Connection: close, so no client keeps sending on it
            return response
        if counted:
            self.in_flight += 1
        try:
            return await handler(request)
        except Refused as exc:
            response = _error(exc.status, exc.message, self.metrics, openai)
            response.headers.update(exc.headers)
            return response
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body larger than {self.settings.max_body_bytes} bytes", self.metrics,
                          openai)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason or exc.text or "bad request", self.metrics, openai)
            raise
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"invalid request body: {exc}", self.metrics, openai)
        finally:
            if counted:
                self.in_flight -= 1

    # --- admission and drain --------------------------------------------------------------
    def _apply_admission(self, admission: AdmissionSettings) -> None:
        """The thresholds live in the router's settings (its decisions read them); the queue takes
        its bounds."""
        self.router.settings.admission = admission
        self.queue.size, self.queue.timeout_s = admission.queue_size, admission.queue_timeout_s

    async def admission(self, request: web.Request) -> web.Response:
        """GET: the busy thresholds and queue in force; PUT (needs the router's --auth-token):
        change the fields given, for this replica, from now on."""
        if request.method == "PUT":
            if not self.settings.auth_token:
                raise Refused(403, "changing admission needs a router started with --auth-token")
            raw = await request.read()
            change = _decode(raw, AdmissionChange)
            self._apply_admission(change.applied_to(self.router.settings.admission))
            log.warning("admission changed: %s", self.router.settings.admission)
            if request.query.get("scope") != "process":
                await self._tell_siblings("PUT", "/v1/admission?scope=process", raw, request.headers)
        return web.Response(body=_json.encode(self.router.settings.admission), content_type="application/json")

    async def _decide(self, route: RouteRequest, exclude: frozenset[str] = frozenset()) -> Outcome:
        """A decision, waiting in the queue while every candidate is busy; past the queue's
        bounds a refusal with Retry-After."""
        try:
            return await self.queue.admit(lambda: self.router.route(route, exclude=exclude))
        except Refusal as exc:
            self.metrics.admission_refusals.labels(exc.reason).inc()
            raise Refused(exc.status, str(exc), {"Retry-After": str(exc.retry_after_s)}) from None

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503 + Retry-After), let those in flight finish for up to
        `timeout_s`; the number still in flight then (cut by the shutdown, their bookings
        released as their handlers end)."""
        self.draining = True
        self.metrics.draining.set(1)
        self.queue.close()
        started = time.monotonic()
        deadline = started + timeout_s
        # Serve the refusals for a moment even with nothing in flight: a load balancer (or a
        # client's connection pool) learns from them to go elsewhere before the port closes,
        # instead of sending into a connection the exit resets.
        linger_until = started + min(timeout_s, _DRAIN_LINGER_S)
        while (self.in_flight or time.monotonic() < linger_until) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    # --- /v1/route ----------------------------------------------------------------------
    def _check_tokens(self, count: int, field: str) -> None:
        if count == 0:
            raise Refused(400, f"{field} is empty: there is nothing to route")
        if count > self.settings.max_request_tokens:
            raise Refused(413, f"{field} has {count} tokens; this router accepts at most "
                               f"{self.settings.max_request_tokens} (--max-request-tokens)")

    def _check_budget(self, budget: int, field: str) -> None:
        if budget > self.settings.max_new_tokens:
            raise Refused(400, f"{field} is {budget}; this router accepts at most {self.settings.max_new_tokens} "
                               "(--max-new-tokens)")

    @staticmethod
    def _check_client_id(request_id: str | None) -> None:
        if request_id and request_id.startswith(PROXY_BOOKING_PREFIX):
            raise Refused(400, f"request ids starting with {PROXY_BOOKING_PREFIX!r} are the proxy's own bookings; "
                               "choose another request_id")

    async def route(self, request: web.Request) -> web.Response:
        body = _decode(await request.read(), RouteRequest)
        self._check_tokens(len(body.token_ids), "token_ids")
        self._check_budget(body.max_new_tokens, "max_new_tokens")
        self._check_client_id(body.request_id)
        try:
            outcome = await self._decide(body)
        except RoutingError as exc:
            return _error(exc.status, str(exc), self.metrics)
        headers = {"X-Kvtier-Worker": outcome.response.worker_id}
        if outcome.response.degraded:
            headers["X-Kvtier-Degraded"] = ",".join(outcome.response.degraded)
        return web.Response(body=_json.encode(outcome.response), content_type="application/json", headers=headers)

    async def release(self, request: web.Request) -> web.Response:
        body = _decode(await request.read(), ReleaseRequest)
        self._check_client_id(body.request_id)
        try:
            released = await self.router.release(body.model, body.request_id, body.stage)
            self.queue.notify()
        except Exception as exc:  # noqa: BLE001 - the store is down: the booking expires by itself
            return _error(503, f"state store unavailable ({type(exc).__name__}: {exc}); the booking "
                               "expires after --booking-ttl")
        if not released.released:
            return _error(404, f"no booking for request id {body.request_id!r} of model {body.model!r} "
                               "(never booked, already released, or expired)", self.metrics)
        return web.Response(body=_json.encode(released), content_type="application/json")

    # --- health and metrics -------------------------------------------------------------
    async def _store_health(self) -> tuple[bool, str, list]:
        """Whether Redis answers (one PING), and the processors' hash checks, re-read at most
        once per `_STORE_HEALTH_S`: /healthz is open to anyone, so polling it costs Redis little."""
        router = self.router
        state_ok, state_error = True, ""
        try:
            await asyncio.wait_for(router.redis.ping(), 0.5)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            state_ok, state_error = False, f"{type(exc).__name__}: {exc}"
        mismatches = router.hash_mismatches
        if state_ok and time.monotonic() - self._hash_checks_read >= _STORE_HEALTH_S:
            try:
                mismatches = await asyncio.wait_for(router.refresh_hash_mismatches(), 0.5)
                self._hash_checks_read = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - health reports, it does not fail
                log.warning("reading hash checks failed: %s", exc)
        return state_ok, state_error, mismatches

    async def healthz(self, request: web.Request) -> web.Response:
        router = self.router
        state_ok, state_error, mismatches = await self._store_health()
        shared = SharedPoolHealth(enabled=router.settings.shared_cache and router.shared_pool is not None,
                                  last_error=router.last_shared_pool_error)
        hash_scheme = HashSchemeHealth(ok=not mismatches, mismatched_workers=[
            MismatchedWorker(model=model, worker_id=check.worker_id, mismatched_pages=check.mismatched,
                             checked_pages=check.checked, kinds=check.mismatch_kinds, explanation=check.explanation)
            for model, check in mismatches])
        decision_log = router.decision_log
        tokenizers = self.tokenization.health()
        healthy = state_ok and not shared.last_error and hash_scheme.ok and all(t.ok for t in tokenizers)
        body = RouterHealth(
            status="draining" if self.draining else "ok" if healthy else "degraded",
            router_id=router.router_id,
            routing="tier-aware" if state_ok else "load/round-robin (state store unavailable)",
            state_store=StateStoreHealth(ok=state_ok, error=state_error or router.last_state_error),
            shared_pool=shared,
            hash_scheme=hash_scheme,
            partial_workers=[PartialWorker(model=model, worker_id=w)
                             for model, workers in router.partial_workers.items() for w in workers],
            page_size=router.settings.router_page_size,
            decision_log=DecisionLogHealth(enabled=decision_log is not None,
                                           connected=bool(decision_log is not None and decision_log.connected)),
            models=sorted(router.models_seen),
            state_source="mirror" if router.mirror is not None else "redis",
            indexes=router.mirror.health() if router.mirror is not None else [],
            tokenizers=tokenizers,
            open_circuits=router.breaker.open_circuits(),
            queue=QueueHealth(depth=self.queue.depth, peak=self.queue.peak, size=self.queue.size,
                              timeout_s=self.queue.timeout_s),
        )
        if self.settings.process is not None and request.query.get("scope") == "process":
            body = msgspec.structs.replace(body, processes=[self._process_health(self.settings.process.index, body)])
        slot = self.settings.process
        if slot is not None and request.query.get("scope") != "process":
            body = await self._with_siblings(body, slot)
        # 503 while draining, so a load balancer's health check takes this replica out first
        return web.Response(status=503 if self.draining else 200, body=_json.encode(body),
                            content_type="application/json")

    def _process_health(self, index: int, health: RouterHealth) -> ProcessHealth:
        return ProcessHealth(index=index, pid=os.getpid(), status=health.status, decisions=self.router.decisions_made,
                             in_flight=self.in_flight, queue_depth=self.queue.depth,
                             indexes_ready=all(i.ready for i in health.indexes))

    async def _with_siblings(self, own: RouterHealth, slot: ProcessSlot) -> RouterHealth:
        """`own` with every process of the replica listed, and the worst status of theirs."""
        answers = await self._tell_siblings("GET", "/healthz?scope=process")
        processes = [self._process_health(slot.index, own)]
        for entry, answer in answers:
            health = None
            if answer is not None:
                try:
                    health = decode_router_health(answer)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
            if health is None or not health.processes:
                processes.append(ProcessHealth(index=entry["index"], pid=entry.get("pid", 0), status="unreachable"))
            else:
                processes.append(health.processes[0])
        seen = {p.index for p in processes}
        processes += [ProcessHealth(index=i, status="unreachable") for i in range(slot.count) if i not in seen]
        statuses = {p.status for p in processes}
        status = ("draining" if "draining" in statuses else "ok" if statuses == {"ok"} else "degraded")
        return msgspec.structs.replace(own, status=status, processes=sorted(processes, key=lambda p: p.index))

    async def _tell_siblings(self, method: str, path: str, body: bytes | None = None,
                             headers=None) -> list[tuple[dict, bytes | None]]:
        """Ask every other process of the replica (their private loopback ports), at once:
        [(its entry, its answer's body or None)]."""
        slot = self.settings.process
        if slot is None:
            return []
        forwarded = {k: v for k, v in (headers or {}).items() if k.lower() in ("authorization", "content-type")}

        async def ask(session: ClientSession, entry: dict) -> tuple[dict, bytes | None]:
            try:
                async with session.request(method, f"http://127.0.0.1:{entry['port']}{path}", data=body,
                                           headers=forwarded) as reply:
                    data = await reply.read()
                    return entry, data if reply.status < 500 or method == "GET" else None
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return entry, None

        siblings = slot.siblings()
        if not siblings:
            return []
        async with ClientSession(timeout=ClientTimeout(total=SIBLING_TIMEOUT_S)) as session:
            return list(await asyncio.gather(*(ask(session, entry) for entry in siblings)))

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(replica_registry(self.metrics.registry)),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # --- proxy mode ---------------------------------------------------------------------
    async def _release_quietly(self, model: str, request_id: str, stage: ReleaseStage) -> None:
        try:
            await self.router.release(model, request_id, stage)
            self.queue.notify()
        except Exception as exc:  # noqa: BLE001 - a lost release only delays expiry
            log.warning("could not release %s (%s) of request %s: %s", stage.value, model, request_id, exc)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = _decode(raw, GenerateRequest)
        self._check_tokens(len(body.input_ids), "input_ids")
        budget = body.sampling_params.max_new_tokens or 0
        self._check_budget(budget, "sampling_params.max_new_tokens")
        model = self._model_of(body.model)
        # The booking has an id of the proxy's own, not the client's rid: a client cannot
        # pre-book (or release) another's request by its rid.
        route = RouteRequest(model=model, token_ids=body.input_ids, request_id=_proxy_booking_id(),
                             max_new_tokens=budget)
        return await self._forward(request, raw, route, received)

    # --- the OpenAI-compatible API (proxy mode) ------------------------------------------
    def _check_prompt_bytes(self, size: int, field: str) -> None:
        if size > self.settings.max_prompt_bytes:
            raise Refused(413, f"{field} has {size} bytes of text; this router tokenizes at most "
                               f"{self.settings.max_prompt_bytes} (--max-prompt-bytes)")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = _decode(raw, CompletionRequest)
        model = self._model_of(body.model)
        self._check_budget(body.output_budget, "max_tokens")
        if isinstance(body.prompt, list):
            tokens, tokenized = body.prompt, False  # token ids: routed as they are
        else:
            tokenizer = self._tokenizer(model)
            size = len(body.prompt.encode("utf-8", "surrogatepass"))
            self._check_prompt_bytes(size, "prompt")
            tokens, tokenized = await self._off_loop(tokenizer.encode_prompt, body.prompt, size), True
            if self.settings.hand_over_token_ids:
                handed = completion_with_prompt_ids(raw, tokens)
                if handed is not None:
                    raw = handed
                    self.metrics.token_ids_handed_over.labels(model).inc()
        self._check_tokens(len(tokens), "prompt")
        route = RouteRequest(model=model, token_ids=tokens, request_id=_proxy_booking_id(),
                             max_new_tokens=body.output_budget)
        return await self._forward(request, raw, route, received, tokenized=tokenized)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = _decode(raw, ChatCompletionRequest)
        model = self._model_of(body.model)
        self._check_budget(body.output_budget, "max_tokens")
        tokenizer = self._tokenizer(model)
        # the text the template is given (contents, tool calls, tools, kwargs) bounds what it renders
        size = body.text_bytes()
        self._check_prompt_bytes(size, "messages")
        try:
            chat = await self._off_loop(tokenizer.tokenize_chat_request, body, size)
        except ChatTemplateError as exc:
            raise Refused(400, str(exc)) from None
        self._check_tokens(len(chat.ids), "messages")
        route = RouteRequest(model=model, token_ids=chat.ids, request_id=_proxy_booking_id(),
                             max_new_tokens=body.output_budget)
        if not chat.exact:
            self.metrics.tokenizer_unchecked.labels(model).inc()
        # images and the like make the ids the text's, not the engine's: routed, not checked
        return await self._forward(request, raw, route, received, tokenized=chat.exact)

    async def models(self, request: web.Request) -> web.Response:
        """The models whose workers have announced (and hold a live lease)."""
        names: set[str] = set()
        directory_of = self.router.directory
        try:
            for token in await directory_of.known_models():
                names.update(meta.model for meta in (await directory_of.get(name_of_token(token))).workers.values())
        except Exception as exc:  # noqa: BLE001 - without Redis: the models last seen live
            log.warning("listing models without the state store (%s): the last known ones", exc)
            for model in self.router.models_seen:
                cached = directory_of.cached(model)
                if cached is not None:
                    names.update(meta.model for meta in cached.workers.values())
        return web.Response(body=_json.encode(ModelList(data=[ModelCard(id=name) for name in sorted(names)])),
                            content_type="application/json")

    def _model_of(self, named: str | None) -> str:
        model = named or self.settings.default_model
        if not model:
            raise Refused(400, "no model: send \"model\" in the body or start the router with --model")
        return model

    def _tokenizer(self, model: str) -> ModelTokenizer:
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None:
            known = ", ".join(sorted(self._tokenizers)) or "none"
            raise Refused(400, f"no tokenizer for model {model!r} (this router has: {known}); start it with "
                               f"--tokenizer {model}=PATH, the folder of the model's tokenizer.json")
        return tokenizer

    async def _off_loop(self, fn, argument, size: int = 0):
        """Tokenization in a pool, so a long prompt never stalls other requests' decisions; a
        long one (`size` bytes) in a pool of its own, so it never stalls the short ones."""
        started = time.perf_counter()
        pool = self._long_pool if size > _LONG_PROMPT_BYTES else self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, argument)
        finally:
            self.metrics.tokenize_seconds.observe(time.perf_counter() - started)

    # --- forwarding -----------------------------------------------------------------------
    def _upstream(self) -> ClientSession:
        if self._session is None:
            s = self.settings
            # limit=0: no cap across workers; each worker (host, port) has a pool of its own
            connector = TCPConnector(limit=0, limit_per_host=s.upstream_connections_per_worker)
            self._session = ClientSession(connector=connector, timeout=ClientTimeout(
                total=s.upstream_timeout_s or None, connect=s.upstream_connect_timeout_s,
                sock_read=s.upstream_idle_timeout_s))
        return self._session

    def _upstream_headers(self, request: web.Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        for name in _FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        if self.settings.engine_api_key:
            headers["Authorization"] = f"Bearer {self.settings.engine_api_key}"
        return headers

    async def _first_byte(self, decision: RouteResponse, path: str, raw: bytes, headers: dict[str, str]
                          ) -> tuple[aiohttp.ClientResponse, bytes] | str:
        """Send the request to the chosen worker and wait for the first bytes of its answer:
        (the answer, its first chunk), or why it failed before any byte (the request can still
        go elsewhere: nothing has reached the client)."""
        upstream = None
        error: BaseException
        try:
            upstream = await self._upstream().post(decision.worker_url.rstrip("/") + path, data=raw,
                                                   headers=headers)
            if upstream.status in _RETRY_STATUSES:
                upstream.release()
                return f"status_{upstream.status}"
            return upstream, await upstream.content.readany()
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            reason, error = "refused", exc
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
            reason, error = "timeout", exc
        except (aiohttp.ClientError, OSError) as exc:
            reason, error = "disconnected", exc
        except BaseException:
            if upstream is not None:
                upstream.close()
            raise
        if upstream is not None:
            upstream.close()
        log.warning("worker %s at %s failed before answering (%s: %s)", decision.worker_id, decision.worker_url,
                    type(error).__name__, error)
        return reason

    def _worker_failed(self, model: str, worker_id: str, reason: str) -> None:
        self.metrics.upstream_failures.labels(reason).inc()
        if self.router.breaker.failed(model, worker_id):
            self._export_circuits()
            log.warning("worker %s/%s failed %d times in a row: left out of this replica's candidates for now",
                        model, worker_id, self.router.breaker.failures_to_open)

    def _export_circuits(self) -> None:
        self.metrics.replace_series(self.metrics.circuit_open, {
            (circuit.model, circuit.worker_id): 1 for circuit in self.router.breaker.open_circuits()})

    async def _forward(self, request: web.Request, raw: bytes, route: RouteRequest, received: float,
                       tokenized: bool = False) -> web.StreamResponse:
        """Route, then send the body unchanged to the same path on the chosen worker and stream
        its answer back. A worker that refuses, times out or fails before the first byte of its
        answer is left for another candidate (up to --migration-limit times; its booking given
        back, the workers tried named in X-Kvtier-Tried); after the first byte nothing is sent
        again, and a stream that breaks ends with an error event. The booking is released at
        the first chunk (prefill done) and at the end, also when the client goes away (aiohttp
        cancels this handler, which closes the upstream). `received`: when the request arrived
        (perf_counter), for the latency histograms; `tokenized`: the router tokenized the prompt,
        so the engine's count in its answer checks the router's tokenizer."""
        model, openai = route.model, request.path in _OPENAI_PATHS
        upstream_headers = self._upstream_headers(request)
        session = request.headers.get("X-Session-Id")
        if session:
            route = msgspec.structs.replace(route, session_id=_session_id(session))
        tried: list[str] = []
        why: list[str] = []  # what each tried worker did, for the 502 if none answers
        booking_id = route.request_id or _proxy_booking_id()
        while True:
            try:
                outcome = await self._decide(route, frozenset(tried))
            except RoutingError as exc:
                if not tried:
                    return _error(exc.status, str(exc), self.metrics, openai)
                return self._none_answered(tried, why, openai)
            if tried:
                self.metrics.migrations.inc()
            decision = outcome.response
            router_s = time.perf_counter() - received
            if not decision.worker_url:
                self.metrics.proxy_requests.labels("no_worker_url").inc()
                attempt: tuple[aiohttp.ClientResponse, bytes] | str = "no_worker_url"
                why.append(f"{decision.worker_id} announced no HTTP endpoint (start its bridge with --worker-url)")
            else:
                try:
                    attempt = await self._first_byte(decision, request.path, raw, upstream_headers)
                except BaseException:
                    await self._release_quietly(model, decision.request_id, ReleaseStage.COMPLETE)
                    raise
                if isinstance(attempt, str):
                    self._worker_failed(model, decision.worker_id, attempt)
                    why.append(f"{decision.worker_id} failed before the first byte ({attempt})")
            if isinstance(attempt, str):
                await self._release_quietly(model, decision.request_id, ReleaseStage.COMPLETE)
                tried.append(decision.worker_id)
                if len(tried) > self.settings.migration_limit:
                    return self._none_answered(tried, why, openai)
                route = msgspec.structs.replace(route, request_id=f"{booking_id}.m{len(tried)}")
                continue
            self.router.breaker.succeeded(model, decision.worker_id)
            upstream, first = attempt
            try:
                return await self._relay(request, route, outcome, upstream, first, received, router_s, tried,
                                         tokenized)
            finally:
                upstream.close()
                await self._release_quietly(model, decision.request_id, ReleaseStage.COMPLETE)

    def _none_answered(self, tried: list[str], why: list[str], openai: bool) -> web.Response:
        self.metrics.proxy_requests.labels("unreachable").inc()
        # The workers' addresses stay in the log: they are the cluster's, not the client's to know.
        response = _error(502, f"no worker answered: {'; '.join(why)}", None, openai)
        response.headers["X-Kvtier-Tried"] = ",".join(tried)
        return response

    async def _relay(self, request: web.Request, route: RouteRequest, outcome: Outcome,
                     upstream: aiohttp.ClientResponse, first: bytes, received: float, router_s: float,
                     tried: list[str], tokenized: bool) -> web.StreamResponse:
        decision, model = outcome.response, route.model
        headers = {"X-Kvtier-Worker": decision.worker_id, "X-Kvtier-Request-Id": decision.request_id,
                   # the router's share of this request's latency, per request, for whoever debugs it
                   "X-Kvtier-Router-Ms": f"{router_s * 1000:.3f}"}
        if decision.degraded:
            headers["X-Kvtier-Degraded"] = ",".join(decision.degraded)
        if tried:
            headers["X-Kvtier-Tried"] = ",".join(tried)
        if decision.affinity:
            headers["X-Kvtier-Affinity"] = decision.affinity
        self.metrics.proxy_overhead.observe(router_s)
        labels = (decision.worker_id, self.settings.routing_mode, decision.overlap.dominant_tier())
        answer = _AnswerTail() if tokenized else None
        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type
        streamed = upstream.content_type == "text/event-stream"
        ok = upstream.status == 200
        if ok:
            if streamed:  # a whole answer's first byte is its last: not a first token
                self.metrics.ttft.labels(*labels).observe(time.perf_counter() - received)
            asyncio.ensure_future(self._release_quietly(model, decision.request_id, ReleaseStage.FIRST_TOKEN))
        await response.prepare(request)
        chunk = first
        try:
            while chunk:
                if answer is not None and ok:
                    answer.add(chunk, keep_all=not streamed)
                await response.write(chunk)
                chunk = await upstream.content.readany()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self.metrics.proxy_requests.labels("failed_after_first_byte").inc()
            failure = f"worker {decision.worker_id} failed mid-answer: {type(exc).__name__}"
            log.warning("%s (%s): %s", failure, decision.worker_url, exc)
            if streamed:
                # The stream has begun (status sent): end it with an error event, which OpenAI
                # clients raise, instead of a connection cut short.
                error = OpenAIErrorBody(error=OpenAIError(message=f"{failure} (mid-stream)", type="server_error",
                                                          code=502))
                await response.write(b"data: " + _json.encode(error) + b"\n\ndata: [DONE]\n\n")
                await response.write_eof()
                return response
            raise
        # Recorded before the answer's end goes out: a client that reads /metrics or /healthz
        # once it has its answer finds the answer counted.
        self.metrics.proxy_requests.labels("ok" if ok else "worker_error").inc()
        if ok:
            self.metrics.request_seconds.labels(*labels).observe(time.perf_counter() - received)
            if answer is not None:
                self._check_tokenization(route, decision, reported_usage(answer.bytes(), streamed))
                self._check_stored_later(model, decision, outcome.pages)
        await response.write_eof()
        return response

    def _check_stored_later(self, model: str, decision: RouteResponse, pages: RequestPages | None) -> None:
        """In `settings.stored_page_check_s`, ask Redis whether the worker holds the request's
        last full page under this router's hash (router/tokenization_check.py). Skipped for a
        decision made without the workers' true state (no state store, a store being rebuilt,
        stale workers only), a prompt shorter than a page, or while many checks are already
        waiting (one Redis command each: a sample is enough)."""
        if pages is None or not len(pages) or len(self._page_checks) >= 256 \
                or self.settings.stored_page_check_s <= 0 or _UNTRUSTED_STATE.intersection(decision.degraded):
            return
        task = asyncio.ensure_future(self._check_stored(model, decision.worker_id, pages.keys[-1]))
        self._page_checks.add(task)
        task.add_done_callback(self._page_checks.discard)

    async def _check_stored(self, model: str, worker_id: str, page: PageKey) -> None:
        await asyncio.sleep(self.settings.stored_page_check_s)
        key = ModelKeys.for_model(model).pages(worker_id)
        members = [page_member(tier, page) for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK)]
        try:
            found = await self.router.redis.smismember(key, members)  # type: ignore[misc]  # async client
        except Exception as exc:  # noqa: BLE001 - no verdict without the store
            log.debug("stored-page check of %s on %s skipped: %s", model, worker_id, exc)
            return
        self.tokenization.record_stored(model, any(found))
        self.metrics.stored_page_checks.labels(model, "found" if any(found) else "missing").inc()

    def _check_tokenization(self, route: RouteRequest, decision: RouteResponse, usage: Usage | None) -> None:
        """The engine's prompt count against the router's (see router/tokenization_check.py);
        an answer without `usage` (a stream that did not ask for it) checks nothing."""
        if usage is None:
            return
        model = route.model
        matched = self.tokenization.record(model, decision.worker_id, len(route.token_ids), usage,
                                           decision.overlap.reusable_pages() * decision.page_size,
                                           decision.page_size)
        self.metrics.tokenizer_checks.labels(model, "match" if matched else "mismatch").inc()
        now = time.monotonic()
        if not matched and now - self._mismatch_logged.get(model, -3600.0) >= 60.0:
            self._mismatch_logged[model] = now
            log.warning("model %s: worker %s counted %d prompt tokens where this router counted %d: the "
                        "router's tokenizer or chat template (--tokenizer) is not the engine's, so its page "
                        "hashes are not either and routing ignores the cache (see /healthz tokenizers)",
                        model, decision.worker_id, usage.prompt_tokens, len(route.token_ids))


_session_decoder = msgspec.json.Decoder(SessionId)


def _session_id(header: str) -> str:
    try:
        return _session_decoder.decode(_json.encode(header))
    except msgspec.ValidationError as exc:
        raise Refused(400, f"X-Session-Id: {exc} (1 to 128 of A-Z a-z 0-9 _ . : -)") from None


def _proxy_booking_id() -> str:
    return PROXY_BOOKING_PREFIX + uuid.uuid4().hex


class _AnswerTail:
    """What the usage check needs of a proxied answer: all of a JSON body (up to a bound), or
    the last part of a stream, where the usage event comes."""

    WHOLE_LIMIT = 8 << 20
    TAIL = 64 << 10

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0

    def add(self, chunk: bytes, keep_all: bool) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        limit = self.WHOLE_LIMIT if keep_all else self.TAIL
        while self._size - len(self._chunks[0]) >= limit and len(self._chunks) > 1:
            self._size -= len(self._chunks.pop(0))

    def bytes(self) -> bytes:
        return b"".join(self._chunks)


async def run_router_service(router: Router, settings: ServiceSettings, host: str, port: int,
                             stop: asyncio.Event, ready=None) -> None:
    service = RouterService(router, settings)
    # handler_cancellation: a client that goes away cancels its handler, so a proxied request
    # stops its upstream request and gives its booking back at once.
    # shutdown_timeout: after the drain, what is still running is cut at once (its bookings are
    # released as each handler ends), not waited on for aiohttp's default minute
    stats = GuardStats(on_close=lambda reason: router.metrics.connections_closed.labels(reason).inc())
    for reason in CLOSE_REASONS:  # exported as 0 from the start
        router.metrics.connections_closed.labels(reason)
    runner = guarded_runner(service.app(), settings.http_limits, stats=stats, access_log=None, handle_signals=False,
                            handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    slot = settings.process
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=slot is not None)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    if slot is not None:
        # Where this process answers its siblings (/healthz?scope=process, PUT /v1/admission).
        private = web.TCPSite(runner, "127.0.0.1", 0)
        await private.start()
        slot.register(private._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    log.info("router %s serving on http://%s:%d", router.router_id, host, bound)
    if ready is not None:
        ready(bound)
    try:
        await stop.wait()
        started = time.monotonic()
        log.info("router %s draining: %d requests in flight, up to %.0f s (--drain-timeout)", router.router_id,
                 service.in_flight, settings.drain_timeout_s)
        left = await service.drain(settings.drain_timeout_s)
        log.info("router %s drained in %.1f s; %d requests cut", router.router_id, time.monotonic() - started, left)
    finally:
        started = time.monotonic()
        await runner.cleanup()
        log.info("router %s stopped (%.1fs)", router.router_id, time.monotonic() - started)


@dataclass
class RouterConfig:
    redis_url: str
    nats_url: str = ""
    host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "kv"  # kv | load | round-robin | random
    shared_cache_type: str = "none"  # none | hicache
    mooncake_master: str = ""
    shared_cache_timeout_s: float = 0.05
    page_size: int | None = None
    booking_ttl_s: float = 600.0
    state_timeout_s: float = 0.25
    #: Redis connections of this replica; a request finding all busy waits for one (up to
    #: redis_pool_wait_s) instead of being routed as if Redis were down: a busy pool is load,
    #: not an outage
    redis_max_connections: int = 256
    redis_pool_wait_s: float = 2.0
    breaker_failures: int = 3
    breaker_backoff_s: float = 5.0
    session_ttl_s: float = 600.0
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    router_id: str = ""
    weights: ScoringWeights | None = None
    seed: int | None = None  # seeds the tie-breaking draws: the same calls give the same decisions
    predicted_pages: bool = False
    state_source: str = "mirror"  # mirror | redis
    service: ServiceSettings = None  # type: ignore[assignment]


async def run_router(config: RouterConfig, stop: asyncio.Event, ready=None) -> None:
    from kvtier.plumbing.connections import redis_async_client

    from .core import RouterSettings
    from .decision_log import DecisionLog
    from .metrics import RouterMetrics
    from .shared_pool import SharedPoolClient

    weights = config.weights or ScoringWeights()
    if config.router_mode == "load":
        # Cache-blind modes are the same machinery with every cache weight at zero: the
        # choice is then by booked load alone, ties broken at random.
        weights = msgspec.structs.replace(weights, overlap_score_credit=0.0, host_cache_hit_weight=0.0,
                                          disk_cache_hit_weight=0.0, shared_cache_multiplier=0.0)
    metrics = RouterMetrics()
    client = redis_async_client(config.redis_url, max_connections=config.redis_max_connections,
                                pool_wait_s=config.redis_pool_wait_s, socket_connect_timeout=config.state_timeout_s,
                                socket_timeout=config.state_timeout_s)
    shared_pool = None
    if config.shared_cache_type == "hicache":
        shared_pool = SharedPoolClient(config.mooncake_master, timeout_s=config.shared_cache_timeout_s)
    decision_log = None
    if config.nats_url:
        decision_log = DecisionLog(config.nats_url, on_published=metrics.decision_log_published.inc,
                                   on_dropped=metrics.decision_log_dropped.inc)
        decision_log.start()
    router = Router(client, RouterSettings(weights=weights, shared_cache=shared_pool is not None,
                                           router_page_size=config.page_size, booking_ttl_s=config.booking_ttl_s,
                                           router_id=config.router_id, predicted_pages=config.predicted_pages,
                                           state_source=config.state_source,
                                           breaker_failures=config.breaker_failures,
                                           breaker_backoff_s=config.breaker_backoff_s,
                                           session_ttl_s=config.session_ttl_s,
                                           admission=config.admission,
                                           selection=config.router_mode if config.router_mode in SELECTIONS
                                           else "score"),
                    metrics, shared_pool=shared_pool, decision_log=decision_log,
                    rng=random.Random(config.seed) if config.seed is not None else None)
    service = dataclasses.replace(config.service or ServiceSettings(), routing_mode=config.router_mode)
    try:
        await run_router_service(router, service, config.host, config.http_port, stop, ready)
    finally:
        if decision_log is not None:
            await decision_log.close()
        if shared_pool is not None:
            await shared_pool.close()
        await client.aclose() if hasattr(client, "aclose") else await client.close()
