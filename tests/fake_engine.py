"""A stand-in for an SGLang engine's HTTP side, for proxy tests only (no GPU here): `/generate`
with `input_ids`, streaming SSE chunks (`data: {...}` then `data: [DONE]`) or one JSON body,
like SGLang's native API. It records what it received and can hold its first chunk until
released, so a test can observe the router's bookings at each stage. Run as a process:
`python -m tests.fake_engine PORT`."""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web


def build_app(hold_file: str | None = None) -> web.Application:
    received: list[dict] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
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

    async def seen(request: web.Request) -> web.Response:
        return web.json_response(received)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/seen", seen)
    return app


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)


if __name__ == "__main__":
    port = int(sys.argv[1])
    hold = sys.argv[2] if len(sys.argv) > 2 else None
    web.run_app(build_app(hold), host="127.0.0.1", port=port, print=None, handle_signals=True)
