"""Offline bounds on what any routing policy can reuse on a trace, for the cluster's memory.

- `infinite`: one cache that never forgets: every request reuses the longest page prefix any
  earlier request had. No policy on any cluster recomputes less.
- `pooled_lru`: one LRU cache with the whole cluster's capacity (every worker's device and
  host pages, plus the L3 pool when there is one), as if all workers were one. A router
  spreads requests over separate caches, so it rarely gets this much; when even this is
  close to nothing, the trace's reuse lies farther back than the cluster can remember and no
  policy can differ much.

Both count recomputed prompt tokens (a trailing partial page is always recomputed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.eval.trace import PreparedRequest
from kvtier.schemas.hashes import PageDigest
from kvtier.sim.sim_cluster import ClusterShape


@dataclass(frozen=True)
class Bound:
    recomputed_tokens: int
    prompt_tokens: int

    @property
    def reused_share(self) -> float:
        return 1 - self.recomputed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_json(self) -> dict:
        return {"recomputed_tokens": self.recomputed_tokens, "reused_pct": round(100 * self.reused_share, 2)}


def _prefix_hit(digests: list[PageDigest], cache) -> int:
    hit = 0
    while hit < len(digests) and digests[hit] in cache:
        hit += 1
    return hit


def infinite_cache(requests: Iterable[PreparedRequest], page_size: int) -> Bound:
    seen: set[PageDigest] = set()
    recomputed = prompt = 0
    for request in requests:
        hit = _prefix_hit(request.digests, seen)
        seen.update(request.digests)
        recomputed += request.input_tokens - hit * page_size
        prompt += request.input_tokens
    return Bound(recomputed, prompt)


def pooled_lru(requests: Iterable[PreparedRequest], page_size: int, capacity_pages: int) -> Bound:
    """One LRU of `capacity_pages` pages. A request's pages are touched leaf first, so a
    prefix's first pages are always the most recent and eviction never strands a suffix."""
    cache: OrderedDict[PageDigest, None] = OrderedDict()
    recomputed = prompt = 0
    for request in requests:
        hit = _prefix_hit(request.digests, cache)
        recomputed += request.input_tokens - hit * page_size
        prompt += request.input_tokens
        for digest in reversed(request.digests[:capacity_pages]):
            cache[digest] = None
            cache.move_to_end(digest)
        while len(cache) > capacity_pages:
            cache.popitem(last=False)
    return Bound(recomputed, prompt)


def cluster_capacity_pages(shape: ClusterShape) -> int:
    return shape.workers * (shape.device_pages + shape.host_pages) + (shape.l3_capacity if shape.l3 else 0)


def bounds(requests: list[PreparedRequest], shape: ClusterShape) -> dict[str, Bound]:
    return {"infinite": infinite_cache(requests, shape.page_size),
            "pooled_lru": pooled_lru(requests, shape.page_size, cluster_capacity_pages(shape))}
