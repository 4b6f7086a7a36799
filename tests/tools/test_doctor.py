"""`kvtier doctor` against a real deployment: nats-server, Redis, a `kvtier processor`, `kvtier
bridge`s on SGLang-format publishers, a `kvtier router` and (when installed) a real Mooncake
master. One stack serves the module; each case adds its own model (so findings do not mix) and
the cases break things in order from least to most destructive, Redis and NATS going last.

The judging logic is pure (kvtier/tools/doctor/judge.py); a few cases check it on hand-made views first."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import redis

from kvtier.harness.embedded import NatsServer, RedisServer, ServerStartError, free_port
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.router_health import RouterHealth
from kvtier.schemas.sglang import BlockStored
from kvtier.schemas.state_keys import ModelKeys
from kvtier.sim.sglang_publisher import SglangEventPublisher
from kvtier.tools.doctor import judge, views
from kvtier.tools.doctor import observe as observing
from kvtier.tools.doctor import report as reporting

from ..helpers import (
    bridge_process,
    processor_process,
    stop_all,
    wait_until,
    worker_announced,
)
from ..router_helpers import RouterProcess, http

MODEL_OK = "doc-ok"          # healthy: HiCache + Mooncake layout, host tier reported, hashes match
MODEL_GPU = "doc-gpu"        # HiCache announced, but every event says GPU
MODEL_PS = "doc-ps"          # two workers with different page sizes, no layout
MODEL_PLAIN = "doc-plain"    # no layout; later publishes hashes that do not match SGLang's chain
PAGE = 4

pytestmark = pytest.mark.timeout(150)


# --- the judging logic on hand-made views (no I/O) ---------------------------------------------
def _worker(**kw) -> views.WorkerRecord:
    base = {"model": "m", "worker": "w0", "lease_left_s": 5.0, "epoch": 10, "seq": 7, "applied_ago_s": 1.0,
            "page_size": 4}
    base.update(kw)
    return views.WorkerRecord(**base)


def _redis(*workers, **kw) -> views.RedisView:
    return views.RedisView(url="redis://x", reachable=True, models=sorted({w.model for w in workers}),
                         workers=list(workers), **kw)


def _one(findings, check, status=None):
    found = [f for f in findings if f.check == check and (status is None or f.status == status)]
    assert len(found) == 1, findings
    return found[0]


def test_exit_code_fails_on_fail_and_on_warn_only_when_strict():
    ok = views.Finding(check="nats", status=views.Status.OK, finding="fine")
    warn = views.Finding(check="events", status=views.Status.WARN, finding="quiet")
    fail = views.Finding(check="redis", status=views.Status.FAIL, finding="down")
    assert judge.exit_code([ok]) == 0 and judge.exit_code([ok], strict=True) == 0
    assert judge.exit_code([ok, warn]) == 0 and judge.exit_code([ok, warn], strict=True) == 1
    assert judge.exit_code([ok, warn, fail]) == 1
    last = json.loads(reporting.report_json([ok, warn], strict=True))
    assert last["exit_code"] == 1 and last["counts"] == {"ok": 1, "warn": 1, "fail": 0}


def test_events_in_the_stream_but_not_in_redis_blame_the_processor():
    stale_apply = _worker(applied_ago_s=900.0)
    nats = views.NatsView(url="nats://x", reachable=True,
                        last_messages={"m/w0": views.LastMessage(kind="announce", age_s=0.4, epoch=10, seq=9)})
    finding = _one(judge.check_events(_redis(stale_apply), nats, 60), "events", views.Status.FAIL)
    assert "not applied" in finding.finding and "10:9" in finding.finding and "kvtier processor" in finding.fix
    # the bridge's cursor equals what Redis applied: the engine is quiet, not the processor
    nats.last_messages["m/w0"] = views.LastMessage(kind="announce", age_s=0.4, epoch=10, seq=7)
    finding = _one(judge.check_events(_redis(stale_apply), nats, 60), "events", views.Status.WARN)
    assert "bridge is alive" in finding.finding and "--kv-events-config" in finding.fix


def test_router_page_size_from_healthz_is_compared_and_its_absence_said():
    workers = _redis(_worker(worker="a"), _worker(worker="b"))
    says_8 = views.RouterView(url="http://r1", reachable=True, http_status=200,
                            healthz=RouterHealth(status="ok", page_size=8))
    trusts = views.RouterView(url="http://r2", reachable=True, http_status=200,
                            healthz=RouterHealth(status="ok", page_size=None))
    silent = views.RouterView(url="http://r3", reachable=True, http_status=200, healthz=RouterHealth(status="ok"))
    finding = _one(judge.check_page_sizes(workers, [says_8]), "page_size", views.Status.FAIL)
    assert "--page-size 8" in finding.finding and "--page-size 4" in finding.fix
    assert _one(judge.check_page_sizes(workers, [trusts]), "page_size").status == views.Status.OK
    finding = _one(judge.check_page_sizes(workers, [silent]), "page_size", views.Status.OK)
    assert "http://r3 do not report their --page-size" in finding.finding


def test_a_router_index_not_at_the_feed_head_is_a_warning():
    from kvtier.schemas.router_health import IndexHealth, RouterHealth

    def router(*indexes, source="index"):
        return views.RouterView(url="r", reachable=True, http_status=200,
                                healthz=RouterHealth(state_source=source, indexes=list(indexes)))

    redis_view = _redis(feeds={"m": views.FeedHead(change=10, marker_id="A"),
                               "n": views.FeedHead(change=3, marker_id="B")})
    at_head = IndexHealth(model="m", ready=True, change=10, marker_id="A", entries=5)
    assert _one(judge.check_router_indexes(redis_view, [router(at_head)]), "router_index", views.Status.OK)
    # a router from before the rename, which named its source "mirror", is judged alike
    behind = IndexHealth(model="m", ready=True, change=7, marker_id="A")
    assert _one(judge.check_router_indexes(redis_view, [router(behind, source="mirror")]), "router_index",
                views.Status.WARN)
    for index, words in ((IndexHealth(model="m", ready=True, change=7, marker_id="A"), "at change 7, the feed at 10"),
                         (IndexHealth(model="m", ready=True, change=10, marker_id="old"), "built under marker 'old'"),
                         (IndexHealth(model="m", ready=False, last_bootstrap_reason="gap"), "being built (gap)")):
        finding = _one(judge.check_router_indexes(redis_view, [router(index)]), "router_index", views.Status.WARN)
        assert words in finding.finding and finding.subject == "r m"
    # a router that walks in Redis has no index to judge; an unreachable Redis judges nothing
    assert judge.check_router_indexes(redis_view, [router(source="redis")]) == []
    assert judge.check_router_indexes(views.RedisView(url="x", reachable=False), [router(at_head)]) == []


def test_open_circuits_waiting_requests_and_a_drain_are_warnings():
    from kvtier.schemas.router_health import OpenCircuitHealth, QueueHealth

    def router(http_status=200, **health):
        return views.RouterView(url="r", reachable=True, http_status=http_status, healthz=RouterHealth(**health))

    assert judge.check_router_front_door([router(status="ok")]) == []
    circuit = OpenCircuitHealth(model="m", worker_id="w1", failures=3, reopens_in_s=4.2)
    finding = _one(judge.check_router_front_door([router(open_circuits=[circuit])]), "router_circuit",
                   views.Status.WARN)
    assert finding.subject == "r m/w1" and "after 3 failures" in finding.finding
    queued = router(queue=QueueHealth(depth=4, peak=9, size=256, timeout_s=10.0))
    assert "4 requests wait" in _one(judge.check_router_front_door([queued]), "router_queue",
                                     views.Status.WARN).finding
    draining = _one(judge.check_routers([router(http_status=503, status="draining")]), "router", views.Status.WARN)
    assert "draining" in draining.finding


def test_a_router_tokenizing_unlike_its_engines_fails():
    from kvtier.schemas.openai import PromptTokensDetails, Usage
    from kvtier.schemas.router_health import RouterHealth
    from router.tokenization_check import RECENT_CHECKS, TokenizationCheck

    check = TokenizationCheck()
    assert check.record("m", "w0", 10, Usage(prompt_tokens=10), overlap_tokens=0, page_size=4)
    assert not check.record("m", "w1", 10, Usage(prompt_tokens=11), overlap_tokens=0, page_size=4)
    # cached tokens beyond what the router saw on the worker (more than a page): counted, not failed
    check.record("m", "w0", 10, Usage(prompt_tokens=10, prompt_tokens_details=PromptTokensDetails(cached_tokens=9)),
                 overlap_tokens=4, page_size=4)
    [health] = check.health()
    assert (health.checked, health.mismatched, health.recent_mismatched, health.cached_beyond_overlap) == (3, 1, 1, 1)
    assert health.last_mismatch is not None and (health.last_mismatch.router_tokens,
                                                 health.last_mismatch.engine_tokens) == (10, 11)

    def router(tokenizers):
        return views.RouterView(url="r", reachable=True, http_status=200, healthz=RouterHealth(tokenizers=tokenizers))

    finding = _one(judge.check_router_tokenizers([router(check.health())]), "router_tokenizer", views.Status.FAIL)
    assert "worker w1 counted 11 prompt tokens, the router 10" in finding.finding
    assert "--tokenizer m=PATH" in finding.fix
    # a mismatch ages out of the recent window once the tokenizer is fixed
    for _ in range(RECENT_CHECKS):
        check.record("m", "w0", 10, Usage(prompt_tokens=10), overlap_tokens=0, page_size=4)
    assert _one(judge.check_router_tokenizers([router(check.health())]), "router_tokenizer", views.Status.OK)
    assert judge.check_router_tokenizers([router([])]) == []
    # pages the engine never stored under the router's hashes: a few evicted ones are not a
    # fault, most of the recent checks missing is
    for found in (True, False, False, False, False):
        check.record_stored("m", found)
    assert check.health()[0].ok and check.health()[0].recent_pages_missing == 4
    check.record_stored("m", False)
    [health] = check.health()
    assert not health.ok and (health.pages_checked, health.pages_missing) == (6, 5)
    finding = _one(judge.check_router_tokenizers([router([health])]), "router_tokenizer", views.Status.FAIL)
    assert "5 of the last 6 proxied text requests left no page" in finding.finding
    for _ in range(RECENT_CHECKS):
        check.record_stored("m", True)
    assert check.health()[0].ok


def test_usage_is_read_from_a_whole_answer_and_from_the_last_streamed_event():
    from kvtier.schemas.openai import reported_usage

    whole = b'{"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}'
    assert reported_usage(whole, streamed=False).prompt_tokens == 7
    stream = (b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}}'
              b'\n\ndata: [DONE]\n\n')
    usage = reported_usage(stream, streamed=True)
    assert usage.prompt_tokens == 5 and usage.prompt_tokens_details.cached_tokens == 4
    assert reported_usage(b'data: {"choices": []}\n\ndata: [DONE]\n\n', streamed=True) is None
    assert reported_usage(b"not json", streamed=False) is None
    assert reported_usage(b'ta: {"usage": {"prompt_tokens": 1}}\n\n', streamed=True) is None  # cut: not an event


def test_a_router_healthz_body_round_trips_through_its_schema():
    """The body as routers have always written it (field names and order) decodes into
    RouterHealth and encodes back to the same bytes; a router that does not report its
    --page-size is told from one that trusts each worker's."""
    import msgspec

    from kvtier.schemas.router_health import decode_router_health

    body = {"status": "degraded", "router_id": "r1", "routing": "tier-aware",
            "state_store": {"ok": True, "error": ""},
            "shared_pool": {"enabled": True, "credited": True, "last_error": "timeout"},
            "hash_scheme": {"ok": False, "mismatched_workers": [
                {"model": "m", "worker_id": "w1", "mismatched_pages": 3, "checked_pages": 5,
                 "kinds": {"hash_scheme": 3}, "explanation": "other scheme"}]},
            "partial_workers": [{"model": "m", "worker_id": "w2"}],
            "engine_queues": [{"model": "m", "worker_id": "w1", "waiting": 2, "running": 5, "read_ago_s": 0.7}],
            "pricing": "learned-rates",
            "worker_rates": [{"model": "m", "worker_id": "w1", "compute": 2.01, "host_load": 1.5, "l3_load": 1.0,
                              "queued": 1.7, "samples": 40, "relative_error": 0.03, "ttft_mape": 0.12,
                              "ttft_bias": -0.04, "ttft_compared": 40}],
            "page_size": None,
            "decision_log": {"enabled": True, "connected": False}, "models": ["m"], "state_source": "mirror",
            "indexes": [{"model": "m", "ready": True, "position": "1796162837965-0", "change": 2,
                         "marker_id": "f42838bb26d24e01", "entries": 14, "lag_seconds": 0.001, "bootstraps": 1,
                         "last_bootstrap_reason": "start", "last_bootstrap_seconds": 0.0084}],
            "tokenizers": [{"model": "m", "checked": 3, "mismatched": 1, "recent_mismatched": 1, "recent_window": 3,
                            "last_mismatch": {"worker_id": "w1", "router_tokens": 10, "engine_tokens": 11,
                                              "at": 1796162837.9}, "cached_beyond_overlap": 0,
                            "pages_checked": 2, "pages_missing": 0, "recent_pages_missing": 0,
                            "recent_pages_window": 2, "ok": False}],
            "open_circuits": [{"model": "m", "worker_id": "w3", "failures": 3, "reopens_in_s": 4.5}],
            "queue": {"depth": 2, "peak": 7, "size": 256, "timeout_s": 10.0},
            "processes": [{"index": 1, "pid": 4242, "status": "ok", "decisions": 9, "in_flight": 1,
                           "queue_depth": 0, "indexes_ready": True}],
            "summary_only": False}
    raw = msgspec.json.encode(body)
    health = decode_router_health(raw)
    assert msgspec.json.encode(health) == raw
    assert health.hash_scheme.mismatched_workers[0].kinds == {"hash_scheme": 3}
    assert health.engine_queues[0].waiting == 2 and health.engine_queues[0].running == 5
    assert health.worker_rates[0].compute == 2.01 and health.pricing == "learned-rates"
    assert health.worker_rates[0].ttft_mape == 0.12 and health.worker_rates[0].ttft_compared == 40
    assert judge._router_page_size(views.RouterView(url="r", reachable=True, healthz=health)) == (True, None)
    assert decode_router_health(b'{"status": "ok"}').page_size is msgspec.UNSET
    # A router from before --processes wrote no "processes": it reads as one process.
    assert decode_router_health(b'{"status": "ok"}').processes == []


def test_router_metrics_are_parsed():
    text = ('# HELP router_shared_pool_errors_total x\nrouter_shared_pool_errors_total{reason="timeout"} 3.0\n'
            'router_shared_pool_errors_total{reason="error"} 1.0\nrouter_page_size_mismatch_total 2.0\n'
            'router_page_size_mismatch_created 1.7e9\n')
    assert observing.parse_router_metrics(text) == ({"timeout": 3.0, "error": 1.0}, 2.0)


def test_gpu_only_worker_is_judged_only_when_hicache_is_expected():
    from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

    meta = WorkerMetadata(worker_id="w0", model="m", page_size=4, mooncake=MooncakeLayout())
    hicache = _worker(tiers_seen=1, meta=meta, hicache=True)
    assert _one(judge.check_tiers(_redis(hicache)), "tiers").status == views.Status.FAIL
    assert _one(judge.check_tiers(_redis(_worker(tiers_seen=1))), "tiers").status == views.Status.OK
    assert (_one(judge.check_tiers(_redis(_worker(tiers_seen=3, meta=meta, hicache=True))), "tiers").status
            == views.Status.OK)
    # the same worker beside one that reports host pages: a mixed fleet
    mixed = judge.check_tiers(_redis(_worker(tiers_seen=1), _worker(worker="w1", tiers_seen=3)))
    assert _one(mixed, "tiers", views.Status.WARN).subject == "m/w0"


# --- a real deployment ------------------------------------------------------------------------
def _tokens(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(pages * PAGE)]


def _stored(tokens: list[int], medium: str, hashes: list[int] | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes or sglang_block_hashes(tokens, PAGE), parent_block_hash=None,
                       token_ids=tokens, block_size=PAGE, medium=medium)


def _closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # released at once: nothing listens there


def _start_master():
    """A real Mooncake master with its HTTP metadata server off: then it listens on loopback only
    (the metadata server is the part that binds 0.0.0.0), so it may run outside a netns."""
    try:
        from kvtier.harness.mooncake import MooncakeMaster, MooncakeUnavailable
    except ImportError:
        return None
    master = MooncakeMaster(extra_args=["--enable_http_metadata_server=false"])
    try:
        master.start()
    except (MooncakeUnavailable, ServerStartError):
        master.cleanup()
        return None
    with socket.socket() as s:  # safety: the metadata server must not be up
        s.settimeout(0.5)
        if s.connect_ex(("127.0.0.1", master.metadata_port)) == 0:
            master.cleanup()
            return None
    return master


class Stack:
    def __init__(self, es: contextlib.ExitStack):
        self.nats = es.enter_context(NatsServer())
        self.redis = es.enter_context(RedisServer())
        self.client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        self.master = _start_master()
        if self.master is not None:
            es.callback(self.master.cleanup)
        self.processes = []
        self.publishers: dict[str, SglangEventPublisher] = {}
        self.bridges = {}
        es.callback(self.close)
        self.processor = processor_process(self.nats.url, self.redis.url)
        self.processes.append(self.processor)
        master_url = self.master.http_url if self.master is not None else _closed_port_url()
        self.router = RouterProcess(self.redis.url, "--page-size", str(PAGE), "--shared-cache-type", "hicache",
                                    "--mooncake-master", master_url, nats_url=self.nats.url)
        self.processes.append(self.router)
        wait_until(lambda: (http("GET", self.router.url + "/healthz")[1].get("decision_log") or {}).get("connected"),
                   timeout=20, what="the router's decision log to connect to NATS")

    def start_worker(self, model: str, worker: str, page_size: int = PAGE, *extra: str) -> SglangEventPublisher:
        publisher = SglangEventPublisher()
        self.publishers[f"{model}/{worker}"] = publisher
        bridge = bridge_process(publisher, self.nats.url, worker, model, page_size, *extra)
        self.bridges[f"{model}/{worker}"] = bridge
        self.processes.append(bridge)
        wait_until(lambda: worker_announced(self.client, model, worker), timeout=30,
                   what=lambda: f"{model}/{worker} announced\n{bridge.output()[-1500:]}\n"
                                f"{self.processor.output()[-1500:]}")
        return publisher

    def state(self, model: str, worker: str) -> dict[str, str]:
        raw = self.client.hgetall(ModelKeys.for_model(model).state(worker))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def close(self) -> None:
        try:
            for process in reversed(self.processes):
                with contextlib.suppress(AssertionError):
                    stop_all(process)
        finally:
            for process in self.processes:
                process.kill()
            for publisher in self.publishers.values():
                publisher.close()
            self.client.close()


@pytest.fixture(scope="module")
def stack():
    with contextlib.ExitStack() as es:
        s = Stack(es)
        publisher = s.start_worker(MODEL_OK, "w0", PAGE, "--hicache-storage-backend", "mooncake")
        tokens = _tokens(1, 6)
        publisher.publish([_stored(tokens, "GPU")])
        publisher.publish([_stored(tokens[: 3 * PAGE], "CPU_PINNED")])  # write-through: the host copy landed
        wait_until(lambda: s.state(MODEL_OK, "w0").get("tiers_seen") == "3", timeout=20,
                   what=lambda: f"tiers_seen 3 for w0: {s.state(MODEL_OK, 'w0')}\n{s.processor.output()[-2000:]}")
        yield s


def run_doctor(stack: Stack, *args: str, env: dict[str, str] | None = None, endpoints: bool = True,
               timeout: float = 60) -> tuple[int, dict, str]:
    """`kvtier doctor ... --json` as a user runs it: (exit code, the last-line JSON, all output)."""
    command = [sys.executable, "-m", "kvtier.cli", "doctor", "--json", "--timeout", "2", *args]
    if endpoints:
        command += ["--nats", stack.nats.url, "--redis", stack.redis.url]
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})
    took = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.stdout.strip(), output
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["exit_code"] == proc.returncode, output
    assert took < 20, f"doctor took {took:.1f}s:\n{output}"
    return proc.returncode, report, output


def found(report: dict, check: str, status: str | None = None, subject: str | None = None) -> list[dict]:
    return [f for f in report["findings"] if f["check"] == check and (status is None or f["status"] == status)
            and (subject is None or f["subject"] == subject)]


def problems(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["status"] != "ok"]


@pytest.mark.slow
def test_healthy_stack_passes_every_check(stack):
    # The router indexes the model it routes (its index was started when it first routed it).
    assert stack.router.route(MODEL_OK, _tokens(1, 6), book=False)[0] == 200
    stack.router.wait_index_settled(stack.client, MODEL_OK)
    args = ["--router", stack.router.url, "--model", MODEL_OK, "--strict"]
    if stack.master is not None:
        args += ["--mooncake-master", stack.master.http_url]
    rc, report, output = run_doctor(stack, *args)
    assert rc == 0 and problems(report) == [], output
    checks = {f["check"] for f in report["findings"]}
    assert checks >= {"nats", "streams", "redis", "workers", "events", "tiers", "page_size", "mooncake", "router",
                      "router_index", "hash_scheme", "dead_letters"}, output
    assert "at the change feed's head (doc-ok: " in found(report, "router_index")[0]["finding"], output
    assert "host tier reported by 1 of 1" in found(report, "tiers")[0]["finding"]
    assert "1 of 1 workers live" in found(report, "workers")[0]["finding"]
    assert "page size 4" in found(report, "page_size")[0]["finding"]
    if stack.master is not None:
        assert found(report, "mooncake", "ok", stack.master.http_url), output
    hash_check = found(report, "hash_scheme")[0]["finding"]
    assert "all match" in hash_check or "no hash checks recorded" in hash_check
    # the human table comes first, the verdict last before the JSON
    assert output.startswith("STATUS ") and "kvtier doctor: OK (0 failed, 0 warnings" in output


def test_flags_come_from_the_environment_too(stack):
    env = {"KVTIER_NATS": stack.nats.url, "KVTIER_REDIS": stack.redis.url, "KVTIER_ROUTER": stack.router.url,
           "KVTIER_MODEL": MODEL_OK, "KVTIER_STRICT": "1"}
    rc, report, output = run_doctor(stack, env=env, endpoints=False)
    assert rc == 0, output
    assert found(report, "router", "ok", stack.router.url), output
    assert found(report, "workers", "ok", ModelKeys.for_model(MODEL_OK).model_token), output
    assert report["strict"] is True


@pytest.mark.slow
def test_a_worker_without_recent_events_is_a_warning(stack):
    wait_until(lambda: time.time() * 1000 - float(stack.state(MODEL_OK, "w0")["applied_ms"]) > 1500, timeout=10)
    rc, report, output = run_doctor(stack, "--model", MODEL_OK, "--events-window", "1")
    assert rc == 0, output  # a warning alone
    (finding,) = problems(report)
    assert finding["check"] == "events" and finding["status"] == "warn" and finding["subject"] == "doc-ok/w0", output
    assert "no KV events in the last 1s" in finding["finding"] and "bridge is alive" in finding["finding"]
    assert "--kv-events-config" in finding["fix"]
    rc, _, output = run_doctor(stack, "--model", MODEL_OK, "--events-window", "1", "--strict")
    assert rc == 1, output


def test_mooncake_master_unreachable_while_a_worker_advertises_a_layout_fails(stack):
    closed = _closed_port_url()
    rc, report, output = run_doctor(stack, "--model", MODEL_OK, "--mooncake-master", closed)
    assert rc == 1, output
    (finding,) = found(report, "mooncake", "fail", closed)
    assert "cannot reach the Mooncake master" in finding["finding"], output
    assert "1 workers advertise a Mooncake layout" in finding["finding"]
    assert "network path" in finding["fix"]


@pytest.mark.slow
def test_only_gpu_tiers_with_hicache_on_blames_the_sglang_build(stack):
    # HiCache announced by the bridge (--hicache on), no L3: only the host tier is expected
    publisher = stack.start_worker(MODEL_GPU, "g0", PAGE, "--hicache", "on", "--hicache-write-policy", "write_through")
    for seed in range(3):
        publisher.publish([_stored(_tokens(10 + seed, 2), "GPU")])
    wait_until(lambda: stack.state(MODEL_GPU, "g0").get("n1") == "6", timeout=20,
               what=lambda: f"6 device pages applied: {stack.state(MODEL_GPU, 'g0')}")
    assert stack.state(MODEL_GPU, "g0")["tiers_seen"] == "1"
    rc, report, output = run_doctor(stack, "--model", MODEL_GPU)
    assert rc == 1, output
    (finding,) = found(report, "tiers", "fail")
    assert finding["subject"] == "doc-gpu/g0" and "sglang#22894" in finding["finding"], output
    assert "every page it ever stored was on GPU" in finding["finding"]
    assert "rebuild SGLang" in finding["fix"] and "emit KV events for L2 host cache insertions" in finding["fix"]


@pytest.fixture(scope="module")
def page_size_pair(stack):
    # short leases: a later case lets them expire
    stack.start_worker(MODEL_PS, "p4", 4, "--lease-ttl", "1.5")
    stack.start_worker(MODEL_PS, "p8", 8, "--lease-ttl", "1.5")
    return ["p4", "p8"]


@pytest.mark.slow
def test_page_size_mismatch_between_two_workers_fails(stack, page_size_pair):
    rc, report, output = run_doctor(stack, "--model", MODEL_PS, "--router", stack.router.url)
    assert rc == 1, output
    finding = found(report, "page_size", "fail", "doc-ps")
    assert finding, output
    assert "different page sizes: 4 (p4); 8 (p8)" in finding[0]["finding"]
    assert "same SGLang --page-size" in finding[0]["fix"]
    healthz = http("GET", stack.router.url + "/healthz")[1]
    if "page_size" in healthz:  # routers that report their --page-size are compared too
        (router_finding,) = found(report, "page_size", "fail", f"{stack.router.url} / doc-ps")
        assert "--page-size 4 but workers of doc-ps use 8" in router_finding["finding"], output


@pytest.fixture(scope="module")
def plain_worker(stack):
    publisher = stack.start_worker(MODEL_PLAIN, "h0", PAGE)
    publisher.publish([_stored(_tokens(30, 3), "GPU")])
    wait_until(lambda: stack.state(MODEL_PLAIN, "h0").get("n1") == "3", timeout=20,
               what=lambda: f"3 device pages applied: {stack.state(MODEL_PLAIN, 'h0')}")
    return publisher


@pytest.mark.slow
def test_no_worker_advertising_a_layout_is_a_warning(stack, plain_worker):
    args = ["--model", MODEL_PLAIN]
    args += ["--mooncake-master", stack.master.http_url] if stack.master is not None else ["--router", stack.router.url]
    rc, report, output = run_doctor(stack, *args)
    assert rc == 0, output  # a warning alone
    (finding,) = found(report, "mooncake", "warn")
    assert "no workers have HiCache enabled" in finding["finding"], output
    assert "--hicache-storage-backend mooncake" in finding["fix"]
    assert [f["check"] for f in problems(report)] == ["mooncake"], output
    assert run_doctor(stack, *args, "--strict")[0] == 1


def test_hash_scheme_mismatch_fails_with_its_explanation(stack, plain_worker):
    keys = ModelKeys.for_model(MODEL_PLAIN)
    tokens = _tokens(40, 4)
    # the engine publishes hashes that are not SGLang's sha256 chain over these tokens
    plain_worker.publish([_stored(tokens, "GPU", hashes=[11, 12, 13, 14])])
    wait_until(lambda: stack.state(MODEL_PLAIN, "h0").get("n1") == "7", timeout=20,
               what=lambda: f"7 device pages applied: {stack.state(MODEL_PLAIN, 'h0')}")
    wait_until(lambda: (stack.client.hget(keys.hash_check, "h0") or b"").find(b'"mismatched":4') >= 0, timeout=15,
               what=lambda: f"the processor's hash check of h0 in {keys.hash_check} (written by the processor's hash "
                            f"validation): {stack.client.hget(keys.hash_check, 'h0')!r}\n"
                            f"{stack.processor.output()[-2000:]}")
    rc, report, output = run_doctor(stack, "--model", MODEL_PLAIN)
    assert rc == 1, output
    (finding,) = found(report, "hash_scheme", "fail", "doc-plain/h0")
    assert "4 of 7 checked pages have hashes kvtier cannot reproduce (hash_scheme: 4)" in finding["finding"], output
    assert "another hash scheme" in finding["finding"]  # the processor's explanation, carried through
    assert "0.5.6 or later" in finding["fix"]


@pytest.mark.slow
def test_dead_letters_are_counted_with_their_latest_reason(stack):
    import asyncio

    from ..helpers import read_dead_letters

    stack.publishers[f"{MODEL_OK}/w0"].publish_payload(b"\xc1 not msgpack")
    letters = asyncio.run(read_dead_letters(stack.nats.url, 1))
    assert letters, "the bridge dead-lettered nothing"
    reason = letters[-1][1]["Kvtier-Reason"]
    rc, report, output = run_doctor(stack, "--model", MODEL_OK)
    assert rc == 0, output  # a warning alone
    (finding,) = found(report, "dead_letters", "warn")
    assert finding["finding"].startswith(f"{len(letters)} dead letter"), output
    assert "[bridge doc-ok.w0]" in finding["finding"] and reason[:60] in finding["finding"], output
    assert "nats stream view KVTIER_DLQ" in finding["fix"]
    assert run_doctor(stack, "--model", MODEL_OK, "--strict")[0] == 1


@pytest.mark.slow
def test_no_live_workers_when_every_lease_expired(stack, page_size_pair):
    for worker in page_size_pair:
        stack.bridges[f"{MODEL_PS}/{worker}"].stop()
    wait_until(lambda: all(stack.state(MODEL_PS, w).get("stale_reason") == "lease_expired" for w in page_size_pair),
               timeout=15, what=lambda: [stack.state(MODEL_PS, w) for w in page_size_pair])
    rc, report, output = run_doctor(stack, "--model", MODEL_PS)
    assert rc == 1, output
    (finding,) = found(report, "workers", "fail", "doc-ps")
    assert "no live workers: all 2 leases expired" in finding["finding"], output
    assert "p4: lease_expired" in finding["finding"] and "kvtier bridge" in finding["fix"]


@pytest.mark.slow
def test_events_in_the_stream_but_not_applied_blame_the_processor(stack):
    stack.processor.stop()
    publisher = stack.publishers[f"{MODEL_OK}/w0"]
    publisher.publish([_stored(_tokens(50, 2), "GPU")])
    cursor = wait_until(lambda: _bridge_cursor_ahead(stack), timeout=10, what="the bridge to publish the batch")
    time.sleep(1.2)  # older than the events window below
    rc, report, output = run_doctor(stack, "--model", MODEL_OK, "--events-window", "1")
    assert rc == 1, output
    (finding,) = found(report, "events", "fail", "doc-ok/w0")
    assert f"the stream holds {cursor}" in finding["finding"] and "not applied" in finding["finding"], output
    assert "kvtier processor" in finding["fix"]


def _bridge_cursor_ahead(stack) -> str:
    """The (epoch:seq) the bridge announced once it is past what Redis applied, else ''."""
    import asyncio

    view = asyncio.run(observing.observe_nats(stack.nats.url, [views.WorkerRecord(model=MODEL_OK, worker="w0")], 2))
    last = view.last_messages.get(f"{MODEL_OK}/w0")
    state = stack.state(MODEL_OK, "w0")
    if last is None or (last.epoch, last.seq) <= (int(state["epoch"]), int(state["seq"])):
        return ""
    return f"{last.epoch}:{last.seq}"


def test_redis_down_fails(stack):
    stack.redis.stop()
    rc, report, output = run_doctor(stack, "--model", MODEL_OK, "--router", stack.router.url)
    assert rc == 1, output
    (finding,) = found(report, "redis", "fail")
    assert "cannot reach Redis" in finding["finding"] and "--redis" in finding["fix"], output
    assert found(report, "nats", "ok"), output  # the rest is still checked
    router = found(report, "router", subject=stack.router.url)
    assert router and router[0]["status"] == "fail" and "cannot reach Redis" in router[0]["finding"], output


@pytest.mark.slow
def test_nats_down_fails(stack):
    stack.nats.stop()
    rc, report, output = run_doctor(stack, "--model", MODEL_OK)
    assert rc == 1, output
    (finding,) = found(report, "nats", "fail")
    assert "cannot reach NATS" in finding["finding"] and "nats-server" in finding["fix"], output
