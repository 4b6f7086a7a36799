"""`kvtier events tail`: KVTIER_EVENTS decoded, one line per tier event (or announcement),
filtered by model, worker, tier and kind; the last N, those since a time, and/or following
new ones as they arrive.

    2025-06-01T12:00:00.123Z #57 org_model-1/w0 e1:12 stored device 4 pages [1a2b3c4d…, …]

`#57` is the stream sequence (what `kvtier replay --at-seq` takes), `e1:12` the worker's
(epoch, seq). Page keys are the 16-hex-digit form used in Redis, abbreviated to 8.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from dataclasses import dataclass

import msgspec

from kvtier.consumers.pull import StoredMessage, StreamReader, read_backward
from kvtier.schemas.events import (
    AllCleared,
    EventBatch,
    PagesStored,
    UnsupportedVersion,
    WorkerAnnounce,
    WorkerExpired,
    decode_message,
)
from kvtier.schemas.hashes import page_key
from kvtier.schemas.subjects import EVENTS_STREAM
from kvtier.tools.replay import connect, events_filter, iso, parse_time, stream_bounds
from kvtier.tools.settings import EventsTailSettings

KINDS = ("stored", "removed", "cleared", "announce")
TIERS = ("device", "host", "disk", "external")


@dataclass(frozen=True)
class Filters:
    tier: str | None = None
    kind: str | None = None


def lines_of(msg: StoredMessage, filters: Filters, show_pages: int = 3) -> list[tuple[str, dict]]:
    """(text, JSON record) for each event of a message that passes the filters."""
    try:
        message = decode_message(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion) as exc:
        if filters.kind or filters.tier:
            return []
        reason = str(exc)[:120]
        return [(f"{iso(msg.time)} #{msg.seq} {msg.subject} UNDECODABLE ({reason})",
                 {"seq": msg.seq, "time": msg.time, "subject": msg.subject, "kind": "undecodable", "error": reason})]
    head = f"{iso(msg.time)} #{msg.seq}"
    if isinstance(message, WorkerAnnounce):
        if filters.tier or filters.kind not in (None, "announce"):
            return []
        m, c = message.metadata, message.cursor
        text = (f"{head} {m.model}/{m.worker_id} e{c.epoch}:{c.seq} announce page_size {m.page_size}, lease "
                f"{message.lease_ttl_s:g}s, dp {m.dp_rank}/{m.dp_size}, tp {m.tp_size}"
                + (", mooncake" if m.mooncake else ""))
        return [(text, {"seq": msg.seq, "time": msg.time, "model": m.model, "worker": m.worker_id, "kind": "announce",
                        "tier": None, "epoch": c.epoch, "worker_seq": c.seq, "page_size": m.page_size,
                        "lease_ttl_s": message.lease_ttl_s})]
    if isinstance(message, WorkerExpired):
        if filters.tier or filters.kind not in (None, "expired"):
            return []
        text = (f"{head} {message.model}/{message.worker_id} e{message.epoch}:{message.seq} expired: its lease ran "
                f"out at {iso(message.lease_expiry_ms / 1000)} (a processor's decision)")
        return [(text, {"seq": msg.seq, "time": msg.time, "model": message.model, "worker": message.worker_id,
                        "kind": "expired", "tier": None, "epoch": message.epoch, "worker_seq": message.seq,
                        "lease_expiry_ms": message.lease_expiry_ms})]
    return _batch_lines(msg, message, head, filters, show_pages)


def _batch_lines(msg: StoredMessage, batch: EventBatch, head: str, filters: Filters, show_pages: int):
    who = f"{batch.model}/{batch.worker_id} e{batch.epoch}:{batch.seq}"
    base = {"seq": msg.seq, "time": msg.time, "model": batch.model, "worker": batch.worker_id, "epoch": batch.epoch,
            "worker_seq": batch.seq}
    epoch_note = f" [new epoch: {batch.epoch_reason.value}]" if batch.epoch_reason else ""
    out = []
    for event in batch.events:
        if isinstance(event, AllCleared):
            kind, tier, hashes = "cleared", None, []
        else:
            kind = "stored" if isinstance(event, PagesStored) else "removed"
            tier, hashes = event.tier.value, event.hashes
        if (filters.kind and filters.kind != kind) or (filters.tier and filters.tier != tier):
            continue
        keys = [page_key(h) for h in hashes]
        if kind == "cleared":
            detail = "all tiers"
        else:
            shown = ", ".join(k[:8] + "…" for k in keys[:show_pages])
            more = f", +{len(keys) - show_pages}" if len(keys) > show_pages else ""
            detail = f"{tier} {len(keys)} page{'s' if len(keys) != 1 else ''} [{shown}{more}]"
        out.append((f"{head} {who} {kind} {detail}{epoch_note}",
                    {**base, "kind": kind, "tier": tier, "pages": len(keys), "page_keys": keys,
                     "epoch_reason": batch.epoch_reason.value if batch.epoch_reason else None}))
        epoch_note = ""
    if not batch.events and not (filters.kind or filters.tier):
        out.append((f"{head} {who} (no events){epoch_note}",
                    {**base, "kind": "batch", "tier": None, "pages": 0, "page_keys": [],
                     "epoch_reason": batch.epoch_reason.value if batch.epoch_reason else None}))
    return out


async def tail(nats_url: str, *, model: str | None = None, worker: str | None = None, filters: Filters = Filters(),
               since: float | None = None, last: int | None = None, follow: bool = False, as_json: bool = False,
               stop: asyncio.Event | None = None, out=None) -> int:
    """Print matching events; returns how many were printed."""
    out = out or sys.stdout
    nc = await connect(nats_url)
    printed = 0

    def emit(lines) -> None:
        nonlocal printed
        for text, record in lines:
            out.write((json.dumps(record) if as_json else text) + "\n")
            printed += 1
        out.flush()

    try:
        js = nc.jetstream()
        first, end, count = await stream_bounds(js, EVENTS_STREAM)
        subject = events_filter(model, worker)
        if since is None and last is None:
            last = 10
        if since is not None:
            async with StreamReader(nc, EVENTS_STREAM, subject, start_time=since) as reader:
                async for msg in reader.messages(end_seq=end):
                    if msg.seq > end:
                        break
                    emit(lines_of(msg, filters))
        elif count and last:
            emit(await _last(nc, subject, filters, last, first, end))
        if follow:
            async with StreamReader(nc, EVENTS_STREAM, subject, start_seq=end + 1) as reader:
                async for msg in reader.messages(follow=True, stop=stop):
                    emit(lines_of(msg, filters))
        return printed
    finally:
        await nc.close()


async def _last(nc, subject: str, filters: Filters, n: int, first: int, end: int) -> list:
    """The last `n` matching lines up to `end`, reading back from the end in growing chunks."""
    found: list = []

    def take(chunk) -> bool:
        nonlocal found
        found = [line for msg in chunk for line in lines_of(msg, filters)] + found
        return len(found) >= n

    await read_backward(nc, EVENTS_STREAM, subject, first, end, take, window=max(n, 64))
    return found[-n:]


def run_events(settings: EventsTailSettings) -> int:
    """`kvtier events tail` (its only subcommand, so the parser has already chosen it)."""
    since = parse_time(settings.since) if settings.since is not None else None
    filters = Filters(tier=settings.tier, kind=settings.kind)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await tail(settings.nats_url, model=settings.model, worker=settings.worker, filters=filters,
                          since=since, last=settings.last, follow=settings.follow, as_json=settings.json, stop=stop)

    asyncio.run(main())
    return 0
