"""The simulated engine's own queue, counted as SGLang's `/metrics` counts it
(`sglang:num_queue_reqs`, `sglang:num_running_reqs`), in process and over the sim-worker's HTTP."""

from __future__ import annotations

import re
import urllib.request

from kvtier.harness.embedded import free_port
from kvtier.sim.hicache_sim import HiCacheSim, SimConfig
from kvtier.sim.sim_worker import free_port_block

from ..helpers import KvtierProcess, stop_all, wait_until
from ..router_helpers import answers, http

PAGE = 64


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(pages * PAGE)]


def test_waiting_and_running_requests_follow_the_engines_clock():
    sim = HiCacheSim(SimConfig(page_size=PAGE, device_pages=4096, host_pages=4096))
    first = sim.serve(prompt(1, 64), 0.0, output_tokens=50)
    second = sim.serve(prompt(2, 64), 0.0, output_tokens=50)
    third = sim.serve(prompt(3, 64), 0.0, output_tokens=50)
    assert 0 < first.ttft_s < second.ttft_s < third.ttft_s  # prefills one after another
    counts = sim.engine.request_counts
    assert counts(first.ttft_s / 2) == (2, 1)  # the first in prefill, two waiting
    assert counts((first.ttft_s + second.ttft_s) / 2) == (1, 2)  # the first decodes, the second prefills
    assert counts((second.ttft_s + third.ttft_s) / 2) == (0, 3)
    assert counts(max(r.complete_at for r in (first, second, third)) + 1) == (0, 0)  # all done


def gauges(text: str) -> dict[tuple[str, str], float]:
    found = {}
    for name, rank, value in re.findall(r'^(sglang:num_\w+)\{model_name="sim",dp_rank="(\d+)"\} (\S+)$', text,
                                        re.MULTILINE):
        found[(name, rank)] = float(value)
    return found


def test_the_sim_worker_serves_the_queue_gauges_per_rank():
    zmq_base, replay_base, http_port = free_port_block(2), free_port_block(2), free_port()
    sim = KvtierProcess("sim-worker", "--ranks", "2", "--port", str(zmq_base), "--replay-port", str(replay_base),
                        "--http-port", str(http_port), "--page-size", str(PAGE))
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: answers(url + "/healthz"), timeout=20, what=lambda: sim.output()[-2000:])
        # three long prompts at the same simulated moment on rank 0: seconds of prefill each,
        # so the wall time between them and the read below cannot move anything on
        for seed in range(3):
            status, body, _ = http("POST", f"{url}/w/0/generate", {"input_ids": prompt(seed, 512), "now": 0.0})
            assert status == 200, body
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            found = gauges(reply.read().decode())
        assert found == {("sglang:num_queue_reqs", "0"): 2, ("sglang:num_running_reqs", "0"): 1,
                         ("sglang:num_queue_reqs", "1"): 0, ("sglang:num_running_reqs", "1"): 0}, found
    finally:
        stop_all(sim)
