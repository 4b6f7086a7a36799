"""The overlap walk of docs/DESIGN.md §4, as one plain function: the spec.

Three implementations compute it, each shaped by where it runs: the Lua walk in Redis
(read_overlap.lua, over a worker's pages set), the in-memory index (tier_index.py, every
worker at once on bit masks) and the replay's router model (kvtier/eval/policies.py
`TierView.walk`, which calls this function). Tests check each against this one on random
page sets and requests (tests/router/test_walk.py, tests/router/test_tier_state.py); none of them is the
spec.

The walk, for one worker: from the request's first page, count the pages on device while
they are contiguous (a page not on device yet but predicted there extends that prefix and
is counted as predicted); from where that stops, go on while the page is on host; from
there, while it is on disk. Each page is counted once, at the stage that reaches it. The
shared pool then counts the request's pages it holds at positions past the device prefix
(predicted pages included): `hits_beyond(device + predicted)`. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence
from typing import TypeVar

from kvtier.schemas.routing import TierOverlap
from kvtier.schemas.tiers import Tier

Page = TypeVar("Page", bound=Hashable)

_DEVICE, _HOST, _DISK = Tier.DEVICE.bit, Tier.HOST.bit, Tier.DISK.bit


def walk(pages: Sequence[Page], held: Mapping[Page, int], predicted: Container[Page] = (),
         pooled: Sequence[bool] | None = None) -> TierOverlap:
    """One worker's overlap with a request.

    `pages`: the request's pages in order (hashes or keys: any value the other arguments use).
    `held`: the worker's pages, each to the bits of the tiers holding it (`Tier.bit`, OR'd;
    other bits are ignored). `predicted`: the pages booked onto its device but not there
    yet. `pooled`: which of the request's pages (by position) the shared pool holds; None
    when the pool is not asked (`shared_beyond` stays 0)."""
    n = len(pages)
    position = device = guessed = 0
    while position < n:
        page = pages[position]
        if held.get(page, 0) & _DEVICE:
            device += 1
        elif page in predicted:
            guessed += 1
        else:
            break
        position += 1
    after_device = position
    while position < n and held.get(pages[position], 0) & _HOST:
        position += 1
    after_host = position
    while position < n and held.get(pages[position], 0) & _DISK:
        position += 1
    beyond = sum(1 for hit in pooled[after_device:] if hit) if pooled is not None else 0
    return TierOverlap(device=device, host=after_host - after_device, disk=position - after_host,
                       predicted=guessed, shared_beyond=beyond)
