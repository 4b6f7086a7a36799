"""How a bench talks to the kvtier processes it starts (routers, sim-workers): every body it
sends is encoded from a schemas/ type, every answer it reads is decoded into one; a router's
/healthz decoded, its /metrics summed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from kvtier.schemas.router_health import RouterHealth, decode_router_health
from kvtier.schemas.routing import (
    ReleaseRequest,
    ReleaseStage,
    RouteRequest,
    RouteResponse,
    decode_route_response,
)
from kvtier.schemas.sglang_server import GenerateMetaInfo, decode_generate_meta_info
from kvtier.schemas.sim import AdvanceBody, SimGenerateBody

_json = msgspec.json.Encoder()
JSON_HEADERS = {"Content-Type": "application/json"}


class Refused(RuntimeError):
    """A process answered other than 200: `what (status): its body`."""

    def __init__(self, what: str, status: int, body: bytes):
        super().__init__(f"{what} ({status}): {body[:500].decode(errors='replace')}")
        self.status = status


async def post(session, url: str, body: msgspec.Struct) -> tuple[int, bytes]:
    """POST `body` as JSON (an aiohttp session); the answer's status and bytes."""
    async with session.post(url, data=_json.encode(body), headers=JSON_HEADERS) as response:
        return response.status, await response.read()


async def route(session, router: str, request: RouteRequest, what: str = "route") -> RouteResponse:
    """`POST /v1/route`; Refused unless the router answers 200."""
    status, raw = await post(session, router + "/v1/route", request)
    if status != 200:
        raise Refused(what, status, raw)
    return decode_route_response(raw)


async def release(session, router: str, model: str, request_id: str,
                  stage: ReleaseStage = ReleaseStage.COMPLETE, ttft_ms: float | None = None, *, owner: str) -> int:
    """`POST /v1/release`; the status (404: nothing booked under that id; 403: `owner` is not
    the booking's). `ttft_ms`: the first token's time as the client measured it; `owner`: the
    secret the booking's /v1/route answer named."""
    status, _ = await post(session, router + "/v1/release", ReleaseRequest(
        model=model, request_id=request_id, stage=stage, ttft_ms=ttft_ms, owner=owner))
    return status


async def generate(session, rank_url: str, body: SimGenerateBody, what: str = "generate") -> GenerateMetaInfo:
    """`POST <sim-worker>/w/<rank>/generate`: the rank's `meta_info`; Refused unless 200."""
    status, raw = await post(session, rank_url + "/generate", body)
    if status != 200:
        raise Refused(what, status, raw)
    return decode_generate_meta_info(raw)


async def advance(session, sim_url: str, now: float) -> None:
    """`POST <sim-worker>/advance`: the simulated clock moves to `now`."""
    await post(session, sim_url + "/advance", AdvanceBody(now=now))


async def closed_loop_rate(session, targets: list[str], path: str, body: Callable[[], bytes], concurrency: int,
                           seconds: float) -> float:
    """Requests/s of `concurrency` closed-loop clients POSTing `body()` to `path` of `targets`
    in turn for `seconds`; any answer but 200 raises."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done
        n = k
        while time.perf_counter() < deadline:
            target = targets[n % len(targets)]
            async with session.post(target + path, data=body(), headers=JSON_HEADERS) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{target} answered {r.status}")
            done += 1
            n += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return done / (time.perf_counter() - started)


async def router_health(session, router: str) -> RouterHealth | None:
    """`GET /healthz` of a router, decoded; None when it does not answer (a replica gone)."""
    try:
        async with session.get(router + "/healthz", timeout=2) as r:
            return decode_router_health(await r.read())
    except Exception:  # noqa: BLE001 - a replica that is gone has no health
        return None


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of one metric's samples in a Prometheus text page, of those with `labels`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if (line.startswith(name + " ") or line.startswith(name + "{"))
               and all(f'{key}="{value}"' in line for key, value in labels.items()))
