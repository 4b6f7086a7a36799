"""Valid messages of every wire format kvtier reads, as hypothesis strategies: SGLang's events
and payloads, kvtier's stream messages, the JSON that Redis and the HTTP peers hand back, and
the router's request bodies. Most come as lists and maps, ready for strategies.inputs to
perturb and mutate."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import strategies as st

from kvtier.schemas.events import (
    EMPTY_TOKENS,
    AllCleared,
    BridgeCursor,
    ControlRequest,
    EpochReason,
    EventBatch,
    PagesRemoved,
    PagesStored,
    WorkerAnnounce,
    encode_message,
    pack_token_ids,
)
from kvtier.schemas.hashes import INT64_MAX, INT64_MIN
from kvtier.schemas.health import HashCheck
from kvtier.schemas.routing import CandidateScore, RouteDecision, ScoringWeights, TierOverlap
from kvtier.schemas.sglang import MAX_EVENTS_PER_BATCH, MAX_PAGES_PER_EVENT, MAX_TOKENS_PER_EVENT
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import AttentionKind, MooncakeLayout, WorkerMetadata

from .strategies import INTERESTING_FLOATS, KNOWN_MEDIUMS, encode_msgpack, mutated, one_msgpack_value, values

HASHES = st.integers(INT64_MIN, INT64_MAX)
TOKENS = st.integers(0, (1 << 32) - 1)
NAMES = st.text(min_size=1, max_size=20) | st.sampled_from(["m", "w0", "meta-llama/Llama-3.1-8B", "w-dp1", "ü"])
#: Any one msgpack value, raw (not a broken one: that breaks the whole message, which is then not valid).
ANY_MSGPACK_VALUE = values().map(encode_msgpack).filter(one_msgpack_value).map(msgspec.Raw)


# --- SGLang's side ---------------------------------------------------------------------------
@st.composite
def sglang_events(draw, hashes: st.SearchStrategy = HASHES, array: bool | None = None, mediums=None):
    """One SGLang event as the engine encodes it: a map (>= 0.5.20) or a tagged array."""
    array = draw(st.booleans()) if array is None else array
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    medium = draw(st.sampled_from(mediums or KNOWN_MEDIUMS))
    if kind == "AllBlocksCleared":
        return [kind] if array else {"type": kind}
    block_hashes = draw(st.lists(hashes, max_size=6))
    if kind == "BlockRemoved":
        return [kind, block_hashes, medium] if array else {"type": kind, "block_hashes": block_hashes, "medium": medium}
    size = draw(st.integers(1, 8))
    shape = draw(st.sampled_from(["exact", "exact", "none", "any", "bigram"]))
    if shape == "exact":
        tokens: list = draw(st.lists(TOKENS, min_size=len(block_hashes) * size, max_size=len(block_hashes) * size))
    elif shape == "none":
        tokens = []
    elif shape == "any":
        tokens = draw(st.lists(TOKENS, max_size=20))
    else:
        tokens = draw(st.lists(st.lists(TOKENS, min_size=2, max_size=2), max_size=8))
    parent = draw(st.none() | hashes)
    lora = draw(st.none() | st.integers(0, 1000))
    if array:
        return [kind, block_hashes, parent, tokens, size, lora, medium][:draw(st.integers(5, 7))]
    event = {"type": kind, "block_hashes": block_hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": size, "lora_id": lora, "medium": medium}
    if draw(st.booleans()):
        event["lora_name"] = draw(st.none() | st.text(max_size=10))
        event["cache_salt"] = draw(st.none() | st.text(max_size=10))
        event["extra_keys"] = draw(ANY_MSGPACK_VALUE)  # a newer engine's field, ignored
    return event


@st.composite
def sglang_payloads(draw, events: st.SearchStrategy | None = None):
    """`[ts, [event, ...], attn_dp_rank]` (the rank may be missing or null)."""
    ts = draw(st.floats(0, 2e9) | st.sampled_from(INTERESTING_FLOATS))
    batch = draw(st.lists(sglang_events() if events is None else events, max_size=5))
    rank = draw(st.sampled_from(["absent", None, 0, 3]))
    return [ts, batch] if rank == "absent" else [ts, batch, rank]


@st.composite
def huge_payloads(draw):
    """Valid batches with one event of 10^4-10^6 pages or tokens, and lying array headers."""
    n = draw(st.sampled_from([10_000, 150_000, 1_000_000, MAX_PAGES_PER_EVENT + 1]))
    kind = draw(st.sampled_from(["hashes", "tokens", "removed", "events", "lie"]))
    if kind == "lie":  # an array32 header claiming 4 billion events, then almost nothing
        return b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff\xc0"
    if kind == "events":
        return encode_msgpack([1.0, [["AllBlocksCleared"]] * min(n, MAX_EVENTS_PER_BATCH + 1)])
    if kind == "removed":
        return encode_msgpack([1.0, [["BlockRemoved", list(range(n)), "CPU_PINNED"]]])
    if kind == "tokens":
        m = min(n, 150_000) * 4 if draw(st.booleans()) else MAX_TOKENS_PER_EVENT + 1
        return encode_msgpack([1.0, [["BlockStored", list(range(m // 4)), None, list(range(m)), 4]]])
    return encode_msgpack([1.0, [{"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": None,
                                  "token_ids": [], "block_size": 1}]])


def pub_frames() -> st.SearchStrategy[list[bytes]]:
    """ZMQ frames as the PUB and replay sockets receive them: [topic, seq, payload], mutated, or any."""
    frame = st.binary(max_size=12) | st.sampled_from([b"", b"\x00" * 8, b"\xff" * 8, b"\x00" * 7, b"\x00" * 9])
    valid = st.tuples(st.binary(max_size=4), st.integers(-(1 << 63), INT64_MAX), st.binary(max_size=20)).map(
        lambda t: [t[0], t[1].to_bytes(8, "big", signed=True), t[2]])
    return valid | st.lists(frame, max_size=5) | mutated(valid.map(lambda f: b"\x00".join(f))).map(
        lambda b: b.split(b"\x00", 3))


# --- kvtier's stream messages ------------------------------------------------------------------
def _tier_events():
    tiers = st.sampled_from(list(Tier))
    # Token ids travel as raw msgpack, checked only by the hash check: any one msgpack value may be there.
    tokens = st.lists(TOKENS, max_size=24).map(pack_token_ids) | ANY_MSGPACK_VALUE
    stored = st.builds(
        lambda tier, hashes, parent, size, tokens, lora, ns: PagesStored(
            tier=tier, hashes=hashes, parent=parent, page_size=size, token_ids=tokens, lora_id=lora, namespace=ns),
        tiers, st.lists(HASHES, max_size=6), st.none() | HASHES, st.integers(1, 8), tokens,
        st.none() | st.integers(0, 1 << 40), st.none() | st.sampled_from(["cache_salt", "lora:x", "eagle-bigram"]))
    removed = st.builds(PagesRemoved, tier=tiers, hashes=st.lists(HASHES, max_size=6))
    return stored | removed | st.just(AllCleared())


def worker_metadata() -> st.SearchStrategy[WorkerMetadata]:
    layouts = st.none() | st.builds(MooncakeLayout, attention=st.sampled_from(list(AttentionKind)),
                                    tp_size=st.integers(1, 16), pp_size=st.integers(1, 4),
                                    key_prefix=st.sampled_from(["", "pfx"]))
    return st.builds(WorkerMetadata, worker_id=NAMES, model=NAMES, page_size=st.integers(1, 1024),
                     dp_rank=st.integers(0, 7), dp_size=st.integers(1, 8), tp_size=st.integers(1, 16),
                     pp_size=st.integers(1, 4), mooncake=layouts, http_endpoint=st.sampled_from(["", "http://h:1"]),
                     hicache_enabled=st.none() | st.booleans(), engine_version=st.text(max_size=8))


def kvtier_messages() -> st.SearchStrategy:
    """EventBatch / WorkerAnnounce objects, as the bridge would publish them."""
    batches = st.builds(
        EventBatch, worker_id=NAMES, model=NAMES, dp_rank=st.integers(0, 7), epoch=st.integers(1, 1 << 45),
        seq=st.integers(1, 1 << 40), ts=st.floats(0, 2e9), source_ts=st.floats(0, 2e9),
        source_seq_first=st.integers(-1, 1 << 40), source_seq_last=st.integers(-1, 1 << 40),
        source_ts_last=st.floats(0, 2e9), epoch_reason=st.none() | st.sampled_from(list(EpochReason)),
        events=st.lists(_tier_events(), max_size=5))
    announces = st.builds(
        WorkerAnnounce, metadata=worker_metadata(), ts=st.floats(0, 2e9), lease_ttl_s=st.floats(0.1, 3600),
        cursor=st.builds(BridgeCursor, epoch=st.integers(0, 1 << 45), seq=st.integers(0, 1 << 40),
                         source_seq_last=st.integers(-1, 1 << 40), source_ts_last=st.floats(0, 2e9)))
    return batches | announces


def control_requests() -> st.SearchStrategy[ControlRequest]:
    """What an operator (or a processor) sends on a bridge's control subject."""
    return st.builds(ControlRequest, request=st.sampled_from(["resync", "x"]), reason=st.text(max_size=10))


def as_builtins_msgpack(message) -> Any:
    """The message as lists and maps, stored events' token ids kept raw (whatever they hold)."""
    if not isinstance(message, EventBatch):
        return msgspec.msgpack.decode(encode_message(message))
    stored = {i: e for i, e in enumerate(message.events) if isinstance(e, PagesStored)}
    events = [msgspec.structs.replace(e, token_ids=EMPTY_TOKENS) if i in stored else e
              for i, e in enumerate(message.events)]
    obj = msgspec.msgpack.decode(encode_message(msgspec.structs.replace(message, events=events)))
    for i, event in stored.items():  # ["stored", tier, hashes, parent, page_size, token_ids, lora_id, namespace]
        obj["events"][i][5] = event.token_ids
    return obj


def as_builtins_json(value) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def route_decisions() -> st.SearchStrategy[RouteDecision]:
    """Decisions as routers publish them on `kvtier.decisions.<model>` (some of a newer `v`)."""
    overlaps = st.builds(TierOverlap, device=st.integers(0, 64), host=st.integers(0, 64), disk=st.integers(0, 64),
                         shared_beyond=st.integers(0, 64), predicted=st.integers(0, 8))
    candidates = st.builds(CandidateScore, worker_id=NAMES, logit=st.floats(-1e6, 1e6), overlap=overlaps,
                           prefill_load=st.integers(0, 1 << 20), decode_load=st.integers(0, 1 << 20),
                           page_size=st.integers(1, 1024))
    return st.builds(
        RouteDecision, v=st.sampled_from([1, 1, 1, 2]), request_id=NAMES, model=NAMES, router_id=NAMES,
        ts=st.floats(0, 2e9), weights=st.just(ScoringWeights()), random_draw=st.floats(0, 1),
        page_hashes=st.dictionaries(st.sampled_from([4, 16, 64]), st.lists(HASHES, max_size=4), max_size=2),
        request_pages=st.integers(0, 64), chosen=NAMES, candidates=st.lists(candidates, max_size=3),
        degraded=st.lists(st.sampled_from(["state-store-unavailable", "shared-pool-unavailable"]), max_size=2),
        latency_ms=st.floats(0, 100), shared_pool_queried=st.booleans())


# --- JSON read back from Redis and from HTTP peers ------------------------------------------------
def hash_checks() -> st.SearchStrategy:
    return st.builds(HashCheck, worker_id=NAMES, checked=st.integers(0, 1 << 40), matched=st.integers(0, 1 << 40),
                     mismatched=st.integers(0, 1 << 40), unverifiable=st.integers(0, 100),
                     mismatch_kinds=st.dictionaries(st.sampled_from(["hash_scheme", "namespace", "page_size"]),
                                                    st.integers(0, 100)),
                     explanation=st.text(max_size=30), updated_ms=st.integers(0, 1 << 42))


@st.composite
def server_infos(draw):
    """`/server_info` replies: with a kv_events descriptor, with only a kv_events_config, or neither."""
    info: dict = {"tp_size": draw(st.integers(1, 8)), "pp_size": draw(st.integers(1, 2)),
                  "dp_size": draw(st.integers(1, 4)), "dcp_size": 1, "page_size": draw(st.sampled_from([1, 16, 64])),
                  "enable_hierarchical_cache": draw(st.booleans()),
                  "hicache_storage_backend": draw(st.sampled_from([None, "mooncake", "file"])),
                  "hicache_write_policy": draw(st.sampled_from([None, "write_through", "write_back"])),
                  "model_path": "org/model", "served_model_name": draw(st.none() | st.just("served")),
                  "version": "0.5.23", "unrelated": {"x": [1, 2]}}
    shape = draw(st.sampled_from(["descriptor", "config", "neither", "null"]))
    config = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    if shape == "descriptor":
        info["kv_events"] = {"publisher": draw(st.sampled_from(["zmq", "null"])), "endpoint_host": "*",
                             "endpoint_port_base": 5557, "topic": "", "block_size": info["page_size"],
                             "dp_size": info["dp_size"], "replay_endpoint_port_base": draw(st.none() | st.just(5600))}
    elif shape == "null":
        info["kv_events"] = None
    if shape in ("config", "descriptor"):
        info["kv_events_config"] = json.dumps(config)
    return info


@st.composite
def l3_layouts(draw):
    return {"enabled": draw(st.booleans()), "backend": draw(st.sampled_from([None, "mooncake", "file"])),
            "page_size": draw(st.none() | st.sampled_from([16, 64])), "reason": draw(st.none() | st.just("why")),
            "hicache_object_layout": {
                "pools": [{"pool": draw(st.sampled_from(["kv", "mamba"])), "suffixes": ["_0_k", "_0_v"],
                           "hit_policy": "all_pages"}],
                "key_prefix": draw(st.none() | st.just("pfx")), "is_mla_backend": draw(st.none() | st.booleans()),
                "pp_rank": None, "pp_size": 1}}


@st.composite
def mooncake_replies(draw):
    keys = draw(st.lists(st.text(min_size=1, max_size=10), max_size=5))
    return {"success": draw(st.booleans()),
            "data": {k: ({"ok": True} if draw(st.booleans()) else {"ok": False, "error": "OBJECT_NOT_FOUND"})
                     for k in keys},
            "error": draw(st.none() | st.just("x"))}


@st.composite
def generate_replies(draw):
    """SGLang's (and kvtier sim-worker's) `POST /generate` replies, one or a batch."""
    details = draw(st.sampled_from([None, {"device": 32, "host": 64},
                                    {"device": 0, "host": 32, "storage": 64, "storage_backend": "MooncakeStore"},
                                    {"device": 8, "host": 0, "l3": 0}]))
    meta: dict = {"prompt_tokens": draw(st.integers(0, 4096)), "cached_tokens": draw(st.integers(0, 4096)),
                  "e2e_latency": draw(st.floats(0, 10))}
    if details is not None or draw(st.booleans()):
        meta["cached_tokens_details"] = details
    if draw(st.booleans()):
        meta["ttft_s"] = draw(st.floats(0, 10))
    reply = {"text": "x", "meta_info": meta}
    return draw(st.sampled_from([reply, [reply], []]))


@st.composite
def jsz_replies(draw):
    """nats-server's `/jsz?streams=true`, as `kvtier bench soak` samples it."""
    stamps = st.sampled_from(["0001-01-01T00:00:00Z", "2025-06-01T12:00:00.123456789Z", "2025-06-01T12:00:00Z",
                              "2025-06-01T12:00:00.12+02:00", "not a time", "", "2025-13-45T99:00:00.x"])
    streams = [{"name": name, "config": {"subjects": ["kvtier.events.>"]},
                "state": draw(st.none() | st.fixed_dictionaries(
                    {"messages": st.integers(0, 1 << 40), "bytes": st.integers(0, 1 << 50)},
                    optional={"first_ts": st.none() | stamps, "last_seq": st.integers(0, 1 << 40)}))}
               for name in draw(st.lists(st.sampled_from(["KVTIER_EVENTS", "KVTIER_DLQ", "KVTIER_DECISIONS"]),
                                         max_size=3, unique=True))]
    account = {"name": "$G", "id": "$G", "stream_detail": draw(st.sampled_from([streams, None, []]))}
    return {"server_id": "N", "now": "2025-06-01T12:00:05Z", "streams": len(streams),
            "account_details": draw(st.sampled_from([[account], None, []]))}


@st.composite
def router_healths(draw):
    """Routers' `/healthz` bodies, some without fields (an older router), as `kvtier doctor` reads them."""
    body: dict = {
        "status": draw(st.sampled_from(["ok", "degraded"])), "router_id": draw(NAMES),
        "routing": draw(st.sampled_from(["tier-aware", "load/round-robin (state store unavailable)"])),
        "state_store": {"ok": draw(st.booleans()), "error": draw(st.text(max_size=10))},
        "shared_pool": {"enabled": draw(st.booleans()),
                        "last_error": draw(st.sampled_from(["", "x", "no answer within"]))},
        "hash_scheme": {"ok": draw(st.booleans()), "mismatched_workers": [
            {"model": "m", "worker_id": w, "mismatched_pages": draw(st.integers(0, 100)),
             "checked_pages": draw(st.integers(0, 100)), "kinds": {"hash_scheme": 1}, "explanation": "why"}
            for w in draw(st.lists(NAMES, max_size=3))]},
        "partial_workers": [{"model": "m", "worker_id": w} for w in draw(st.lists(NAMES, max_size=3))],
        "page_size": draw(st.none() | st.integers(1, 256)),
        "decision_log": {"enabled": draw(st.booleans()), "connected": draw(st.booleans())},
        "models": draw(st.lists(NAMES, max_size=3)),
    }
    for name in draw(st.sets(st.sampled_from(sorted(body)), max_size=3)):
        del body[name]
    return body


# --- the router's request bodies -----------------------------------------------------------------
MODEL = "fz-model"
#: Token lists of a few lengths (0 and over the router's limit included).
TOKEN_LISTS = st.lists(TOKENS, min_size=1, max_size=40) | st.sampled_from([list(range(1, 65)), []])
OVERRIDE_NAMES = ["overlap_score_credit", "host_cache_hit_weight", "disk_cache_hit_weight",
                  "shared_cache_multiplier", "prefill_load_scale", "temperature"]


@st.composite
def route_requests(draw, model: str = MODEL):
    body: dict = {"model": draw(st.sampled_from([model, model, "unknown-model"])), "token_ids": draw(TOKEN_LISTS)}
    if draw(st.booleans()):
        body["request_id"] = draw(st.uuids()).hex
    if draw(st.booleans()):
        body["overrides"] = draw(st.dictionaries(st.sampled_from(OVERRIDE_NAMES),
                                                 st.floats(0, 10) | st.sampled_from([0.0, 1e6, 100.0]), max_size=3))
    if draw(st.booleans()):
        body["max_new_tokens"] = draw(st.integers(0, 10_000_000))
    if draw(st.booleans()):
        body["book"] = draw(st.booleans())
    return body


@st.composite
def release_requests(draw, model: str = MODEL):
    # the owner is a guess: no generated release owns a booking (the oracle expects 403 or 404)
    return {"model": draw(st.sampled_from([model, "other"])), "request_id": draw(st.uuids()).hex,
            "stage": draw(st.sampled_from(["first_token", "complete"])), "owner": draw(st.uuids()).hex}


@st.composite
def generate_requests(draw, model: str = MODEL):
    body: dict = {"input_ids": draw(TOKEN_LISTS), "model": model, "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["rid"] = draw(st.uuids()).hex
    if draw(st.booleans()):
        body["sampling_params"] = {"max_new_tokens": draw(st.integers(0, 8)), "temperature": 0.5}
    if draw(st.booleans()):
        body["text"] = "forwarded as sent"
    return body
