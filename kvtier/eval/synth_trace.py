"""A synthetic high-reuse trace in the Mooncake format, and the statistics that describe any
trace (`trace_stats`), so a reader can compare a synthetic trace with a real one.

The generator: Poisson arrivals; a share of requests are follow-ups that extend an earlier
request's blocks (a conversation's next turn, or an agent's next step over the same
context), the earlier request drawn with a bias towards recent ones; the rest start fresh.
Lengths are log-normal. With the defaults it matches the statistics of the high-reuse trace
the routing work was measured on (kvtier bench replay in BENCHMARKS.md): ~3,990 requests over
~1,020 s, input mean ~15k / median ~11.6k tokens, output mean ~150, ~64% of 512-token blocks
seen before, ~45% of requests with a prefix hit. Same parameters and seed, same trace.

`--trace synthetic` (or `synthetic:SEED`) makes `kvtier bench replay` and `kvtier tune` use it;
`kvtier bench synth-trace --out FILE` writes it.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvtier.eval.trace_record import TRACE_BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class SynthParams:
    requests: int = 3993
    duration_s: float = 1022.0
    #: Share of requests that extend an earlier request's context.
    followup_share: float = 0.45
    #: Follow-ups pick the request they extend among the most recent ones, this many back on
    #: average (geometric), so reuse stays within reach of a cluster's memory.
    recency_mean: float = 60.0
    #: New blocks a follow-up appends (geometric mean).
    followup_new_blocks: float = 3.0
    #: Of the follow-ups, the share that open a new session on one of `documents` long shared
    #: contexts (a document, a code base, a long system prompt), drawn by Zipf popularity.
    document_share: float = 0.6
    documents: int = 40
    document_median_tokens: float = 20000.0
    document_sigma: float = 0.7
    zipf_s: float = 1.1
    #: Fresh requests: log-normal input length (median, sigma) in tokens.
    fresh_median_tokens: float = 8000.0
    fresh_sigma: float = 0.5
    max_input_tokens: int = 191378
    output_mean_tokens: float = 149.0
    #: Fan-out: this share of fresh requests come with `fanout - 1` siblings within a few
    #: milliseconds that share its whole context and add a block of their own (an agent's
    #: parallel calls, a batch over one document). 0: none (the default trace).
    fanout_share: float = 0.0
    fanout: int = 8

    def __post_init__(self) -> None:
        if self.requests < 1 or self.duration_s <= 0:
            raise ValueError("requests must be >= 1 and duration_s > 0")
        if not 0.0 <= self.followup_share <= 1.0:
            raise ValueError(f"followup_share must be in [0, 1], got {self.followup_share}")


def generate(params: SynthParams = SynthParams(), seed: int = 1) -> list[TraceRequest]:
    rng = random.Random(seed)
    rate = params.requests / params.duration_s
    now = 0.0
    next_id = 0
    sessions: list[list[int]] = []  # each session's context so far, least recently used first
    out: list[TraceRequest] = []

    def fresh_blocks(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    max_blocks = -(-params.max_input_tokens // TRACE_BLOCK_TOKENS)
    documents = [fresh_blocks(max(1, round(rng.lognormvariate(math.log(params.document_median_tokens),
                                                               params.document_sigma) / TRACE_BLOCK_TOKENS)))
                 for _ in range(params.documents)]
    popularity = [1 / (k + 1) ** params.zipf_s for k in range(params.documents)]
    for _ in range(params.requests):
        now += rng.expovariate(rate)
        if sessions and rng.random() < params.followup_share:
            if documents and rng.random() < params.document_share:
                base = rng.choices(documents, popularity)[0]  # a new session on a shared context
            else:
                back = min(len(sessions), 1 + int(rng.expovariate(1 / params.recency_mean)))
                base = sessions.pop(-back)  # the session's next turn: its whole context so far, and more
            new = 1 + int(rng.expovariate(1 / params.followup_new_blocks))
            blocks = (base + fresh_blocks(new))[:max_blocks]
            tail = rng.randint(1, TRACE_BLOCK_TOKENS)  # the last block is partly filled
            length = (len(blocks) - 1) * TRACE_BLOCK_TOKENS + tail
        else:
            length = int(min(params.max_input_tokens, max(TRACE_BLOCK_TOKENS,
                                                          rng.lognormvariate(math.log(params.fresh_median_tokens),
                                                                             params.fresh_sigma))))
            blocks = fresh_blocks(-(-length // TRACE_BLOCK_TOKENS))
        output = max(1, int(rng.expovariate(1 / params.output_mean_tokens)))
        sessions.append(blocks)
        out.append(TraceRequest(timestamp=round(now * 1000), input_length=length, output_length=output,
                                hash_ids=blocks))
        if params.fanout_share and len(out) < params.requests and rng.random() < params.fanout_share:
            for _ in range(min(params.fanout - 1, params.requests - len(out))):
                now += rng.uniform(0.001, 0.005)
                sibling = blocks + fresh_blocks(1)
                out.append(TraceRequest(timestamp=round(now * 1000),
                                        input_length=length + rng.randint(1, TRACE_BLOCK_TOKENS),
                                        output_length=max(1, int(rng.expovariate(1 / params.output_mean_tokens))),
                                        hash_ids=sibling))
        if len(out) >= params.requests:
            break
    return out


def trace_stats(requests: list[TraceRequest]) -> dict:
    """Requests, span, rate, input mean/median/max, output mean, the share of 512-token blocks
    seen before, and the share of requests whose first block was seen before (a prefix hit)."""
    seen: set[int] = set()
    blocks = reused = hits = 0
    for request in requests:
        if request.hash_ids and request.hash_ids[0] in seen:
            hits += 1
        for block in request.hash_ids:
            blocks += 1
            reused += block in seen
        seen.update(request.hash_ids)
    inputs = [r.input_length for r in requests]
    span = (requests[-1].timestamp - requests[0].timestamp) / 1000 if requests else 0.0
    return {
        "requests": len(requests), "span_s": round(span, 1),
        "rate_per_s": round(len(requests) / span, 2) if span else None,
        "input_mean": round(statistics.fmean(inputs)), "input_median": round(statistics.median(inputs)),
        "input_max": max(inputs), "output_mean": round(statistics.fmean(r.output_length for r in requests)),
        "blocks_seen_before_pct": round(100 * reused / blocks, 1) if blocks else 0.0,
        "requests_with_prefix_hit_pct": round(100 * hits / len(requests), 1) if requests else 0.0,
    }


def write_trace(requests: list[TraceRequest], stream=sys.stdout) -> None:
    for r in requests:
        stream.write(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                 "output_length": r.output_length, "hash_ids": r.hash_ids}) + "\n")


def run_synth_trace(params: SynthParams, seed: int, out: str) -> int:
    """`kvtier bench synth-trace`: the trace to `out` ('-': standard output), its statistics to stderr."""
    requests = generate(params, seed)
    if out == "-":
        write_trace(requests)
    else:
        with open(out, "w") as f:
            write_trace(requests, f)
    print(json.dumps({"params": asdict(params), "seed": seed, "stats": trace_stats(requests)}), file=sys.stderr)
    return 0
