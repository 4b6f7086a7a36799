"""The proxied paths of a router replica (--proxy): SGLang's /generate, and the OpenAI-compatible
/v1/completions, /v1/chat/completions and /v1/models, whose text is tokenized here with the
model's own tokenizer and chat template (--tokenizer).

A proxied request is routed, then sent unchanged to the same path on the chosen worker, and its
answer streamed back. A worker that fails before the first byte of its answer is left for another
candidate (--migration-limit); a stream that breaks after it ends with an error event. The HTTP
edge (router/service.py) registers these handlers and owns admission, auth and the drain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from kvtier.plumbing.tokenizer import ChatTemplateError, ModelTokenizer
from kvtier.schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorBody,
    completion_with_prompt_ids,
    reported_usage,
)
from kvtier.schemas.routing import GenerateRequest, ReleaseStage, RouteRequest, RouteResponse, SessionId
from kvtier.schemas.subjects import name_of_token

from . import rates
from .admission import AdmissionQueue
from .answers import STREAM_END, AnswerTail, Relay, answer_headers, malformed
from .core import Outcome, Router, RoutingError
from .refusals import OPENAI_PATHS, Refused, check_budget, check_tokens, decode_body, error_response, json_encoder
from .releases import Releases
from .service_settings import ServiceSettings
from .tokenization_watch import TokenizationWatch

log = logging.getLogger("kvtier.router.http")

#: Request headers a proxied request carries to its worker: tracing, and the client's request id.
_FORWARDED_HEADERS = ("traceparent", "tracestate", "baggage", "X-Request-Id")
#: Booking ids of proxied requests start with this; /v1/route and /v1/release refuse such ids,
#: so no client can release (or pre-book) a proxied request's booking.
PROXY_BOOKING_PREFIX = "proxy:"
#: 5xx statuses counted under their own reason in router_upstream_failures (any other 5xx is
#: "status_5xx"); every 5xx before the first byte of an answer migrates the request.
_NAMED_STATUSES = frozenset({500, 502, 503, 504})
#: What a chat's size counts for each message beyond its text: the role and the markers the
#: template wraps it in (a few to a few dozen bytes in common templates), so a chat of many
#: empty messages is as large as what it renders.
CHAT_MESSAGE_BYTES = 32
#: Text prompts longer than this (bytes) are tokenized in a pool of their own, so a few long
#: prompts never hold back the short ones.
_LONG_PROMPT_BYTES = 64 << 10

#: A decision for a request, leaving out the workers already tried (the edge's admission queue).
Decide = Callable[[RouteRequest, frozenset[str]], Awaitable[Outcome]]
#: A worker's answer and its first chunk, or why it gave none.
Attempt = tuple[aiohttp.ClientResponse, bytes] | str


def export_circuits(router: Router) -> None:
    """router_worker_circuit_open: 1 for each worker this replica leaves out now."""
    router.metrics.replace_series(router.metrics.circuit_open, {
        (circuit.model, circuit.worker_id): 1 for circuit in router.breaker.open_circuits()})


class Proxy:
    """The proxied handlers of one replica, with what they hold: the models' tokenizers and their
    pools, the upstream connection pools, and the tokenization checks."""

    def __init__(self, router: Router, settings: ServiceSettings, queue: AdmissionQueue, decide: Decide) -> None:
        self.router = router
        self.settings = settings
        self.metrics = router.metrics
        self.queue = queue
        self._decide = decide
        self._session: ClientSession | None = None
        # Loaded at start (a bad folder stops the router there, not at the first request).
        self._tokenizers = {model: ModelTokenizer.load(path, cache_bytes=settings.tokenizer_cache_bytes)
                            for model, path in settings.tokenizers.items()}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-tokenize")
        self._long_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                thread_name_prefix="kvtier-tokenize-long")
        self.tokenization = TokenizationWatch(router, settings.stored_page_check_s, self._tokenizers)
        self.releases = Releases(router, queue.notify)
        #: The answers being relayed now, so a drain that runs out of time can end each one
        #: with the error event instead of a cut connection.
        self._relays: set[Relay] = set()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._long_pool.shutdown(wait=False, cancel_futures=True)
        self.tokenization.cancel()

    def export_tokenizer_caches(self) -> None:
        for model, tokenizer in self._tokenizers.items():
            if (cache := tokenizer.piece_cache) is not None:
                self.metrics.tokenizer_cache_bytes.labels(model).set(cache.bytes)

    # --- the handlers ---------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = decode_body(raw, GenerateRequest)
        check_tokens(len(body.input_ids), "input_ids", self.settings)
        budget = body.sampling_params.max_new_tokens or 0
        check_budget(budget, "sampling_params.max_new_tokens", self.settings)
        model = self._model_of(body.model)
        # The booking has an id of the proxy's own, not the client's rid: a client cannot
        # pre-book (or release) another's request by its rid.
        route = RouteRequest(model=model, token_ids=body.input_ids, request_id=_proxy_booking_id(),
                             max_new_tokens=budget)
        return await self._forward(request, raw, route, received)

    def _check_prompt_bytes(self, size: int, field: str) -> None:
        if size > self.settings.max_prompt_bytes:
            raise Refused(413, f"{field} has {size} bytes of text; this router tokenizes at most "
                               f"{self.settings.max_prompt_bytes} (--max-prompt-bytes)")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = decode_body(raw, CompletionRequest)
        model = self._model_of(body.model)
        check_budget(body.output_budget, "max_tokens", self.settings)
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
        check_tokens(len(tokens), "prompt", self.settings)
        route = RouteRequest(model=model, token_ids=tokens, request_id=_proxy_booking_id(),
                             max_new_tokens=body.output_budget)
        return await self._forward(request, raw, route, received, tokenized=tokenized)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        raw = await request.read()
        body = decode_body(raw, ChatCompletionRequest)
        model = self._model_of(body.model)
        check_budget(body.output_budget, "max_tokens", self.settings)
        tokenizer = self._tokenizer(model)
        count = len(body.messages)
        if count > self.settings.max_chat_messages:
            raise Refused(413, f"messages has {count} messages; this router renders at most "
                               f"{self.settings.max_chat_messages} (--max-chat-messages)")
        # the text the template is given (contents, tool calls, tools, kwargs), and what it wraps
        # each message in, bound what it renders
        size = body.text_bytes() + count * CHAT_MESSAGE_BYTES
        self._check_prompt_bytes(size, "messages")
        try:
            chat = await self._off_loop(tokenizer.tokenize_chat_request, body, size)
        except ChatTemplateError as exc:
            raise Refused(400, str(exc)) from None
        check_tokens(len(chat.ids), "messages", self.settings)
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
        return web.Response(body=json_encoder.encode(ModelList(data=[ModelCard(id=name) for name in sorted(names)])),
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
        long one (`size` bytes) in a pool of its own, so it never stalls the short ones. Past
        --tokenize-timeout (waiting in the pool included) the request is refused: one not begun
        yet never runs, one running is left to finish in its thread (Python cannot stop it)."""
        started = time.perf_counter()
        pool = self._long_pool if size > _LONG_PROMPT_BYTES else self._pool
        future = pool.submit(fn, argument)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.settings.tokenize_timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            self.metrics.tokenize_timeouts.inc()
            raise Refused(413, f"rendering and tokenizing this prompt took longer than "
                               f"{self.settings.tokenize_timeout_s:g} s (--tokenize-timeout)") from None
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

    async def _first_byte(self, decision: RouteResponse, path: str, raw: bytes, headers: dict[str, str]) -> Attempt:
        """Send the request to the chosen worker and wait for the first bytes of its answer:
        (the answer, its first chunk), or why it failed before any byte (the request can still
        go elsewhere: nothing has reached the client)."""
        upstream = None
        error: BaseException
        try:
            upstream = await self._upstream().post(decision.worker_url.rstrip("/") + path, data=raw,
                                                   headers=headers)
            if upstream.status >= 500:
                upstream.release()
                log.warning("worker %s at %s answered %d before any byte of an answer", decision.worker_id,
                            decision.worker_url, upstream.status)
                return f"status_{upstream.status}" if upstream.status in _NAMED_STATUSES else "status_5xx"
            first = await upstream.content.readany()
            unusable = malformed(upstream, first)
            if unusable:
                upstream.close()
                log.warning("worker %s at %s answered nothing usable: %s", decision.worker_id, decision.worker_url,
                            unusable)
                return "malformed"
            return upstream, first
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
            export_circuits(self.router)
            log.warning("worker %s/%s failed %d times in a row: left out of this replica's candidates for now",
                        model, worker_id, self.router.breaker.failures_to_open)

    async def _forward(self, request: web.Request, raw: bytes, route: RouteRequest, received: float,
                       tokenized: bool = False) -> web.StreamResponse:
        """Route, then send the body unchanged to the same path on the chosen worker and stream
        its answer back. A worker that refuses, times out, fails (a 5xx) or answers nothing
        usable before the first byte of its answer is left for another candidate (up to
        --migration-limit times; its booking given back, the workers tried named in
        X-Kvtier-Tried), and counts as a failure for its circuit; after the first byte nothing
        is sent again, and a stream that breaks ends with an error event. The booking is
        released at the first chunk (prefill done) and on every way out of this handler: the
        end, the client gone (aiohttp cancels this handler, which closes the upstream), an
        upstream error or timeout, a drain that cuts the stream (see `_release_later`).
        `received`: when the request arrived (perf_counter), for the latency histograms;
        `tokenized`: the router tokenized the prompt, so the engine's count in its answer
        checks the router's tokenizer."""
        model, openai = route.model, request.path in OPENAI_PATHS
        upstream_headers = self._upstream_headers(request)
        session = request.headers.get("X-Session-Id")
        if session:
            route = msgspec.structs.replace(route, session_id=_session_id(session))
        tried: list[str] = []
        why: list[str] = []  # what each tried worker did, for the 502 if none answers
        booking_id = route.request_id or _proxy_booking_id()
        route = msgspec.structs.replace(route, request_id=booking_id)
        while True:
            try:
                outcome = await self._decided(route, tried)
            except RoutingError as exc:
                if not tried:
                    return error_response(exc.status, str(exc), self.metrics, openai)
                return self._none_answered(tried, why, openai)
            if tried:
                self.metrics.migrations.inc()
            decision = outcome.response
            router_s = time.perf_counter() - received
            attempt = await self._try_worker(model, decision, request.path, raw, upstream_headers, why)
            if isinstance(attempt, str):
                await self.releases.awaited(model, decision.request_id, ReleaseStage.COMPLETE)
                tried.append(decision.worker_id)
                if len(tried) > self.settings.migration_limit:
                    return self._none_answered(tried, why, openai)
                route = msgspec.structs.replace(route, request_id=f"{booking_id}.m{len(tried)}")
                continue
            self.router.breaker.succeeded(model, decision.worker_id)
            upstream, first = attempt
            relay = Relay(upstream, streamed=upstream.content_type == "text/event-stream")
            self._relays.add(relay)
            try:
                return await self._relay(request, route, outcome, relay, first, received, router_s, tried,
                                         tokenized)
            finally:
                self._relays.discard(relay)
                upstream.close()
                await self.releases.awaited(model, decision.request_id, ReleaseStage.COMPLETE,
                                            after=relay.first_token_release)

    async def _decided(self, route: RouteRequest, tried: list[str]) -> Outcome:
        """The decision for `route`. Cut short by anything but a refusal (the client gone, the
        drain), its booking is given back: the booking script may have run before the
        cancellation reached this await."""
        try:
            return await self._decide(route, frozenset(tried))
        except (RoutingError, Refused):
            raise
        except BaseException:
            assert route.request_id is not None
            self.releases.later(route.model, route.request_id, ReleaseStage.COMPLETE)
            raise

    async def _try_worker(self, model: str, decision: RouteResponse, path: str, raw: bytes,
                          headers: dict[str, str], why: list[str]) -> Attempt:
        """The chosen worker's first byte, or why it gave none (also said in `why`, for the 502).
        Cancelled or failing otherwise, the decision's booking is given back first."""
        if not decision.worker_url:
            self.metrics.proxy_requests.labels("no_worker_url").inc()
            why.append(f"{decision.worker_id} announced no HTTP endpoint (start its bridge with --worker-url)")
            return "no_worker_url"
        try:
            attempt = await self._first_byte(decision, path, raw, headers)
        except BaseException:
            await self.releases.awaited(model, decision.request_id, ReleaseStage.COMPLETE)
            raise
        if isinstance(attempt, str):
            self._worker_failed(model, decision.worker_id, attempt)
            why.append(f"{decision.worker_id} failed before the first byte ({attempt})")
        return attempt

    def _none_answered(self, tried: list[str], why: list[str], openai: bool) -> web.Response:
        self.metrics.proxy_requests.labels("unreachable").inc()
        # The workers' addresses stay in the log: they are the cluster's, not the client's to know.
        response = error_response(502, f"no worker answered: {'; '.join(why)}", None, openai)
        response.headers["X-Kvtier-Tried"] = ",".join(tried)
        return response

    async def _relay(self, request: web.Request, route: RouteRequest, outcome: Outcome, relay: Relay,
                     first: bytes, received: float, router_s: float, tried: list[str],
                     tokenized: bool) -> web.StreamResponse:
        decision, model, upstream, streamed = outcome.response, route.model, relay.upstream, relay.streamed
        headers = answer_headers(decision, router_s, tried)
        self.metrics.proxy_overhead.observe(router_s)
        labels = (decision.worker_id, self.settings.routing_mode, decision.overlap.dominant_tier())
        answer = AnswerTail() if tokenized else None
        response = web.StreamResponse(status=upstream.status, headers=headers)
        response.content_type = upstream.content_type
        ok = upstream.status == 200
        if ok:
            # The worker's own first-token time (from sending it the request) teaches its rates;
            # a whole answer's first byte is its last, not a first token, and teaches nothing.
            first_token_ms = rates.NOT_A_SAMPLE_MS
            if streamed:
                now = time.perf_counter()
                self.metrics.ttft.labels(*labels).observe(now - received)
                first_token_ms = max((now - received - router_s) * 1000, 0.001)
            relay.first_token_release = self.releases.later(model, decision.request_id, ReleaseStage.FIRST_TOKEN,
                                                            first_token_ms)
        recorded = False

        def record_end() -> None:
            # Recorded before the answer's end goes out: a client that reads /metrics or
            # /healthz once it has its answer finds it counted (and one that closes right
            # after the stream's [DONE], cancelling this handler, does not lose it).
            nonlocal recorded
            recorded = True
            self.metrics.proxy_requests.labels("ok" if ok else "worker_error").inc()
            if ok:
                self.metrics.request_seconds.labels(*labels).observe(time.perf_counter() - received)
                if answer is not None:
                    self.tokenization.check_counts(route, decision, reported_usage(answer.bytes(), streamed))
                    self.tokenization.check_stored_later(model, decision, outcome.pages)

        await response.prepare(request)
        chunk = first
        try:
            while chunk:
                if answer is not None and ok:
                    answer.add(chunk, keep_all=not streamed)
                if streamed and not recorded and chunk.rstrip().endswith(STREAM_END):
                    record_end()
                await response.write(chunk)
                if relay.cut:
                    break
                chunk = await upstream.content.readany()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if not await self._end_broken_answer(response, decision, exc, relay):
                raise
            return response
        if relay.cut:  # the drain closed the upstream: the answer did not end
            if not await self._end_broken_answer(response, decision, None, relay):
                raise ConnectionResetError(relay.cut)
            return response
        if not recorded:
            record_end()
        await response.write_eof()
        return response

    async def _end_broken_answer(self, response: web.StreamResponse, decision: RouteResponse,
                                 exc: BaseException | None, relay: Relay) -> bool:
        """The worker failed mid-answer, or the drain cut it (`relay.cut`): counted and logged.
        A stream has begun (its status is sent), so it ends with an error event, which OpenAI
        clients raise, and `[DONE]`, instead of a connection cut short: True. A whole body
        cannot say so: False, and the caller lets the error cut it."""
        if relay.cut:
            self.metrics.proxy_requests.labels("cut_by_drain").inc()
            failure, code = f"{relay.cut}: the answer from worker {decision.worker_id} was cut", 503
            log.warning("%s", failure)
        else:
            self.metrics.proxy_requests.labels("failed_after_first_byte").inc()
            failure, code = f"worker {decision.worker_id} failed mid-answer: {type(exc).__name__}", 502
            log.warning("%s (%s): %s", failure, decision.worker_url, exc)
        if not relay.streamed:
            return False
        error = OpenAIErrorBody(error=OpenAIError(message=f"{failure} (mid-stream)", type="server_error", code=code))
        await response.write(b"data: " + json_encoder.encode(error) + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return True

    async def cut_streams(self, reason: str, timeout_s: float) -> int:
        """The drain ran out of time: every answer still being relayed is stopped (its upstream
        closed) and, when it is a stream, ended with the error event; waits up to `timeout_s`
        for their handlers to finish. The number that were cut."""
        relays = list(self._relays)
        for relay in relays:
            relay.cut = reason
            relay.upstream.close()
        deadline = time.monotonic() + timeout_s
        while self._relays & set(relays) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(relays)


_session_decoder = msgspec.json.Decoder(SessionId)


def _session_id(header: str) -> str:
    try:
        return _session_decoder.decode(json_encoder.encode(header))
    except msgspec.ValidationError as exc:
        raise Refused(400, f"X-Session-Id: {exc} (1 to 128 of A-Z a-z 0-9 _ . : -)") from None


def _proxy_booking_id() -> str:
    return PROXY_BOOKING_PREFIX + uuid.uuid4().hex
