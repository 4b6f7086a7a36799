"""The simulated HiCache cluster end to end: `kvtier sim-worker` -> real `kvtier bridge` ->
JetStream -> `kvtier processor` -> Redis holds exactly the simulator's own view; trace replay
orders policies as the formula predicts; `kvtier demo` completes and writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.consumers.apply import read_worker_pages
from kvtier.eval.bounds import infinite_cache
from kvtier.eval.trace import TraceRequest, block_tokens, load_trace, prepare, trace_tokens
from kvtier.harness.embedded import free_port
from kvtier.sim.sim_worker import free_port_block

from ..helpers import KvtierProcess, processor_process, stop_all, wait_until, worker_announced
from ..router_helpers import answers, http

MODEL = "sim-model"


def tiers_of(url: str, rank: int) -> dict[int, set[str]]:
    status, body, _ = http("GET", f"{url}/w/{rank}/tiers")
    assert status == 200
    return {h: set(t) for h, t in body}


def redis_view(client, worker: str) -> dict[int, set[str]]:
    return {h: {t.value for t in tiers} for h, tiers in read_worker_pages(client, MODEL, worker).items()}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_redis_reproduces_the_simulators_own_view(policy, nats_server, redis_server, redis_client):
    ranks = 2
    zmq_base, replay_base, http_port = free_port_block(ranks), free_port_block(ranks), free_port()
    sim = KvtierProcess("sim-worker", "--ranks", str(ranks), "--port", str(zmq_base), "--replay-port",
                        str(replay_base), "--http-port", str(http_port), "--page-size", "4", "--device-pages", "24",
                        "--host-pages", "40", "--write-policy", policy, "--l3")
    url = f"http://127.0.0.1:{http_port}"
    bridge = KvtierProcess("bridge", "--endpoint", f"tcp://127.0.0.1:{zmq_base}", "--replay-endpoint",
                           f"tcp://127.0.0.1:{replay_base}", "--worker-id", "sim", "--model", MODEL, "--page-size",
                           "4", "--dp-size", str(ranks), "--nats", nats_server.url)
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: answers(url + "/healthz"), timeout=20, what=lambda: sim.output()[-2000:])
        wait_until(lambda: all(worker_announced(redis_client, MODEL, f"sim-dp{r}") for r in range(ranks)), timeout=30)
        # conversations that share prefixes, grow and get evicted: stores, copies, load_backs, evictions
        now = 0.0
        for turn in range(30):
            for rank in range(ranks):
                conversation = [hid for hid in range(turn % 5 + 1)]
                tokens = [t for hid in conversation for t in block_tokens(hid + 100 * rank)[:16]]
                tokens += list(range(turn * 8, turn * 8 + 5 + turn % 7))
                now += 0.01
                status, body, _ = http("POST", f"{url}/w/{rank}/generate", {"input_ids": tokens, "now": now})
                assert status == 200, body
                assert body["meta_info"]["arrived_behind_s"] == 0.0
        # a request that reaches rank 0 after a later one says by how much it is out of order
        status, body, _ = http("POST", f"{url}/w/0/generate", {"input_ids": [1, 2, 3], "now": now - 0.25})
        assert status == 200 and abs(body["meta_info"]["arrived_behind_s"] - 0.24) < 1e-9, body
        http("POST", url + "/advance", {"now": now + 1.0})  # every pending copy lands
        for rank in range(ranks):
            expected = tiers_of(url, rank)
            assert expected and any("host" in t for t in expected.values())
            # wait_until calls the lambdas in this iteration, before the loop variables move on
            wait_until(lambda: redis_view(redis_client, f"sim-dp{rank}") == expected, timeout=30,  # noqa: B023
                       what=lambda: f"rank {rank}: Redis {len(redis_view(redis_client, f'sim-dp{rank}'))} pages, "  # noqa: B023
                                    f"sim {len(expected)}")  # noqa: B023
    finally:
        stop_all(bridge, processor, sim)


def test_trace_tokens_keep_prefix_sharing_and_lengths(tmp_path):
    a = TraceRequest(timestamp=0, input_length=700, output_length=5, hash_ids=[7, 8])
    b = TraceRequest(timestamp=1, input_length=1024, output_length=5, hash_ids=[7, 9])
    ta, tb = trace_tokens(a), trace_tokens(b)
    assert len(ta) == 700 and len(tb) == 1024
    assert ta[:512] == tb[:512] and ta[512:] != tb[512:700]
    assert trace_tokens(a) == ta  # deterministic
    # b reuses a's first block: 8 pages of 64; everything else is recomputed
    assert infinite_cache(prepare([a, b], 64), 64).recomputed_tokens == 700 + (1024 - 512)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                          "output_length": r.output_length, "hash_ids": r.hash_ids}) for r in (a, b)))
    assert load_trace(str(path)) == [a, b]
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="not a Mooncake trace record"):
        load_trace(str(path))


def crafted_trace(path) -> None:
    """Four conversations, each revisited after others have pushed it out of device memory
    (it stays on the host tier of the worker that served it)."""
    lines, t, filler = [], 0, 10_000
    for turn in range(4):
        for conversation in range(4):
            ids = [conversation * 100 + k for k in range(3 + turn)]
            lines.append({"timestamp": t, "input_length": len(ids) * 512, "output_length": 20, "hash_ids": ids})
            t += 400
            for _ in range(2):  # unrelated requests that evict device pages
                lines.append({"timestamp": t, "input_length": 3 * 512, "output_length": 20,
                              "hash_ids": [filler, filler + 1, filler + 2]})
                filler += 3
                t += 400
        # one more, so a turn is an odd number of requests and round robin cannot stay lucky
        lines.append({"timestamp": t, "input_length": 512, "output_length": 20, "hash_ids": [filler]})
        filler += 1
        t += 400
    path.write_text("\n".join(json.dumps(line) for line in lines))


@pytest.mark.slow
def test_policies_order_as_the_formula_predicts(tmp_path):
    trace = tmp_path / "crafted.jsonl"
    crafted_trace(trace)
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "replay", "--trace", str(trace), "--workers", "2",
         "--page-size", "64", "--device-pages", "56", "--host-pages", "2048",
         "--policies", "round_robin,device_only,tier_aware,oracle", "--no-l3", "--json"],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    p = report["policies"]
    # the revisited prefix is only on one worker's host tier: tier-aware follows it there
    assert p["tier_aware"]["hit_tokens"]["host"] > p["device_only"]["hit_tokens"]["host"], p
    assert p["tier_aware"]["recomputed_tokens"] < p["device_only"]["recomputed_tokens"], p
    assert p["tier_aware"]["recomputed_tokens"] < p["round_robin"]["recomputed_tokens"], p
    assert p["tier_aware"]["recomputed_tokens"] >= report["bounds"]["infinite"]["recomputed_tokens"]
    # through the real pipeline, lockstep: nothing degraded, and beside the oracle
    assert p["tier_aware"]["via"] == "pipeline" and p["tier_aware"]["degraded_decisions"] == 0
    assert report["mode"] == "lockstep" and "oracle" in p


@pytest.mark.slow
def test_the_realtime_replay_reports_how_far_the_machine_fell_behind(tmp_path):
    """--realtime: the live pipeline on the wall clock. Its figures depend on the machine, so it
    says how late requests reached their engine and how many arrived out of trace order."""
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "replay", "--realtime", "--trace", "synthetic:2",
         "--requests", "40", "--workers", "2", "--device-pages", "256", "--host-pages", "512",
         "--policies", "round_robin,tier_aware,oracle", "--time-scale", "100", "--json"],
        capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["mode"] == "realtime" and set(report["policies"]) == {"round_robin", "tier_aware"}
    for _name, summary in report["policies"].items():
        assert summary["requests"] == 40 and summary["ttft_p50_ms"] > 0
        assert 0 <= summary["out_of_order_requests"] <= 40
        assert 0 <= summary["reached_worker_late_p50_s"] <= summary["reached_worker_late_p99_s"]
    assert report["policies"]["tier_aware"]["via"] == "realtime"
    assert report["policies"]["tier_aware"]["route_p50_ms"] > 0
    assert "reached the worker" in out.stdout


@pytest.mark.slow
def test_demo_completes_and_writes_its_report(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--requests", "60", "--workers", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["policies"]) == {"random", "round_robin", "least_load", "device_only", "tier_aware",
                                       "tier_aware_shared", "oracle"}
    assert report["via"]["tier_aware_shared"] == "pipeline" and report["via"]["device_only"] == "pipeline"
    assert all(r["requests"] == 60 and r["degraded_decisions"] == 0 for r in report["policies"].values())
    assert set(report["bounds"]) == {"infinite", "pooled_lru"}
    # the sweep: host pool 0/2/4/8 with and without L3 (no L3 without a host pool), then one worker of the
    # two at half speed beside the TTFT oracle, a verdict each
    assert [(p["host_ratio"], p["l3"], p["speeds"]) for p in report["sweep"]] == [
        (2, True, None), (4, True, None), (8, True, None), (0, False, None), (2, False, None), (4, False, None),
        (8, False, None), (2, True, [1.0, 0.5])]
    assert all(p["verdict"] for p in report["sweep"])
    assert {"ttft_oracle", "predicted_ttft"} <= set(report["sweep"][-1]["policies"])
    assert "least true TTFT" in report["sweep"][-1]["verdict"] and "predicted_ttft" in report["sweep"][-1]["verdict"]
    assert (tmp_path / "policies.png").stat().st_size > 10_000
    assert "verdict:" in out.stdout and "infinite cache" in out.stdout and "host:device" in out.stdout
