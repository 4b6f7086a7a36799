"""A stand-in for an SGLang engine's HTTP side, for proxy tests only (no GPU here): `/generate`
with `input_ids`, streaming SSE chunks (`data: {...}` then `data: [DONE]`) or one JSON body,
like SGLang's native API, and `/v1/completions` with token-id prompts, streamed. It records
what it received (bodies, and /generate's headers) and can hold its first chunk until
released, so a test can observe the router's bookings at each stage. With `--fail MODE` it
answers its health (`/seen`) but fails every request: `500` (an error status), `empty` (a 200
that ends before any byte), `garbage` (a stream that does not begin with an event). Run as a
process: `python -m tests.fake_engine PORT [HOLD_FILE] [--fail MODE]`."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


async def _failed(request: web.Request, fail: str) -> web.StreamResponse:
    if fail == "500":
        return web.json_response({"error": "the engine failed"}, status=500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if fail == "garbage":
        await response.write(b"<html>oops</html>")
    await response.write_eof()
    return response


def build_app(hold_file: str | None = None, fail: str = "") -> web.Application:
    received: list[dict] = []
    headers_seen: list[dict] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        headers_seen.append(dict(request.headers))
        if fail:
            return await _failed(request, fail)
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 3))
        if not body.get("stream"):
            return web.json_response({"text": "x" * n, "meta_info": {"prompt_tokens": len(body["input_ids"]),
                                                                       "completion_tokens": n}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            await response.write(f"data: {json.dumps({'text': 'x' * (i + 1), 'index': i})}\n\n".encode())
            if i == 0 and hold_file:
                # wait until the test says go: the router must have released prefill by now
                while not _exists(hold_file):
                    await asyncio.sleep(0.02)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    cancelled: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        """OpenAI's /v1/completions with token-id prompts: streamed chunks, held after the first
        (with a hold file) until the file exists; counts requests whose client went away."""
        body = await request.json()
        received.append(body)
        if fail:
            return await _failed(request, fail)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(int(body.get("max_tokens") or 3)):
                chunk = {"id": "c", "object": "text_completion", "created": 0, "model": body.get("model", ""),
                         "choices": [{"index": 0, "text": " x", "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and hold_file:
                    while not _exists(hold_file):
                        await asyncio.sleep(0.02)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            cancelled.append(1)
            raise
        return response

    async def seen(request: web.Request) -> web.Response:
        return web.json_response(received)

    async def gone(request: web.Request) -> web.Response:
        return web.json_response(len(cancelled))

    async def headers(request: web.Request) -> web.Response:
        return web.json_response(headers_seen)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/seen", seen)
    app.router.add_get("/cancelled", gone)
    app.router.add_get("/headers", headers)
    return app


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("hold", nargs="?")
    parser.add_argument("--fail", choices=("500", "empty", "garbage"), default="")
    args = parser.parse_args()
    port = args.port
    web.run_app(build_app(args.hold, args.fail), host="127.0.0.1", port=port, print=None, handle_signals=True,
                handler_cancellation=True)  # a router that goes away cancels the request, as SGLang sees it
