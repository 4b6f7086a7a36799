"""The family of workloads a routing policy is judged on (`kvtier bench replay --suite`), each
a Mooncake-format trace made from a seed, so a policy is never judged on the one trace it was
developed on.

- `conversation`: a window of the public Mooncake conversation trace (shipped), its real
  timing; the seed picks the window.
- `synthetic`: kvtier's high-reuse trace (synth_trace.py) at its own rate.
- `agentic`: multi-turn agent sessions on 6 applications whose shared system prompts are
  3-24k tokens; each turn appends the model's output and a tool's output (a few hundred to
  many thousand tokens) to the session's context, after a pause while the tool runs.
- `shared_prompts`: many applications (40), each with a long shared system prompt, and short
  questions on them; a few follow up on their answer.
- `bursty`: the synthetic trace's requests arriving in phases whose offered prefill is 0.5 to
  1.2 times the cluster's capacity.

The generated workloads offer a set share of the cluster's prefill capacity (`load`): the
rate is set so that the prompt tokens no earlier request holds (what no cache can save) come
at close to that share of what the workers can prefill together (agent sessions cut off by
the trace's end make it come out within about a tenth of it). Seeds TUNING_SEEDS are the ones a
change may be tuned on; HELD_OUT_SEEDS are kept out of any tuning, to check it on.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.eval.synth_trace import SynthParams
from kvtier.eval.synth_trace import generate as synthetic_trace
from kvtier.eval.trace_record import TRACE_BLOCK_TOKENS, TraceRequest

TUNING_SEEDS = (1, 2, 3)
#: Never used to tune a policy: `--suite --held-out` runs these.
HELD_OUT_SEEDS = (101, 102, 103)
#: Requests per workload in the suite (its --requests).
SUITE_REQUESTS = 1500


class _Blocks:
    """Fresh block ids, never reused across the trace."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> list[int]:
        ids = list(range(self.next, self.next + count))
        self.next += count
        return ids


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


class _Context:
    """A prompt as 512-token blocks: the full blocks keep their ids as it grows; the last,
    partly filled block changes id whenever tokens are appended to it (its hash would)."""

    def __init__(self, shared: list[int], shared_tokens: int, blocks: _Blocks) -> None:
        self.full = list(shared)  # the shared prefix's full blocks
        self.tokens = shared_tokens
        self.blocks = blocks

    def append(self, tokens: int) -> None:
        self.tokens += tokens
        full = self.tokens // TRACE_BLOCK_TOKENS
        if full > len(self.full):
            self.full += self.blocks.take(full - len(self.full))

    def request(self, at_s: float, output: int) -> TraceRequest:
        partial = self.tokens % TRACE_BLOCK_TOKENS
        ids = self.full + (self.blocks.take(1) if partial else [])
        return TraceRequest(timestamp=round(at_s * 1000), input_length=self.tokens, output_length=output,
                            hash_ids=ids)


def _apps(rng: random.Random, blocks: _Blocks, count: int, low: float, high: float
          ) -> list[tuple[list[int], int]]:
    """`count` shared system prompts, log-uniform between `low` and `high` tokens: (their full
    blocks, their tokens); the tail past the last full block is each request's own."""
    apps = []
    for _ in range(count):
        tokens = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        apps.append((blocks.take(tokens // TRACE_BLOCK_TOKENS), tokens))
    return apps


def agentic(seed: int, requests: int, rate_scale: float) -> list[TraceRequest]:
    """Agent sessions (see the module docstring); `rate_scale` multiplies the session rate."""
    rng, blocks = random.Random(seed), _Blocks()
    apps = _apps(rng, blocks, 6, 3000, 24000)
    popularity = [1 / (k + 1) for k in range(len(apps))]
    session_rate = 0.25 * rate_scale  # new sessions per second
    ready: list[tuple[float, int]] = []  # (when the session's next turn arrives, session)
    contexts: list[_Context] = []
    turns_left: list[int] = []
    out: list[TraceRequest] = []
    next_session = rng.expovariate(session_rate)
    while len(out) < requests:
        if not ready or next_session <= ready[0][0]:
            now = next_session
            next_session += rng.expovariate(session_rate)
            shared, tokens = rng.choices(apps, popularity)[0]
            context = _Context(shared, tokens, blocks)
            context.append(_lognormal(rng, 400, 0.8, 30, 4000))  # the user's task
            contexts.append(context)
            turns_left.append(min(1 + int(rng.expovariate(1 / 7)), 40))
            session = len(contexts) - 1
        else:
            now, session = heapq.heappop(ready)
        context = contexts[session]
        output = _lognormal(rng, 150, 0.8, 1, 2000)
        out.append(context.request(now, output))
        turns_left[session] -= 1
        if turns_left[session] > 0 and context.tokens < 120_000:
            context.append(output + _lognormal(rng, 1200, 1.0, 50, 16000))  # the call, then the tool's answer
            heapq.heappush(ready, (now + _lognormal(rng, 3000, 1.0, 200, 60000) / 1000, session))
    out.sort(key=lambda r: r.timestamp)
    return out


def shared_prompts(seed: int, requests: int, rate_scale: float) -> list[TraceRequest]:
    """Short questions on long shared system prompts (see the module docstring)."""
    rng, blocks = random.Random(seed), _Blocks()
    apps = _apps(rng, blocks, 40, 2000, 32000)
    popularity = [1 / (k + 1) for k in range(len(apps))]
    rate = 4.0 * rate_scale
    recent: list[_Context] = []
    out: list[TraceRequest] = []
    now = 0.0
    while len(out) < requests:
        now += rng.expovariate(rate)
        if recent and rng.random() < 0.15:
            context = recent.pop(-min(len(recent), 1 + int(rng.expovariate(1 / 20))))  # a follow-up
        else:
            shared, tokens = rng.choices(apps, popularity)[0]
            context = _Context(shared, tokens, blocks)
        context.append(_lognormal(rng, 120, 0.9, 10, 1500))
        output = _lognormal(rng, 200, 0.8, 1, 2000)
        out.append(context.request(now, output))
        context.append(output)
        recent = (recent + [context])[-200:]
    return out


def synthetic(seed: int, requests: int, rate_scale: float) -> list[TraceRequest]:
    params = SynthParams()
    return synthetic_trace(SynthParams(requests=requests, duration_s=params.duration_s * requests / params.requests
                                       / rate_scale), seed)


def new_tokens(trace: list[TraceRequest]) -> list[int]:
    """Each request's prompt tokens in blocks no earlier request held: what no cache saves."""
    seen: set[int] = set()
    out = []
    for request in trace:
        fresh = sum(1 for block in request.hash_ids if block not in seen)
        seen.update(request.hash_ids)
        out.append(min(fresh * TRACE_BLOCK_TOKENS, request.input_length))
    return out


def offered_load(trace: list[TraceRequest], capacity_tokens_per_s: float) -> float:
    """New prompt tokens per second over the trace's span, as a share of the capacity."""
    span = (trace[-1].timestamp - trace[0].timestamp) / 1000 if len(trace) > 1 else 0.0
    return sum(new_tokens(trace)) / span / capacity_tokens_per_s if span > 0 else 0.0


def at_load(make: Callable[[int, int, float], list[TraceRequest]], seed: int, requests: int, load: float,
            capacity_tokens_per_s: float) -> list[TraceRequest]:
    """`make`'s trace with its rate scaled so its offered load is `load` of the capacity (four
    calibration passes: the load is close to linear in the rate, not exactly)."""
    scale = 1.0
    for _ in range(4):
        offered = offered_load(make(seed, requests, scale), capacity_tokens_per_s)
        scale *= load / offered
    return make(seed, requests, scale)


def bursty(seed: int, requests: int, capacity_tokens_per_s: float) -> list[TraceRequest]:
    """The synthetic trace's requests, in order, arriving in phases (mean 30 s) each at a load
    drawn from 0.5-1.2 of the capacity: Poisson within a phase at the rate that offers it."""
    content = synthetic(seed, requests, 1.0)
    fresh = new_tokens(content)
    mean_new = sum(fresh) / len(fresh)
    rng = random.Random(seed * 7919 + 1)
    now, phase_end, out = 0.0, 0.0, []
    rate = 0.0
    for request in content:
        if now >= phase_end:
            phase_end = now + rng.expovariate(1 / 30)
            rate = rng.uniform(0.5, 1.2) * capacity_tokens_per_s / mean_new
        now += rng.expovariate(rate)
        out.append(TraceRequest(timestamp=round(now * 1000), input_length=request.input_length,
                                output_length=request.output_length, hash_ids=request.hash_ids))
    return out


def conversation(seed: int, requests: int) -> list[TraceRequest]:
    """A window of `requests` consecutive requests of the shipped conversation trace, from an
    offset the seed picks, its timestamps from 0."""
    from kvtier.eval.trace import CONVERSATION_TRACE, load_trace

    trace = load_trace(CONVERSATION_TRACE)
    room = max(len(trace) - requests, 0)
    start = (seed * 2741) % (room + 1) if seed != 1 else 0
    window = trace[start:start + requests]
    first = window[0].timestamp
    return [TraceRequest(timestamp=r.timestamp - first, input_length=r.input_length, output_length=r.output_length,
                         hash_ids=r.hash_ids) for r in window]


@dataclass(frozen=True)
class Workload:
    name: str
    #: Offered load for the generated ones (None: the workload's own rate).
    load: float | None

    def trace(self, seed: int, requests: int, capacity_tokens_per_s: float) -> list[TraceRequest]:
        if self.name == "conversation":
            return conversation(seed, requests)
        if self.name == "synthetic":
            return synthetic(seed, requests, 1.0)
        if self.name == "bursty":
            return bursty(seed, requests, capacity_tokens_per_s)
        make = {"agentic": agentic, "shared_prompts": shared_prompts}[self.name]
        return at_load(make, seed, requests, self.load or 0.5, capacity_tokens_per_s)


WORKLOADS = (Workload("conversation", None), Workload("synthetic", None), Workload("agentic", 0.45),
             Workload("shared_prompts", 0.45), Workload("bursty", None))
WORKLOAD_NAMES = tuple(w.name for w in WORKLOADS)


def workload(name: str) -> Workload:
    for w in WORKLOADS:
        if w.name == name:
            return w
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
