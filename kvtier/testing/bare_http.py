"""The best a router's HTTP front can do on this machine: an aiohttp server (on uvloop, as
`kvtier router` runs) whose /v1/route decodes the same body into the same typed request with
msgspec and answers a small JSON, and whose /v1/release does the same with a release. No
routing at all: `kvtier bench route` drives it with the very client that drives the router,
side by side in one run, and reports the router's decisions/s as a fraction of it.

With `--upstream URL` (repeated) it is also the best a Python proxy can do: /v1/completions and
/v1/chat/completions sent unchanged to the upstreams in turn (round robin, aiohttp's client with
a pool per upstream, as the router's), the answer streamed back chunk by chunk; no tokenizing,
no routing, no bookings. `kvtier bench peers` puts it beside kvtier's router as the floor of
what relaying costs in this language on this machine.

    python -m kvtier.testing.bare_http --port 8123 [--upstream http://127.0.0.1:30000/w/0 ...]
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec
from aiohttp import ClientSession, TCPConnector, web

from kvtier.schemas.routing import ReleaseRequest, RouteRequest

_route = msgspec.json.Decoder(RouteRequest)
_release = msgspec.json.Decoder(ReleaseRequest)
_encode = msgspec.json.encode


async def route(request: web.Request) -> web.Response:
    body = _route.decode(await request.read())
    return web.Response(body=_encode({"request_id": body.request_id or "", "worker_id": "w0", "logit": 0.0}),
                        content_type="application/json")


async def release(request: web.Request) -> web.Response:
    body = _release.decode(await request.read())
    return web.Response(body=_encode({"request_id": body.request_id, "released": True}),
                        content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


class Relay:
    """Requests sent on unchanged to `upstreams` in turn, each answer streamed back."""

    def __init__(self, upstreams: list[str]):
        self.upstreams, self.turn = [u.rstrip("/") for u in upstreams], 0
        self.session: ClientSession | None = None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self.session is None:
            self.session = ClientSession(connector=TCPConnector(limit=0, limit_per_host=256))
        raw = await request.read()
        upstream_url = self.upstreams[self.turn % len(self.upstreams)] + request.path
        self.turn += 1
        async with self.session.post(upstream_url, data=raw, headers={"Content-Type": "application/json"}) as up:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            await response.prepare(request)
            while chunk := await up.content.readany():
                await response.write(chunk)
            await response.write_eof()
            return response


def app(upstreams: list[str] | None = None) -> web.Application:
    application = web.Application(client_max_size=32 << 20)
    application.router.add_post("/v1/route", route)
    application.router.add_post("/v1/release", release)
    application.router.add_get("/healthz", healthz)
    if upstreams:
        relay = Relay(upstreams)
        application.router.add_post("/v1/completions", relay.forward)
        application.router.add_post("/v1/chat/completions", relay.forward)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--upstream", action="append", default=[], help="An engine's base URL (repeated).")
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(app(args.upstream), host=args.host, port=args.port, access_log=None, print=None,
                handle_signals=True, loop=asyncio.new_event_loop())


if __name__ == "__main__":
    main()
