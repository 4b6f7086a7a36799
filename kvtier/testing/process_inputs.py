"""What the real processes are fed (hypothesis strategies): engine payloads and frames for a
bridge, stream messages for a processor, HTTP requests for a router; valid ones among every
kind of bad one. oracle.py says what each process must make of them."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from kvtier.schemas.events import EventBatch, PagesRemoved, PagesStored
from kvtier.schemas.tiers import Tier

from .oracle import ROUTER_MAX_BODY, ROUTER_MAX_TOKENS
from .strategies import encode_json, encode_msgpack, mutated, perturbed, values
from .valid_messages import (
    MODEL,
    OVERRIDE_NAMES,
    as_builtins_msgpack,
    generate_requests,
    kvtier_messages,
    release_requests,
    route_requests,
    sglang_events,
    sglang_payloads,
)

# --- the engine side: a valid batch (SGLang events, from a small pool of hashes so removes hit
# stored pages), a bad payload, or bad frames ------------------------------------------------
POOL_HASHES = st.integers(1, 40)
BRIDGE_MEDIUMS = ["GPU", "CPU_PINNED", "DISK", None, "cpu", "EXTERNAL"]


@st.composite
def engine_items(draw):
    """One thing the engine side sends: ("payload", bytes) or ("frames", [frame, ...])."""
    valid = sglang_payloads(sglang_events(hashes=POOL_HASHES, mediums=BRIDGE_MEDIUMS))
    kind = draw(st.sampled_from(["valid", "valid", "valid", "perturbed", "mutated", "bad_event", "garbage", "frames"]))
    if kind == "valid":
        return "payload", encode_msgpack(draw(valid))
    if kind == "perturbed":
        return "payload", encode_msgpack(draw(perturbed(valid)))
    if kind == "mutated":
        return "payload", draw(mutated(valid.map(encode_msgpack)))
    if kind == "bad_event":  # a good batch with one bad event among good ones
        payload = draw(valid)
        bad = draw(st.sampled_from([
            {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [],
             "block_size": 4, "medium": draw(st.sampled_from(["SSD_TIER9", "ＧＰＵ", "GPU\r\nX: y", "x" * 3000]))},
            {"type": "BlockStored", "block_hashes": ["x"], "parent_block_hash": None, "token_ids": [],
             "block_size": 4},
            ["BlockStored", [2], None, [], -4, None, "GPU"], {"type": "Mystery\r\n"}, ["BlockRemoved", [1 << 63]],
            msgspec.Raw(b"\xa2\xff\xfe"), msgspec.Raw(b"\x91" * 2000 + b"\xc0")]))
        payload[1].insert(draw(st.integers(0, len(payload[1]))), bad)
        return "payload", encode_msgpack(payload)
    if kind == "garbage":
        return "payload", draw(st.binary(max_size=64) | values().map(encode_msgpack)
                               | st.sampled_from([b"\x91" * 5000, b"\xff" * 3000]))
    frames = draw(st.lists(st.binary(max_size=10), min_size=1, max_size=5).filter(lambda f: len(f) != 3)
                  | st.tuples(st.binary(max_size=3), st.binary(max_size=12).filter(lambda s: len(s) != 8),
                              st.binary(max_size=10)).map(list))
    return "frames", frames


# --- the stream side: messages published straight to JetStream ---------------------------------
#: The server's default max_payload: the largest message anyone can publish.
MAX_STREAM_MESSAGE = 1 << 20
ODD_TOKENS = ["fz", "w0", "m_w", "-", "_", "é", "ü", "\u202e", "%", "$", "#", "a:b", "x" * 200, "0", "{m}", "w,1",
              "\U0001f600"]


@st.composite
def stream_items(draw, model: str, fuzz_worker: str):
    """(subject tokens, data, raw) published to kvtier.events.<a>.<b>: mutated, perturbed or
    arbitrary messages for another worker, or on subjects with odd tokens (raw: not UTF-8,
    sent over a raw socket)."""
    def named(message):
        if isinstance(message, EventBatch):
            return msgspec.structs.replace(message, model=model, worker_id=fuzz_worker)
        meta = msgspec.structs.replace(message.metadata, model=model, worker_id=fuzz_worker)
        return msgspec.structs.replace(message, metadata=meta)

    valid = kvtier_messages().map(named).map(as_builtins_msgpack)
    data = draw(st.one_of(perturbed(valid).map(encode_msgpack), mutated(valid.map(encode_msgpack)),
                          values().map(encode_msgpack), st.binary(max_size=100), valid.map(encode_msgpack),
                          st.sampled_from([b"\xc1" * (MAX_STREAM_MESSAGE - 64), b"\x91" * 4000 + b"\xc0"])))
    data = data[:MAX_STREAM_MESSAGE - 64]  # what the server takes (a cut message is a bad one too)
    place = draw(st.sampled_from(["fuzz", "fuzz", "odd", "raw"]))
    if place == "fuzz":
        return (model, fuzz_worker), data, False
    if place == "odd":
        return (draw(st.sampled_from(ODD_TOKENS + [model])), draw(st.sampled_from(ODD_TOKENS))), data, False
    return (model.encode() + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])), b"w"), data, True


#: The good worker's batches published between the fuzzed messages.
GOOD_EVENTS = st.lists(st.lists(
    st.builds(PagesStored, tier=st.sampled_from(list(Tier)), hashes=st.lists(POOL_HASHES, max_size=4))
    | st.builds(PagesRemoved, tier=st.sampled_from(list(Tier)), hashes=st.lists(POOL_HASHES, max_size=4)),
    max_size=3), max_size=4)


# --- the router: requests of each endpoint ------------------------------------------------------
ROUTER_KINDS = ["valid", "valid", "valid", "valid", "perturbed", "perturbed", "wrong_field", "missing", "mutated",
                "garbage", "too_many_tokens", "too_big", "bad_utf8", "nan_override", "unknown_override", "negative",
                "not_object"]


@st.composite
def router_requests(draw, model: str = MODEL):
    """(path, body bytes, kind): valid requests of each endpoint and every kind of bad one."""
    path, valid = draw(st.sampled_from([("/v1/route", route_requests(model)), ("/v1/release", release_requests(model)),
                                        ("/generate", generate_requests(model))]))
    kind = draw(st.sampled_from(ROUTER_KINDS))
    body = draw(valid)
    if kind == "valid":
        return path, encode_json(body), kind
    if kind == "perturbed":
        return path, encode_json(draw(perturbed(st.just(body), True))), kind
    if kind == "wrong_field":
        name = draw(st.sampled_from(sorted(body)))
        body[name] = draw(st.sampled_from([{"x": 1}, [[1]], "1", 1.5, -1, None, True, 1 << 70]) | values(True))
        return path, encode_json(body), kind
    if kind == "missing":
        for name in ("model", "token_ids", "request_id", "input_ids"):
            body.pop(name, None) if draw(st.booleans()) else None
        return path, encode_json(body), kind
    if kind == "mutated":
        return path, draw(mutated(st.just(encode_json(body)))), kind
    if kind == "garbage":
        return path, draw(st.binary(max_size=100) | values(True).map(encode_json)
                          | st.sampled_from([b"not json", b"{", b"[" * 5000,
                                             b'{"model": "m", "token_ids": [1,]}'])), kind
    return _refused_request(draw, path, kind, model)


def _refused_request(draw, path: str, kind: str, model: str) -> tuple[str, bytes, str]:
    """The kinds of request the router must refuse for what a field holds (or the body is)."""
    tokens_field = "input_ids" if path == "/generate" else "token_ids"
    if kind == "too_many_tokens":
        body = {"model": model, tokens_field: [7] * draw(st.integers(ROUTER_MAX_TOKENS + 1, 3000))}
        return path, encode_json(body), kind
    if kind == "too_big":
        return path, encode_json({"model": model, tokens_field: [1], "pad": "x" * (ROUTER_MAX_BODY + 10)}), kind
    if kind == "bad_utf8":
        raw = encode_json({"model": "__BAD__", tokens_field: [1], "request_id": "__BAD__"})
        return path, raw.replace(b"__BAD__", draw(st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\xc3("]))), kind
    if kind == "nan_override":
        value = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1", b"1e7", b"\"1\""]))
        return "/v1/route", (b'{"model":"%s","token_ids":[1,2,3,4],"overrides":{"%s":%s}}'
                             % (model.encode(), draw(st.sampled_from(OVERRIDE_NAMES)).encode(), value)), kind
    if kind == "unknown_override":
        return "/v1/route", encode_json({"model": model, "token_ids": [1],
                                         "overrides": {
                                             draw(st.sampled_from(["temprature", "credit", "", "x.y"])): 1}}), kind
    if kind == "negative":
        if path == "/v1/route":
            return path, encode_json({"model": model, "token_ids": [1],
                                      "max_new_tokens": draw(st.integers(max_value=-1))}), kind
        if path == "/generate":
            return path, encode_json({"input_ids": [1], "sampling_params": {"max_new_tokens": -5}}), kind
        return path, encode_json({"model": model, "request_id": draw(st.integers())}), kind
    return path, draw(st.sampled_from([b"[]", b"1", b'"s"', b"null", b"true", b"[{}]"])), kind
