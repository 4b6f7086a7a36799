"""A simulated cluster of SGLang HiCache workers sharing one L3 pool: the ranks of
`hicache_sim.HiCacheSim`, plus what a replay needs around them. Pure: no I/O, no wall clock.

- `serve(rank, ...)` runs one request on one rank at its arrival time.
- `truth(...)` is the ground truth a router would want at a moment: every rank's tiered
  overlap with a request (device prefix, then host, then the shared pool beyond the device
  prefix) and its true queued prefill and decode pages. The oracle policy scores on it.
- Ranks may differ in speed (`worker_speeds`: one factor per rank on its prefill throughput
  and load-back bandwidths) and slow down during a trace (`slowdowns`); `ttfts(...)` is the
  TTFT each rank would give a request now, on the ground truth and its speed at the time.
- Each rank's KV events are kept with the simulated time at which SGLang would publish them:
  a request's events when its prefill has run (SGLang inserts the pages into its radix tree
  after the forward pass), a device->host copy's when it lands, never earlier than the
  rank's previous batch (a rank publishes in order). `events_until(rank, t)` hands out those
  due by `t`, so a replay can model how late routers see them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from kvtier.schemas.hashes import PageDigest
from kvtier.schemas.sglang import SglangEvent
from kvtier.sim.cost_model import CostModel
from kvtier.sim.hicache_sim import HiCacheSim, InMemorySharedPool, ServeResult, SimConfig


@dataclass(frozen=True)
class Slowdown:
    """Rank `rank` runs `factor` times its speed from `at_s` trace seconds after the first
    request on (a card that throttles, a neighbour that takes its PCIe bandwidth)."""

    rank: int
    factor: float
    at_s: float

    @classmethod
    def parse(cls, text: str) -> Slowdown:
        """RANK:FACTOR@SECONDS, e.g. 3:0.5@300."""
        try:
            rank, rest = text.split(":", 1)
            factor, at = rest.split("@", 1)
            return cls(int(rank), float(factor), float(at))
        except ValueError:
            raise ValueError(f"a slowdown is RANK:FACTOR@SECONDS (e.g. 3:0.5@300), got {text!r}") from None


def parse_speeds(text: str) -> tuple[float, ...]:
    """F,F,...: one speed factor per rank ('' : every rank at speed 1)."""
    try:
        return tuple(float(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        raise ValueError(f"worker speeds are comma-separated numbers, one per worker, got {text!r}") from None


@dataclass(frozen=True)
class ClusterShape:
    workers: int = 8
    page_size: int = 64
    device_pages: int = 2048
    host_pages: int = 16384
    write_policy: str = "write_through"
    l3: bool = True
    l3_pages: int | None = None  # None: as many as the workers' host pools together
    dma_delay_s: float = 0.002
    cost: CostModel = field(default_factory=CostModel)
    #: One factor per rank on its prefill throughput and load-back bandwidths; (): all 1.
    worker_speeds: tuple[float, ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.worker_speeds and len(self.worker_speeds) != self.workers:
            raise ValueError(f"worker speeds give {len(self.worker_speeds)} factors for {self.workers} workers: "
                             "one per worker")
        if any(not speed > 0 for speed in self.worker_speeds):
            raise ValueError(f"worker speeds must be > 0, got {','.join(map(str, self.worker_speeds))}")
        for slow in self.slowdowns:
            if not 0 <= slow.rank < self.workers or not slow.factor > 0 or slow.at_s < 0:
                raise ValueError(f"slowdown {slow.rank}:{slow.factor}@{slow.at_s}: the rank must be one of the "
                                 f"{self.workers} workers, the factor > 0 and the time >= 0")

    @property
    def heterogeneous(self) -> bool:
        return any(speed != 1.0 for speed in self.worker_speeds) or bool(self.slowdowns)

    def speed(self, rank: int, since_start_s: float) -> float:
        """Rank `rank`'s speed factor `since_start_s` trace seconds after the first request."""
        factor = self.worker_speeds[rank] if self.worker_speeds else 1.0
        for slow in self.slowdowns:
            if slow.rank == rank and since_start_s >= slow.at_s:
                factor *= slow.factor
        return factor

    @property
    def l3_capacity(self) -> int:
        return self.l3_pages if self.l3_pages is not None else self.workers * self.host_pages

    def sim_config(self, emit_events: bool = True, event_token_ids: bool = True) -> SimConfig:
        return SimConfig(page_size=self.page_size, device_pages=self.device_pages, host_pages=self.host_pages,
                         write_policy=self.write_policy, dma_delay_s=self.dma_delay_s, l3=self.l3, cost=self.cost,
                         emit_events=emit_events, event_token_ids=event_token_ids)


@dataclass(frozen=True)
class RankTruth:
    """One rank at one moment, in pages."""

    device: int
    host: int
    shared_beyond: int  # pool pages at positions >= device (0 without L3)
    prefill_pages: int  # queued prefill work not yet at its first token
    decode_pages: int  # prompt + output pages of the requests decoding now


class SimCluster:
    def __init__(self, shape: ClusterShape, emit_events: bool = True, event_token_ids: bool = True):
        """`emit_events=False`: keep no KV events (a replay that only needs outcomes);
        `event_token_ids=False`: events without token ids (a reader that needs only hashes)."""
        self.shape = shape
        self.pool = InMemorySharedPool(shape.l3_capacity) if shape.l3 else None
        config = shape.sim_config(emit_events, event_token_ids)
        self.ranks = [HiCacheSim(replace(config, cost=shape.cost.at_speed(shape.speed(rank, 0.0))), self.pool)
                      for rank in range(shape.workers)]
        self._start: float | None = None  # the first request's time: slowdowns count from it
        self._slowed = [False] * len(shape.slowdowns)
        self._stamped: list[deque[tuple[float, list[SglangEvent]]]] = [deque() for _ in self.ranks]
        self._last_stamp = [float("-inf")] * shape.workers

    # --- time and events -------------------------------------------------------------------
    def _stamp(self, rank: int, at: float) -> None:
        events = self.ranks[rank].drain_events()
        if events:
            at = max(at, self._last_stamp[rank])
            self._last_stamp[rank] = at
            self._stamped[rank].append((at, events))

    def _slow_down(self, now: float) -> None:
        """Apply the slowdowns due by `now` (each once, at the first moment the replay reaches)."""
        if self._start is None:
            self._start = now
        for k, slow in enumerate(self.shape.slowdowns):
            if not self._slowed[k] and now - self._start >= slow.at_s:
                self._slowed[k] = True
                self.ranks[slow.rank].set_cost(self.shape.cost.at_speed(self.shape.speed(slow.rank, now - self._start)))

    def speed(self, rank: int, now: float) -> float:
        """Rank `rank`'s true speed factor at `now` (what a router would have to learn)."""
        return self.shape.speed(rank, now - (self._start if self._start is not None else now))

    def advance(self, now: float) -> None:
        """Land every copy due by `now`, each rank's in landing order, stamped when it lands."""
        if self.shape.slowdowns:
            self._slow_down(now)
        for rank, sim in enumerate(self.ranks):
            while (landing := sim.next_landing()) is not None and landing <= now:
                sim.advance(landing)
                self._stamp(rank, landing)
            sim.advance(now)

    def serve(self, rank: int, token_ids, now: float, output_tokens: int = 0,
              digests: list[PageDigest] | None = None) -> ServeResult:
        self.advance(now)
        result = self.ranks[rank].serve(token_ids, now, output_tokens, digests)
        self._stamp(rank, now + result.ttft_s)  # published once its prefill has run
        return result

    def events_until(self, rank: int, t: float) -> list[list[SglangEvent]]:
        """The rank's event batches due by `t`, oldest first (each one engine batch)."""
        queue, due = self._stamped[rank], []
        while queue and queue[0][0] <= t:
            due.append(queue.popleft()[1])
        return due

    def next_event_at(self, rank: int) -> float | None:
        queue = self._stamped[rank]
        return queue[0][0] if queue else None

    # --- ground truth ----------------------------------------------------------------------
    def truth(self, digests: list[PageDigest], now: float) -> list[RankTruth]:
        """Every rank's overlap and load at `now` (call `advance(now)` first)."""
        pooled = [self.pool.contains(d) for d in digests] if self.pool is not None else None
        out = []
        for sim in self.ranks:
            device, host = sim.overlap(digests)
            beyond = sum(pooled[device:]) if pooled is not None else 0
            out.append(RankTruth(device=device, host=host, shared_beyond=beyond,
                                 prefill_pages=sim.engine.queued_prefill_pages(now),
                                 decode_pages=sim.engine.decode_pages(now)))
        return out

    def ttfts(self, digests: list[PageDigest], prompt_tokens: int, now: float) -> list[float]:
        """The TTFT each rank would give this request at `now` (call `advance(now)` first)."""
        return [sim.ttft_if_served(digests, prompt_tokens, now) for sim in self.ranks]

    def utilisation(self, span_s: float) -> list[float]:
        """Each rank's prefill busy time over `span_s` of simulated time."""
        return [sim.engine.busy_s / span_s if span_s > 0 else 0.0 for sim in self.ranks]
