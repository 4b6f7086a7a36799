"""What the fuzz properties judge by: the Violation a finding raises, and, for the real
processes, what each must make of an input, worked out in process from the same decoders
(the tier state Redis must hold, the dead letters the bridge and the processor must write,
the answer the router must give)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.producers.convert import convert_batch
from kvtier.router.refusals import Refused, decode_body
from kvtier.schemas.events import (
    AllCleared,
    PagesRemoved,
    PagesStored,
    TierEvent,
    UnsupportedVersion,
    WorkerAnnounce,
    decode_message,
)
from kvtier.schemas.routing import ErrorBody, GenerateRequest, ReleaseRequest, RouteRequest, decode_route_response
from kvtier.schemas.sglang import MalformedBatch, decode_payload
from kvtier.schemas.subjects import subject_token
from kvtier.schemas.tiers import Tier

from .strategies import encode_json
from .valid_messages import MODEL

MSGSPEC_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
#: Every error a router request body may be refused with (before anything else reads it).
ROUTER_REQUEST_ERRORS = (Refused, *MSGSPEC_ERRORS)


class Violation(AssertionError):
    """A property does not hold: the finding."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Violation(what)


def refused(exc: BaseException) -> bool:
    """A documented refusal: it must say why. Returns False (the input was not accepted)."""
    expect(bool(str(exc)), f"{type(exc).__name__} without a message")
    return False


# --- the tier state ------------------------------------------------------------------------
def apply_tier_events(pages: dict[int, set[Tier]], events: list[TierEvent]) -> None:
    """What a worker holds after `events` (the apply script's semantics), applied to `pages`."""
    for event in events:
        if isinstance(event, PagesStored):
            for h in event.hashes:
                pages.setdefault(h, set()).add(event.tier)
        elif isinstance(event, PagesRemoved):
            for h in event.hashes:
                tiers = pages.get(h)
                if tiers is not None:
                    tiers.discard(event.tier)
                    if not tiers:
                        del pages[h]
        elif isinstance(event, AllCleared):
            pages.clear()


def tier_state(events: list[TierEvent]) -> dict[int, set[Tier]]:
    pages: dict[int, set[Tier]] = {}
    apply_tier_events(pages, events)
    return pages


# --- the bridge and the processor ----------------------------------------------------------
def expected_from_engine(item) -> tuple[list[TierEvent], int]:
    """(tier events the bridge forwards, dead letters it writes) for one engine item."""
    kind, data = item
    if kind == "frames":
        return [], 1
    try:
        batch = decode_payload(data)
    except MalformedBatch:
        return [], 1
    converted = convert_batch(batch)
    return converted.events, len(converted.rejected)


def processor_verdict(tokens: tuple, data: bytes) -> bool:
    """Whether the processor must dead-letter this message (its own rule, from the outside)."""
    if isinstance(tokens[0], bytes) or isinstance(tokens[1], bytes):
        return True  # a subject that is not UTF-8 names no worker
    try:
        message = decode_message(data)
    except (*MSGSPEC_ERRORS, UnsupportedVersion):
        return True
    meta = message.metadata if isinstance(message, WorkerAnnounce) else message
    return (tokens[0], tokens[1]) != (subject_token(meta.model), subject_token(meta.worker_id))


# --- the router ----------------------------------------------------------------------------
#: The small limits the fuzzed router runs with (--max-request-tokens, --max-body-bytes).
ROUTER_MAX_TOKENS = 256
ROUTER_MAX_BODY = 16 << 10
REQUEST_TYPES = {"/v1/route": RouteRequest, "/v1/release": ReleaseRequest, "/generate": GenerateRequest}


def router_expectation(path: str, body: bytes, default_model: str = MODEL) -> tuple[str, Any]:
    """("invalid", the decoder's message) | ("too_big", "") | ("tokens", "") | ("valid", the
    decoded request) from the same decoding the router does, in process."""
    if len(body) > ROUTER_MAX_BODY:
        return "too_big", ""
    try:
        request = decode_body(body, REQUEST_TYPES[path])
    except ROUTER_REQUEST_ERRORS as exc:
        return "invalid", getattr(exc, "message", str(exc))
    tokens = getattr(request, "token_ids", getattr(request, "input_ids", None))
    if tokens is not None and (not tokens or len(tokens) > ROUTER_MAX_TOKENS):
        return "tokens", ""
    return "valid", request


def check_router_exchange(stack, path: str, body: bytes) -> int:
    """One request against the real router (a stacks.RouterStack): never a 5xx, never a hang;
    a 4xx has a JSON {"error"} naming the problem (the decoder's own message for a malformed
    body); a valid request for the seeded model gets a 200. Returns the status."""
    expectation, detail = router_expectation(path, body, stack.model)
    error = ""
    try:
        status, raw = stack.request("POST", path, body)
    except (ConnectionResetError, BrokenPipeError) as exc:
        expect(expectation == "too_big", f"connection dropped ({exc}) for a {len(body)}-byte body")
        return 413
    expect(status < 500, f"{status} for {path} {body[:300]!r}: {raw[:500]!r}")
    if status >= 400:
        try:
            error = msgspec.json.decode(raw, type=ErrorBody).error
        except MSGSPEC_ERRORS:
            raise Violation(f"{status} without a JSON error body: {raw[:300]!r}") from None
        expect(len(error) > 5, f"empty error message: {raw[:300]!r}")
    if expectation == "invalid":
        expect(status == 400 and detail in error, f"{status} {raw[:300]!r} for a body the decoder refuses ({detail})")
    elif expectation == "too_big":
        expect(status == 413, f"{status} for an oversized body")
    elif expectation == "tokens":
        expect(status in (400, 413) and ("token" in error or "input_ids" in error), f"{status} {raw[:300]!r}")
    elif (getattr(detail, "model", None) or stack.model) == stack.model:
        _expect_served(stack, detail, status, body, raw)
    else:
        expect(400 <= status < 500, f"{status} for a request of an unknown model")
    return status


def _expect_served(stack, request, status: int, body: bytes, raw: bytes) -> None:
    """A valid request for the seeded model. Request ids booked by /v1/route stay booked until
    released (or --booking-ttl): another booking under the same id is a 409, a release that
    does not give the booking's owner secret a 403 (a generated one never does); /generate
    releases its own at the end."""
    rid = getattr(request, "request_id", None) or getattr(request, "rid", None)
    if isinstance(request, ReleaseRequest):
        expect(status == (403 if rid in stack.used_ids else 404), f"{status} {raw[:300]!r}")
    elif rid is not None and rid in stack.used_ids and getattr(request, "book", True):
        expect(status == 409, f"{status} for a request id already booked: {raw[:300]!r}")
    else:
        expect(status == 200, f"{status} for a valid request: {body[:300]!r} -> {raw[:300]!r}")
        if isinstance(request, RouteRequest) and request.book and rid is not None:
            stack.used_ids.add(rid)


def check_router_still_serves(stack) -> None:
    """After the fuzzing, a plain request is still routed to one of the stack's workers."""
    status, raw = stack.request("POST", "/v1/route", encode_json({"model": stack.model, "token_ids": list(range(1, 17)),
                                                                  "book": False}))
    try:
        worker = decode_route_response(raw).worker_id if status == 200 else None
    except MSGSPEC_ERRORS:
        worker = None
    expect(worker in stack.WORKERS, f"{status} {raw[:300]!r}")
