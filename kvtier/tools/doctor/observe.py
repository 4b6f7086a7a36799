"""The I/O edge of `kvtier doctor`: reads NATS, Redis, each router's /healthz and /metrics and the
Mooncake master into the views of `views.py`, each probe bounded by a timeout; a probe that fails
is recorded in its view, never raised."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request

import msgspec

from kvtier.plumbing.connections import redact, redis_client
from kvtier.schemas.health import decode_hash_check
from kvtier.schemas.mooncake import decode_batch_query_reply
from kvtier.schemas.router_health import decode_router_health
from kvtier.schemas.subjects import (
    DECISIONS_STREAM,
    DLQ_STREAM,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    subject_token,
)
from kvtier.schemas.worker import WorkerMetadata, decode_worker_metadata

from .judge import index_behind, message_ahead_of, shorten
from .views import (
    LATEST_DEAD_LETTERS,
    MOONCAKE_PROBE_KEY,
    DeadLetter,
    FeedHead,
    LastMessage,
    MooncakeView,
    NatsView,
    Observation,
    RedisView,
    RouterView,
    StreamView,
    WorkerRecord,
)


# --- observe: the I/O edge ---------------------------------------------------------------------
def _err(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower() if isinstance(exc, ConnectionError) else exc.strerror
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _hicache_on(meta: WorkerMetadata) -> bool:
    """Whether a worker's metadata says HiCache is on: announced by its bridge (--hicache, or
    read from SGLang with --sglang-url), or implied by a Mooncake layout (an L3 backend needs
    the host tier)."""
    return bool(meta.hicache_enabled) or meta.mooncake is not None


def observe_redis(url: str, model: str | None, timeout: float) -> RedisView:
    import redis

    from kvtier.schemas.state_keys import MODELS_KEY, ModelKeys, as_text
    from kvtier.tools.inspect import collect

    client = redis_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    token = ModelKeys.for_model(model).model_token if model else None
    try:
        client.ping()
        models = sorted(as_text(t) for t in client.smembers(MODELS_KEY))
        rows = collect(client, model) if (token is None or token in models) else []
        workers = []
        by_model: dict[str, list[dict]] = {}
        for row in rows:
            by_model.setdefault(row["model"], []).append(row)
        for model_token, model_rows in by_model.items():
            keys = ModelKeys(model_token)
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(keys.page_sizes)
            pipe.hgetall(keys.hash_check)
            for row in model_rows:
                pipe.hget(keys.state(row["worker"]), "tiers_seen")
                pipe.get(keys.meta(row["worker"]))
            replies = pipe.execute()
            page_sizes = {as_text(k): as_text(v) for k, v in replies[0].items()}
            hash_checks = {as_text(k): v for k, v in replies[1].items()}
            for i, row in enumerate(model_rows):
                tiers_seen, raw_meta = replies[2 + 2 * i], replies[3 + 2 * i]
                workers.append(_worker_record(row, tiers_seen, raw_meta, page_sizes.get(row["worker"]),
                                            hash_checks.get(row["worker"])))
        feeds = {}
        if models:
            pipe = client.pipeline(transaction=False)
            for model_token in models:
                pipe.get(ModelKeys(model_token).changes_counter)
                pipe.hget(ModelKeys(model_token).incarnation, "id")
            replies = pipe.execute()
            feeds = {m: FeedHead(change=int(replies[2 * i] or 0), marker_id=as_text(replies[2 * i + 1] or b""))
                     for i, m in enumerate(models)}
        return RedisView(url=redact(url), reachable=True, models=models, requested_model=token, workers=workers,
                         feeds=feeds)
    except redis.RedisError as exc:
        return RedisView(url=redact(url), reachable=False, error=str(exc).strip() or _err(exc), requested_model=token)
    finally:
        client.close()


def _worker_record(row: dict, tiers_seen, raw_meta, page_size, raw_check) -> WorkerRecord:
    meta, hicache, size = None, False, None
    if raw_meta:
        try:
            meta = decode_worker_metadata(raw_meta)
            hicache = _hicache_on(meta)
            size = meta.page_size
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    if page_size:
        try:
            size = int(page_size)
        except ValueError:
            pass
    check = None
    if raw_check:
        try:
            check = decode_hash_check(raw_check)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return WorkerRecord(
        model=row["model"], worker=row["worker"], lease_left_s=row["lease_left_s"], epoch=row["epoch"],
        seq=row["seq"], stale=row["stale"], stale_reason=row["stale_reason"], partial=row["partial"],
        gaps=row["gaps"],
        applied_ago_s=row["applied_ago_s"], pages=row["pages"],
        tiers_seen=int(tiers_seen) if tiers_seen is not None else None,
        page_size=size, meta=meta, hicache=hicache, hash_check=check)


async def observe_nats(url: str, workers: list[WorkerRecord], timeout: float) -> NatsView:
    import ssl

    import nats
    import nats.js.errors

    from kvtier.plumbing.nats_options import NatsOptionsError, configured, explain, redact_nats
    from kvtier.plumbing.streams import partitions_of
    from kvtier.schemas.events import EventBatch, WorkerAnnounce, WorkerExpired, decode_message

    seen: list[BaseException] = []

    async def quiet(exc: Exception) -> None:
        seen.append(exc)
        del seen[:-8]  # the recent ones (the callback outlives the connect)

    shown = redact_nats(url)
    try:
        nc = await asyncio.wait_for(
            configured().connect(url, connect_timeout=timeout, allow_reconnect=False, max_reconnect_attempts=1,
                                 reconnect_time_wait=0.1, error_cb=quiet, name="kvtier-doctor"), timeout + 1)
    except NatsOptionsError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the finding
        if any(not isinstance(e, OSError) or isinstance(e, ssl.SSLError) for e in seen):
            error = explain(exc, seen)  # refused credentials, an untrusted certificate
        elif type(exc).__name__ == "NoServersError":
            error = "no server answers there (refused, or not a NATS port)"
        else:
            error = _err(exc)
        return NatsView(url=shown, reachable=False, error=error)
    view = NatsView(url=shown, reachable=True)
    try:
        js = nc.jetstream(timeout=timeout)
        try:
            await js.account_info()
        except Exception as exc:  # noqa: BLE001 - JetStream off or not answering
            view.jetstream, view.error = False, _err(exc)
            return view
        now = time.time()
        for name in (EVENTS_STREAM, DLQ_STREAM, DECISIONS_STREAM):
            try:
                info = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                view.streams[name] = StreamView(name=name, exists=False)
                continue
            partitions = None
            if name == EVENTS_STREAM:
                try:
                    partitions = partitions_of(info.config)
                except Exception:  # noqa: BLE001 - reported as unknown
                    partitions = None
            view.streams[name] = StreamView(name=name, exists=True, messages=info.state.messages,
                                            partitions=partitions)
            if name == DLQ_STREAM and info.state.messages:
                seq = info.state.last_seq
                while seq >= info.state.first_seq and len(view.latest_dead_letters) < LATEST_DEAD_LETTERS:
                    try:
                        msg = await js.get_msg(DLQ_STREAM, seq)
                    except nats.js.errors.NotFoundError:  # deleted in between
                        seq -= 1
                        continue
                    headers = msg.headers or {}
                    view.latest_dead_letters.append(DeadLetter(
                        subject=msg.subject or "", stage=headers.get("Kvtier-Stage", ""),
                        reason=headers.get("Kvtier-Reason", ""),
                        age_s=now - msg.time.timestamp() if msg.time else None))
                    seq -= 1
        if view.streams.get(EVENTS_STREAM, StreamView(name="", exists=False)).exists:
            for w in workers:
                subject = f"{EVENTS_PREFIX}.{w.model}.{subject_token(w.worker)}.*"
                try:
                    msg = await js.get_last_msg(EVENTS_STREAM, subject)
                except nats.js.errors.NotFoundError:
                    continue
                age = now - msg.time.timestamp() if msg.time else 0.0
                try:
                    message = decode_message(msg.data)
                except Exception:  # noqa: BLE001 - an undecodable message is dead-lettered by the processor
                    view.last_messages[w.key] = LastMessage(kind="unreadable", age_s=age)
                    continue
                if isinstance(message, EventBatch):
                    last = LastMessage(kind="batch", age_s=age, epoch=message.epoch, seq=message.seq)
                elif isinstance(message, WorkerAnnounce):
                    last = LastMessage(kind="announce", age_s=age, epoch=message.cursor.epoch, seq=message.cursor.seq)
                elif isinstance(message, WorkerExpired):
                    last = LastMessage(kind="expired", age_s=age, epoch=message.epoch, seq=message.seq)
                else:
                    last = LastMessage(kind="unreadable", age_s=age)
                view.last_messages[w.key] = last
    except Exception as exc:  # noqa: BLE001 - NATS went away mid-check
        view.reachable, view.error = False, _err(exc)
    finally:
        with contextlib.suppress(Exception):  # closing is best effort
            await asyncio.wait_for(nc.close(), timeout)
    return view


#: The routers' bearer token, as `kvtier router` reads it from its environment: a router with
#: --auth-token shows only a summary of its /healthz to a reader without it.
ROUTER_TOKEN_VARIABLE = "KVTIER_AUTH_TOKEN"


def _http_get(url: str, timeout: float) -> tuple[int, bytes]:
    headers = {"User-Agent": "kvtier-doctor"}
    token = os.environ.get(ROUTER_TOKEN_VARIABLE, "").strip()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(1 << 22)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096)


_SAMPLE = re.compile(r'^(router_shared_pool_errors_total|router_page_size_mismatch_total)(\{[^}]*\})?\s+(\S+)')


def parse_router_metrics(text: str) -> tuple[dict[str, float], float]:
    """(router_shared_pool_errors_total by reason, router_page_size_mismatch_total)."""
    errors: dict[str, float] = {}
    mismatches = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        if name == "router_page_size_mismatch_total":
            mismatches += number
        else:
            reason = re.search(r'reason="([^"]*)"', labels or "")
            key = reason.group(1) if reason else ""
            errors[key] = errors.get(key, 0.0) + number
    return errors, mismatches


def observe_router(url: str, timeout: float) -> RouterView:
    base = url.rstrip("/")
    try:
        status, body = _http_get(base + "/healthz", timeout)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, bad URL: all the same finding
        return RouterView(url=url, reachable=False, error=_err(exc))
    view = RouterView(url=url, reachable=True, http_status=status)
    try:
        view.healthz = decode_router_health(body)
    except msgspec.DecodeError as exc:  # ValidationError included: JSON, but not a router's health
        view.error = (f"not a kvtier router's /healthz body ({exc}): "
                      + (shorten(body.decode(errors="replace"), 100) or "empty body"))
    with contextlib.suppress(Exception):  # metrics are extra detail
        metrics_status, metrics = _http_get(base + "/metrics", timeout)
        if metrics_status == 200:
            view.shared_pool_errors, view.page_size_mismatches = parse_router_metrics(metrics.decode(errors="replace"))
    return view


def observe_mooncake(url: str, timeout: float) -> MooncakeView:
    parsed = urllib.parse.urlsplit(url)
    probe = url if parsed.path not in ("", "/") else f"{url.rstrip('/')}/batch_query_keys?keys={MOONCAKE_PROBE_KEY}"
    try:
        status, body = _http_get(probe, timeout)
    except Exception as exc:  # noqa: BLE001 - refused, timed out, bad URL
        return MooncakeView(url=url, reachable=False, error=_err(exc))
    if status != 200:
        return MooncakeView(url=url, reachable=False,
                            error=f"GET {probe} answered HTTP {status}: is this the master's metrics port?")
    if "/batch_query_keys" in probe:
        try:
            reply = decode_batch_query_reply(body)
        except msgspec.ValidationError:  # JSON, but not shaped like a query reply
            reply = None
        except msgspec.DecodeError:
            return MooncakeView(url=url, reachable=False,
                                error=f"GET {probe} did not answer JSON: is this the master's metrics port?")
        if reply is None or reply.success is msgspec.UNSET:
            return MooncakeView(url=url, reachable=False, error=f"GET {probe} answered an unexpected body")
        return MooncakeView(url=url, reachable=True, detail="/batch_query_keys answers")
    return MooncakeView(url=url, reachable=True, detail=f"GET {parsed.path} answers HTTP 200")


async def observe(nats_url: str, redis_url: str, routers: list[str], mooncake_master: str = "",
                  model: str | None = None, events_window_s: float = 300.0, timeout: float = 3.0) -> Observation:
    router_task = asyncio.gather(*(asyncio.to_thread(observe_router, url, timeout) for url in routers))
    mooncake_task = asyncio.ensure_future(asyncio.to_thread(observe_mooncake, mooncake_master, timeout)) \
        if mooncake_master else None
    redis_view = await asyncio.to_thread(observe_redis, redis_url, model, timeout)
    nats_view = await observe_nats(nats_url, redis_view.workers, timeout)
    if redis_view.reachable:
        await asyncio.to_thread(_confirm_behind, redis_view, nats_view, redis_url, timeout)
    router_views = list(await router_task)
    # Routers were asked concurrently with Redis: one whose index looks behind the feed head
    # read may simply have answered first. Ask it once more, now surely after that read.
    for i, view in enumerate(router_views):
        if any(index_behind(view, redis_view)):
            router_views[i] = await asyncio.to_thread(observe_router, view.url, timeout)
    mooncake_view = await mooncake_task if mooncake_task is not None else None
    return Observation(nats=nats_view, redis=redis_view, routers=router_views, mooncake=mooncake_view,
                       events_window_s=events_window_s)


def _confirm_behind(redis_view: RedisView, nats_view: NatsView, redis_url: str, timeout: float) -> None:
    """Redis was read before NATS: a worker whose stream cursor looks ahead may simply have
    published in between. Re-read those workers' (epoch, seq, applied_ms) once."""
    import redis

    from kvtier.schemas.state_keys import ModelKeys, as_text

    suspects = [w for w in redis_view.workers
                if w.key in nats_view.last_messages and message_ahead_of(nats_view.last_messages[w.key], w)]
    if not suspects:
        return
    client = redis_client(redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        for w in suspects:
            epoch, seq, applied = client.hmget(ModelKeys(w.model).state(w.worker), "epoch", "seq", "applied_ms")
            w.epoch, w.seq = int(as_text(epoch or b"0")), int(as_text(seq or b"0"))
            if applied:
                w.applied_ago_s = max(0.0, time.time() - float(as_text(applied)) / 1000)
    except redis.RedisError:
        pass
    finally:
        client.close()
