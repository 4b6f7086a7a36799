"""How the fuzz suite turns valid messages into bad input: the hypothesis profiles, odd values
of each wire format, structural perturbations, byte mutations, and `inputs`, which mixes them
all for one decoder. The valid messages themselves are in valid_messages.py."""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import zlib
from datetime import timedelta
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from kvtier.schemas.hashes import INT64_MAX, INT64_MIN
from kvtier.schemas.sglang import MAX_EVENTS_PER_BATCH

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


def one_msgpack_value(data: bytes) -> bool:
    """Whether `data` decodes as one msgpack value (a broken one breaks a whole message)."""
    try:
        msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


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


# --- structural perturbations ----------------------------------------------------------------
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


def _deep_value(depth: int, json_safe: bool) -> msgspec.Raw:
    return _deep(depth, b"[" if json_safe else b"\x91", b"0" if json_safe else b"\x00", b"]" if json_safe else b"")


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
            obj = _set(obj, path, _deep_value(draw(st.sampled_from([10, 400, 2000, 5000])), json_safe))
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
    deep = _deep_value(draw(st.sampled_from([2000, 5000])), json_safe)
    if isinstance(target, dict):
        target[draw(st.sampled_from(["zz", "extra_keys", "type2"]))] = deep
    else:
        target.append(deep)
    return obj


# --- byte mutations ----------------------------------------------------------------------------
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
