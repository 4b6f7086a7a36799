"""`kvtier bench fuzz`: every decoder of input kvtier does not control, fuzzed, in process and
through the real processes; and the strategies `tests/test_fuzz.py` shares.

The property, for each decoder: it returns a valid typed value or raises its module's
documented errors (msgspec.DecodeError / ValidationError, MalformedBatch, UnsupportedVersion,
...), never another exception, never hangs (a hypothesis deadline), and a valid message
round-trips. Through the real processes: bad engine input ends in KVTIER_DLQ with a reason
while the valid batches around it are applied; bad stream messages likewise; every bad router
request gets a 4xx naming what is wrong, never a 5xx or a hang, and the router keeps serving.

Inputs per decoder mix: valid messages; structural perturbations of them (a value replaced by
one of another type, NaN/inf, out-of-range ints, unknown tiers and mediums, invalid UTF-8, a
deep nesting, a huge array, a field dropped or added); byte mutations of valid encodings
(flip, overwrite, truncate, insert, delete, duplicate); arbitrary msgpack/JSON values; random
bytes. Hypothesis settings: profile "ci" (tests, derandomized) and "bench" (this command).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import math
import os
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec

try:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
except ImportError as exc:  # a test dependency: pip install -e '.[test]'
    raise ImportError("kvtier bench fuzz needs hypothesis: pip install 'hypothesis>=6.100'") from exc

from kvtier.consumers.apply import _script_ops
from kvtier.consumers.hash_check import HashValidator
from kvtier.producers.bridge import _chunk_by_pages
from kvtier.producers.convert import convert_batch, encoded_size_bound, source_timestamp
from kvtier.producers.sglang_discovery import WorkerFlags, discover
from kvtier.producers.sglang_source import ReplaySocketError, _split_replay, parse_pub_frames
from kvtier.schemas.events import (
    EMPTY_TOKENS,
    AllCleared,
    BridgeCursor,
    ControlRequest,
    EpochReason,
    EventBatch,
    PagesRemoved,
    PagesStored,
    TierEvent,
    UnsupportedVersion,
    WorkerAnnounce,
    decode_control,
    decode_message,
    encode_control,
    encode_message,
    pack_token_ids,
    token_ids_of,
)
from kvtier.schemas.hashes import INT64_MAX, INT64_MIN, BlockHash, sglang_block_hashes
from kvtier.schemas.health import HashCheck, decode_hash_check, encode_hash_check
from kvtier.schemas.jetstream import decode_jsz
from kvtier.schemas.mooncake import decode_batch_query_reply
from kvtier.schemas.router_health import decode_router_health
from kvtier.schemas.routing import (
    CandidateScore,
    ErrorBody,
    GenerateRequest,
    ReleaseRequest,
    RouteDecision,
    RouteRequest,
    ScoringWeights,
    TierOverlap,
    decision_request_id,
    decode_decision,
    decode_route_response,
    encode_decision,
)
from kvtier.schemas.sglang import (
    MAX_EVENTS_PER_BATCH,
    MAX_PAGES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
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
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import (
    AttentionKind,
    MooncakeLayout,
    WorkerMetadata,
    decode_worker_metadata,
    encode_worker_metadata,
)

MSGSPEC_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)

# --- hypothesis profiles -------------------------------------------------------------------
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
            HealthCheck.large_base_example, HealthCheck.function_scoped_fixture]
#: Tests: reproducible (derandomized), a generous deadline (2 shared cores), no example database.
settings.register_profile("ci", max_examples=60, deadline=timedelta(seconds=3), derandomize=True, database=None,
                          suppress_health_check=_SLOW_OK, print_blob=True)
#: The bench: seeded by --seed, sized by --cases.
settings.register_profile("bench", max_examples=1000, deadline=timedelta(seconds=10), database=None,
                          suppress_health_check=list(HealthCheck),
                          phases=(Phase.explicit, Phase.generate, Phase.shrink))


def profile(name: str | None = None) -> settings:
    """The named profile ($KVTIER_FUZZ_PROFILE, else "ci")."""
    return settings.get_profile(name or os.environ.get("KVTIER_FUZZ_PROFILE", "ci"))


# --- values --------------------------------------------------------------------------------
UINT64_MAX = (1 << 64) - 1
INTERESTING_INTS = [0, 1, -1, 255, 256, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
                    (1 << 53) - 1, 1 << 53, (1 << 53) + 1, INT64_MAX, INT64_MIN, 1 << 63, UINT64_MAX]
INTERESTING_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, -1.0, 0.5, 1e308, -1e308, 5e-324, 1e11, 1e11 + 1]
KNOWN_MEDIUMS = [None, "", "GPU", "DEVICE", "CPU", "CPU_PINNED", "CPU_TIER1", "DISK", "CPU_TIER2", "NVME", "STORAGE",
                 "EXTERNAL", "SHARED", "REMOTE", "NETWORK", "gpu", "cpu_pinned", "Disk"]
#: Unknown tiers and mediums, odd names and texts (kvtier's tier names, Unicode look-alikes,
#: control characters, subject wildcards, very long).
INTERESTING_TEXTS = ["", " ", "\x00", "\r\n", "\t", "SSD", "TAPE", "HBM", "gpu ", " GPU", "GPU\x00", "ＧＰＵ", "ß",
                     "\u0130", "é", "device", "host", "disk", "external", "ssd", "stored", "removed", "cleared",
                     "batch", "announce", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Mystery", ".", "..",
                     "*", ">", "a.b", "w*1", "kvtier.events.m.w", "\U0001f600", "\u202e", "x" * 300, "y" * 5000]

_MSGPACK = msgspec.msgpack.Encoder()
_JSON = msgspec.json.Encoder()


def encode_msgpack(value: Any) -> bytes:
    return _MSGPACK.encode(value)


def encode_json(value: Any) -> bytes:
    return _JSON.encode(value)


def _deep(depth: int, opener: bytes, leaf: bytes, closer: bytes = b"") -> msgspec.Raw:
    return msgspec.Raw(opener * depth + leaf + closer * depth)


#: Encoded msgpack the encoder cannot produce from Python values: invalid UTF-8 strings, ext
#: types, lying length headers, NaN as float32, deep nesting, never-used bytes.
RAW_MSGPACK = [
    b"\xa2\xff\xfe", b"\xa3\xed\xa0\x80", b"\xa4\xf0\x28\x8c\x28", b"\xa1\x80", b"\xd9\x02\xc3\x28",  # invalid UTF-8
    b"\xd4\x01\x02", b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x00\x05",  # ext, timestamp ext, empty ext
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",  # lying
    b"\xdc\x00\x03\x01", b"\xca\x7f\xc0\x00\x00", b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # short array, NaNs
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xc1", b"\xc4\x03abc",
    b"\x91" * 3000 + b"\xc0", b"\x81\xa1k" * 3000 + b"\xc0", b"\x91" * 400 + b"\xc0",
]
#: JSON the encoder cannot produce: NaN and infinities, numbers out of every range, lone
#: surrogate escapes, invalid UTF-8, control characters, deep nesting.
RAW_JSON = [
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 400, b"-" + b"9" * 30, b"1.0e-400", b"-0",
    b'"\\ud800"', b'"\\udc00\\ud800"', b'"\xff\xfe"', b'"\xed\xa0\x80"', b'"\xc3\x28"', b'"a\x00b"', b'"\x01"',
    b"[" * 3000 + b"]" * 3000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b"[" * 400 + b"]" * 400,
    b"true", b"null", b"{}", b"[]", b'""', b'"' + b"z" * 70000 + b'"',
]


def _scalars(json_safe: bool) -> st.SearchStrategy:
    ints = st.integers(INT64_MIN, UINT64_MAX) | st.sampled_from(INTERESTING_INTS)
    floats = st.floats() | st.sampled_from(INTERESTING_FLOATS)
    texts = st.text(max_size=12) | st.sampled_from(INTERESTING_TEXTS)
    base = st.none() | st.booleans() | ints | floats | texts
    table = RAW_JSON if json_safe else RAW_MSGPACK
    raws = st.integers(0, len(table) - 1).map(lambda i: msgspec.Raw(table[i]))  # (a short repr)
    return base | raws if json_safe else base | st.binary(max_size=12) | raws


@functools.cache
def values(json_safe: bool = False) -> st.SearchStrategy:
    """Arbitrary values of the format: scalars, raw oddities, nested lists and maps."""
    scalar = _scalars(json_safe)
    keys = st.text(max_size=8) | st.sampled_from(INTERESTING_TEXTS[:20])
    return st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                        max_leaves=12)


#: Sizes of the huge arrays dropped into messages: around and beyond the schemas' limits.
HUGE_SIZES = [1000, 20_000, MAX_EVENTS_PER_BATCH + 1]


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, path + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return obj


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


@st.composite
def perturbed(draw, base: st.SearchStrategy, json_safe: bool = False):
    """A valid message (as lists and maps) with 1-3 edits at drawn places: a value replaced
    (another type, NaN/inf, out of range, invalid UTF-8, deep, huge), a field dropped, an
    unknown field added, a value wrapped in a list."""
    obj = copy.deepcopy(draw(base))
    other = values(json_safe)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(obj)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        target = _get(obj, path)
        op = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add", "wrap", "huge", "deep"]))
        if op == "replace":
            obj = _set(obj, path, draw(other))
        elif op == "drop" and path:
            parent = _get(obj, path[:-1])
            del parent[path[-1]]
        elif op == "add" and isinstance(target, dict):
            target[draw(st.text(max_size=8) | st.sampled_from(INTERESTING_TEXTS[:20]))] = draw(other)
        elif op == "add" and isinstance(target, list):
            target.insert(draw(st.integers(0, len(target))), draw(other))
        elif op == "wrap":
            obj = _set(obj, path, [target])
        elif op == "huge":
            n = draw(st.sampled_from(HUGE_SIZES))
            obj = _set(obj, path, [draw(st.sampled_from([0, 1, -1, INT64_MAX, 1.5, None, "GPU"]))] * n)
        elif op == "deep":
            # Not near 1,000: the exact depth msgspec refuses depends on the caller's stack, and
            # the bridge's oracle runs on another stack than the bridge.
            depth = draw(st.sampled_from([10, 400, 2000, 5000]))
            obj = _set(obj, path, _deep(depth, b"[" if json_safe else b"\x91", b"0" if json_safe else b"\x00",
                                        b"]" if json_safe else b""))
        if not isinstance(obj, (list, dict)):
            break
    return obj


@st.composite
def deep_extra(draw, base: st.SearchStrategy, json_safe: bool = False):
    """A valid message with a deeply nested value added where a decoder must walk past it:
    an unknown field of a map, an extra element of an array (newer versions' fields)."""
    obj = copy.deepcopy(draw(base))
    containers = [p for p in _paths(obj) if isinstance(_get(obj, p), (dict, list))]
    if not containers:
        return obj
    target = _get(obj, containers[draw(st.integers(0, len(containers) - 1))])
    depth = draw(st.sampled_from([2000, 5000]))
    deep = _deep(depth, b"[" if json_safe else b"\x91", b"0" if json_safe else b"\x00", b"]" if json_safe else b"")
    if isinstance(target, dict):
        target[draw(st.sampled_from(["zz", "extra_keys", "type2"]))] = deep
    else:
        target.append(deep)
    return obj


INTERESTING_BYTES = [0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xCA, 0xCB, 0xCF, 0xD3, 0xD9, 0xDB,
                     0xDC, 0xDD, 0xDE, 0xDF, 0xFF, ord("{"), ord("}"), ord("["), ord("]"), ord('"'), ord("\\"),
                     ord(","), ord(":"), ord("-"), ord("e"), ord("0")]


@st.composite
def mutated(draw, base: st.SearchStrategy[bytes]):
    """A valid encoding with 1-4 byte-level edits."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete", "duplicate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=6) | st.sampled_from(RAW_MSGPACK[:12]))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "duplicate":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 16))]
    return bytes(data)


def quick_mutants(data: bytes, k: int) -> list[bytes]:
    """`k` byte mutations of `data`, derived from it alone (reproducible): what `mutated`
    does, without hypothesis's cost per example, so one drawn input yields k + 1 cases."""
    import random
    import zlib

    rng = random.Random(zlib.crc32(data) ^ len(data))
    out = []
    for _ in range(k):
        m = bytearray(data)
        for _ in range(rng.randint(1, 2)):
            op = rng.randrange(6)
            pos = rng.randrange(len(m)) if m else 0
            if op == 0:
                del m[pos:]
            elif op == 1 and m:
                m[pos] ^= 1 << rng.randrange(8)
            elif op == 2 and m:
                m[pos] = rng.choice(INTERESTING_BYTES)
            elif op == 3:
                m[pos:pos] = rng.choice(RAW_MSGPACK[:14] + RAW_JSON[:16])
            elif op == 4:
                del m[pos:pos + rng.randint(1, 8)]
            else:
                m[pos:pos] = m[pos:pos + rng.randint(1, 16)]
        out.append(bytes(m))
    return out


def amplified(check: Callable[[bytes], bool], k: int) -> Callable[[bytes], tuple[int, int]]:
    """`check` on the input and on `quick_mutants(input, k)`; a failure names the mutant."""
    def run(data: bytes) -> tuple[int, int]:
        accepted = int(check(data))
        for mutant in quick_mutants(data, k):
            try:
                accepted += int(check(mutant))
            except Violation as exc:
                raise Violation(f"{exc} (mutant {mutant[:400]!r} of {data[:400]!r})") from None
            except Exception as exc:  # any other exception is the finding
                raise Violation(f"{type(exc).__name__}: {exc} on mutant {mutant[:400]!r} of {data[:400]!r}") from exc
        return k + 1, accepted
    return run


def inputs(valid: st.SearchStrategy, json_safe: bool = False) -> st.SearchStrategy[bytes]:
    """Bytes for a decoder: `valid` (lists/maps of a valid message) encoded, perturbed,
    mutated; arbitrary values; random bytes."""
    encode = encode_json if json_safe else encode_msgpack
    valid_bytes = valid.map(encode)
    return st.one_of(
        valid_bytes,
        perturbed(valid, json_safe).map(encode),
        deep_extra(valid, json_safe).map(encode),
        mutated(valid_bytes),
        values(json_safe).map(encode),
        st.binary(max_size=200),
    )


# --- valid messages, as lists and maps -----------------------------------------------------
HASHES = st.integers(INT64_MIN, INT64_MAX)
TOKENS = st.integers(0, (1 << 32) - 1)


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
        # a newer engine's field, ignored: any one msgpack value (not a broken one: that breaks
        # the whole payload, which is then not valid)
        event["extra_keys"] = draw(values().map(encode_msgpack).filter(_one_msgpack_value).map(msgspec.Raw))
    return event


@st.composite
def sglang_payloads(draw, events: st.SearchStrategy | None = None):
    """`[ts, [event, ...], attn_dp_rank]` (the rank may be missing or null)."""
    ts = draw(st.floats(0, 2e9) | st.sampled_from(INTERESTING_FLOATS))
    batch = draw(st.lists(sglang_events() if events is None else events, max_size=5))
    rank = draw(st.sampled_from(["absent", None, 0, 3]))
    return [ts, batch] if rank == "absent" else [ts, batch, rank]


def _one_msgpack_value(data: bytes) -> bool:
    try:
        msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


def _tier_events():
    tiers = st.sampled_from(list(Tier))
    # Token ids travel as raw msgpack, checked only by the hash check: any one msgpack value may
    # be there (not a broken one: that breaks the whole message, which is then not valid).
    tokens = st.lists(TOKENS, max_size=24).map(pack_token_ids) | values().map(encode_msgpack).filter(
        _one_msgpack_value).map(msgspec.Raw)
    stored = st.builds(
        lambda tier, hashes, parent, size, tokens, lora, ns: PagesStored(
            tier=tier, hashes=hashes, parent=parent, page_size=size, token_ids=tokens, lora_id=lora, namespace=ns),
        tiers, st.lists(HASHES, max_size=6), st.none() | HASHES, st.integers(1, 8), tokens,
        st.none() | st.integers(0, 1 << 40), st.none() | st.sampled_from(["cache_salt", "lora:x", "eagle-bigram"]))
    removed = st.builds(PagesRemoved, tier=tiers, hashes=st.lists(HASHES, max_size=6))
    return stored | removed | st.just(AllCleared())


NAMES = st.text(min_size=1, max_size=20) | st.sampled_from(["m", "w0", "meta-llama/Llama-3.1-8B", "w-dp1", "ü"])


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


def as_builtins_msgpack(message) -> Any:
    """The message as lists and maps, stored events' token ids kept raw (whatever they hold)."""
    if not isinstance(message, EventBatch):
        return msgspec.msgpack.decode(encode_message(message))
    stored = [i for i, e in enumerate(message.events) if isinstance(e, PagesStored)]
    events = [msgspec.structs.replace(e, token_ids=EMPTY_TOKENS) if i in stored else e
              for i, e in enumerate(message.events)]
    obj = msgspec.msgpack.decode(encode_message(msgspec.structs.replace(message, events=events)))
    for i in stored:  # ["stored", tier, hashes, parent, page_size, token_ids, lora_id, namespace]
        obj["events"][i][5] = message.events[i].token_ids
    return obj


def as_builtins_json(value) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


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
    return {"model": draw(st.sampled_from([model, "other"])), "request_id": draw(st.uuids()).hex,
            "stage": draw(st.sampled_from(["first_token", "complete"]))}


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


# --- properties: each returns whether the input was accepted; a violation raises ----------
class Violation(AssertionError):
    pass


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise Violation(what)


def _refused(exc: BaseException) -> bool:
    _expect(bool(str(exc)), f"{type(exc).__name__} without a message")
    return False


def _state(events: list[TierEvent]) -> dict[int, set[Tier]]:
    """What a worker holds after `events` (the apply script's semantics)."""
    pages: dict[int, set[Tier]] = {}
    apply_tier_events(pages, events)
    return pages


def apply_tier_events(pages: dict[int, set[Tier]], events: list[TierEvent]) -> None:
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


#: A small message budget, so the in-process check splits events as often as the bridge would
#: split a huge one against the server's max_payload.
SPLIT_BUDGET = 4096


def check_sglang_payload(data: bytes) -> bool:
    """decode_payload returns a DecodedBatch or raises MalformedBatch; what the bridge makes of
    a decoded batch (convert, split into messages) the processor's decoder accepts, and the
    split messages apply to the same state as the events unsplit."""
    try:
        batch = decode_payload(data)
    except MalformedBatch as exc:
        return _refused(exc)
    _expect(isinstance(batch, DecodedBatch) and isinstance(batch.ts, float), "not a DecodedBatch")
    _expect(all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in batch.events), "event type")
    _expect(all(reason for _, _, reason in batch.rejected), "rejected event without a reason")
    converted = convert_batch(batch)
    _expect(all(reason and isinstance(raw, bytes) for raw, reason in converted.rejected), "rejection without reason")
    source_ts = source_timestamp(batch.ts, 1.7e9)
    pages = sum(len(getattr(e, "hashes", ())) for e in converted.events)
    split: list[TierEvent] = []
    # The bridge's own limits for big batches (16384 pages, ~1 MB), small ones for the rest.
    max_pages, budget = (16384, (1 << 20) - (8 << 10)) if pages > 10_000 else (64, SPLIT_BUDGET)
    for chunk in _chunk_by_pages(converted.events, max_pages, budget):
        message = EventBatch(worker_id="w", model="m", epoch=1, seq=1, ts=1.7e9, source_ts=source_ts,
                             source_ts_last=batch.ts, events=chunk)
        encoded = encode_message(message)
        _expect(sum(encoded_size_bound(e) for e in chunk) <= budget, "chunk over budget")
        _expect(sum(len(getattr(e, "hashes", ())) for e in chunk) <= max_pages, "chunk over the page limit")
        decoded = decode_message(encoded)  # must not raise: the processor would dead-letter good events
        _expect(decoded.events == chunk, "events changed on the wire")
        split += chunk
    if pages <= 50_000:
        _expect(_state(split) == _state(converted.events), "splitting changed the state")
    return True


def check_sglang_event(data: bytes) -> bool:
    try:
        event = decode_event(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)), "event type")
    again = decode_payload(encode_payload(1.0, [event]))
    _expect(again.events == [event] and not again.rejected, "event does not round-trip")
    return True


def frames_strategy() -> st.SearchStrategy[list[bytes]]:
    frame = st.binary(max_size=12) | st.sampled_from([b"", b"\x00" * 8, b"\xff" * 8, b"\x00" * 7, b"\x00" * 9])
    valid = st.tuples(st.binary(max_size=4), st.integers(-(1 << 63), INT64_MAX), st.binary(max_size=20)).map(
        lambda t: [t[0], t[1].to_bytes(8, "big", signed=True), t[2]])
    return valid | st.lists(frame, max_size=5) | mutated(valid.map(lambda f: b"\x00".join(f))).map(
        lambda b: b.split(b"\x00", 3))


def check_frames(frames: list[bytes]) -> bool:
    """parse_pub_frames (PUB), _split_replay (replay socket), decode_seq."""
    accepted = False
    try:
        raw = parse_pub_frames(frames)
        _expect(raw.seq == int.from_bytes(frames[1], "big", signed=True) and raw.payload == frames[2], "frames")
        accepted = True
    except MalformedBatch as exc:
        _refused(exc)
    try:
        seq_frame, _payload = _split_replay(frames)
        decode_seq(seq_frame)
    except (ReplaySocketError, MalformedBatch) as exc:
        _refused(exc)
    return accepted


def check_kvtier_message(data: bytes) -> bool:
    """decode_message returns an EventBatch/WorkerAnnounce or raises msgspec's errors or
    UnsupportedVersion; what the processor derives from a valid one (subject tokens, Redis
    keys, script ops, the hash check, the metadata JSON a router reads) never raises."""
    try:
        message = decode_message(data)
    except (*MSGSPEC_ERRORS, UnsupportedVersion) as exc:
        return _refused(exc)
    encoded = encode_message(message)
    _expect(encode_message(decode_message(encoded)) == encoded, "message does not round-trip")
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
                    _refused(exc)
        HashValidator(budget_pages_per_s=None).check_batch(message, None, None)
    else:
        meta = message.metadata
        ModelKeys.for_model(meta.model).meta(meta.worker_id)
        subject_token(meta.worker_id)
        _expect(decode_worker_metadata(encode_worker_metadata(meta)) == meta, "metadata does not survive Redis")
    return True


def check_control(data: bytes) -> bool:
    try:
        request = decode_control(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(decode_control(encode_control(request)) == request, "control request does not round-trip")
    return True


def check_hash_check(data: bytes) -> bool:
    try:
        check = decode_hash_check(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _ = check.ok
    _expect(decode_hash_check(encode_hash_check(check)) == check, "hash check does not round-trip")
    return True


def check_worker_metadata(data: bytes) -> bool:
    from kvtier.schemas.mooncake import mooncake_object_keys

    try:
        meta = decode_worker_metadata(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(decode_worker_metadata(encode_worker_metadata(meta)) == meta, "metadata does not round-trip")
    if meta.mooncake is not None:
        keys = mooncake_object_keys(bytes(32), meta.mooncake)
        _expect(0 < len(keys) <= 4096, f"{len(keys)} objects per page")
    return True


def check_server_info(data: bytes) -> bool:
    """The bridge's discovery: the reply decodes or raises msgspec's errors, and what discover()
    makes of a decoded one is settings or a ValueError (DiscoveryError) naming the problem."""
    try:
        info = decode_server_info(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(isinstance(info, ServerInfo), "type")
    if isinstance(info.kv_events_config, str):
        try:
            decode_kv_events_config(info.kv_events_config)
        except MSGSPEC_ERRORS as exc:
            _refused(exc)
    for flags in (WorkerFlags(), WorkerFlags(hicache_storage_backend="mooncake")):
        try:
            discover("http://127.0.0.1:30000", info, None, flags)
        except ValueError as exc:
            _refused(exc)
    return True


_LAYOUT_INFO = decode_server_info(json.dumps({
    "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "block_size": 16},
    "tp_size": 2, "page_size": 16, "enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}))


def check_l3_layout(data: bytes) -> bool:
    try:
        layout = decode_l3_cache_layout(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(isinstance(layout, L3CacheLayout), "type")
    for flags in (WorkerFlags(), WorkerFlags(hicache_storage_backend="mooncake")):
        try:
            discover("http://127.0.0.1:30000", _LAYOUT_INFO, layout, flags)
        except ValueError as exc:
            _refused(exc)
    return True


def check_mooncake_reply(data: bytes) -> bool:
    try:
        reply = decode_batch_query_reply(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    found = {key: status.ok for key, status in (reply.data or {}).items()}  # what the router reads
    _expect(all(isinstance(v, bool) for v in found.values()), "ok is not a bool")
    return True


def check_generate_reply(data: bytes) -> bool:
    from kvtier.tools.probe import cached_tokens_of, worker_ttft_of

    try:
        meta = decode_generate_meta_info(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    cached = cached_tokens_of(meta)  # what `kvtier probe hicache` reads of it
    _expect(cached.total is None or isinstance(cached.total, int), "cached tokens are not a count")
    ttft, field = worker_ttft_of(meta)
    _expect((ttft is None) == (field == ""), "a TTFT without the field it came from")
    return True


def check_router_health(data: bytes) -> bool:
    from kvtier.tools.doctor.judge import check_page_sizes, check_routers
    from kvtier.tools.doctor.views import RedisView, RouterView

    try:
        health = decode_router_health(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    _expect(decode_router_health(msgspec.json.encode(health)) == health, "router health does not round-trip")
    view = RouterView(url="http://r", reachable=True, http_status=200, healthz=health)
    check_routers([view])  # what the doctor reads of it
    check_page_sizes(RedisView(url="redis://r", reachable=True), [view])
    return True


def check_decision(data: bytes) -> bool:
    """A decision-log message decodes or is refused (a newer `v` included); the search's
    request-id-only read agrees with the full decode; analytics counts a valid one."""
    from kvtier.consumers.analytics_model import TierAnalytics

    try:
        decision = decode_decision(data)
    except (*MSGSPEC_ERRORS, UnsupportedVersion) as exc:
        return _refused(exc)
    encoded = encode_decision(decision)
    _expect(encode_decision(decode_decision(encoded)) == encoded, "decision does not round-trip")
    _expect(decision_request_id(data) == decision.request_id, "the request id read alone differs")
    TierAnalytics().decision(decision)
    return True


def check_jsz(data: bytes) -> bool:
    from kvtier.bench.soak import streams_of

    try:
        jsz = decode_jsz(data)
    except MSGSPEC_ERRORS as exc:
        return _refused(exc)
    for name, stream in streams_of(jsz, 1.75e9).items():  # what the soak samples of it
        _expect(isinstance(name, str) and math.isfinite(stream["age_s"]), f"stream {name!r}: {stream}")
    return True


def _route_errors():
    from kvtier.router.service import Refused

    return (Refused, *MSGSPEC_ERRORS)


def check_route_request(data: bytes) -> bool:
    """The router's request decoding and everything before Redis: the weights with the
    overrides applied and the scoring formula over them never raise, never give NaN."""
    from kvtier.router import scoring
    from kvtier.router.hashing import RequestPages
    from kvtier.router.service import _decode

    try:
        request = _decode(data, RouteRequest)
    except _route_errors() as exc:
        return _refused(exc)
    weights = request.overrides.applied_to(ScoringWeights()) if request.overrides else ScoringWeights()
    pages = RequestPages.of(request.token_ids[:4096], 4)
    candidates = [scoring.CandidateInputs("a", TierOverlap(device=len(pages)), 3, 5),
                  scoring.CandidateInputs("b", TierOverlap(host=1, disk=1, shared_beyond=2), 0, 0)]
    for u in (0.0, 0.5, 0.999999):
        scored = scoring.score(len(pages), candidates, weights, u)
        _expect(0 <= scored.chosen < 2 and not any(math.isnan(v) for v in scored.logits), f"scored {scored}")
    return True


def check_release_request(data: bytes) -> bool:
    from kvtier.router.service import _decode

    try:
        _decode(data, ReleaseRequest)
    except _route_errors() as exc:
        return _refused(exc)
    return True


def check_generate_request(data: bytes) -> bool:
    from kvtier.router.service import _decode

    try:
        body = _decode(data, GenerateRequest)
    except _route_errors() as exc:
        return _refused(exc)
    RouteRequest(model=body.model or "m", token_ids=body.input_ids, request_id=body.rid,
                 max_new_tokens=body.sampling_params.max_new_tokens or 0)
    return True


@dataclass(frozen=True)
class Target:
    name: str
    strategy: st.SearchStrategy
    check: Callable[[Any], bool]
    weight: float = 1.0  # share of the cases (the central wire formats get more)
    amplify: bool = True  # inputs are bytes: add quick mutants of each

    def checker(self, mutants: int) -> Callable[[Any], Any]:
        return amplified(self.check, mutants) if self.amplify and mutants else self.check


def decoder_targets() -> list[Target]:
    """Every decoder of untrusted input, with its inputs and its property."""
    json_of = as_builtins_json
    return [
        Target("sglang.payload", inputs(sglang_payloads()), check_sglang_payload, 3),
        Target("sglang.payload.huge", huge_payloads(), check_sglang_payload, 0.02, amplify=False),
        Target("sglang.event", inputs(sglang_events()), check_sglang_event, 2),
        Target("sglang.frames", frames_strategy(), check_frames, 0.5, amplify=False),
        Target("events.message", inputs(kvtier_messages().map(as_builtins_msgpack)), check_kvtier_message, 3),
        Target("events.control", inputs(st.builds(ControlRequest, request=st.sampled_from(["resync", "x"]),
                                                  reason=st.text(max_size=10)).map(json_of), True), check_control),
        Target("health.hash_check", inputs(hash_checks().map(json_of), True), check_hash_check),
        Target("worker.metadata", inputs(worker_metadata().map(json_of), True), check_worker_metadata, 1.5),
        Target("sglang_server.server_info", inputs(server_infos(), True), check_server_info),
        Target("sglang_server.l3_layout", inputs(l3_layouts(), True), check_l3_layout),
        Target("sglang_server.generate_reply", inputs(generate_replies(), True), check_generate_reply),
        Target("mooncake.batch_query_reply", inputs(mooncake_replies(), True), check_mooncake_reply),
        Target("router_health.healthz", inputs(router_healths(), True), check_router_health),
        Target("routing.decision", inputs(route_decisions().map(lambda d: msgspec.msgpack.decode(encode_decision(d)))),
               check_decision),
        Target("jetstream.jsz", inputs(jsz_replies(), True), check_jsz, 0.5),
        Target("routing.route", inputs(route_requests(), True), check_route_request, 2),
        Target("routing.release", inputs(release_requests(), True), check_release_request),
        Target("routing.generate", inputs(generate_requests(), True), check_generate_request),
    ]


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


# --- running the decoder properties (the bench; tests call the checks through @given) -----
@dataclass
class TargetResult:
    name: str
    examples: int = 0  # hypothesis examples (an example may hold several cases)
    cases: int = 0
    accepted: int = 0
    failures: int = 0
    seconds: float = 0.0
    first_failure: str = ""

    def as_dict(self) -> dict:
        rate = self.cases / self.seconds if self.seconds else 0.0
        return {"cases": self.cases, "examples": self.examples, "accepted": self.accepted,
                "rejected": self.cases - self.accepted, "failures": self.failures, "seconds": round(self.seconds, 2),
                "cases_per_s": round(rate, 1), "first_failure": self.first_failure}


def run_property(name: str, strategy: st.SearchStrategy, check: Callable[[Any], bool], examples: int, seed: int,
                 base: settings | None = None, timeout_s: float | None = None) -> TargetResult:
    """Run `check` on `examples` inputs drawn from `strategy` (hypothesis, seeded); a failure
    is shrunk, recorded and the run goes on with the next seed until all are done. `check`
    returns whether the input was accepted, or (cases, accepted) for an input of several."""
    result = TargetResult(name)
    started = time.perf_counter()
    attempt = 0
    while result.examples < examples and (timeout_s is None or time.perf_counter() - started < timeout_s):
        remaining = examples - result.examples

        def counted(value):
            result.examples += 1
            outcome = check(value)
            cases, accepted = outcome if isinstance(outcome, tuple) else (1, int(bool(outcome)))
            result.cases += cases
            result.accepted += accepted

        test = given(strategy)(counted)
        test = settings(base or profile("bench"), max_examples=remaining)(test)
        test = hypothesis_seed(seed * 1000 + attempt)(test)
        before = result.examples
        try:
            test()
        except Exception as exc:  # noqa: BLE001 - a failure is the finding: record it and go on
            result.failures += 1
            if not result.first_failure:
                result.first_failure = "".join(traceback.format_exception_only(type(exc), exc))[-2000:]
        attempt += 1
        if result.examples == before:
            break  # nothing more to draw
    result.seconds = time.perf_counter() - started
    return result


# --- real processes --------------------------------------------------------------------------
def _nats_publish_raw(port: int, subject: bytes, data: bytes) -> None:
    """PUB with a subject nats-py would not send (not UTF-8); the server stores it as is."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n')
        sock.sendall(b"PUB " + subject + b" " + str(len(data)).encode() + b"\r\n" + data + b"\r\nPING\r\n")
        reply = b""
        while b"PONG" not in reply and b"-ERR" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        if b"-ERR" in reply:
            raise RuntimeError(f"nats-server refused the raw publish: {reply!r}")


def _source_seq(headers: dict) -> int:
    """The events-stream sequence a dead letter was made from (0 when it does not say)."""
    try:
        return int(str(headers.get("Kvtier-Stream-Seq", 0)))
    except ValueError:
        return 0


async def dead_letters(js, after: int = 0) -> list[tuple[int, str, dict, bytes]]:
    """(stream seq, subject, headers, data) of the dead letters after stream seq `after`."""
    import nats.js.errors

    from kvtier.schemas.subjects import DLQ_STREAM

    try:
        info = await js.stream_info(DLQ_STREAM)
    except nats.js.errors.NotFoundError:
        return []
    out = []
    for seq in range(max(after + 1, info.state.first_seq), info.state.last_seq + 1):
        msg = await js.get_msg(DLQ_STREAM, seq)
        out.append((seq, msg.subject, dict(msg.headers or {}), msg.data))
    return out


class Processes:
    """kvtier subcommands started here, each stopped by its PID."""

    def __init__(self) -> None:
        from kvtier.bench.processes import KvtierSubprocess

        self._cls = KvtierSubprocess
        self.dir = tempfile.mkdtemp(prefix="kvtier-fuzz-")
        self.running: list = []

    def start(self, name: str, *args: str):
        process = self._cls(list(args), self.dir, name)
        self.running.append(process)
        return process

    def check(self) -> None:
        for process in self.running:
            process.check()

    def stop(self) -> None:
        for process in reversed(self.running):
            process.stop()
        self.running.clear()


def wait_for(predicate: Callable[[], Any], timeout: float, what: Callable[[], str] | str = "") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise Violation(f"timed out after {timeout}s waiting for {what() if callable(what) else what}; last {last!r}")


# The engine side: a valid batch (SGLang events, from a small pool of hashes so removes
# hit stored pages), a bad payload, or bad frames.
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


class BridgeStack:
    """A raw SGLang-format PUB (with its replay socket), one `kvtier bridge` on it, one
    `kvtier processor`, on the given NATS and Redis."""

    MODEL, WORKER = "fz-bridge", "w0"

    def __init__(self, nats_url: str, redis_url: str):
        import redis

        from kvtier.sim.sglang_publisher import SglangEventPublisher

        self.nats_url = nats_url
        self.client = redis.Redis.from_url(redis_url)
        self.publisher = SglangEventPublisher()
        self.processes = Processes()
        self.processor = self.processes.start("processor", "processor", "--nats", nats_url, "--redis", redis_url,
                                              "--reap-interval", "0.2")
        args = ["bridge", "--endpoint", self.publisher.endpoint, "--replay-endpoint", self.publisher.replay_endpoint,
                "--worker-id", self.WORKER, "--model", self.MODEL, "--page-size", "4", "--nats", nats_url,
                "--heartbeat", "0.5"]
        self.bridge = self.processes.start("bridge", *args)
        self._dlq_seen = 0
        try:
            wait_for(self._announced, 30, lambda: f"the bridge's announcement\n{self.bridge.tail()}")
            self._dlq_seen = self._dlq_last()
        except BaseException:
            self.close()
            raise

    def _announced(self) -> bool:
        self.processes.check()
        return self.client.zscore(ModelKeys.for_model(self.MODEL).leases, self.WORKER) is not None

    def _dlq_last(self) -> int:
        async def last():
            import nats

            nc = await nats.connect(self.nats_url)
            try:
                letters = await dead_letters(nc.jetstream(), 0)
                return letters[-1][0] if letters else 0
            finally:
                await nc.close()
        return asyncio.run(last())

    def state(self) -> dict[int, set[Tier]]:
        from kvtier.consumers.apply import read_worker_pages

        return read_worker_pages(self.client, self.MODEL, self.WORKER)

    def run(self, items: list, timeout: float = 30.0) -> int:
        """Send `items` after a clearing batch; check that Redis equals the reference of the
        valid events and that each bad payload/event/frame set left one dead letter with a
        reason, from the bridge (none from the processor). Returns the dead letters."""
        reference: dict[int, set[Tier]] = {}
        expected_dead = 0
        self._dlq_seen = self._dlq_last()  # letters of an earlier, failed example do not count
        self.publisher.publish([AllBlocksCleared()])
        for kind, data in items:
            if kind == "frames":
                self.publisher._pub.send_multipart(data)
            else:
                self.publisher.publish_payload(data)
            events, dead = expected_from_engine((kind, data))
            apply_tier_events(reference, events)
            expected_dead += dead
        got: list = []

        def settled() -> bool:
            self.processes.check()
            nonlocal got
            got = asyncio.run(self._letters())
            return len(got) >= expected_dead and self.state() == reference

        wait_for(settled, timeout, lambda: (f"Redis {sorted(self.state().items())[:8]} vs reference "
                                           f"{sorted(reference.items())[:8]}; {len(got)} of {expected_dead} dead "
                                           f"letters\nbridge: {self.bridge.tail(1500)}\nprocessor: "
                                           f"{self.processor.tail(1500)}"))
        time.sleep(0.2)  # nothing more may come
        got = asyncio.run(self._letters())
        self._dlq_seen = max([self._dlq_seen, *(seq for seq, *_ in got)])
        for _seq, subject, headers, _data in got:
            _expect(subject == f"kvtier.dlq.bridge.{self.MODEL}.{self.WORKER}",
                    f"dead letter from {subject} ({headers.get('Kvtier-Reason')}): the processor refused what the "
                    "bridge forwarded")
            _expect(bool(headers.get("Kvtier-Reason")), f"dead letter without a reason: {headers}")
        _expect(len(got) == expected_dead, f"{len(got)} dead letters for {expected_dead} bad inputs: "
                                           f"{[h.get('Kvtier-Reason') for _, _, h, _ in got]}\n"
                                           f"bridge: {self.bridge.tail(3000)}")
        return len(got)

    async def _letters(self):
        return await self._letters_since(self._dlq_seen)

    async def _letters_since(self, after: int):
        import nats

        nc = await nats.connect(self.nats_url)
        try:
            return await dead_letters(nc.jetstream(), after)
        finally:
            await nc.close()

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.publisher.close()
            self.client.close()


# The stream side: messages published straight to JetStream.
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


class ProcessorStack:
    """One `kvtier processor`; messages published straight to the events stream."""

    MODEL, WORKER, FUZZ = "fz-proc", "good", "fz"

    def __init__(self, nats_url: str, redis_url: str, nats_port: int):
        import redis

        self.nats_url, self.nats_port = nats_url, nats_port
        self.client = redis.Redis.from_url(redis_url)
        self.processes = Processes()
        self.epoch, self.seq = int(time.time() * 1000), 0
        self._dlq_seen = 0
        self._events_from = 0
        asyncio.run(self._ensure_streams())
        self.processor = self.processes.start("processor", "processor", "--nats", nats_url, "--redis", redis_url,
                                              "--reap-interval", "0.2")
        self.reference: dict[int, set[Tier]] = {}

    async def _ensure_streams(self) -> None:
        import nats

        from kvtier.plumbing.streams import StreamSettings, ensure_streams
        from kvtier.schemas.subjects import EVENTS_STREAM

        nc = await nats.connect(self.nats_url)
        try:
            await ensure_streams(nc.jetstream(), StreamSettings())
            letters = await dead_letters(nc.jetstream(), 0)
            self._dlq_seen = letters[-1][0] if letters else 0
            # letters for messages published before this point belong to an earlier example,
            # however late the processor writes them (a slow machine, a timed-out example)
            self._events_from = (await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq
        finally:
            await nc.close()

    def state(self) -> dict[int, set[Tier]]:
        from kvtier.consumers.apply import read_worker_pages

        return read_worker_pages(self.client, self.MODEL, self.WORKER)

    def good_batch(self, events: list[TierEvent]) -> EventBatch:
        self.seq += 1
        apply_tier_events(self.reference, events)
        return EventBatch(worker_id=self.WORKER, model=self.MODEL, epoch=self.epoch, seq=self.seq, ts=time.time(),
                          source_ts=time.time(), events=events)

    def run(self, items: list, good: list[list[TierEvent]], timeout: float = 30.0) -> int:
        """Publish the fuzzed `items` interleaved with good batches of events for the good
        worker; check that the good worker's state equals the reference and that each message
        the processor must refuse left one dead letter with a reason."""
        from kvtier.schemas.events import encode_message as encode
        from kvtier.schemas.subjects import events_subject

        expected_dead = sum(processor_verdict(tokens, data) for tokens, data, _raw in items)
        asyncio.run(self._ensure_streams())  # letters of an earlier, failed example do not count

        async def publish():
            import nats

            nc = await nats.connect(self.nats_url)
            js = nc.jetstream()
            try:
                for i in range(max(len(items), len(good))):
                    if i < len(items):
                        tokens, data, raw = items[i]
                        if raw:
                            subject = b"kvtier.events." + tokens[0] + b"." + tokens[1]
                            await asyncio.to_thread(_nats_publish_raw, self.nats_port, subject, data)
                        else:
                            await js.publish(f"kvtier.events.{tokens[0]}.{tokens[1]}", data, timeout=5)
                    if i < len(good):
                        batch = self.good_batch(good[i])
                        await js.publish(events_subject(self.MODEL, self.WORKER), encode(batch),
                                         headers={"Nats-Msg-Id": batch.msg_id}, timeout=5)
            finally:
                await nc.close()

        asyncio.run(publish())
        got: list = []

        def settled() -> bool:
            self.processes.check()
            nonlocal got
            got = asyncio.run(self._letters())
            applied = self.client.hget(ModelKeys.for_model(self.MODEL).state(self.WORKER), "seq")
            return len(got) >= expected_dead and int(applied or 0) == self.seq and self.state() == self.reference

        wait_for(settled, timeout, lambda: (f"Redis {sorted(self.state().items())[:8]} vs "
                                           f"{sorted(self.reference.items())[:8]}; {len(got)} of {expected_dead} "
                                           f"dead letters\nprocessor: {self.processor.tail(2500)}"))
        time.sleep(0.2)
        got = asyncio.run(self._letters())
        self._dlq_seen = max([self._dlq_seen, *(seq for seq, *_ in got)])
        for _seq, subject, headers, _data in got:
            _expect(subject.startswith("kvtier.dlq.processor."), f"dead letter on {subject}")
            _expect(bool(headers.get("Kvtier-Reason")), f"dead letter without a reason: {headers}")
        _expect(len(got) == expected_dead, f"{len(got)} dead letters for {expected_dead} bad messages: "
                                           f"{[(_source_seq(h), h.get('Kvtier-Reason')) for _, _, h, _ in got]} "
                                           f"(events from stream seq {self._events_from})")
        return len(got)

    async def _letters(self):
        import nats

        nc = await nats.connect(self.nats_url)
        try:
            letters = await dead_letters(nc.jetstream(), self._dlq_seen)
            return [letter for letter in letters if _source_seq(letter[2]) > self._events_from]
        finally:
            await nc.close()

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.client.close()


GOOD_EVENTS = st.lists(st.lists(
    st.builds(PagesStored, tier=st.sampled_from(list(Tier)), hashes=st.lists(POOL_HASHES, max_size=4))
    | st.builds(PagesRemoved, tier=st.sampled_from(list(Tier)), hashes=st.lists(POOL_HASHES, max_size=4)),
    max_size=3), max_size=4)


# The router: a real `kvtier router --proxy` over seeded tier state, and a stand-in engine.
class StubEngine:
    """SGLang's /generate as a proxying router reaches it (answers at once), in a thread."""

    def __init__(self):
        from aiohttp import web

        async def generate(request):
            await request.read()
            return web.json_response({"text": "", "meta_info": {}})

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", generate)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="stub-engine", daemon=True)
        self._thread.start()
        ready.wait(10)

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _free_port() -> int:
    from kvtier.harness.embedded import free_port

    return free_port()


ROUTER_MAX_TOKENS = 256
ROUTER_MAX_BODY = 16 << 10


class RouterStack:
    """`kvtier router --proxy` with small limits (--max-request-tokens 256, --max-body-bytes
    16 KiB) over three live workers of MODEL whose engine is a StubEngine."""

    WORKERS = ("w0", "w1", "w2")

    def __init__(self, redis_url: str, model: str = MODEL):
        import redis

        from kvtier.consumers.apply import TierStateWriter

        self.model = model
        self.engine = StubEngine()
        self.client = redis.Redis.from_url(redis_url)
        writer = TierStateWriter(self.client)
        tokens = list(range(1, 65))
        for i, worker in enumerate(self.WORKERS):
            meta = WorkerMetadata(worker_id=worker, model=model, page_size=4, http_endpoint=self.engine.url)
            writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=3600,
                                           cursor=BridgeCursor(epoch=1, seq=0)))
            hashes = [BlockHash(h) for h in sglang_block_hashes(tokens, 4)][: 4 * i + 2]
            result = writer.apply(EventBatch(worker_id=worker, model=model, epoch=1, seq=1, ts=time.time(),
                                             source_ts=time.time(),
                                             events=[PagesStored(tier=Tier.DEVICE, hashes=hashes)]))
            assert result.status == 0, result
        self.processes = Processes()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router = self.processes.start(
            "router", "router", "--redis", redis_url, "--http-port", str(self.port), "--proxy", "--model", model,
            "--max-request-tokens", str(ROUTER_MAX_TOKENS), "--max-body-bytes", str(ROUTER_MAX_BODY))
        try:
            wait_for(self._up, 30, lambda: f"the router to answer\n{self.router.tail()}")
        except BaseException:
            self.close()
            raise
        self.used_ids: set[str] = set()

    def _up(self) -> bool:
        self.processes.check()
        try:
            return self.request("GET", "/healthz", b"", timeout=1)[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body: bytes, timeout: float = 15.0,
                content_type: str = "application/json") -> tuple[int, bytes]:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body or None, headers={"Content-Type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def close(self) -> None:
        try:
            self.processes.stop()
        finally:
            self.engine.close()
            self.client.close()


@st.composite
def router_requests(draw, model: str = MODEL):
    """(path, body bytes, kind): valid requests of each endpoint and every kind of bad one."""
    path, valid = draw(st.sampled_from([("/v1/route", route_requests(model)), ("/v1/release", release_requests(model)),
                                        ("/generate", generate_requests(model))]))
    kind = draw(st.sampled_from(["valid", "valid", "valid", "valid", "perturbed", "perturbed", "wrong_field", "missing",
                                 "mutated", "garbage", "too_many_tokens", "too_big", "bad_utf8", "nan_override",
                                 "unknown_override", "negative", "not_object"]))
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


def router_expectation(path: str, body: bytes, default_model: str = MODEL) -> tuple[str, Any]:
    """("invalid", the decoder's message) | ("too_big", "") | ("tokens", "") | ("valid", the
    decoded request) from the same decoding the router does, in process."""
    from kvtier.router.service import Refused, _decode

    if len(body) > ROUTER_MAX_BODY:
        return "too_big", ""
    kind = {"/v1/route": RouteRequest, "/v1/release": ReleaseRequest, "/generate": GenerateRequest}[path]
    try:
        request = _decode(body, kind)
    except (Refused, *MSGSPEC_ERRORS) as exc:
        return "invalid", getattr(exc, "message", str(exc))
    tokens = getattr(request, "token_ids", getattr(request, "input_ids", None))
    if tokens is not None and (not tokens or len(tokens) > ROUTER_MAX_TOKENS):
        return "tokens", ""
    return "valid", request


def check_router_exchange(stack: RouterStack, path: str, body: bytes) -> int:
    """One request against the real router: never a 5xx, never a hang; a 4xx has a JSON
    {"error"} naming the problem (the decoder's own message for a malformed body); a valid
    request for the seeded model gets a 200."""
    expectation, detail = router_expectation(path, body, stack.model)
    error = ""
    try:
        status, raw = stack.request("POST", path, body)
    except (ConnectionResetError, BrokenPipeError) as exc:
        _expect(expectation == "too_big", f"connection dropped ({exc}) for a {len(body)}-byte body")
        return 413
    _expect(status < 500, f"{status} for {path} {body[:300]!r}: {raw[:500]!r}")
    if status >= 400:
        try:
            error = msgspec.json.decode(raw, type=ErrorBody).error
        except MSGSPEC_ERRORS:
            raise Violation(f"{status} without a JSON error body: {raw[:300]!r}") from None
        _expect(len(error) > 5, f"empty error message: {raw[:300]!r}")
    if expectation == "invalid":
        _expect(status == 400 and detail in error, f"{status} {raw[:300]!r} for a body the decoder refuses "
                                                   f"({detail})")
    elif expectation == "too_big":
        _expect(status == 413, f"{status} for an oversized body")
    elif expectation == "tokens":
        _expect(status in (400, 413) and ("token" in error or "input_ids" in error), f"{status} {raw[:300]!r}")
    elif (getattr(detail, "model", None) or stack.model) == stack.model:
        # Request ids booked by /v1/route stay booked until released (or --booking-ttl):
        # another booking under the same id is a 409; /generate releases its own at the end.
        rid = getattr(detail, "request_id", None) or getattr(detail, "rid", None)
        if isinstance(detail, ReleaseRequest):
            _expect(status == (200 if rid in stack.used_ids else 404), f"{status} {raw[:300]!r}")
            if status == 200 and detail.stage.value == "complete":
                stack.used_ids.discard(rid)
        elif rid is not None and rid in stack.used_ids and getattr(detail, "book", True):
            _expect(status == 409, f"{status} for a request id already booked: {raw[:300]!r}")
        else:
            _expect(status == 200, f"{status} for a valid request: {body[:300]!r} -> {raw[:300]!r}")
            if isinstance(detail, RouteRequest) and detail.book and rid is not None:
                stack.used_ids.add(rid)
    else:
        _expect(400 <= status < 500, f"{status} for a request of an unknown model")
    return status


def check_router_still_serves(stack: RouterStack) -> None:
    status, raw = stack.request("POST", "/v1/route", encode_json({"model": stack.model, "token_ids": list(range(1, 17)),
                                                                  "book": False}))
    try:
        worker = decode_route_response(raw).worker_id if status == 200 else None
    except MSGSPEC_ERRORS:
        worker = None
    _expect(worker in stack.WORKERS, f"{status} {raw[:300]!r}")


# --- `kvtier bench fuzz` -------------------------------------------------------------------
def _split(total: int, targets: list[Target]) -> dict[str, int]:
    weight = sum(t.weight for t in targets)
    shares = {t.name: max(1, int(total * t.weight / weight)) for t in targets}
    shares[targets[0].name] += total - sum(shares.values())
    return shares


def run_fuzz_bench(args) -> int:
    from kvtier.harness.embedded import NatsServer, RedisServer

    cases, seed = args.cases, args.seed
    results: dict[str, TargetResult] = {}
    started = time.perf_counter()
    bench = profile("bench")
    targets = decoder_targets()
    shares = _split(cases, targets)
    print(f"kvtier bench fuzz: {cases} in-process cases over {len(targets)} decoders, seed {seed}", flush=True)
    for target in targets:
        per_example = 1 + (args.mutants if target.amplify else 0)
        result = run_property(target.name, target.strategy, target.checker(args.mutants),
                              max(1, shares[target.name] // per_example), seed, bench)
        results[target.name] = result
        _report(result)
    in_process_s = time.perf_counter() - started
    process_cases = args.process_cases if args.process_cases is not None else min(2000, max(100, cases // 50))
    with NatsServer() as nats_server, RedisServer() as redis_server:
        results["router.http"] = _router_bench(redis_server.url, process_cases, seed, bench)
        _report(results["router.http"])
        examples = max(10, process_cases // 25)  # each holds ~6 inputs and takes a second or two
        results["bridge.pipeline"] = _bridge_bench(nats_server.url, redis_server.url, examples, seed, bench)
        _report(results["bridge.pipeline"])
        results["processor.stream"] = _processor_bench(nats_server.url, nats_server.port, redis_server.url,
                                                       examples, seed, bench)
        _report(results["processor.stream"])
    total = sum(r.cases for r in results.values())
    failures = sum(r.failures for r in results.values())
    elapsed = time.perf_counter() - started
    in_cases = sum(results[t.name].cases for t in targets)
    print(f"total: {total} cases, {failures} failures, {elapsed:.1f}s ({in_cases / in_process_s:.0f} in-process "
          f"cases/s)")
    if args.json:
        print(json.dumps({
            "bench": "fuzz", "cases": total, "failures": failures, "seed": seed, "seconds": round(elapsed, 1),
            "in_process_cases": in_cases, "in_process_cases_per_s": round(in_cases / in_process_s, 1),
            "targets": {name: r.as_dict() for name, r in results.items()},
        }))
    return 1 if failures else 0


def _report(result: TargetResult) -> None:
    line = (f"  {result.name:28s} {result.cases:8d} cases  {result.accepted:7d} valid  {result.failures} failures  "
            f"{result.seconds:6.1f}s")
    print(line, flush=True)
    if result.first_failure:
        print("    first failure: " + result.first_failure.strip().replace("\n", "\n    "), flush=True)


def _router_bench(redis_url: str, cases: int, seed: int, base: settings) -> TargetResult:
    stack = RouterStack(redis_url)
    try:
        result = run_property("router.http", router_requests(stack.model),
                              lambda item: check_router_exchange(stack, item[0], item[1]) == 200, cases, seed,
                              settings(base, deadline=None), timeout_s=600)
        try:
            check_router_still_serves(stack)
        except Violation as exc:
            result.failures += 1
            result.first_failure = result.first_failure or str(exc)
        return result
    finally:
        stack.close()


def _bridge_bench(nats_url: str, redis_url: str, examples: int, seed: int, base: settings) -> TargetResult:
    stack = BridgeStack(nats_url, redis_url)
    try:
        items = st.lists(engine_items(), min_size=1, max_size=12)

        def check(batch):
            stack.run(batch)
            return len(batch), sum(1 for item in batch if expected_from_engine(item)[1] == 0)

        return run_property("bridge.pipeline", items, check, examples, seed,
                            settings(base, deadline=None, phases=(Phase.explicit, Phase.generate)), timeout_s=600)
    finally:
        stack.close()


def _processor_bench(nats_url: str, nats_port: int, redis_url: str, examples: int, seed: int,
                     base: settings) -> TargetResult:
    stack = ProcessorStack(nats_url, redis_url, nats_port)
    try:
        strategy = st.tuples(st.lists(stream_items(stack.MODEL, stack.FUZZ), min_size=1, max_size=12), GOOD_EVENTS)

        def check(example):
            items, good = example
            stack.run(items, good)
            return len(items), sum(1 for tokens, data, _ in items if not processor_verdict(tokens, data))

        return run_property("processor.stream", strategy, check, examples, seed,
                            settings(base, deadline=None, phases=(Phase.explicit, Phase.generate)), timeout_s=600)
    finally:
        stack.close()


__all__ = ["profile", "decoder_targets", "run_property", "run_fuzz_bench", "Target", "Violation", "BridgeStack",
           "ProcessorStack", "RouterStack", "engine_items", "stream_items", "router_requests", "GOOD_EVENTS",
           "check_router_exchange", "check_router_still_serves"]
