"""Heterogeneous clusters: a worker's speed factor scales its prefill and load-back costs (not
decode), a slowdown takes effect at its trace time, and the what-if TTFT the TTFT oracle reads
equals what serving the request then costs."""

from __future__ import annotations

import pytest

from kvtier.schemas.hashes import sglang_page_digests
from kvtier.sim.cost_model import CostModel
from kvtier.sim.sim_cluster import ClusterShape, SimCluster, Slowdown, parse_speeds

PAGE = 64
PROMPT = list(range(1000, 1000 + 100 * PAGE))  # 100 pages: 0.32 s of prefill at speed 1


def shape(**kwargs) -> ClusterShape:
    return ClusterShape(**{"workers": 2, "page_size": PAGE, "device_pages": 400, "host_pages": 400, "l3": False,
                           **kwargs})


def test_a_speed_factor_scales_prefill_and_load_back_but_not_decode():
    base = CostModel()
    half = base.at_speed(0.5)
    assert half.prefill_tokens_per_s == base.prefill_tokens_per_s / 2
    assert half.host_to_device_gb_s == base.host_to_device_gb_s / 2 and half.l3_read_gb_s == base.l3_read_gb_s / 2
    assert half.hbm_gb_s == base.hbm_gb_s and half.weight_bytes == base.weight_bytes
    assert base.at_speed(1.0) is base
    with pytest.raises(ValueError, match="speed factor must be > 0"):
        base.at_speed(0.0)


def test_the_same_request_takes_twice_as_long_on_a_half_speed_worker():
    cluster = SimCluster(shape(worker_speeds=(1.0, 0.5)))
    fast = cluster.serve(0, PROMPT, 0.0)
    slow = cluster.serve(1, PROMPT, 0.0)
    assert fast.ttft_s == pytest.approx(len(PROMPT) / 20000)
    assert slow.ttft_s == pytest.approx(2 * fast.ttft_s)
    assert cluster.speed(0, 5.0) == 1.0 and cluster.speed(1, 5.0) == 0.5


def test_a_slowdown_starts_at_its_trace_time_counted_from_the_first_request():
    cluster = SimCluster(shape(slowdowns=(Slowdown(rank=1, factor=0.5, at_s=300.0),)))
    start = 1000.0  # trace clocks need not start at 0
    cluster.serve(0, [1, 2, 3], start)  # the first request
    before = cluster.serve(1, PROMPT, start + 299.0)
    after = cluster.serve(1, list(range(900_000, 900_000 + len(PROMPT))), start + 301.0)
    assert after.ttft_s == pytest.approx(2 * before.ttft_s)
    assert cluster.speed(1, start + 299.0) == 1.0 and cluster.speed(1, start + 301.0) == 0.5
    assert cluster.speed(0, start + 301.0) == 1.0


def test_the_what_if_ttft_is_what_serving_then_costs():
    cluster = SimCluster(shape(worker_speeds=(1.0, 0.5)))
    cluster.serve(0, PROMPT, 0.0, output_tokens=50)  # rank 0 now holds the prompt and decodes
    longer = PROMPT + list(range(5, 5 + 20 * PAGE))
    digests = sglang_page_digests(longer, PAGE)
    now = 0.1  # rank 0's prefill is still running: a new one waits for it
    cluster.advance(now)
    predicted = cluster.ttfts(digests, len(longer), now)
    assert predicted[0] == pytest.approx(0.32 - now + 20 * PAGE / 20000)  # waits, then 20 pages
    assert predicted[1] == pytest.approx(2 * len(longer) / 20000)  # all 120 pages at half speed
    for rank in (1, 0):
        assert cluster.serve(rank, longer, now, digests=digests).ttft_s == pytest.approx(predicted[rank])


def test_bad_speeds_and_slowdowns_are_refused_with_what_is_wrong():
    assert parse_speeds("") == () and parse_speeds("1,0.5") == (1.0, 0.5)
    with pytest.raises(ValueError, match="comma-separated numbers"):
        parse_speeds("1,fast")
    with pytest.raises(ValueError, match="3 factors for 2 workers"):
        shape(worker_speeds=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="must be > 0"):
        shape(worker_speeds=(1.0, 0.0))
    assert Slowdown.parse("3:0.5@300") == Slowdown(3, 0.5, 300.0)
    with pytest.raises(ValueError, match="RANK:FACTOR@SECONDS"):
        Slowdown.parse("3@300")
    with pytest.raises(ValueError, match="one of the 2 workers"):
        shape(slowdowns=(Slowdown(5, 0.5, 10.0),))
