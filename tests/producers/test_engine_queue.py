"""Reading the engine's own queue from its Prometheus text (producers/engine_queue.py)."""

from __future__ import annotations

from kvtier.producers.engine_queue import engine_queue

# SGLang's own lines (one scheduler), as served with --enable-metrics
SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 7.0
sglang:gen_throughput{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 12.5
"""

PER_RANK = """sglang:num_queue_reqs{model_name="m",dp_rank="0"} 2
sglang:num_running_reqs{model_name="m",dp_rank="0"} 1
sglang:num_queue_reqs{model_name="m",dp_rank="1"} 5
sglang:num_running_reqs{model_name="m",dp_rank="1"} 4
"""


def test_one_scheduler_without_a_rank_label_is_the_workers_queue():
    assert engine_queue(SGLANG, dp_rank=0, dp_size=1) == (7, 3)


def test_each_dp_rank_reads_its_own_samples():
    assert engine_queue(PER_RANK, dp_rank=0, dp_size=2) == (2, 1)
    assert engine_queue(PER_RANK, dp_rank=1, dp_size=2) == (5, 4)
    assert engine_queue(PER_RANK, dp_rank=2, dp_size=3) is None  # no sample of that rank


def test_what_cannot_be_told_apart_or_read_is_none():
    # several ranks behind one unlabelled total: no rank's share can be told
    assert engine_queue(SGLANG, dp_rank=0, dp_size=2) is None
    assert engine_queue("", dp_rank=0, dp_size=1) is None
    assert engine_queue("sglang:gen_throughput 5\n", dp_rank=0, dp_size=1) is None
    # a NaN or negative sample says nothing; the other gauge still counts
    assert engine_queue("sglang:num_queue_reqs NaN\nsglang:num_running_reqs 2\n", 0, 1) == (0, 2)
    assert engine_queue("sglang:num_queue_reqs -1\n", 0, 1) is None
