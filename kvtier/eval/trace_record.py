"""A Mooncake trace's request record and block size: what trace.py reads and synth_trace.py
generates. Apart from both so that trace.load_trace can call the generator without the two
modules importing each other."""

from __future__ import annotations

import msgspec

TRACE_BLOCK_TOKENS = 512


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
