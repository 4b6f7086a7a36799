"""Bounds on untrusted input, declared once.

kvtier decodes bytes it does not control: SGLang's ZMQ payloads, JetStream messages that
anyone with access to the stream may publish, router request bodies, Redis values, the
replies of SGLang's and Mooncake's HTTP servers. Each decoder returns a valid typed value or
raises its module's documented errors (msgspec.DecodeError / msgspec.ValidationError, and
MalformedBatch / UnsupportedVersion where a module says so) and nothing else:
`tests/bench/test_fuzz.py` checks it, `kvtier bench fuzz` measures it.

msgspec raises RecursionError, not DecodeError, for input nested deeper than Python's
recursion limit (about 1,000 levels: a 2 KB message), so every such decoder goes through
`guarded`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

import msgspec

T = TypeVar("T")
Data = TypeVar("Data")

#: Model names and worker ids on the wire: never empty (an empty name has no subject token
#: and no Redis key), at most 256 characters (the router's limit for model names).
NAME_MAX_CHARS = 256
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=NAME_MAX_CHARS)]

#: (epoch, seq) are compared as Lua numbers (doubles) by the apply script: integers above
#: 2**53 - 1 would compare equal to their neighbours, so they are refused at decode time.
#: Epochs are unix milliseconds (~1.8e12) and seqs count batches: far below the bound.
MAX_SAFE_INT = (1 << 53) - 1

#: Timestamps are unix seconds; NaN, infinities and anything past the year 5138 are refused.
MAX_TIMESTAMP_S = 1e11


def guarded(decode: Callable[[Data], T], data: Data) -> T:
    """`decode(data)`, with too-deep nesting reported as msgspec.DecodeError."""
    try:
        return decode(data)
    except RecursionError:
        raise msgspec.DecodeError("input is nested too deeply (more than about 1,000 levels)") from None
