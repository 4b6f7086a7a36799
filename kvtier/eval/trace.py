"""Mooncake-format traces: reading them, and turning their hash ids into token ids.

The format is the Mooncake FAST'25 one: one JSON object per line with `timestamp` (ms),
`input_length`, `output_length`, `hash_ids` (512-token blocks, equal ids = equal prefix).
Token ids are derived deterministically from each hash id, so prefix sharing is kept; a
request is cut to its `input_length`.
"""

from __future__ import annotations

import array
import gzip
import hashlib
import pathlib
from dataclasses import dataclass

import msgspec

from kvtier.eval.trace_record import TRACE_BLOCK_TOKENS, TraceRequest
from kvtier.schemas.hashes import PageDigest, sglang_page_digests

#: Traces shipped inside the package (kvtier/data/README.md says where they come from).
DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "data"
#: The whole public Mooncake conversation trace (12,031 requests), gzipped.
CONVERSATION_TRACE = DATA_DIR / "mooncake_conversation_trace.jsonl.gz"
#: Its first 1,000 requests.
SAMPLE_TRACE = DATA_DIR / "mooncake_trace_sample.jsonl"


def load_trace(path: str | pathlib.Path, limit: int | None = None) -> list[TraceRequest]:
    """A Mooncake-format JSONL trace (plain, or gzipped when the name ends in .gz), or one
    kvtier/eval/synth_trace.py generates: "synthetic[:SEED]" (the high-reuse trace) or
    "synthetic-fanout[:SEED]" (the same with a fifth of fresh requests fanned out 8 ways)."""
    name, _, seed = str(path).partition(":")
    if name in ("synthetic", "synthetic-fanout"):
        from kvtier.eval.synth_trace import SynthParams, generate

        params = SynthParams(fanout_share=0.2 if name == "synthetic-fanout" else 0.0)
        try:
            requests = generate(params, seed=int(seed) if seed else 1)
        except ValueError:
            raise ValueError(f"--trace {path}: {name} takes an integer seed, e.g. {name}:2") from None
        return requests[:limit] if limit is not None else requests
    decoder = msgspec.json.Decoder(TraceRequest)
    requests = []
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        f = opener(path, "rb")
    except FileNotFoundError:
        raise ValueError(f"trace file {path} not found (traces shipped with kvtier: {CONVERSATION_TRACE.name} "
                         f"and {SAMPLE_TRACE.name} in {DATA_DIR})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                requests.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


_block_cache: dict[int, array.array] = {}


def block_tokens(hash_id: int) -> array.array:
    """512 token ids (< 65536) for one trace block, the same for the same id, every run."""
    block = _block_cache.get(hash_id)
    if block is None:
        block = array.array("H", hashlib.shake_128(hash_id.to_bytes(8, "little", signed=True)).digest(1024))
        if len(_block_cache) < 400_000:
            _block_cache[hash_id] = block
    return block


def token_array(request: TraceRequest) -> array.array:
    """The request's token ids as a compact array (2 bytes each)."""
    tokens = array.array("H")
    for hash_id in request.hash_ids:
        tokens.extend(block_tokens(hash_id))
    del tokens[request.input_length:]
    return tokens


def trace_tokens(request: TraceRequest) -> list[int]:
    return token_array(request).tolist()


def _salted_block_tokens(hash_id: int, salt: int) -> array.array:
    seed = hash_id.to_bytes(8, "little", signed=True) + salt.to_bytes(8, "little", signed=True)
    return array.array("H", hashlib.shake_128(seed).digest(2 * TRACE_BLOCK_TOKENS))


def trace_prompt(request: TraceRequest, salt: int, max_tokens: int) -> list[int]:
    """The request's token ids (< 65536) in one loop over a looping trace (`salt`: the loop),
    cut to `max_tokens`: equal blocks within a loop (prefix sharing kept), fresh in the next,
    so a long run keeps creating and evicting pages."""
    length = min(request.input_length, max_tokens)
    tokens = array.array("H")
    for hash_id in request.hash_ids:
        if len(tokens) >= length:
            break
        tokens.extend(_salted_block_tokens(hash_id, salt))
    return tokens[:length].tolist()


@dataclass(frozen=True)
class PreparedRequest:
    """A trace request with what every replay of it needs, computed once."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    digests: list[PageDigest]  # SGLang's page chain at the replay's page size
    source: TraceRequest

    def token_ids(self) -> list[int]:
        """Computed again on each call (kept for every request, they would take gigabytes)."""
        return trace_tokens(self.source)


def prepare(requests: list[TraceRequest], page_size: int) -> list[PreparedRequest]:
    out = []
    for index, request in enumerate(requests):
        tokens = token_array(request)
        out.append(PreparedRequest(index=index, arrival_s=request.timestamp / 1000.0, input_tokens=len(tokens),
                                   output_tokens=request.output_length,
                                   digests=sglang_page_digests(tokens, page_size), source=request))
    return out
