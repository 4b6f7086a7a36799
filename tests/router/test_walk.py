"""router/walk.py is the overlap walk's spec; the in-memory index (router/tier_index.py), the
replay's router model (kvtier/eval/policies.py `TierView`) and the shared pool's credit
(router/shared_pool.py, router/steps.py) must agree with it. The Lua walk in Redis is checked
against the same spec in tests/router/test_tier_state.py (it needs a Redis server)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.eval.policies import TierView
from kvtier.router.shared_pool import SharedPages
from kvtier.router.state import ModelDirectory
from kvtier.router.steps import with_shared
from kvtier.router.tier_index import TierIndex
from kvtier.router.walk import walk
from kvtier.schemas.hashes import BlockHash
from kvtier.schemas.routing import TierOverlap
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

D, H, K = Tier.DEVICE.bit, Tier.HOST.bit, Tier.DISK.bit
WALKED = (Tier.DEVICE, Tier.HOST, Tier.DISK)
WORKERS = ("w0", "w1", "w2", "w3")
PAGES = [BlockHash(p) for p in range(1, 11)]
MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK", Tier.EXTERNAL: "EXTERNAL"}


# --- the rules, by example --------------------------------------------------------------------
@pytest.mark.parametrize("held, want", [
    ({}, TierOverlap()),
    ({1: D, 2: D, 3: D, 4: H, 5: H, 6: K}, TierOverlap(device=3, host=2, disk=1)),
    # a page on device past the host stage is not counted: each stage goes on only on its tier
    ({1: D, 2: D, 3: H, 4: D | H, 5: H, 6: D}, TierOverlap(device=2, host=3)),
    # not on device from the first page: the walk starts on host
    ({1: H, 2: H | K, 3: K, 4: D}, TierOverlap(host=2, disk=1)),
    # a page on several tiers counts once, where the walk reaches it
    ({1: D | H | K, 2: H | K, 3: K}, TierOverlap(device=1, host=1, disk=1)),
    # a gap ends the walk, whatever follows
    ({2: D, 3: D}, TierOverlap()),
    # bits of other tiers (external) are not walked
    ({1: Tier.EXTERNAL.bit, 2: D}, TierOverlap()),
])
def test_the_walk_goes_device_then_host_then_disk(held, want):
    assert walk([1, 2, 3, 4, 5, 6], held) == want


def test_predicted_pages_extend_the_device_prefix_and_the_pool_counts_past_it():
    held = {1: D, 3: D, 4: H, 5: K}
    assert walk([1, 2, 3, 4, 5], held, predicted={2, 3}) == TierOverlap(device=2, predicted=1, host=1, disk=1)
    assert walk([1, 2, 3, 4, 5], held) == TierOverlap(device=1)
    pooled = [True, True, False, True, True]
    assert walk([1, 2, 3, 4, 5], held, {2}, pooled).shared_beyond == 2  # positions 3 and 4, past 1 + 2
    assert walk([1, 2, 3, 4, 5], held, pooled=pooled).shared_beyond == 3
    assert walk([], held, pooled=[]) == TierOverlap()


# --- every implementation agrees with it -----------------------------------------------------
tier = st.sampled_from(WALKED + (Tier.EXTERNAL,))
# Runs of pages in request order as often as scattered ones, so that walks go past page one.
run = st.tuples(st.integers(0, len(PAGES) - 1), st.integers(1, len(PAGES))).map(lambda r: PAGES[r[0]:r[0] + r[1]])
pages = st.one_of(run, st.lists(st.sampled_from(PAGES), max_size=8))
op = st.one_of(
    st.tuples(st.sampled_from(["store", "remove"]), st.sampled_from(WORKERS), tier, pages),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.none(), st.none()),
)
requests = st.lists(st.one_of(st.integers(0, len(PAGES)).map(lambda n: PAGES[:n]),
                              st.lists(st.sampled_from(PAGES), max_size=10, unique=True)), min_size=1, max_size=6)


def replay(ops) -> dict[str, dict[BlockHash, int]]:
    """The history as each worker's pages: page -> tier bits (the spec's input)."""
    held: dict[str, dict[BlockHash, int]] = {w: {} for w in WORKERS}
    for kind, worker, on, pages in ops:
        pages_of = held[worker]
        if kind == "clear":
            pages_of.clear()
            continue
        for page in pages:
            bits = pages_of.get(page, 0) | on.bit if kind == "store" else pages_of.get(page, 0) & ~on.bit
            if bits:
                pages_of[page] = bits
            else:
                pages_of.pop(page, None)
    return held


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), requests=requests)
def test_the_index_walks_as_the_spec(ops, requests):
    index = TierIndex()
    for kind, worker, on, pages in ops:
        if kind == "clear":
            index.clear(worker)
        elif kind == "store":
            index.store(worker, on, pages)
        else:
            index.remove(worker, on, pages)
    held = replay(ops)
    for request in requests:
        got = index.overlaps(request, WORKERS)
        assert got == {w: walk(request, held[w]) for w in WORKERS}, request


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), requests=requests,
       predicted=st.dictionaries(st.sampled_from(WORKERS), st.sets(st.sampled_from(PAGES))))
def test_the_replays_router_model_walks_as_the_spec(ops, requests, predicted):
    views = {w: TierView() for w in WORKERS}
    for kind, worker, on, pages in ops:
        if kind == "clear":
            views[worker].apply([AllBlocksCleared()])
        elif kind == "store":
            views[worker].apply([BlockStored(block_hashes=pages, parent_block_hash=None, token_ids=[], block_size=4,
                                             medium=MEDIUM[on])])
        else:
            views[worker].apply([BlockRemoved(block_hashes=pages, medium=MEDIUM[on])])
    held = replay(ops)
    for request in requests:
        for w in WORKERS:
            held_predicted = dict.fromkeys(predicted.get(w, ()), 1)  # as RouterModel holds them: page -> bookings
            want = walk(request, held[w], held_predicted)
            assert views[w].walk(request, held_predicted) == (want.device, want.host, want.disk, want.predicted)


@settings(max_examples=300, deadline=None)
@given(held=st.dictionaries(st.sampled_from(PAGES), st.integers(0, 15)), request=st.lists(st.sampled_from(PAGES)),
       predicted=st.sets(st.sampled_from(PAGES)), data=st.data())
def test_the_shared_pool_credit_counts_as_the_spec(held, request, predicted, data):
    pooled = data.draw(st.lists(st.booleans(), min_size=len(request), max_size=len(request)))
    want = walk(request, held, predicted, pooled)
    own = walk(request, held, predicted)
    layout = MooncakeLayout(tp_size=1)
    directory = ModelDirectory({"w": WorkerMetadata(worker_id="w", model="m", page_size=4, mooncake=layout)}, 0.0)
    assert with_shared("w", 4, own, directory, {4: {layout: SharedPages.of(pooled)}}) == want
