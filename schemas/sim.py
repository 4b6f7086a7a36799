"""`kvtier sim-worker`'s own HTTP bodies (kvtier/sim/sim_worker.py), and what its clients (the
benchmarks, `kvtier probe hicache`, tests) send it.

The endpoints it shares with SGLang or Mooncake are declared with theirs, so that the
simulator answers exactly what kvtier decodes from the real servers:
`POST /w/<rank>/generate` replies with sglang_server.py's `GenerateReply` (and takes its
`GenerateBody`, plus `now`); `GET /batch_query_keys` replies with mooncake.py's
`BatchQueryReply`; a refused body is routing.py's `ErrorBody`.
"""

from __future__ import annotations

import msgspec

from .sglang_server import GenerateBody


class SimGenerateBody(GenerateBody, kw_only=True):
    """`POST /w/<rank>/generate`: SGLang's native body plus the simulated time of the request."""

    #: Simulated seconds (a trace's clock); None: the clock moves on by the wall time since
    #: the previous request.
    now: float | None = None


class AdvanceBody(msgspec.Struct, kw_only=True):
    """`POST /advance`: complete the device->host copies due by `now` (simulated seconds)."""

    now: float


class AdvanceReply(msgspec.Struct, kw_only=True):
    #: The simulated clock after the move (it never goes back).
    now: float


class FlushReply(msgspec.Struct, kw_only=True):
    """`POST /flush_cache` (every rank) or `/w/<rank>/flush_cache`."""

    flushed: list[int]
    #: The L3 pool was emptied too (asked with `?storage=1`, and the sim-worker has one).
    storage: bool = False


#: `GET /w/<rank>/tiers`: the rank's own view, [[page hash, [tier, ...]], ...] (tiers sorted).
RankTiers = list[tuple[int, list[str]]]


class ServedTokens(msgspec.Struct, kw_only=True):
    """Prompt tokens the ranks have served since start (or the last `/flush_cache`), and those
    of them found cached, by tier: what a benchmark reads before and after a run to see how
    much of the prompts a front door's routing let the engines reuse."""

    prompt: int = 0
    device: int = 0
    host: int = 0
    l3: int = 0


class SimHealth(msgspec.Struct, kw_only=True):
    """`GET /healthz`."""

    ranks: int
    #: The simulated clock.
    now: float
    #: Pages in the ranks' shared L3 pool; None without --l3.
    l3_pages: int | None
    #: Text prompts and chats this sim-worker tokenized itself (prompts given as token ids are
    #: not), so a test sees whether a router handed its ids over.
    tokenized_prompts: int = 0
    served: ServedTokens = msgspec.field(default_factory=ServedTokens)
