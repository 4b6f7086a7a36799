"""The other processes of one replica (`kvtier router --processes N`, router/processes.py), asked
over their private loopback ports: PUT /v1/admission reaches every process, and /healthz lists
them all with the worst status of theirs."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from aiohttp import ClientSession, ClientTimeout

from kvtier.schemas.router_health import ProcessHealth, RouterHealth, decode_router_health
from kvtier.schemas.routing import AdmissionAnswer, AdmissionSettings

from .processes import SIBLING_TIMEOUT_S, ProcessSlot


async def tell_siblings(slot: ProcessSlot | None, method: str, path: str, body: bytes | None = None,
                        headers=None) -> list[tuple[dict, bytes | None]]:
    """Ask every other process of the replica (their private loopback ports), at once:
    [(its entry, its answer's body or None)]."""
    if slot is None:
        return []
    forwarded = {k: v for k, v in (headers or {}).items() if k.lower() in ("authorization", "content-type")}

    async def ask(session: ClientSession, entry: dict) -> tuple[dict, bytes | None]:
        try:
            async with session.request(method, f"http://127.0.0.1:{entry['port']}{path}", data=body,
                                       headers=forwarded) as reply:
                data = await reply.read()
                return entry, data if reply.status < 300 or method == "GET" else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return entry, None

    siblings = slot.siblings()
    if not siblings:
        return []
    async with ClientSession(timeout=ClientTimeout(total=SIBLING_TIMEOUT_S)) as session:
        return list(await asyncio.gather(*(ask(session, entry) for entry in siblings)))


def with_siblings(own: RouterHealth, own_process: ProcessHealth, slot: ProcessSlot,
                  answers: list[tuple[dict, bytes | None]]) -> RouterHealth:
    """`own` with every process of the replica listed (`answers`: the siblings' to
    /healthz?scope=process), and the worst status of theirs."""
    processes = [own_process]
    for entry, answer in answers:
        health = None
        if answer is not None:
            try:
                health = decode_router_health(answer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        if health is None or not health.processes:
            processes.append(ProcessHealth(index=entry["index"], pid=entry.get("pid", 0), status="unreachable"))
        else:
            processes.append(health.processes[0])
    seen = {p.index for p in processes}
    processes += [ProcessHealth(index=i, status="unreachable") for i in range(slot.count) if i not in seen]
    statuses = {p.status for p in processes}
    status = ("draining" if "draining" in statuses else "ok" if statuses == {"ok"} else "degraded")
    return msgspec.structs.replace(own, status=status, processes=sorted(processes, key=lambda p: p.index))


def admission_answer(settings: AdmissionSettings, router_id: str, slot: ProcessSlot | None,
                     replies: list[tuple[dict, bytes | None]]) -> AdmissionAnswer:
    """PUT /v1/admission's answer: `settings` in force on this replica, with the processes that
    took the change (`replies`: the siblings' answers, None where one did not answer 2xx)."""
    own = f"process {slot.index}" if slot is not None else "process 0"
    applied: list[str] = [own]
    missing: list[str] = []
    for entry, body in replies:
        (applied if body is not None else missing).append(f"process {entry.get('index')}")
    return AdmissionAnswer(**msgspec.structs.asdict(settings), router_id=router_id,
                           applied=sorted(applied), not_applied=sorted(missing))
