"""The best a router's HTTP front can do on this machine: an aiohttp server (on uvloop, as
`kvtier router` runs) whose /v1/route decodes the same body into the same typed request with
msgspec and answers a small JSON, and whose /v1/release does the same with a release. No
routing at all: `kvtier bench route` drives it with the very client that drives the router,
side by side in one run, and reports the router's decisions/s as a fraction of it.

    python -m kvtier.testing.bare_http --port 8123
"""

from __future__ import annotations

import argparse
import asyncio

import msgspec
from aiohttp import web

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


def app() -> web.Application:
    application = web.Application(client_max_size=32 << 20)
    application.router.add_post("/v1/route", route)
    application.router.add_post("/v1/release", release)
    application.router.add_get("/healthz", healthz)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    import uvloop

    uvloop.install()
    web.run_app(app(), host=args.host, port=args.port, access_log=None, print=None,
                handle_signals=True, loop=asyncio.new_event_loop())


if __name__ == "__main__":
    main()
