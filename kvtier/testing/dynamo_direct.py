"""The client straight to Dynamo's engines, for `kvtier bench peers`' Dynamo side: run by the Python
of Dynamo's own venv as a file (`python kvtier/testing/dynamo_direct.py REQUESTS.json ...`; it
imports only Dynamo and the standard library, since kvtier is not installed there).

REQUESTS.json is a list of {"at": seconds from the start, "token_ids": [...], "max_tokens": n}.
Once `--workers` instances of `--endpoint` are discovered, each request is sent at its time,
through Dynamo's runtime client (round robin, as kvtier's `direct` front door goes to its
workers), as a preprocessed request (the token ids the frontend would have made), and streamed.
Printed: one JSON line per request, in order ({"ok", "ttft_s", "tpot_s", "tokens",
"cached_tokens", "error"}), then {"wall_s": ...}. TTFT is the first streamed item, TPOT the
time from it to the last item over max_tokens - 1, as kvtier.testing.peer_load times the
frontend's answers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any


def _request(model: str, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "token_ids": token_ids, "stop_conditions": {"max_tokens": max_tokens},
            "sampling_options": {}, "output_options": {}, "eos_token_ids": [], "annotations": []}


async def _one(client, start: float, at: float, request: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    first = last = None
    tokens, cached = 0, None
    try:
        stream = await client.round_robin(request)
        async for item in stream:
            data = item.data() if hasattr(item, "data") else item
            last = time.perf_counter()
            first = first or last
            if isinstance(data, dict):
                tokens += len(data.get("token_ids") or [])
                usage = data.get("completion_usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    except Exception as exc:  # noqa: BLE001 - a refused or broken answer is counted, not raised
        return {"ok": False, "ttft_s": time.perf_counter() - sent, "tpot_s": None, "tokens": tokens,
                "cached_tokens": cached, "error": str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}
    if first is None or last is None:
        return {"ok": False, "ttft_s": time.perf_counter() - sent, "tpot_s": None, "tokens": 0,
                "cached_tokens": cached, "error": "no answer"}
    n = request["stop_conditions"]["max_tokens"]
    return {"ok": True, "ttft_s": first - sent, "tpot_s": (last - first) / (n - 1) if n > 1 else None,
            "tokens": tokens, "cached_tokens": cached, "error": ""}


async def _run(args: argparse.Namespace) -> int:
    from dynamo.runtime import DistributedRuntime

    with open(args.requests, encoding="utf-8") as f:
        requests = json.load(f)
    runtime = DistributedRuntime(asyncio.get_running_loop(), args.discovery_backend, args.request_plane,
                                 event_plane=args.event_plane)
    try:
        client = await runtime.endpoint(args.endpoint).client()
        deadline = time.monotonic() + args.wait_s
        while len(client.instance_ids()) < args.workers:
            if time.monotonic() > deadline:
                print(f"{len(client.instance_ids())} of {args.workers} instances of {args.endpoint} "
                      f"in {args.wait_s:.0f}s", file=sys.stderr)
                return 1
            await asyncio.sleep(0.05)
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _one(client, start, r["at"], _request(args.model, r["token_ids"], r["max_tokens"])) for r in requests))
        wall = time.perf_counter() - start
        for result in results:
            print(json.dumps(result))
        print(json.dumps({"wall_s": wall}), flush=True)
        return 0
    finally:
        runtime.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests")
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, required=True, help="instances to wait for before the first request")
    parser.add_argument("--endpoint", default="dynamo.backend.generate")
    parser.add_argument("--discovery-backend", default="file")
    parser.add_argument("--request-plane", default="tcp")
    parser.add_argument("--event-plane", default="nats")
    parser.add_argument("--wait-s", type=float, default=60.0)
    return asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
