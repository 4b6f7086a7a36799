"""`kvtier probe hicache`: the A/B/C protocol of SGLang's HiCache guide against a real
`kvtier sim-worker` (small device pool, so series C evicts; a host pool that keeps the
prefix), through a real `kvtier bridge` -> JetStream -> `kvtier processor` -> Redis; the same
probe against a worker whose events nobody forwards; and the pure verdict function."""

from __future__ import annotations

import json
import subprocess
import time

import msgspec
import pytest

from kvtier.harness.embedded import free_port
from kvtier.schemas.events import AllCleared, EventBatch, PagesRemoved, PagesStored
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.sglang_server import GenerateMetaInfo, decode_generate_meta_info
from kvtier.schemas.tiers import Tier
from kvtier.sim.sim_worker import free_port_block
from kvtier.tools.probe import (
    CachedTokens,
    Evidence,
    Verdict,
    cached_tokens_of,
    collect_evidence,
    judge,
    worker_ttft_of,
)

from ..helpers import KvtierProcess, processor_process, stop_all, wait_until, worker_announced
from ..router_helpers import answers

MODEL = "probe-model"
PAGE = 4


def start_sim_worker() -> tuple[KvtierProcess, int, int, str]:
    """One rank, 48 device pages (two 24-page prompts fill it), 400 host pages."""
    zmq_port, replay_port, http_port = free_port_block(1), free_port_block(1), free_port()
    sim = KvtierProcess("sim-worker", "--port", str(zmq_port), "--replay-port", str(replay_port), "--http-port",
                        str(http_port), "--page-size", str(PAGE), "--device-pages", "48", "--host-pages", "400")
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: answers(url + "/healthz"), timeout=30, what=lambda: sim.output()[-2000:])
    except BaseException:
        sim.kill()
        raise
    return sim, zmq_port, replay_port, url


def run_probe(*args: str, timeout: float = 90.0) -> tuple[int, str]:
    probe = KvtierProcess("probe", "hicache", *args)
    try:
        rc = probe.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        probe.kill()
        raise AssertionError(f"probe still running after {timeout}s:\n{probe.output()[-3000:]}") from None
    finally:
        probe.kill()  # a no-op once it has exited; stops it if the wait was interrupted
    return rc, probe.output()


def report_of(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def by_series(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["series"]}


@pytest.mark.slow
def test_probe_proves_the_l2_read_through_the_pipeline(nats_server, redis_server, redis_client):
    sim, zmq_port, replay_port, url = start_sim_worker()
    bridge = KvtierProcess("bridge", "--endpoint", f"tcp://127.0.0.1:{zmq_port}", "--replay-endpoint",
                           f"tcp://127.0.0.1:{replay_port}", "--worker-id", "w0", "--model", MODEL, "--page-size",
                           str(PAGE), "--nats", nats_server.url, "--heartbeat", "0.5")
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: worker_announced(redis_client, MODEL, "w0"), timeout=30,
                   what=lambda: f"bridge: {bridge.output()[-1500:]}\nprocessor: {processor.output()[-1500:]}")
        started = time.monotonic()
        # no --page-size: the probe reads the one the bridge announced
        rc, output = run_probe("--worker-url", url + "/w/0", "--worker-id", "w0", "--model", MODEL,
                               "--nats", nats_server.url, "--redis", redis_server.url, "--prefix-tokens", "64",
                               "--seed", "11", "--json")
        took = time.monotonic() - started
        assert rc == 0, output[-3000:]
        report = report_of(output)
        series = by_series(report)
        assert report["page_size"] == PAGE and report["prefix_tokens"] == 64
        assert {name: s["verdict"] for name, s in series.items()} == {
            "A": "recomputed", "B": "device hit", "C": "L2 read proven"}, output[-4000:]

        a, b, c = (series[n]["evidence"] for n in "ABC")
        assert a["event_stream"] and a["tier_state"]
        assert a["before_device"] == a["before_host"] == 0 and a["fresh_device_pages"] == 16
        assert a["cached"]["total"] == 0
        assert b["before_device"] == 16 and b["load_back_pages"] == 0
        assert b["cached"]["device"] == 64 and b["cached"]["host"] == 0
        # C: the whole prefix was on host only, every page of it came back to device, and the
        # worker's own breakdown says the tokens came from host
        assert report["prefix_pages_on_device_before_c"] == 0 and 1 <= report["evicting_prefixes_sent"] < 64
        assert c["before_device"] == 0 and c["before_host_only"] == 16
        assert c["load_back_pages"] == 16 and c["load_back_batches"]
        assert c["cached"]["host"] >= 64
        for e in (a, b, c):
            assert e["wall_ttft_s"] > 0 and e["worker_ttft_s"] is not None and e["worker_ttft_field"] == "ttft_s"
        # the human report: one table row per series, then the verdicts with their reasons
        assert "series prompt" in output and "L2 READ PROVEN" in output and "host->device load" in output
        assert took < 60, took
        # the same prompts again: A is now a reuse, not a first sight
        rc, output = run_probe("--worker-url", url + "/w/0", "--worker-id", "w0", "--model", MODEL,
                               "--nats", nats_server.url, "--redis", redis_server.url, "--prefix-tokens", "64",
                               "--seed", "11", "--evict-prefixes", "0", "--watch-timeout", "2", "--json")
        assert rc == 0, output[-3000:]
        again = by_series(report_of(output))
        assert again["A"]["verdict"] == "device hit" and again["A"]["evidence"]["before_device"] == 16, output[-3000:]
    finally:
        stop_all(bridge, processor, sim)


@pytest.mark.slow
def test_without_telemetry_reuse_is_not_proven(nats_server, redis_server):
    """Nobody bridges this worker: no event stream, no tier state. It still reports cached
    tokens (even 'host' ones in C), and the probe must not turn that into a proof."""
    sim, _, _, url = start_sim_worker()
    try:
        common = ["--worker-url", url + "/w/0", "--worker-id", "lonely", "--model", MODEL, "--nats", nats_server.url,
                  "--redis", redis_server.url, "--prefix-tokens", "64", "--seed", "5"]
        rc, output = run_probe(*common)
        assert rc == 2 and "give --page-size" in output, output[-2000:]  # nothing announced it

        rc, output = run_probe(*common, "--page-size", str(PAGE), "--evict-prefixes", "4", "--watch-timeout", "1",
                               "--json")
        assert rc == 0, output[-3000:]
        report = report_of(output)
        series = by_series(report)
        assert {name: s["verdict"] for name, s in series.items()} == {
            "A": "recomputed", "B": "consistent with reuse, not proven",
            "C": "consistent with reuse, not proven"}, output[-4000:]
        assert report["evicting_prefixes_sent"] == 4 and report["prefix_pages_on_device_before_c"] is None
        for s in series.values():
            assert not s["evidence"]["event_stream"] and not s["evidence"]["tier_state"]
        assert series["B"]["evidence"]["cached"]["device"] == 64
        assert series["C"]["evidence"]["cached"]["host"] >= 64  # the worker claims host tokens ...
        assert any("no event stream" in r for r in series["C"]["reasons"])  # ... which nothing here can confirm
        assert "telemetry: event stream NO, tier state in Redis NO" in output
    finally:
        stop_all(sim)


# --- the pure parts ---------------------------------------------------------------------------
def evidence(**overrides) -> Evidence:
    base = dict(series="X", page_size=4, prompt_tokens=96, prefix_pages=16, event_stream=True, tier_state=True)
    return Evidence(**{**base, **overrides})


def details(device=0, host=0, storage=None) -> CachedTokens:
    return CachedTokens(total=device + host + (storage or 0), details=True, device=device, host=host, storage=storage)


def test_judge_l2_read_proven():
    ev = evidence(before_host=16, before_host_only=16, load_back_pages=16, load_back_batches=["7:3"],
                  cached=details(host=64))
    j = judge(ev)
    assert j.verdict is Verdict.L2_READ_PROVEN and "7:3" in j.reasons[0]
    # a worker without a tier breakdown: the telemetry alone proves it
    assert judge(evidence(before_host=16, before_host_only=16, load_back_pages=3,
                          cached=CachedTokens(total=64))).verdict is Verdict.L2_READ_PROVEN
    # the worker's own breakdown says nothing came from host: contradiction, not proof
    assert judge(evidence(before_host_only=16, load_back_pages=16,
                          cached=details(device=64))).verdict is Verdict.NOT_PROVEN


def test_judge_device_hit():
    assert judge(evidence(before_device=16, before_host=16, cached=details(device=64))).verdict is Verdict.DEVICE_HIT
    assert judge(evidence(before_device=16, cached=CachedTokens(total=64))).verdict is Verdict.DEVICE_HIT
    # on device before, but the worker says host: an unseen L2 read, not a device hit
    assert judge(evidence(before_device=4, before_host_only=12,
                          cached=details(device=16, host=48))).verdict is Verdict.NOT_PROVEN


def test_judge_recomputed():
    j = judge(evidence(fresh_device_pages=16, cached=details()))
    assert j.verdict is Verdict.RECOMPUTED and "16 prefix pages freshly stored" in j.reasons[-1]
    # no cached-token count at all, but the telemetry shows a cold prefix freshly stored
    assert judge(evidence(fresh_device_pages=16)).verdict is Verdict.RECOMPUTED
    # the worker's 0 is enough even without telemetry
    assert judge(evidence(event_stream=False, tier_state=False,
                          cached=CachedTokens(total=0))).verdict is Verdict.RECOMPUTED
    # 0 cached tokens but a load was seen: contradiction
    assert judge(evidence(before_host_only=16, load_back_pages=16, event_stream=True,
                          cached=CachedTokens(total=0), tier_state=False)).verdict is Verdict.NOT_PROVEN


def test_judge_consistent_with_reuse_not_proven():
    j = judge(evidence(event_stream=False, tier_state=False, cached=details(host=64)))
    assert j.verdict is Verdict.NOT_PROVEN
    assert any("no event stream" in r for r in j.reasons) and any("no tier state" in r for r in j.reasons)
    # full telemetry, host only before, the worker says host, yet no load arrived (lost events)
    j = judge(evidence(before_host=16, before_host_only=16, cached=details(host=64)))
    assert j.verdict is Verdict.NOT_PROVEN and any("no host->device load" in r for r in j.reasons)
    # a bare cached_tokens count with no tier state
    assert judge(evidence(tier_state=False, cached=CachedTokens(total=64))).verdict is Verdict.NOT_PROVEN
    # a stale tier state: the note is carried into the reasons
    j = judge(evidence(tier_state=False, notes=["tier state is marked stale (gap)"], cached=CachedTokens(total=64)))
    assert j.verdict is Verdict.NOT_PROVEN and "tier state is marked stale (gap)" in j.reasons


def test_judge_inconclusive_without_any_signal():
    j = judge(evidence(event_stream=False, tier_state=False))
    assert j.verdict is Verdict.INCONCLUSIVE and "does not report cached tokens" in j.reasons[0]


def test_collect_evidence_tells_loads_from_fresh_stores():
    prompt = list(range(1000, 1000 + 24))  # 6 pages: the first 4 are the prefix
    hashes = sglang_block_hashes(prompt, 4)
    before = {hashes[0]: {Tier.DEVICE, Tier.HOST}, hashes[1]: {Tier.HOST}, hashes[2]: {Tier.HOST}}
    other = sglang_block_hashes(list(range(5000, 5008)), 4)

    def batch(seq, events):
        return EventBatch(worker_id="w", model="m", epoch=9, seq=seq, ts=1.0, source_ts=1.0, events=events)

    batches = [batch(1, [PagesStored(tier=Tier.HOST, hashes=[hashes[0]])]),
               batch(2, [PagesStored(tier=Tier.DEVICE, hashes=[hashes[1], hashes[2], hashes[3], hashes[4]]),
                         PagesStored(tier=Tier.DEVICE, hashes=other),
                         PagesRemoved(tier=Tier.HOST, hashes=[hashes[2]])]),
               batch(3, [AllCleared()])]
    ev = collect_evidence(series="C", page_size=4, prompt=prompt, prefix_pages=4, before=before, batches=batches,
                          event_stream=True, meta_info=GenerateMetaInfo(cached_tokens=12, e2e_latency=0.25),
                          wall_ttft_s=0.3)
    assert (ev.before_device, ev.before_host, ev.before_host_only) == (1, 3, 2)
    assert ev.load_back_pages == 2 and ev.load_back_batches == ["9:2"]
    assert ev.fresh_device_pages == 1  # hashes[3]: on no tier before; hashes[4] is not in the prefix
    assert ev.device_store_pages == 4 and ev.batches_watched == 3
    assert ev.worker_ttft_s == 0.25 and ev.worker_ttft_field == "e2e_latency"
    assert any("cleared" in n for n in ev.notes)
    # without tier state nothing can be called a load
    blind = collect_evidence(series="C", page_size=4, prompt=prompt, prefix_pages=4, before=None, batches=batches,
                             event_stream=True, meta_info=GenerateMetaInfo(), wall_ttft_s=0.3)
    assert not blind.tier_state and blind.load_back_pages == 0 and blind.fresh_device_pages == 0


@pytest.mark.parametrize("meta, expected", [
    # SGLang: nothing cached -> details null (or absent), cached_tokens 0
    ({"cached_tokens": 0, "cached_tokens_details": None}, CachedTokens(total=0)),
    ({"cached_tokens": 0}, CachedTokens(total=0)),
    # SGLang with HiCache: device and host; with an L3 backend also storage and its name
    ({"cached_tokens": 96, "cached_tokens_details": {"device": 32, "host": 64}},
     CachedTokens(total=96, details=True, device=32, host=64)),
    ({"cached_tokens": 96, "cached_tokens_details": {"device": 0, "host": 32, "storage": 64,
                                                     "storage_backend": "MooncakeStore"}},
     CachedTokens(total=96, details=True, device=0, host=32, storage=64)),
    # kvtier sim-worker: "l3" for the storage part
    ({"cached_tokens": 8, "cached_tokens_details": {"device": 8, "host": 0, "l3": 0}},
     CachedTokens(total=8, details=True, device=8, host=0, storage=0)),
    # a server that reports nothing
    ({}, CachedTokens()),
])
def test_cached_tokens_of_real_and_simulated_shapes(meta, expected):
    reply = msgspec.json.encode({"text": "x", "meta_info": meta})  # as the worker's /generate answers
    assert cached_tokens_of(decode_generate_meta_info(reply)) == expected


def test_worker_ttft_prefers_the_reported_ttft():
    assert worker_ttft_of(GenerateMetaInfo(ttft_s=0.01, e2e_latency=0.5)) == (0.01, "ttft_s")
    assert worker_ttft_of(GenerateMetaInfo(e2e_latency=0.5)) == (0.5, "e2e_latency")
    assert worker_ttft_of(GenerateMetaInfo()) == (None, "")
