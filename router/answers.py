"""What the proxy keeps of an answer it relays (router/proxy.py): the upstream and how it
ends, whether its first bytes can begin an answer at all, the headers it gets, and the tail
the usage check reads."""

from __future__ import annotations

import asyncio

import aiohttp

from kvtier.schemas.routing import RouteResponse

#: How an SSE answer ends (OpenAI's and SGLang's streams alike).
STREAM_END = b"data: [DONE]"


class Relay:
    """One answer being relayed: its upstream, whether it streams, the release of its first
    token (the end's release waits for it), and why the drain cut it ("" while it runs)."""

    __slots__ = ("cut", "first_token_release", "streamed", "upstream")

    def __init__(self, upstream: aiohttp.ClientResponse, streamed: bool) -> None:
        self.upstream, self.streamed = upstream, streamed
        self.first_token_release: asyncio.Task | None = None
        self.cut = ""


def malformed(upstream: aiohttp.ClientResponse, first: bytes) -> str:
    """Why a 2xx answer's first chunk cannot be the start of an answer ("" when it can): an
    answer that ends before its first byte, or a stream whose first bytes are not an event.
    Such an engine is as broken as one that refuses: nothing has reached the client yet."""
    if upstream.status != 200:
        return ""
    if not first:
        return "the answer ended before its first byte"
    if upstream.content_type == "text/event-stream":
        # (a chunk may end inside the first field's name: a prefix of one is not malformed)
        head = first.lstrip()[:6]
        if head and not any(head.startswith(start) or start.startswith(head) for start in _SSE_STARTS):
            return f"a stream whose first bytes are not an event: {first[:40]!r}"
    return ""


#: How a server-sent event's first line begins (a field, or a comment).
_SSE_STARTS = (b"data:", b"event:", b"id:", b"retry:", b":")


def answer_headers(decision: RouteResponse, router_s: float, tried: list[str]) -> dict[str, str]:
    headers = {"X-Kvtier-Worker": decision.worker_id, "X-Kvtier-Request-Id": decision.request_id,
               # the router's share of this request's latency, per request, for whoever debugs it
               "X-Kvtier-Router-Ms": f"{router_s * 1000:.3f}"}
    if decision.degraded:
        headers["X-Kvtier-Degraded"] = ",".join(decision.degraded)
    if tried:
        headers["X-Kvtier-Tried"] = ",".join(tried)
    if decision.affinity:
        headers["X-Kvtier-Affinity"] = decision.affinity
    return headers



class AnswerTail:
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
