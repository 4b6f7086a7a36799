"""The fuzz table: one row per decoder of input kvtier does not control, with what it is fed,
what it may raise, and what must hold of what it returns; one generic `check` runs a row on an
input. Below it, the three targets through the real processes (stacks.py).

The property, for each decoder: it returns a valid typed value or raises its module's
documented errors (msgspec.DecodeError / ValidationError, MalformedBatch, UnsupportedVersion,
...), never another exception, never hangs (a hypothesis deadline), and a valid message
round-trips. Through the real processes: bad engine input ends in KVTIER_DLQ with a reason
while the valid batches around it are applied; bad stream messages likewise; every bad router
request gets a 4xx naming what is wrong, never a 5xx or a hang, and the router keeps serving.

`kvtier bench fuzz` (kvtier/bench/fuzz.py) and tests/bench/test_fuzz.py read this module; it
re-exports the strategies and stacks they use besides the table.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvtier.consumers.apply import _script_ops  # no public equivalent: the ops the apply script gets
from kvtier.consumers.hash_check import HashValidator
from kvtier.producers.convert import convert_batch, encoded_size_bound, source_timestamp
from kvtier.producers.message_chunks import chunk_by_pages
from kvtier.producers.sglang_discovery import WorkerFlags, discover
from kvtier.producers.sglang_source import ReplaySocketError, parse_pub_frames
from kvtier.producers.sglang_source import _split_replay as split_replay  # no public equivalent
from kvtier.router.refusals import decode_body
from kvtier.schemas.events import (
    EventBatch,
    PagesStored,
    TierEvent,
    UnsupportedVersion,
    decode_control,
    decode_message,
    encode_control,
    encode_message,
    token_ids_of,
)
from kvtier.schemas.health import decode_hash_check, encode_hash_check
from kvtier.schemas.jetstream import decode_jsz
from kvtier.schemas.mooncake import decode_batch_query_reply
from kvtier.schemas.router_health import decode_router_health
from kvtier.schemas.routing import (
    GenerateRequest,
    ReleaseRequest,
    RouteRequest,
    ScoringWeights,
    TierOverlap,
    decision_request_id,
    decode_decision,
    encode_decision,
)
from kvtier.schemas.sglang import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    MalformedBatch,
    decode_event,
    decode_payload,
    decode_seq,
    encode_payload,
)
from kvtier.schemas.sglang_server import (
    L3CacheLayout,
    ServerInfo,
    decode_generate_meta_info,
    decode_kv_events_config,
    decode_l3_cache_layout,
    decode_server_info,
)
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import subject_token
from kvtier.schemas.worker import decode_worker_metadata, encode_worker_metadata

from .oracle import (
    MSGSPEC_ERRORS,
    ROUTER_REQUEST_ERRORS,
    Violation,
    check_router_exchange,
    check_router_still_serves,
    expect,
    expected_from_engine,
    processor_verdict,
    refused,
    tier_state,
)
from .process_inputs import GOOD_EVENTS, engine_items, router_requests, stream_items
from .stacks import BridgeStack, ProcessorStack, RouterStack
from .strategies import encode_json, inputs, profile, quick_mutants
from .valid_messages import (
    as_builtins_json,
    as_builtins_msgpack,
    control_requests,
    generate_replies,
    generate_requests,
    hash_checks,
    huge_payloads,
    jsz_replies,
    kvtier_messages,
    l3_layouts,
    mooncake_replies,
    pub_frames,
    release_requests,
    route_decisions,
    route_requests,
    router_healths,
    server_infos,
    sglang_events,
    sglang_payloads,
    worker_metadata,
)


@dataclass(frozen=True)
class Decoder:
    """One row: a decoder of untrusted input, its inputs, its documented errors, and what must
    hold of a value it returns (`returns`: its type; `encoder`: decode(encoder(value)) == value;
    `then`: further checks, raising Violation, for what the service derives from the value)."""

    name: str
    strategy: st.SearchStrategy
    decode: Callable[[Any], Any]
    errors: tuple[type[BaseException], ...] = MSGSPEC_ERRORS
    returns: type | tuple[type, ...] | None = None
    encoder: Callable[[Any], bytes] | None = None
    then: Callable[[Any], Any] | None = None
    weight: float = 1.0  # share of the cases (the central wire formats get more)
    amplify: bool = True  # inputs are bytes: add quick mutants of each

    def checker(self, mutants: int) -> Callable[[Any], Any]:
        run_row = functools.partial(check, self)
        return amplified(run_row, mutants) if self.amplify and mutants else run_row


def check(row: Decoder, data: Any) -> bool:
    """Run `row` on one input: True when the decoder returned a value and everything the row
    expects of it holds, False when it raised one of its documented errors (with a message);
    anything else raises (a Violation, or the unexpected exception itself)."""
    try:
        value = row.decode(data)
    except row.errors as exc:
        return refused(exc)
    if row.returns is not None:
        expect(isinstance(value, row.returns), f"{row.name}: {type(value).__name__} is not a {row.returns}")
    if row.encoder is not None:
        expect(row.decode(row.encoder(value)) == value, f"{row.name}: the value does not round-trip")
    if row.then is not None:
        row.then(value)
    return True


def amplified(check_one: Callable[[bytes], bool], k: int) -> Callable[[bytes], tuple[int, int]]:
    """`check_one` on the input and on `quick_mutants(input, k)`; a failure names the mutant."""
    def run(data: bytes) -> tuple[int, int]:
        accepted = int(check_one(data))
        for mutant in quick_mutants(data, k):
            try:
                accepted += int(check_one(mutant))
            except Violation as exc:
                raise Violation(f"{exc} (mutant {mutant[:400]!r} of {data[:400]!r})") from None
            except Exception as exc:  # any other exception is the finding
                raise Violation(f"{type(exc).__name__}: {exc} on mutant {mutant[:400]!r} of {data[:400]!r}") from exc
        return k + 1, accepted
    return run


# --- what must hold of a decoded value (the rows' `then`) ----------------------------------------
#: A small message budget, so the in-process check splits events as often as the bridge would
#: split a huge one against the server's max_payload.
SPLIT_BUDGET = 4096


def _bridge_forwards(batch: DecodedBatch) -> None:
    """What the bridge makes of a decoded batch (convert, split into messages) the processor's
    decoder accepts, and the split messages apply to the same state as the events unsplit."""
    expect(isinstance(batch.ts, float), "not a DecodedBatch")
    expect(all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in batch.events), "event type")
    expect(all(reason for _, _, reason in batch.rejected), "rejected event without a reason")
    converted = convert_batch(batch)
    expect(all(reason and isinstance(raw, bytes) for raw, reason in converted.rejected), "rejection without reason")
    source_ts = source_timestamp(batch.ts, 1.7e9)
    pages = sum(len(getattr(e, "hashes", ())) for e in converted.events)
    split: list[TierEvent] = []
    # The bridge's own limits for big batches (16384 pages, ~1 MB), small ones for the rest.
    max_pages, budget = (16384, (1 << 20) - (8 << 10)) if pages > 10_000 else (64, SPLIT_BUDGET)
    for chunk in chunk_by_pages(converted.events, max_pages, budget):
        message = EventBatch(worker_id="w", model="m", epoch=1, seq=1, ts=1.7e9, source_ts=source_ts,
                             source_ts_last=batch.ts, events=chunk)
        encoded = encode_message(message)
        expect(sum(encoded_size_bound(e) for e in chunk) <= budget, "chunk over budget")
        expect(sum(len(getattr(e, "hashes", ())) for e in chunk) <= max_pages, "chunk over the page limit")
        decoded = decode_message(encoded)  # must not raise: the processor would dead-letter good events
        expect(isinstance(decoded, EventBatch) and decoded.events == chunk, "events changed on the wire")
        split += chunk
    if pages <= 50_000:
        expect(tier_state(split) == tier_state(converted.events), "splitting changed the state")


def _event_round_trips(event) -> None:
    again = decode_payload(encode_payload(1.0, [event]))
    expect(again.events == [event] and not again.rejected, "event does not round-trip")


def _read_frames(frames: list[bytes]):
    """The PUB socket's reading of the frames (seq and payload exactly as sent); the replay
    socket's reading of the same frames is checked beside it, whatever the first gave."""
    try:
        raw = parse_pub_frames(frames)
        expect(raw.seq == int.from_bytes(frames[1], "big", signed=True) and raw.payload == frames[2], "frames")
        return raw
    finally:
        try:
            seq_frame, _payload = split_replay(frames)
            decode_seq(seq_frame)
        except (ReplaySocketError, MalformedBatch) as exc:
            refused(exc)


def _processor_derives(message) -> None:
    """The message round-trips; what the processor derives from it (subject tokens, Redis keys,
    script ops, the hash check, the metadata JSON a router reads) never raises."""
    encoded = encode_message(message)
    expect(encode_message(decode_message(encoded)) == encoded, "message does not round-trip")
    if isinstance(message, EventBatch):
        ModelKeys.for_model(message.model).pages(message.worker_id)
        subject_token(message.worker_id)
        _ = message.msg_id
        _script_ops(message)
        for event in message.events:
            if isinstance(event, PagesStored):
                try:
                    token_ids_of(event)
                except MSGSPEC_ERRORS as exc:
                    refused(exc)
        HashValidator(budget_pages_per_s=None).check_batch(message, None, None)
    else:
        meta = message.metadata
        ModelKeys.for_model(meta.model).meta(meta.worker_id)
        subject_token(meta.worker_id)
        expect(decode_worker_metadata(encode_worker_metadata(meta)) == meta, "metadata does not survive Redis")


def _mooncake_keys_bounded(meta) -> None:
    from kvtier.schemas.hashes import PageDigest
    from kvtier.schemas.mooncake import mooncake_object_keys

    if meta.mooncake is not None:
        keys = mooncake_object_keys(PageDigest(bytes(32)), meta.mooncake)
        expect(0 < len(keys) <= 4096, f"{len(keys)} objects per page")


def _discovers(info: ServerInfo, layout: L3CacheLayout | None) -> None:
    """The bridge's discovery: settings, or a ValueError (DiscoveryError) naming the problem."""
    for flags in (WorkerFlags(), WorkerFlags(hicache_storage_backend="mooncake")):
        try:
            discover("http://127.0.0.1:30000", info, layout, flags)
        except ValueError as exc:
            refused(exc)


def _server_info_discovers(info: ServerInfo) -> None:
    if isinstance(info.kv_events_config, str):
        try:
            decode_kv_events_config(info.kv_events_config)
        except MSGSPEC_ERRORS as exc:
            refused(exc)
    _discovers(info, None)


_LAYOUT_INFO = decode_server_info(json.dumps({
    "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "block_size": 16},
    "tp_size": 2, "page_size": 16, "enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}))


def _found_is_bool(reply) -> None:
    found = {key: status.ok for key, status in (reply.data or {}).items()}  # what the router reads
    expect(all(isinstance(v, bool) for v in found.values()), "ok is not a bool")


def _probe_reads(meta) -> None:
    from kvtier.tools.probe import cached_tokens_of, worker_ttft_of

    cached = cached_tokens_of(meta)  # what `kvtier probe hicache` reads of it
    expect(cached.total is None or isinstance(cached.total, int), "cached tokens are not a count")
    ttft, field = worker_ttft_of(meta)
    expect((ttft is None) == (field == ""), "a TTFT without the field it came from")


def _doctor_reads(health) -> None:
    from kvtier.tools.doctor.judge import check_page_sizes, check_routers
    from kvtier.tools.doctor.views import RedisView, RouterView

    view = RouterView(url="http://r", reachable=True, http_status=200, healthz=health)
    check_routers([view])  # what the doctor reads of it
    check_page_sizes(RedisView(url="redis://r", reachable=True), [view])


def _decision_and_its_id(data: bytes):
    """A decision-log message in full; the search's request-id-only read must agree with it."""
    decision = decode_decision(data)
    try:
        read_alone = decision_request_id(data)
    except _MESSAGE_ERRORS as exc:  # documented errors, but not for a message that decoded in full
        raise Violation(f"the request id read alone: {type(exc).__name__}: {exc}") from exc
    expect(read_alone == decision.request_id, "the request id read alone differs")
    return decision


def _analytics_counts(decision) -> None:
    from kvtier.consumers.analytics_model import TierAnalytics

    encoded = encode_decision(decision)
    expect(encode_decision(decode_decision(encoded)) == encoded, "decision does not round-trip")
    TierAnalytics().decision(decision)


def _soak_reads(jsz) -> None:
    from kvtier.testing.nats_monitor import streams_of

    for name, stream in streams_of(jsz, 1.75e9).items():  # what the soak samples of it
        expect(isinstance(name, str) and math.isfinite(stream["age_s"]), f"stream {name!r}: {stream}")


def _scores(request: RouteRequest) -> None:
    """Everything before Redis: the weights with the overrides applied and the scoring formula
    over them never raise, never give NaN."""
    from kvtier.router import scoring
    from kvtier.router.hashing import RequestPages

    weights = request.overrides.applied_to(ScoringWeights()) if request.overrides else ScoringWeights()
    pages = RequestPages.of(request.token_ids[:4096], 4)
    candidates = [scoring.CandidateInputs("a", TierOverlap(device=len(pages)), 3, 5),
                  scoring.CandidateInputs("b", TierOverlap(host=1, disk=1, shared_beyond=2), 0, 0)]
    for u in (0.0, 0.5, 0.999999):
        scored = scoring.score(len(pages), candidates, weights, u)
        expect(0 <= scored.chosen < 2 and not any(math.isnan(v) for v in scored.logits), f"scored {scored}")


def _routes(body: GenerateRequest) -> None:
    RouteRequest(model=body.model or "m", token_ids=body.input_ids, request_id=body.rid,
                 max_new_tokens=body.sampling_params.max_new_tokens or 0)


def _request_body(kind: type) -> Callable[[bytes], Any]:
    return functools.partial(decode_body, kind=kind)


# --- the table ---------------------------------------------------------------------------------
_MESSAGE_ERRORS = (*MSGSPEC_ERRORS, UnsupportedVersion)
_SGLANG_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)

DECODERS: tuple[Decoder, ...] = (
    Decoder("sglang.payload", inputs(sglang_payloads()), decode_payload, (MalformedBatch,), DecodedBatch,
            then=_bridge_forwards, weight=3),
    Decoder("sglang.payload.huge", huge_payloads(), decode_payload, (MalformedBatch,), DecodedBatch,
            then=_bridge_forwards, weight=0.02, amplify=False),
    Decoder("sglang.event", inputs(sglang_events()), decode_event, returns=_SGLANG_EVENTS, then=_event_round_trips,
            weight=2),
    Decoder("sglang.frames", pub_frames(), _read_frames, (MalformedBatch,), weight=0.5, amplify=False),
    Decoder("events.message", inputs(kvtier_messages().map(as_builtins_msgpack)), decode_message, _MESSAGE_ERRORS,
            then=_processor_derives, weight=3),
    Decoder("events.control", inputs(control_requests().map(as_builtins_json), True), decode_control,
            encoder=encode_control),
    Decoder("health.hash_check", inputs(hash_checks().map(as_builtins_json), True), decode_hash_check,
            encoder=encode_hash_check, then=lambda hash_check: hash_check.ok),  # a property: must not raise
    Decoder("worker.metadata", inputs(worker_metadata().map(as_builtins_json), True), decode_worker_metadata,
            encoder=encode_worker_metadata, then=_mooncake_keys_bounded, weight=1.5),
    Decoder("sglang_server.server_info", inputs(server_infos(), True), decode_server_info, returns=ServerInfo,
            then=_server_info_discovers),
    Decoder("sglang_server.l3_layout", inputs(l3_layouts(), True), decode_l3_cache_layout, returns=L3CacheLayout,
            then=lambda layout: _discovers(_LAYOUT_INFO, layout)),
    Decoder("sglang_server.generate_reply", inputs(generate_replies(), True), decode_generate_meta_info,
            then=_probe_reads),
    Decoder("mooncake.batch_query_reply", inputs(mooncake_replies(), True), decode_batch_query_reply,
            then=_found_is_bool),
    Decoder("router_health.healthz", inputs(router_healths(), True), decode_router_health,
            encoder=msgspec.json.encode, then=_doctor_reads),
    Decoder("routing.decision", inputs(route_decisions().map(lambda d: msgspec.msgpack.decode(encode_decision(d)))),
            _decision_and_its_id, _MESSAGE_ERRORS, then=_analytics_counts),
    Decoder("jetstream.jsz", inputs(jsz_replies(), True), decode_jsz, then=_soak_reads, weight=0.5),
    Decoder("routing.route", inputs(route_requests(), True), _request_body(RouteRequest), ROUTER_REQUEST_ERRORS,
            then=_scores, weight=2),
    Decoder("routing.release", inputs(release_requests(), True), _request_body(ReleaseRequest),
            ROUTER_REQUEST_ERRORS),
    Decoder("routing.generate", inputs(generate_requests(), True), _request_body(GenerateRequest),
            ROUTER_REQUEST_ERRORS, then=_routes),
)
BY_NAME = {row.name: row for row in DECODERS}


def decoder_targets() -> list[Decoder]:
    """Every decoder of untrusted input, with its inputs and its property (the table's rows)."""
    return list(DECODERS)


def check_sglang_payload(data: bytes) -> bool:
    """The sglang.payload row on one input."""
    return check(BY_NAME["sglang.payload"], data)


# --- through the real processes -------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessTarget:
    """A target through real processes: the stack it starts on the embedded servers (nats,
    redis), the strategy of one example for that stack, and the check of one example
    (accepted, or (cases, accepted) for an example of several inputs)."""

    name: str
    start: Callable[[Any, Any], Any]
    strategy: Callable[[Any], st.SearchStrategy]
    check: Callable[[Any, Any], Any]
    per_request: bool = False  # sized by requests (--process-cases), else by examples of ~6 inputs
    shrink: bool = False  # else a failure is reported as found: an example takes a second or more
    afterwards: Callable[[Any], None] | None = None  # the stack still works after the run


def _bridge_example(stack: BridgeStack, batch: list) -> tuple[int, int]:
    stack.run(batch)
    return len(batch), sum(1 for item in batch if expected_from_engine(item)[1] == 0)


def _processor_example(stack: ProcessorStack, example: tuple) -> tuple[int, int]:
    items, good = example
    stack.run(items, good)
    return len(items), sum(1 for tokens, data, _ in items if not processor_verdict(tokens, data))


PROCESSES: tuple[ProcessTarget, ...] = (
    ProcessTarget("router.http", lambda nats, redis: RouterStack(redis.url), lambda stack: router_requests(stack.model),
                  lambda stack, item: check_router_exchange(stack, item[0], item[1]) == 200, per_request=True,
                  shrink=True, afterwards=check_router_still_serves),
    ProcessTarget("bridge.pipeline", lambda nats, redis: BridgeStack(nats.url, redis.url),
                  lambda stack: st.lists(engine_items(), min_size=1, max_size=12), _bridge_example),
    ProcessTarget("processor.stream", lambda nats, redis: ProcessorStack(nats.url, redis.url, nats.port),
                  lambda stack: st.tuples(st.lists(stream_items(stack.MODEL, stack.FUZZ), min_size=1, max_size=12),
                                          GOOD_EVENTS),
                  _processor_example),
)

__all__ = ["DECODERS", "PROCESSES", "Decoder", "ProcessTarget", "check", "decoder_targets", "check_sglang_payload",
           "Violation", "profile", "encode_json", "kvtier_messages", "sglang_payloads", "engine_items", "stream_items",
           "router_requests", "GOOD_EVENTS", "BridgeStack", "ProcessorStack", "RouterStack", "check_router_exchange",
           "check_router_still_serves"]
