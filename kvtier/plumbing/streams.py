"""JetStream streams kvtier uses, created idempotently by whichever part starts first.

KVTIER_EVENTS holds `kvtier.events.<model>.<worker>`; its subject transform appends a
partition token computed by the server from (model, worker), so processors can split the
work by partition while publishers stay unaware of the partition count.
KVTIER_DLQ holds dead letters (`kvtier.dlq.<stage>.<model>.<worker>`) with their reason in
the `Kvtier-Reason` header: bad input is kept, never dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, SubjectTransform

from kvtier.schemas.subjects import (
    DECISIONS_PREFIX,
    DECISIONS_STREAM,
    DLQ_PREFIX,
    DLQ_STREAM,
    EVENTS_PREFIX,
    EVENTS_STREAM,
    partition_transform_dest,
)

log = logging.getLogger("kvtier.nats")

DEFAULT_PARTITIONS = 8


def dead_letter_headers(**values: str) -> dict[str, str]:
    """Dead-letter headers as printable ASCII: nats-py hands a reader an email `Header` object,
    not text, for a value with other characters, and a worker name or a reason quoting bad
    input may have any. Non-ASCII is written as Python escapes, so the reason stays readable."""
    return {name.replace("_", "-"): value.encode("ascii", "backslashreplace").decode("ascii")
            for name, value in values.items()}


async def connect_nats(url: str, name: str, stop: asyncio.Event | None = None, retry_s: float = 1.0,
                       options=None):
    """Connect to NATS, waiting (with a clear warning each time) while it is unreachable:
    a service started before its broker comes up once the broker does. Returns None if
    `stop` is set first. After the first connection nats-py reconnects by itself.
    `options` (kvtier.plumbing.nats_options.NatsOptions: credentials, TLS) default to the ones the
    command line set for this process. Refused credentials or an untrusted certificate are
    retried too, each time with a warning that says so (never with the secret)."""
    from kvtier.plumbing.nats_options import NatsOptionsError, configured, explain, redact_nats

    options = options or configured()
    shown = redact_nats(url)
    seen: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        seen.append(exc)
        del seen[:-8]  # the recent ones (the callback outlives the connect)
        log.debug("NATS client error: %s", explain(exc))

    async def on_disconnect() -> None:
        log.warning("disconnected from NATS at %s; reconnecting", shown)

    while True:
        try:
            # A bounded first attempt (nats-py would otherwise retry inside connect() forever,
            # deaf to SIGTERM); once connected, reconnect without limit.
            seen.clear()
            nc = await options.connect(url, name=name, max_reconnect_attempts=1,
                                       reconnect_time_wait=0.5, connect_timeout=2, error_cb=on_error,
                                       disconnected_cb=on_disconnect)
            nc.options["max_reconnect_attempts"] = -1
            return nc
        except NatsOptionsError:
            raise  # a setting that cannot work (unreadable TLS file): retrying will not help
        except Exception as exc:  # noqa: BLE001 - any failure to connect is reported and retried
            log.warning("cannot reach NATS at %s (%s); retrying in %.0fs", shown,
                        explain(exc, seen), retry_s)
        if stop is None:
            await asyncio.sleep(retry_s)
        elif await _stopped_within(stop, retry_s):
            return None
async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `stop`; True if it was set (a retry loop then gives up)."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


_PARTITION_RE = re.compile(r"partition\((\d+)")


@dataclass(frozen=True)
class StreamSettings:
    partitions: int = DEFAULT_PARTITIONS
    max_age_s: float = 24 * 3600.0
    max_bytes: int = -1
    replicas: int = 1
    duplicate_window_s: float = 120.0
    file_storage: bool = True
    #: max_age_s / max_bytes were given explicitly (flag or environment): an existing events
    #: stream whose limits differ is updated to them. Otherwise they apply only when creating it.
    retention_explicit: bool = False


class StreamMismatch(RuntimeError):
    pass


def partitions_of(config: StreamConfig) -> int:
    transform = config.subject_transform
    match = _PARTITION_RE.search(transform.dest) if transform and transform.dest else None
    if not match:
        raise StreamMismatch(
            f"stream {config.name} exists without kvtier's partition transform; delete it or "
            "point kvtier at another NATS account"
        )
    return int(match.group(1))


async def ensure_streams(js: JetStreamContext, settings: StreamSettings, *,
                         partitions_explicit: bool = False) -> int:
    """Create the events and dead-letter streams if missing; return the partition count in
    force. An existing stream's partition count wins unless the caller asked for another
    one explicitly, which is an error (re-partitioning would reorder a worker's events)."""
    storage = StorageType.FILE if settings.file_storage else StorageType.MEMORY
    events = StreamConfig(
        name=EVENTS_STREAM,
        subjects=[f"{EVENTS_PREFIX}.*.*"],
        subject_transform=SubjectTransform(src=f"{EVENTS_PREFIX}.*.*",
                                           dest=partition_transform_dest(settings.partitions)),
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=settings.max_age_s,
        max_bytes=settings.max_bytes,
        storage=storage,
        num_replicas=settings.replicas,
        duplicate_window=_duplicate_window(settings.duplicate_window_s, settings.max_age_s),
        allow_direct=True,
    )
    try:
        info = await js.stream_info(EVENTS_STREAM)
    except nats.js.errors.NotFoundError:
        try:
            info = await js.add_stream(events)
        except nats.js.errors.APIError as exc:
            _refuse_unplaceable(exc, settings.replicas)
            info = await js.stream_info(EVENTS_STREAM)  # another process created it first
    existing = partitions_of(info.config)
    if (info.config.num_replicas or 1) < settings.replicas:
        log.warning("stream %s exists with %d replica(s), fewer than the %d requested; kept as it is (raise it "
                    "with `nats stream edit %s --replicas N`)", EVENTS_STREAM, info.config.num_replicas or 1,
                    settings.replicas, EVENTS_STREAM)
    if settings.retention_explicit:
        await _update_retention(js, info.config, settings)
    if partitions_explicit and existing != settings.partitions:
        raise StreamMismatch(
            f"stream {EVENTS_STREAM} has {existing} partitions, but {settings.partitions} were "
            "requested; drop the flag to use the existing count"
        )
    dlq = StreamConfig(name=DLQ_STREAM, subjects=[f"{DLQ_PREFIX}.>"], retention=RetentionPolicy.LIMITS,
                       max_age=7 * 24 * 3600.0, storage=storage, num_replicas=settings.replicas)
    await _add_stream_if_missing(js, dlq)
    return existing


async def ensure_streams_when_ready(js: JetStreamContext, settings: StreamSettings, stop: asyncio.Event, *,
                                    partitions_explicit: bool = False, retry_s: float = 1.0) -> int | None:
    """`ensure_streams`, waiting while JetStream cannot answer yet; returns None if `stop` is
    set first. A server that is up but has no JetStream, a cluster still electing its meta
    leader, or a new replicated stream still electing its own leader each either time out or
    answer 503: these pass, so a part started before its broker is ready waits (with a
    warning each time) instead of exiting. A refusal that retrying cannot change (a
    partition mismatch, replicas the cluster cannot place) is raised at once."""
    while True:
        try:
            return await ensure_streams(js, settings, partitions_explicit=partitions_explicit)
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
            reason = "timed out" if isinstance(exc, nats.errors.TimeoutError) else (
                exc.description or "JetStream is not enabled or not ready")
            log.warning("JetStream cannot set up the streams yet (%s); retrying in %.0fs", reason, retry_s)
        if await _stopped_within(stop, retry_s):
            return None


#: JetStream's answers when a stream's replicas cannot be placed: a standalone server (10074),
#: fewer servers in the cluster than replicas (10005 no suitable peers, 10023 insufficient resources).
_PLACEMENT_ERRORS = {10074, 10005, 10023}


def _refuse_unplaceable(exc: nats.js.errors.APIError, replicas: int) -> None:
    """Raise a clear StreamMismatch when the server cannot hold `replicas` copies; return for
    any other refusal (the stream may have been created by another process meanwhile)."""
    if exc.err_code in _PLACEMENT_ERRORS or (replicas > 1 and "replica" in (exc.description or "")):
        raise StreamMismatch(
            f"cannot create the JetStream streams with {replicas} replicas: {exc.description} (err_code "
            f"{exc.err_code}). --stream-replicas must not exceed the number of JetStream servers in the NATS "
            "cluster (1 for a single server); start the cluster's nodes first or lower it") from None
    if not isinstance(exc, nats.js.errors.BadRequestError):
        raise exc


def _duplicate_window(window_s: float, max_age_s: float) -> float:
    """JetStream refuses a duplicate window longer than the stream's max age: with a short
    retention, publish retries are deduplicated over that retention instead."""
    return min(window_s, max_age_s) if max_age_s and max_age_s > 0 else window_s


async def _update_retention(js: JetStreamContext, current: StreamConfig, settings: StreamSettings) -> None:
    """Bring an existing events stream's age and size limits to the requested ones. Unlike
    the partition count this is safe to change: it only decides how far back replay reaches
    (shrinking it drops the oldest messages at once)."""
    age, size = current.max_age or 0.0, current.max_bytes if current.max_bytes is not None else -1
    want_age = settings.max_age_s or 0.0
    if abs(age - want_age) < 1e-3 and size == settings.max_bytes:
        return
    log.warning("stream %s: changing retention from max_age=%.0fs max_bytes=%d to max_age=%.0fs max_bytes=%d",
                EVENTS_STREAM, age, size, want_age, settings.max_bytes)
    updated = dataclasses.replace(current, max_age=want_age, max_bytes=settings.max_bytes,
                                  duplicate_window=_duplicate_window(current.duplicate_window or 0.0, want_age))
    await js.update_stream(updated)


async def _add_stream_if_missing(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)  # type: ignore[arg-type]  # the configs built here all have a name
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.APIError as exc:
            _refuse_unplaceable(exc, config.num_replicas or 1)  # else another process created it first


async def ensure_decisions_stream(js: JetStreamContext, max_age_s: float = 7 * 24 * 3600.0,
                                  max_bytes: int = 4 << 30, replicas: int = 1) -> None:
    """The routers' decision log (`kvtier.decisions.<model>`), kept by age and size."""
    config = StreamConfig(name=DECISIONS_STREAM, subjects=[f"{DECISIONS_PREFIX}.>"],
                          retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD,
                          max_age=max_age_s, max_bytes=max_bytes, storage=StorageType.FILE,
                          num_replicas=replicas)
    await _add_stream_if_missing(js, config)
