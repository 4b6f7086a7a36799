"""The simulated HiCache worker: exact event sequences per write policy, timing, L3, and
invariants under a seeded random workload, always checked against the reference model."""

from __future__ import annotations

import random

import pytest

from kvtier.schemas.hashes import block_hash_of_digest, sglang_block_hashes, sglang_page_digests
from kvtier.schemas.sglang import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.schemas.tiers import Tier
from kvtier.sim.cost_model import CostModel
from kvtier.sim.hicache_sim import (
    _NONE,
    GPU,
    HOST,
    WRITE_POLICIES,
    HiCacheSim,
    InMemorySharedPool,
    SimConfig,
)
from kvtier.sim.synthetic import ReferenceModel

PS = 4
A = list(range(10))  # two full pages and a partial one
B = list(range(100, 110))
C = list(range(200, 210))
a0, a1 = sglang_block_hashes(A, PS)
b0, b1 = sglang_block_hashes(B, PS)
c0, c1 = sglang_block_hashes(C, PS)
WT, WTS, WB = WRITE_POLICIES


def summary(events):
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("S", e.medium, list(e.block_hashes)))
        elif isinstance(e, BlockRemoved):
            out.append(("R", e.medium, list(e.block_hashes)))
        else:
            out.append(("clear",))
    return out


def check_invariants(sim: HiCacheSim) -> None:
    cfg = sim.config
    device = host = 0
    for digest, nd in sim._nodes.items():
        assert nd.alive and nd.digest == digest
        assert nd.parent is sim._root or sim._nodes.get(nd.parent.digest) is nd.parent
        assert nd.parent.children[digest] is nd
        if nd.on_device:
            assert nd.parent.on_device, "device residency must be prefix-closed"
            device += 1
        else:
            assert nd.host != _NONE, "a node off device must be on host (or on its way there)"
        host += nd.host != _NONE
    assert device == sim._device_used <= cfg.device_pages
    assert host == sim._host_used <= cfg.host_pages


class Harness:
    """Drives a sim; after every step applies the drained events to a ReferenceModel one by
    one and checks: state equals sim.tiers(), stores carry true hash chains, no page kept by
    the worker was ever invisible (write-through), and the tree invariants."""

    def __init__(self, sim: HiCacheSim):
        self.sim = sim
        self.ref = ReferenceModel()
        self.digest_of: dict[int, bytes] = {}
        self.log: list = []

    def _learn(self, tokens):
        for dg in sglang_page_digests(tokens, self.sim.config.page_size):
            self.digest_of[block_hash_of_digest(dg)] = dg

    def serve(self, tokens, now):
        self._learn(tokens)
        result = self.sim.serve(tokens, now)
        assert (result.device_hit_pages + result.host_hit_pages + result.l3_hit_pages
                + result.recomputed_pages == result.pages == len(tokens) // self.sim.config.page_size)
        assert result.recomputed_tokens == len(tokens) - (result.pages - result.recomputed_pages) * PS
        assert 0 <= result.queue_s <= result.ttft_s
        return result, self._check()

    def advance(self, now):
        self.sim.advance(now)
        return self._check()

    def reset(self):
        self.sim.reset()
        return self._check()

    def _check(self):
        events = self.sim.drain_events()
        final = self.sim.tiers()
        for e in events:
            if isinstance(e, BlockStored):
                ps = self.sim.config.page_size
                assert e.block_size == ps and len(e.token_ids) == ps * len(e.block_hashes)
                parent = None if e.parent_block_hash is None else self.digest_of[e.parent_block_hash]
                assert sglang_block_hashes(e.token_ids, ps, parent) == e.block_hashes
            if (isinstance(e, BlockRemoved) and e.medium == GPU
                    and self.sim.config.write_policy != WB):
                for h in e.block_hashes:
                    if Tier.HOST not in self.ref.pages.get(h, set()):
                        assert h not in final, "page left device before its host copy was visible"
            self.ref.apply([e])
        assert self.ref.pages == final
        check_invariants(self.sim)
        self.log.extend(events)
        return summary(events)


def cost(prefill_s_per_token=0.0001, load_back_s_per_page=0.00005, l3_s_per_page=0.0002) -> CostModel:
    """A cost model in the units these tests think in (seconds per token or per page of PS
    tokens); decode costs nothing."""
    kv = 250_000_000  # bytes per token: a page of PS = 4 tokens is 1 GB
    page_gb = kv * PS / 1e9
    def rate(per_unit: float) -> float:
        return 1 / per_unit if per_unit else float("inf")

    return CostModel(kv_bytes_per_token=kv, prefill_tokens_per_s=rate(prefill_s_per_token),
                     host_to_device_gb_s=page_gb * rate(load_back_s_per_page),
                     l3_read_gb_s=page_gb * rate(l3_s_per_page), weight_bytes=0.0, hbm_gb_s=1e9)


def make(policy=WT, prefill_s_per_token=0.0001, load_back_s_per_page=0.00005, **kw):
    kw.setdefault("page_size", PS)
    kw.setdefault("dma_delay_s", 0.002)
    return Harness(HiCacheSim(SimConfig(write_policy=policy, cost=cost(prefill_s_per_token, load_back_s_per_page),
                                        **kw)))


# --- exact sequences per policy ---------------------------------------------------------------
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_first_insert(policy):
    h = make(policy, device_pages=8, host_pages=8, prefill_s_per_token=0.001)
    result, events = h.serve(A, 0.0)
    assert events == [("S", GPU, [a0, a1])]
    stored = h.log[0]
    assert stored.parent_block_hash is None and stored.token_ids == A[:8] and stored.block_size == PS
    assert (result.pages, result.device_hit_pages, result.recomputed_pages, result.recomputed_tokens) == (2, 0, 2, 10)
    assert result.ttft_s == pytest.approx(0.010)
    assert h.advance(0.0019) == []  # the copy has not landed yet
    assert h.advance(0.002) == ([("S", HOST, [a0, a1])] if policy == WT else [])
    assert h.sim.tiers()[a0] == ({Tier.DEVICE, Tier.HOST} if policy == WT else {Tier.DEVICE})


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_repeat_hit(policy):
    h = make(policy, device_pages=8, host_pages=8, selective_threshold=2)
    h.serve(A, 0.0)
    h.advance(1.0)
    result, events = h.serve(A, 1.0)
    assert events == []
    assert (result.device_hit_pages, result.recomputed_pages, result.recomputed_tokens) == (2, 0, 2)
    assert h.advance(1.1) == []  # one hit: below the selective threshold
    _, events = h.serve(A, 2.0)
    assert events == []  # a copy started, but readers see it only when it lands
    assert h.advance(2.002) == ([("S", HOST, [a0, a1])] if policy == WTS else [])


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_device_eviction_under_pressure(policy):
    h = make(policy, device_pages=2, host_pages=8)
    h.serve(A, 0.0)
    _, events = h.serve(B, 1.0)
    evict_new = [("R", GPU, [a1, a0]), ("S", GPU, [b0, b1])]  # LRU leaf first
    if policy == WT:
        assert events == [("S", HOST, [a0, a1])] + evict_new  # host copy before the device one goes
        assert h.sim.tiers()[a0] == {Tier.HOST}
    elif policy == WTS:
        assert events == evict_new  # never copied: the pages leave the worker
        assert a0 not in h.sim.tiers()
    else:
        assert events == evict_new  # write_back: remove(GPU) first ...
        assert a0 not in h.sim.tiers()  # ... the staged copy is invisible until it lands
        assert h.advance(1.0019) == []
        assert h.advance(1.002) == [("S", HOST, [a0, a1])]
        assert h.sim.tiers()[a1] == {Tier.HOST}


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_load_back_on_host_hit(policy):
    h = make(policy, device_pages=2, host_pages=8, prefill_s_per_token=0.001, load_back_s_per_page=0.0001)
    h.serve(A, 0.0)
    h.serve(B, 1.0)
    result, events = h.serve(A, 2.0)
    if policy == WTS:  # A was dropped: recomputed, and B (never copied) is dropped in turn
        assert events == [("R", GPU, [b1, b0]), ("S", GPU, [a0, a1])]
        assert (result.host_hit_pages, result.recomputed_pages) == (0, 2)
        return
    head = [("S", HOST, [b0, b1])] if policy == WT else [("S", HOST, [a0, a1])]
    assert events == head + [("R", GPU, [b1, b0]), ("S", GPU, [a0, a1])]
    assert h.log[-1].parent_block_hash is None and h.log[-1].token_ids == A[:8]
    assert (result.device_hit_pages, result.host_hit_pages, result.recomputed_pages,
            result.recomputed_tokens) == (0, 2, 0, 2)
    assert result.ttft_s == pytest.approx(2 * 0.0001 + 2 * 0.001)
    assert h.sim.tiers()[a0] == {Tier.DEVICE, Tier.HOST}  # load back keeps the host copy
    if policy == WB:
        assert h.advance(2.002) == [("S", HOST, [b0, b1])]


def test_device_prefix_host_continuation_and_new_pages_chain():
    h = make(WT, device_pages=3, host_pages=8)
    h.serve(A, 0.0)
    _, events = h.serve(B, 1.0)  # one page of room missing: only a1 (the LRU leaf) goes
    assert events == [("S", HOST, [a0, a1]), ("R", GPU, [a1]), ("S", GPU, [b0, b1])]
    longer = A[:8] + list(range(50, 58))
    x2, x3 = sglang_block_hashes(longer, PS)[2:]
    result, events = h.serve(longer, 2.0)
    # a0 on device, a1 on host, x2/x3 new: three pages wanted, B's two can go, x3 cannot fit.
    assert events == [("S", HOST, [b0, b1]), ("R", GPU, [b1, b0]), ("S", GPU, [a1, x2])]
    assert h.log[-1].parent_block_hash == a0
    assert (result.device_hit_pages, result.host_hit_pages, result.recomputed_pages) == (1, 1, 2)
    assert result.recomputed_tokens == 8
    assert h.sim.tiers()[a1] == {Tier.DEVICE, Tier.HOST} and x3 not in h.sim.tiers()


# --- host pressure -----------------------------------------------------------------------------
def test_host_pressure_write_back_removes_host_before_device():
    h = make(WB, device_pages=2, host_pages=2)
    h.serve(A, 0.0)
    h.serve(B, 1.0)
    h.advance(1.5)  # A staged and landed: host is full
    _, events = h.serve(C, 2.0)
    assert events == [("R", HOST, [a1, a0]), ("R", GPU, [b1, b0]), ("S", GPU, [c0, c1])]
    assert h.advance(2.002) == [("S", HOST, [b0, b1])]


def test_host_short_write_back_stages_ancestors_first():
    h = make(WB, device_pages=2, host_pages=1)
    h.serve(A, 0.0)
    _, events = h.serve(B, 1.0)
    assert events == [("R", GPU, [a1, a0]), ("S", GPU, [b0, b1])]
    assert h.advance(1.002) == [("S", HOST, [a0])]  # a1 had no room and was dropped
    _, events = h.serve(C, 2.0)
    assert events == [("R", HOST, [a0]), ("R", GPU, [b1, b0]), ("S", GPU, [c0, c1])]
    assert h.advance(2.002) == [("S", HOST, [b0])]


def test_host_pressure_write_through():
    h = make(WT, device_pages=2, host_pages=2)
    h.serve(A, 0.0)
    _, events = h.serve(B, 1.0)
    assert events == [("S", HOST, [a0, a1]), ("R", GPU, [a1, a0]), ("S", GPU, [b0, b1]), ("R", HOST, [a1, a0])]
    assert h.advance(1.002) == [("S", HOST, [b0, b1])]


def test_host_full_of_device_pages_skips_the_copy():
    h = make(WT, device_pages=4, host_pages=2)
    h.serve(A, 0.0)
    h.advance(0.5)
    h.serve(B, 1.0)  # host holds A's copies, which are on device too: nothing to evict
    assert h.advance(1.5) == []
    _, events = h.serve(C, 2.0)  # A is LRU: it leaves device and keeps its host copy ...
    assert events == [("R", GPU, [a1, a0]), ("S", GPU, [c0, c1]), ("R", HOST, [a1, a0])]
    assert h.advance(2.002) == [("S", HOST, [c0, c1])]  # ... until C's copies need the room
    assert h.sim.tiers()[b0] == {Tier.DEVICE}  # B never got a copy


def test_selective_host_pressure():
    h = make(WTS, device_pages=2, host_pages=2, selective_threshold=1)
    h.serve(A, 0.0)
    h.serve(A, 0.1)  # first hit: A qualifies
    assert h.advance(0.2) == [("S", HOST, [a0, a1])]
    assert h.serve(B, 1.0)[1] == [("R", GPU, [a1, a0]), ("S", GPU, [b0, b1])]  # A keeps its host copy
    assert h.serve(B, 1.1)[1] == [("R", HOST, [a1, a0])]  # B qualifies: host room made from A
    assert h.advance(1.2) == [("S", HOST, [b0, b1])]


def test_pages_with_a_copy_in_flight_are_not_evicted():
    # The copy reads the device pages, so they stay until it lands; a request that finds the
    # device full of such pages waits in the queue for the copy (as SGLang's scheduler waits for
    # memory), then evicts them and is cached in full: never served short, whatever the timing.
    h = make(WT, device_pages=2, host_pages=8, prefill_s_per_token=0.001)
    h.serve(A, 0.0)
    result, events = h.serve(B, 0.0005)  # A's copy lands at 0.002
    assert events == [("S", HOST, [a0, a1]), ("R", GPU, [a1, a0]), ("S", GPU, [b0, b1])]
    assert (result.recomputed_pages, result.recomputed_tokens) == (2, 10)
    # it waited behind A's prefill (until 0.010), which outlasts the copy
    assert result.queue_s == pytest.approx(0.0095) and result.ttft_s == pytest.approx(0.0195)
    assert h.sim.tiers()[a0] == {Tier.HOST} and h.sim.tiers()[b0] == {Tier.DEVICE}


def test_waiting_for_a_copy_delays_the_request():
    # an idle engine: the only wait is the copy's
    h = make(WT, device_pages=2, host_pages=8, prefill_s_per_token=0.0)
    h.serve(A, 0.0)
    result, _ = h.serve(B, 0.0005)
    assert result.queue_s == pytest.approx(0.0015) and result.recomputed_pages == 2
    # the same arrival after the copy landed does not wait
    h2 = make(WT, device_pages=2, host_pages=8, prefill_s_per_token=0.0)
    h2.serve(A, 0.0)
    assert h2.serve(B, 0.003)[0].queue_s == 0.0


def test_a_request_that_reaches_the_engine_late_waits_only_for_copies_timed_from_it():
    # A realtime replay's ticker moves the engine's clock to where the wall says the trace is;
    # a request its driver sends late carries an earlier time. Its copies start at its own
    # time, so the next request waits for them by the trace, not by how late the driver ran.
    h = make(WT, device_pages=2, host_pages=8, prefill_s_per_token=0.0)
    h.serve(A, 0.0)
    h.sim.advance(100.0)
    h.serve(B, 1.0)  # B's copy lands at 1.002
    result, _ = h.serve(C, 1.0005)
    assert result.queue_s == pytest.approx(0.0015) and result.recomputed_pages == 2


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_no_host_tier_drops_on_eviction(policy):
    h = make(policy, device_pages=2, host_pages=0)
    h.serve(A, 0.0)
    _, events = h.serve(B, 1.0)
    assert events == [("R", GPU, [a1, a0]), ("S", GPU, [b0, b1])]
    assert h.advance(5.0) == []


def test_dropping_a_page_takes_its_host_only_descendants():
    # x1,x2 come from the pool to host, but the device has no room for them; x0 (device
    # only) is later evicted, so its host-only descendants are unreachable and go too.
    pool = InMemorySharedPool()
    cfg = dict(page_size=PS, host_pages=8, l3=True, write_policy=WTS, selective_threshold=99)
    wb = Harness(HiCacheSim(SimConfig(device_pages=1, **cfg), pool))
    wa = Harness(HiCacheSim(SimConfig(device_pages=8, **dict(cfg, write_policy=WT)), pool))
    X = list(range(300, 312))
    x0, x1, x2 = sglang_block_hashes(X, PS)
    assert wb.serve(X[:4], 0.0)[1] == [("S", GPU, [x0])]
    wa.serve(X, 0.0)
    wa.advance(0.01)
    result, events = wb.serve(X, 1.0)
    assert events == [("S", HOST, [x1, x2])]
    assert (result.device_hit_pages, result.l3_hit_pages, result.recomputed_pages) == (1, 0, 2)
    _, events = wb.serve(C[:4], 2.0)
    assert events == [("R", GPU, [x0]), ("R", HOST, [x2, x1]), ("S", GPU, [c0])]
    assert set(wb.sim.tiers()) == {c0}


# --- L3 -----------------------------------------------------------------------------------------
def test_l3_prefetch_across_two_sims():
    pool = InMemorySharedPool()
    cfg = dict(page_size=PS, device_pages=8, host_pages=8, l3=True,
               cost=cost(prefill_s_per_token=0.001, load_back_s_per_page=0.0001, l3_s_per_page=0.0005))
    wa, wb = Harness(HiCacheSim(SimConfig(**cfg), pool)), Harness(HiCacheSim(SimConfig(**cfg), pool))
    X = list(range(300, 314))  # three pages and a partial one
    x0, x1, x2 = sglang_block_hashes(X, PS)
    wa.serve(X, 0.0)
    assert len(pool) == 0  # put only once the host copy has landed
    wa.advance(0.002)
    assert len(pool) == 3 and all(pool.contains(d) for d in sglang_page_digests(X, PS))

    _, events = wb.serve(X[:4], 0.5)
    assert events == [("S", HOST, [x0]), ("S", GPU, [x0])]  # whole request from the pool
    result, events = wb.serve(X, 1.0)
    assert events == [("S", HOST, [x1, x2]), ("S", GPU, [x1, x2])]  # host store before device store
    assert wb.log[-1].parent_block_hash == x0 and wb.log[-2].parent_block_hash == x0
    assert (result.device_hit_pages, result.host_hit_pages, result.l3_hit_pages,
            result.recomputed_pages) == (1, 0, 2, 0)
    assert result.ttft_s == pytest.approx(2 * (0.0005 + 0.0001) + 2 * 0.001)
    assert wb.sim.tiers()[x2] == {Tier.DEVICE, Tier.HOST}
    assert wb.advance(2.0) == []  # already on host: nothing to copy


def test_l3_put_on_write_back_landing_and_pool_lru():
    pool = InMemorySharedPool()
    h = Harness(HiCacheSim(SimConfig(page_size=PS, device_pages=2, host_pages=8, l3=True,
                                     write_policy=WB), pool))
    h.serve(A, 0.0)
    h.serve(B, 1.0)
    assert len(pool) == 0
    h.advance(1.002)
    assert [pool.contains(d) for d in sglang_page_digests(A, PS)] == [True, True]

    small = InMemorySharedPool(capacity_pages=2)
    d1, d2, d3 = sglang_page_digests(list(range(12)), PS)
    small.put([d1, d2])
    small.put([d1])  # refresh d1
    small.put([d3])
    assert len(small) == 2 and small.contains(d1) and small.contains(d3) and not small.contains(d2)


# --- timing, merging, reset --------------------------------------------------------------------
def test_ttft_and_queueing():
    h = make(WT, device_pages=8, host_pages=8, prefill_s_per_token=0.001)
    r1, _ = h.serve(A, 0.0)
    assert (r1.queue_s, r1.ttft_s) == (0.0, pytest.approx(0.010))
    r2, _ = h.serve(B, 0.004)  # engine busy until 0.010
    assert r2.queue_s == pytest.approx(0.006) and r2.ttft_s == pytest.approx(0.016)
    r3, _ = h.serve(A, 0.012)  # busy until 0.020; device hit: 2 tail tokens
    assert r3.queue_s == pytest.approx(0.008) and r3.ttft_s == pytest.approx(0.010)
    r4, _ = h.serve(A[:3], 1.0)  # shorter than a page: nothing cached, nothing emitted
    assert (r4.pages, r4.recomputed_tokens, r4.queue_s) == (0, 3, 0.0)


def test_merging_keeps_chains_and_adjacent_removes():
    sim = HiCacheSim(SimConfig(page_size=PS, device_pages=4, host_pages=0))
    sim.serve(A, 0.0)
    sim.serve(B, 0.0)  # not a child of a1: a separate event
    sim.serve(C, 1.0)  # evicts a1,a0 (LRU) as one merged remove
    events = sim.drain_events()
    assert summary(events) == [("S", GPU, [a0, a1]), ("S", GPU, [b0, b1]),
                               ("R", GPU, [a1, a0]), ("S", GPU, [c0, c1])]
    assert events[1].parent_block_hash is None and events[1].token_ids == B[:8]
    assert sim.drain_events() == []


def test_reset_clears_and_cancels_copies():
    h = make(WT, device_pages=8, host_pages=8)
    h.serve(A, 0.0)
    assert h.reset() == [("clear",)]
    assert h.sim.tiers() == {} and h.ref.pages == {}
    assert isinstance(h.log[-1], AllBlocksCleared)
    assert h.advance(1.0) == []  # the in-flight copy died with the worker
    _, events = h.serve(A, 2.0)
    assert events == [("S", GPU, [a0, a1])]


def test_config_validation():
    with pytest.raises(ValueError):
        SimConfig(write_policy="write_around")
    with pytest.raises(ValueError):
        SimConfig(page_size=0)


# --- seeded random workload ----------------------------------------------------------------------
def _workload(seed: int, n: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(PS * rng.randint(1, 4))] for _ in range(6)]
    now = 0.0
    for _ in range(n):
        tokens = list(rng.choice(prompts))
        if rng.random() < 0.7:  # a few follow-up turns share more than the system prompt
            tokens += [rng.randrange(4) for _ in range(rng.randint(0, 3 * PS))]
        else:
            tokens += [rng.randrange(1000) for _ in range(rng.randint(0, 6 * PS))]
        now += rng.choice([0.0, 0.0005, 0.001, 0.003, 0.01])
        yield tokens, now


CONFIGS = [
    dict(write_policy=p, device_pages=dev, host_pages=host, l3=l3, dma_delay_s=dma)
    for p in WRITE_POLICIES
    for dev, host, l3, dma in [(24, 40, False, 0.002), (16, 8, False, 0.002), (24, 0, False, 0.002),
                               (20, 30, True, 0.002),
                               # requests longer than the device, copies slower than arrivals
                               (8, 12, True, 0.02)]
]


def _run(cfg):
    pool = InMemorySharedPool(capacity_pages=60) if cfg["l3"] else None
    sims = [Harness(HiCacheSim(SimConfig(page_size=PS, **cfg), pool)) for _ in range(2)]
    totals = {"device": 0, "host": 0, "l3": 0}
    for i, (tokens, now) in enumerate(_workload(seed=7, n=300)):
        result, _ = sims[i % 2].serve(tokens, now)  # two workers share the pool (L3 configs)
        totals["device"] += result.device_hit_pages
        totals["host"] += result.host_hit_pages
        totals["l3"] += result.l3_hit_pages
    for h in sims:
        h.advance(now + 1.0)
    return sims, totals


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_random_workload_invariants(cfg):
    sims, totals = _run(cfg)  # the harness checks invariants and the reference model every step
    assert totals["device"] > 0
    if cfg["host_pages"] >= 30 and cfg["write_policy"] != WTS:
        assert totals["host"] > 0
    if cfg["l3"]:
        assert totals["l3"] > 0
    if cfg["host_pages"] == 0:
        assert all(e.medium == GPU for h in sims for e in h.log)
    again, _ = _run(cfg)  # deterministic: the same workload gives the same events
    assert [h.log for h in again] == [h.log for h in sims]
