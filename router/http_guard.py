"""Server-side timeouts and a connection cap for an aiohttp server.

Plain aiohttp lets a client hold a connection open for an hour or more: a new socket that never
sends anything, a request head dribbled one byte at a time (slowloris), a body shorter than its
Content-Length or a chunked body that never ends stay open until the client gives up, and its
idle keep-alive timeout defaults to 3630 s. Each of them pins a file descriptor, so a few
hundred such sockets exhaust a process's descriptor limit and normal requests fail. This module
bounds every phase of a connection and caps how many there are:

* **request head** -- a connection must deliver a complete request line and headers within
  ``header_timeout_s`` (counted from the accept for the first request; for a later request on a
  keep-alive connection, from the first byte of that request). A silent connection is simply
  closed; one that sent part of a head gets ``408`` and is closed.
* **request body** -- the body must arrive within ``body_timeout_s`` of its head. Past that the
  read in the handler raises :class:`BodyTimeout` (an ``HTTPRequestTimeout``, so 408 with a JSON
  body ``{"error": "..."}``) and the connection is closed after that answer. aiohttp's
  ``client_max_size`` (413) works as before.
* **idle keep-alive** -- a connection idle between requests is closed after
  ``keepalive_timeout_s`` (aiohttp's own ``keepalive_timeout``, passed through).
* **connection cap** -- past ``max_connections`` open client connections, accepting one closes
  the least recently active *idle* connection (one waiting for a request head); if every
  connection is busy with a request, the new one is closed instead. The cap is also lowered to
  fit the process's descriptor limit (see :meth:`HttpLimits.effective_max_connections`, in
  router/http_limits.py).

Integration (``handler_cancellation=True`` and every other ``AppRunner`` option work as
before)::

    from router.http_guard import HttpLimits, guarded_runner, CLOSE_REASONS

    runner = guarded_runner(app, HttpLimits(), access_log=None, handle_signals=False,
                            handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    runner.stats.closed        # {"idle": 3, "header_timeout": 1, ...}: connections closed, by reason
    runner.stats.open          # client connections open now

Handlers keep calling ``await request.read()``: on a guarded server that read is bounded.
:func:`read_body` is the same read with its own ``asyncio.wait_for`` bound, for code that may
also run on an unguarded server (aiohttp's test server, another runner).

Only aiohttp is needed (no Prometheus here: export :class:`GuardStats` through its ``on_close``
hook or by reading ``stats.closed`` in a collector). The hooks are aiohttp's ``Server`` (the
protocol factory that ``AppRunner`` hands to ``loop.create_server``) and its ``RequestHandler``
(the per-connection protocol). aiohttp has no public API for either, so this subclasses them and
reads some of their private state (``RequestHandler._waiter``, ``_messages``, ``_request_count``,
``_request_in_progress``, ``_close``, ``_force_close``, ``_reading_paused``,
``_process_keepalive``; ``Server._kwargs`` and ``_loop``). Checked against aiohttp 3.14.5;
tests/router/test_http_guard.py exercises every one of them, so an aiohttp upgrade that changes them
fails there.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from .http_limits import HttpLimits

__all__ = (
    "CLOSE_REASONS",
    "BodyTimeout",
    "GuardStats",
    "GuardedAppRunner",
    "GuardedRequestHandler",
    "GuardedServer",
    "HttpLimits",
    "guarded_runner",
    "read_body",
)

log = logging.getLogger(__name__)

#: Why the guard closed a connection (the keys of :attr:`GuardStats.closed`):
#:
#: * ``idle``: a new connection sent nothing within ``header_timeout_s``;
#: * ``header_timeout``: a request head was started but not finished within ``header_timeout_s``;
#: * ``body_timeout``: a request body was not finished within ``body_timeout_s`` (answered 408);
#: * ``keepalive_timeout``: a keep-alive connection stayed idle for ``keepalive_timeout_s``;
#: * ``evicted``: an idle connection closed to make room for a new one past ``max_connections``;
#: * ``refused``: a new connection closed on accept, past ``max_connections`` with none idle.
CLOSE_REASONS = ("idle", "header_timeout", "body_timeout", "keepalive_timeout", "evicted", "refused")


@dataclass
class GuardStats:
    """Counters of one guarded server, for the integrator to export (e.g. to Prometheus).

    ``closed`` counts connections the guard closed, by reason (every key of
    :data:`CLOSE_REASONS` is present from the start, at 0); ``accepted`` counts every accepted
    client connection; ``open`` is how many are open now. ``on_close``, if set, is called with
    the reason each time the guard closes one (on the event loop: keep it cheap, never raise)."""

    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLOSE_REASONS, 0))
    accepted: int = 0
    open: int = 0
    on_close: Callable[[str], None] | None = None

    def count_close(self, reason: str) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1
        if self.on_close is not None:
            try:
                self.on_close(reason)
            except Exception:  # a broken exporter must not break the server
                log.exception("http_guard: on_close hook failed")


class BodyTimeout(web.HTTPRequestTimeout):
    """408: the request body did not arrive in time. ``message`` says what was missing; it is
    the JSON body ``{"error": message}`` and also the status line's reason, so that middlewares
    which answer ``HTTPException`` with their own JSON from ``exc.reason`` keep the explanation.
    The response closes the connection."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(reason=message, text=json.dumps({"error": message}), content_type="application/json")
        self.force_close()


def _head_timeout_response(seconds: float) -> bytes:
    body = json.dumps({"error": f"request head (request line and headers) not received within {seconds:g} s"})
    return (
        "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def _describe_missing_body(message: Any, received: int, seconds: float) -> str:
    headers = getattr(message, "headers", None)
    length = headers.get("Content-Length") if headers is not None else None
    if getattr(message, "chunked", False) or length is None:
        return f"chunked request body not finished within {seconds:g} s ({received} bytes received)"
    return f"request body incomplete after {seconds:g} s: received {received} of {length} bytes (Content-Length)"


def _abandon_body(protocol: Any, payload: Any, exc: BaseException | None) -> None:
    """Stop reading the connection's current body: no more bytes are parsed (``close()``: the
    connection closes once the current request is answered), a reader waiting in the handler gets
    ``exc`` (none when the request is already answered), and the body counts as ended, so aiohttp
    does not linger reading it after the answer."""
    protocol.close()
    if exc is not None:
        payload.set_exception(exc)
    if not payload.is_eof():
        payload.feed_eof()


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, with the head and body deadlines and the bookkeeping
    for the connection cap. Made by :class:`GuardedServer`; everything else is aiohttp's."""

    __slots__ = (
        "_g_limits",
        "_g_stats",
        "_g_head_timer",
        "_g_head_bytes",
        "_g_body",
        "_g_body_message",
        "_g_body_timer",
        "_g_body_answered",
        "_g_timed_out",
    )

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._g_limits: HttpLimits = manager.limits
        self._g_stats: GuardStats = manager.stats
        self._g_head_timer: asyncio.TimerHandle | None = None
        self._g_head_bytes = False  # part of a request head has arrived
        self._g_body: Any = None  # the StreamReader of a body still arriving
        self._g_body_message: Any = None
        self._g_body_timer: asyncio.TimerHandle | None = None
        self._g_body_answered = False  # the request of _g_body has been answered
        self._g_timed_out: Any = None  # the body that timed out on this connection

    # --- state -----------------------------------------------------------------------
    def guard_idle(self) -> bool:
        """Open and waiting for a request head: no request queued, in a handler or being answered
        (so closing it loses no work; a partial head may have arrived)."""
        waiter = self._waiter
        return (self.transport is not None and not self._force_close and not self._messages
                and not self._request_in_progress and waiter is not None and not waiter.done())

    def guard_close(self, reason: str) -> None:
        """Count and close this connection now."""
        if self.transport is None:
            return
        self._g_stats.count_close(reason)
        self.force_close()

    # --- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # GuardedServer.connection_made may refuse it
        if self.transport is not None:
            self._g_arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._g_cancel_head()
        self._g_cancel_body()
        self._g_body = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close or self._upgraded or self._payload_parser is not None:
            super().data_received(data)
            return
        if data and self._g_body is None:
            # Bytes of a request head: start its deadline at the first of them (a new connection's
            # deadline already runs from the accept).
            self._g_head_bytes = True
            if self._g_head_timer is None:
                self._g_arm_head()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count == parsed or not self._messages:
            return
        # One or more complete heads: stop the head deadline; a body still arriving gets its own
        # (with pipelining only the last message parsed can have an unfinished body). A part of a
        # pipelined head that came in the same read is timed from the next read; until then
        # aiohttp's keepalive_timeout bounds it.
        self._g_cancel_head()
        self._g_head_bytes = False
        manager = self._manager
        if isinstance(manager, GuardedServer):
            manager.touch(self)
        message, payload = self._messages[-1]
        if payload is not self._g_body and not payload.is_eof():
            self._g_watch_body(message, payload)

    # --- aiohttp hooks -----------------------------------------------------------------
    def _process_keepalive(self) -> None:
        # aiohttp's idle timer (keepalive_timeout): count what it closes.
        was_open = self.transport is not None
        super()._process_keepalive()
        if was_open and self.transport is None:
            if self._request_count:
                reason = "keepalive_timeout"
            else:
                reason = "header_timeout" if self._g_head_bytes else "idle"
            self._g_stats.count_close(reason)

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        payload = request.content
        if payload is self._g_timed_out and resp is not None and not getattr(resp, "prepared", True):
            resp.force_close()  # "Connection: close": the rest of that body will never be read
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if payload is self._g_body:
                self._g_body_answered = True

    # --- the head deadline -------------------------------------------------------------
    def _g_arm_head(self) -> None:
        self._g_cancel_head()
        self._g_head_timer = self._loop.call_later(self._g_limits.header_timeout_s, self._g_head_expired)

    def _g_cancel_head(self) -> None:
        if self._g_head_timer is not None:
            self._g_head_timer.cancel()
            self._g_head_timer = None

    def _g_head_expired(self) -> None:
        self._g_head_timer = None
        if self.transport is None or self._force_close or self._close:
            return
        if not self.guard_idle():
            # A request is queued, in a handler or being answered: the server, not the client, is
            # what the next head waits on. Check again later.
            self._g_arm_head()
            return
        if self._g_head_bytes:
            # Part of a head arrived and nothing of a response is on the wire: say why.
            try:
                self.transport.write(_head_timeout_response(self._g_limits.header_timeout_s))
            except (OSError, RuntimeError):  # the socket is going anyway
                pass
            self.guard_close("header_timeout")
        elif self._request_count == 0:
            self.guard_close("idle")
        # else: an idle keep-alive connection: aiohttp's keepalive_timeout governs it

    # --- the body deadline -------------------------------------------------------------
    def _g_watch_body(self, message: Any, payload: Any) -> None:
        self._g_cancel_body()
        self._g_body = payload
        self._g_body_message = message
        self._g_body_answered = False
        self._g_body_timer = self._loop.call_later(self._g_limits.body_timeout_s, self._g_body_expired)
        payload.on_eof(self._g_body_done)

    def _g_cancel_body(self) -> None:
        if self._g_body_timer is not None:
            self._g_body_timer.cancel()
            self._g_body_timer = None

    def _g_body_done(self) -> None:
        # The body is complete: stop its deadline; the bytes that follow are the next head.
        self._g_cancel_body()
        self._g_body = None
        self._g_body_message = None

    def _g_body_expired(self) -> None:
        self._g_body_timer = None
        payload = self._g_body
        if payload is None or payload.is_eof() or self.transport is None or self._force_close:
            return
        if self._reading_paused:
            # Flow control: the server stopped reading because the handler has not yet taken the
            # bytes already buffered, so the client is not the one who is late. Look again later.
            self._g_body_timer = self._loop.call_later(self._g_limits.body_timeout_s, self._g_body_expired)
            return
        seconds = self._g_limits.body_timeout_s
        message = _describe_missing_body(self._g_body_message, getattr(payload, "total_bytes", 0), seconds)
        answered = self._g_body_answered
        self._g_stats.count_close("body_timeout")
        self._g_timed_out = payload
        self._g_body = None
        self._g_body_message = None
        # A handler still to read (or reading) the body gets BodyTimeout, answered 408; when the
        # request was already answered aiohttp is only draining the body: just end that.
        _abandon_body(self, payload, None if answered else BodyTimeout(message))


class GuardedServer(Server):
    """aiohttp's protocol factory (what ``loop.create_server`` is given), making
    :class:`GuardedRequestHandler` connections and enforcing the connection cap."""

    def __init__(self, handler: Any, *, limits: HttpLimits, stats: GuardStats | None = None, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.stats = stats if stats is not None else GuardStats()
        #: the cap in force (0: none), see HttpLimits.effective_max_connections
        self.max_connections = limits.effective_max_connections()
        # Open client connections, least recently active first (a complete head moves one last).
        self._g_order: dict[RequestHandler, None] = {}

    @classmethod
    def from_server(cls, server: Server, limits: HttpLimits, stats: GuardStats | None = None) -> GuardedServer:
        """The same server as ``server`` (its application handler, request factory,
        ``handler_cancellation`` and protocol options), guarded."""
        return cls(server.request_handler, request_factory=server.request_factory,
                   handler_cancellation=server.handler_cancellation, loop=server._loop,
                   limits=limits, stats=stats, **server._kwargs)

    def __call__(self) -> RequestHandler:
        # No fallback on TypeError as aiohttp's Server has: a bad option should fail loudly.
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.stats.accepted += 1
        cap = self.max_connections
        if cap and len(self._g_order) >= cap:
            victim = next((h for h in self._g_order if isinstance(h, GuardedRequestHandler) and h.guard_idle()),
                          None)
            if victim is None:
                # Every connection is busy with a request: this one waits for nothing but a slot.
                self.stats.count_close("refused")
                handler.force_close()
                return
            del self._g_order[victim]
            victim.guard_close("evicted")
        self._g_order[handler] = None
        self.stats.open = len(self._g_order)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._g_order.pop(handler, None)
        self.stats.open = len(self._g_order)

    def touch(self, handler: RequestHandler) -> None:
        """``handler`` is active (it delivered a request head): evict it last."""
        if handler in self._g_order:
            del self._g_order[handler]
            self._g_order[handler] = None


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` serving its application through a :class:`GuardedServer`.

    ``limits.keepalive_timeout_s`` becomes aiohttp's ``keepalive_timeout`` (so do not pass that);
    every other keyword is ``AppRunner``'s. ``stats`` is the :class:`GuardStats` to count into
    (a new one by default), also ``runner.stats``."""

    __slots__ = ("limits", "stats")

    def __init__(self, app: web.Application, limits: HttpLimits | None = None, *,
                 stats: GuardStats | None = None, **kwargs: Any) -> None:
        limits = limits if limits is not None else HttpLimits()
        if "keepalive_timeout" in kwargs:
            raise TypeError("GuardedAppRunner: set HttpLimits.keepalive_timeout_s, not keepalive_timeout")
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self.limits = limits
        self.stats = stats if stats is not None else GuardStats()

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        return GuardedServer.from_server(plain, self.limits, self.stats)


def guarded_runner(app: web.Application, limits: HttpLimits | None = None, *,
                   stats: GuardStats | None = None, **runner_kwargs: Any) -> GuardedAppRunner:
    """An ``AppRunner`` for ``app`` with ``limits`` (defaults: :class:`HttpLimits`) enforced;
    ``runner_kwargs`` are ``web.AppRunner``'s (``access_log``, ``handle_signals``,
    ``handler_cancellation``, ...). Use it like ``web.AppRunner``: ``await runner.setup()``, then
    ``web.TCPSite(runner, host, port)``; its counters are ``runner.stats``."""
    return GuardedAppRunner(app, limits, stats=stats, **runner_kwargs)


async def read_body(request: web.BaseRequest, limits: HttpLimits | None = None) -> bytes:
    """``await request.read()``, finished within ``limits.body_timeout_s`` or ``BodyTimeout``
    (408, JSON ``{"error": ...}``; the connection is closed after the answer).

    On a guarded server ``request.read()`` is already bounded (from the moment the head
    arrived) and this adds nothing; elsewhere this is the bound (from this call). Bodies over
    the application's ``client_max_size`` still raise ``HTTPRequestEntityTooLarge`` (413)."""
    limits = limits if limits is not None else HttpLimits()
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        pass
    payload = request.content
    headers = request.headers
    chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
    message = _describe_missing_body(_HeadView(headers, chunked), getattr(payload, "total_bytes", 0),
                                     limits.body_timeout_s)
    protocol = request.protocol
    if isinstance(protocol, GuardedRequestHandler):
        protocol._g_stats.count_close("body_timeout")
        protocol._g_cancel_body()
        protocol._g_timed_out = payload
        protocol._g_body = None
    if protocol is not None:
        _abandon_body(protocol, payload, None)
    raise BodyTimeout(message)


@dataclass(frozen=True)
class _HeadView:
    headers: Any
    chunked: bool
