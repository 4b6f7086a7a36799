"""`kvtier router`: the HTTP edge of a stateless router replica.

  POST /v1/route      {"model", "token_ids", "request_id"?, "overrides"?, "max_new_tokens"?, "book"?}
  POST /v1/release    {"model", "request_id", "owner", "stage": "first_token" | "complete", "ttft_ms"?}
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
import hmac
import logging
import os
import random
import secrets
import time
import uuid

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.schemas.router_health import (
    DecisionLogHealth,
    EngineQueueHealth,
    HashSchemeHealth,
    MismatchedWorker,
    PartialWorker,
    ProcessHealth,
    QueueHealth,
    RouterHealth,
    SharedPoolHealth,
    StateStoreHealth,
)
from kvtier.schemas.routing import (
    AdmissionChange,
    AdmissionSettings,
    ReleaseRequest,
    ReleaseStage,
    RouteRequest,
)

from .admission import SHUTTING_DOWN, AdmissionQueue, Refusal
from .config import RouterConfig
from .core import Outcome, Router, RoutingError
from .errors import NotOwner
from .http_guard import CLOSE_REASONS, GuardStats, guarded_runner
from .metrics import replica_registry
from .processes import ProcessSlot
from .proxy import PROXY_BOOKING_PREFIX, Proxy, export_circuits
from .refusals import OPENAI_PATHS, Refused, check_budget, check_tokens, decode_body, error_response, json_encoder
from .service_settings import ServiceSettings
from .settings import SharedCacheType
from .siblings import admission_answer, tell_siblings, with_siblings
from .state import read_engine_queues

__all__ = ("PROXY_BOOKING_PREFIX", "Refused", "RouterConfig", "RouterService", "ServiceSettings", "run_router",
           "run_router_service")

log = logging.getLogger("kvtier.router.http")

#: kvtier/bench/fuzz.py and tests/bench/test_fuzz.py decode bodies as the edge does, by this name.
_decode = decode_body

#: Paths served while draining and not counted as in flight: health, metrics, and releases
#: (a client's booking must still be given back).
_ALWAYS_SERVED = frozenset({"/healthz", "/metrics", "/v1/release"})

#: The least a drain lasts (seconds, within --drain-timeout): new requests are refused for at
#: least this long before the listener closes.
_DRAIN_LINGER_S = 1.0

#: A router leaves at most this long after its --drain-timeout has passed since SIGTERM: the
#: cut streams' error events, the releases under way, the HTTP server's close.
STOP_MARGIN_S = 2.0
#: Of STOP_MARGIN_S, kept for what follows the HTTP server's cleanup (the Redis and NATS
#: clients' close, the interpreter's exit).
_EXIT_SLACK_S = 0.4
#: How long the cut streams' handlers get to write their error event and release.
_CUT_WAIT_S = 0.3
#: How long the releases under way get to reach Redis before its client closes.
_SETTLE_S = 0.3

#: How long /healthz reuses its read of the processors' hash checks.
_STORE_HEALTH_S = 1.0


class RouterService:
    """The HTTP edge of one router process: auth, admission and the drain, /v1/route,
    /v1/release, /healthz and /metrics; with --proxy, the proxied paths (router/proxy.py)."""

    def __init__(self, router: Router, settings: ServiceSettings):
        self.router = router
        self.settings = settings
        self.metrics = router.metrics
        self._housekeeping: asyncio.Task | None = None
        self._hash_checks_read = -1e9
        self._engine_queues: list[EngineQueueHealth] = []  # re-read with the hash checks
        self.queue = AdmissionQueue(on_depth=self.metrics.queue_depth.set, on_wait=self.metrics.queue_wait.observe)
        self._apply_admission(router.settings.admission)
        self.proxy = Proxy(router, settings, self.queue, self._decide)
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
            app.router.add_post("/generate", self.proxy.generate)
            app.router.add_post("/v1/completions", self.proxy.completions)
            app.router.add_post("/v1/chat/completions", self.proxy.chat_completions)
            app.router.add_get("/v1/models", self.proxy.models)
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
        await self.proxy.releases.settle(_SETTLE_S)
        await self.router.close()
        await self.proxy.close()

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.housekeeping_s)
            await self.router.housekeeping()
            export_circuits(self.router)
            self.proxy.export_tokenizer_caches()
            await self.router.start_indexes(quiet=True)  # models that appeared since

    def _refuse_unauthorized(self, request: web.Request, token: str) -> web.Response | None:
        """Bearer-token check before anything else (the body is not even read): every path but
        the open ones needs it when the router has a token. Compared in constant time; the
        answer never repeats what was sent. None: let the request through."""
        path = request.path
        if path == "/healthz" or (path == "/metrics" and not self.settings.protect_metrics):
            return None
        refused = _bearer_refusal(request, token)
        if refused is None:
            return None
        message, error = refused
        response = error_response(401, message, self.metrics)
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
        openai = request.path in OPENAI_PATHS
        counted = request.path not in _ALWAYS_SERVED
        if counted and self.draining:
            self.metrics.admission_refusals.labels("draining").inc()
            response = error_response(503, SHUTTING_DOWN, None, openai)
            response.headers["Retry-After"] = "1"
            response.force_close()  # Connection: close, so no client keeps sending on it
            return response
        if counted:
            self.in_flight += 1
        try:
            return await handler(request)
        except Refused as exc:
            response = error_response(exc.status, exc.message, self.metrics, openai)
            response.headers.update(exc.headers)
            return response
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body larger than {self.settings.max_body_bytes} bytes",
                                  self.metrics, openai)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(exc.status, exc.reason or exc.text or "bad request", self.metrics, openai)
            raise
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(400, f"invalid request body: {exc}", self.metrics, openai)
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
            change = decode_body(raw, AdmissionChange)
            self._apply_admission(change.applied_to(self.router.settings.admission))
            log.warning("admission changed on this replica: %s", self.router.settings.admission)
            replies = [] if request.query.get("scope") == "process" else await tell_siblings(
                self.settings.process, "PUT", "/v1/admission?scope=process", raw, request.headers)
            answer = admission_answer(self.router.settings.admission, self.router.router_id,
                                      self.settings.process, replies)
            return web.Response(body=json_encoder.encode(answer), content_type="application/json")
        return web.Response(body=json_encoder.encode(self.router.settings.admission), content_type="application/json")

    async def _decide(self, route: RouteRequest, exclude: frozenset[str] = frozenset(), owner: str = "") -> Outcome:
        """A decision, waiting in the queue while every candidate is busy; past the queue's
        bounds a refusal with Retry-After."""
        try:
            return await self.queue.admit(lambda: self.router.route(route, exclude=exclude, owner=owner))
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
    @staticmethod
    def _check_client_id(request_id: str | None) -> None:
        if request_id and request_id.startswith(PROXY_BOOKING_PREFIX):
            raise Refused(400, f"request ids starting with {PROXY_BOOKING_PREFIX!r} are the proxy's own bookings; "
                               "choose another request_id")

    async def route(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), RouteRequest)
        check_tokens(len(body.token_ids), "token_ids", self.settings)
        check_budget(body.max_new_tokens, "max_new_tokens", self.settings)
        self._check_client_id(body.request_id)
        if body.request_id is None:  # named here, so a decision cut short can give its booking back
            body = msgspec.structs.replace(body, request_id=uuid.uuid4().hex)
        owner = secrets.token_urlsafe(16) if body.book else ""
        try:
            outcome = await self._decide(body, owner=owner)
        except RoutingError as exc:
            return error_response(exc.status, str(exc), self.metrics)
        except Refused:
            raise
        except BaseException:
            # the client went away (or the drain cut it) after the booking script may have run:
            # nobody holds its owner secret, so the router gives it back
            self.proxy.releases.hold(self.router.release(body.model, body.request_id, ReleaseStage.COMPLETE))
            raise
        answer = msgspec.structs.replace(outcome.response, owner=owner) if outcome.response.booked else outcome.response
        headers = {"X-Kvtier-Worker": answer.worker_id}
        if answer.degraded:
            headers["X-Kvtier-Degraded"] = ",".join(answer.degraded)
        return web.Response(body=json_encoder.encode(answer), content_type="application/json", headers=headers)

    async def release(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), ReleaseRequest)
        self._check_client_id(body.request_id)
        # With a token every client holds the operator's secret: its first tokens teach in full.
        # Without one anyone may release (its own bookings), so what it reports is bounded.
        client = "" if self.settings.auth_token else (request.remote or "unknown")
        try:
            # held apart from this handler: a client gone mid-release cannot lose it
            released = await asyncio.shield(self.proxy.releases.hold(self.router.release(
                body.model, body.request_id, body.stage, body.ttft_ms, body.owner, client)))
            self.queue.notify()
        except NotOwner as exc:
            return error_response(exc.status, str(exc), self.metrics)
        except Exception as exc:  # noqa: BLE001 - the store is down: the booking expires by itself
            return error_response(503, f"state store unavailable ({type(exc).__name__}: {exc}); the booking "
                                       "expires after --booking-ttl")
        if not released.released:
            return error_response(404, f"no booking for request id {body.request_id!r} of model {body.model!r} "
                                       "(never booked, already released, or expired)", self.metrics)
        return web.Response(body=json_encoder.encode(released), content_type="application/json")

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
        mismatches = router.checks.hash_mismatches
        if state_ok and time.monotonic() - self._hash_checks_read >= _STORE_HEALTH_S:
            try:
                mismatches = await asyncio.wait_for(router.checks.refresh(), 0.5)
                self._engine_queues = await asyncio.wait_for(read_engine_queues(router.redis, time.time() * 1000), 0.5)
                self._hash_checks_read = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - health reports, it does not fail
                log.warning("reading hash checks or engine queues failed: %s", exc)
        return state_ok, state_error, mismatches

    async def healthz(self, request: web.Request) -> web.Response:
        router = self.router
        state_ok, state_error, mismatches = await self._store_health()
        shared = SharedPoolHealth(enabled=router.asks_shared_pool, credited=router.settings.shared_cache,
                                  last_error=router.last_shared_pool_error)
        hash_scheme = HashSchemeHealth(ok=not mismatches, mismatched_workers=[
            MismatchedWorker(model=model, worker_id=check.worker_id, mismatched_pages=check.mismatched,
                             checked_pages=check.checked, kinds=check.mismatch_kinds, explanation=check.explanation)
            for model, check in mismatches])
        decision_log = router.decision_log
        tokenizers = self.proxy.tokenization.health()
        healthy = state_ok and not shared.last_error and hash_scheme.ok and all(t.ok for t in tokenizers)
        body = RouterHealth(
            status="draining" if self.draining else "ok" if healthy else "degraded",
            router_id=router.router_id,
            routing="tier-aware" if state_ok else "load/round-robin (state store unavailable)",
            state_store=StateStoreHealth(ok=state_ok, error=state_error or router.last_state_error),
            shared_pool=shared,
            hash_scheme=hash_scheme,
            partial_workers=[PartialWorker(model=model, worker_id=w)
                             for model, workers in router.checks.partial_workers.items() for w in workers],
            engine_queues=self._engine_queues,
            pricing="learned-rates" if router.settings.faster_pick else "formula",
            worker_rates=router.checks.worker_rates,
            page_size=router.settings.router_page_size,
            decision_log=DecisionLogHealth(enabled=decision_log is not None,
                                           connected=bool(decision_log is not None and decision_log.connected)),
            models=sorted(router.models_seen),
            state_source="index" if router.indexes is not None else "redis",
            indexes=router.indexes.health() if router.indexes is not None else [],
            tokenizers=tokenizers,
            open_circuits=router.breaker.open_circuits(),
            queue=QueueHealth(depth=self.queue.depth, peak=self.queue.peak, size=self.queue.size,
                              timeout_s=self.queue.timeout_s),
        )
        if self.settings.process is not None and request.query.get("scope") == "process":
            body = msgspec.structs.replace(body, processes=[self._process_health(self.settings.process.index, body)])
        slot = self.settings.process
        if slot is not None and request.query.get("scope") != "process":
            body = await self._with_siblings(body, slot, request)
        if self.settings.auth_token and _bearer_refusal(request, self.settings.auth_token) is not None:
            body = RouterHealth(status=body.status, routing=body.routing,
                                state_store=StateStoreHealth(ok=body.state_store.ok), summary_only=True)
        # 503 while draining, so a load balancer's health check takes this replica out first
        return web.Response(status=503 if self.draining else 200, body=json_encoder.encode(body),
                            content_type="application/json")

    def _process_health(self, index: int, health: RouterHealth) -> ProcessHealth:
        return ProcessHealth(index=index, pid=os.getpid(), status=health.status, decisions=self.router.decisions_made,
                             in_flight=self.in_flight, queue_depth=self.queue.depth,
                             indexes_ready=all(i.ready for i in health.indexes))

    async def _with_siblings(self, own: RouterHealth, slot: ProcessSlot, request: web.Request) -> RouterHealth:
        answers = await tell_siblings(slot, "GET", "/healthz?scope=process", headers=request.headers)
        return with_siblings(own, self._process_health(slot.index, own), slot, answers)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(replica_registry(self.metrics.registry)),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


def _bearer_refusal(request: web.Request, token: str) -> tuple[str, str] | None:
    """Why the request's bearer token is not `token` (the message, the WWW-Authenticate error),
    or None when it is. Compared in constant time."""
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if not header:
        return ("missing bearer token: this router requires 'Authorization: Bearer <token>' (its --auth-token)",
                "invalid_request")
    if scheme.lower() != "bearer" or not given.strip():
        return "the Authorization header must be 'Bearer <token>'", "invalid_request"
    # surrogateescape: a header byte that is not UTF-8 (aiohttp keeps it as a surrogate)
    # compares as itself instead of failing the encode
    if hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode()):
        return None
    return "invalid bearer token", "invalid_token"


async def run_router_service(router: Router, settings: ServiceSettings, host: str, port: int,
                             stop: asyncio.Event, ready=None) -> None:
    service = RouterService(router, settings)
    # handler_cancellation: a client that goes away cancels its handler, so a proxied request
    # stops its upstream request and gives its booking back at once.
    # shutdown_timeout: after the drain (and the cut of what it left), what is still running is
    # cut at once (its bookings are released as each handler ends), not waited on for
    # aiohttp's default minute
    stats = GuardStats(on_close=lambda reason: router.metrics.connections_closed.labels(reason).inc())
    for reason in CLOSE_REASONS:  # exported as 0 from the start
        router.metrics.connections_closed.labels(reason)
    runner = guarded_runner(service.app(), settings.http_limits, stats=stats, access_log=None, handle_signals=False,
                            handler_cancellation=True, shutdown_timeout=0.5)
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
    stopped_at = time.monotonic()
    try:
        await stop.wait()
        stopped_at = time.monotonic()
        log.info("router %s draining: %d requests in flight, up to %.0f s (--drain-timeout)", router.router_id,
                 service.in_flight, settings.drain_timeout_s)
        left = await service.drain(settings.drain_timeout_s)
        if left:
            # What is still relayed ends with the error event (and its booking is released)
            # before the listener closes, not with a connection the cleanup cuts.
            await service.proxy.cut_streams("this router is shutting down (--drain-timeout passed)", _CUT_WAIT_S)
        log.info("router %s drained in %.1f s; %d requests cut", router.router_id, time.monotonic() - stopped_at,
                 left)
    finally:
        started = time.monotonic()
        # Bounded: the process leaves within --drain-timeout + STOP_MARGIN_S of the signal
        # whatever hangs in the cleanup (a socket, a client's close); commands/router.py
        # forces the exit should this bound fail too.
        budget = max(settings.drain_timeout_s + STOP_MARGIN_S - _EXIT_SLACK_S - (started - stopped_at), 0.1)
        try:
            await asyncio.wait_for(runner.cleanup(), budget)
        except asyncio.TimeoutError:
            log.error("router %s: the HTTP server's cleanup took longer than %.1f s; stopping without it",
                      router.router_id, budget)
        log.info("router %s stopped (%.1fs)", router.router_id, time.monotonic() - started)


async def run_router(config: RouterConfig, stop: asyncio.Event, ready=None) -> None:
    from kvtier.plumbing.connections import redis_async_client

    from .decision_log import DecisionLog
    from .metrics import RouterMetrics
    from .shared_pool import SharedPoolClient

    metrics = RouterMetrics()
    client = redis_async_client(config.redis_url, max_connections=config.redis_max_connections,
                                pool_wait_s=config.redis_pool_wait_s, socket_connect_timeout=config.state_timeout_s,
                                socket_timeout=config.state_timeout_s)
    shared_pool = None
    credited = config.shared_cache_type is SharedCacheType.HICACHE
    if credited or (config.mooncake_master and config.learn_rates):  # asked to credit its pages, or to price them
        shared_pool = SharedPoolClient(config.mooncake_master, timeout_s=config.shared_cache_timeout_s)
    decision_log = None
    if config.nats_url:
        decision_log = DecisionLog(config.nats_url, on_published=metrics.decision_log_published.inc,
                                   on_dropped=metrics.decision_log_dropped.inc)
        decision_log.start()
    router = Router(client, config.router_settings(shared_cache=credited), metrics,
                    shared_pool=shared_pool, decision_log=decision_log,
                    rng=random.Random(config.seed) if config.seed is not None else None)
    service = config.service_settings()
    try:
        await run_router_service(router, service, config.host, config.http_port, stop, ready)
    finally:
        if decision_log is not None:
            await decision_log.close(drain_s=0.3)
        if shared_pool is not None:
            await shared_pool.close()
        await client.aclose() if hasattr(client, "aclose") else await client.close()
