"""Hash-scheme validation: a worker whose published page hashes are not SGLang's chain over
their tokens is caught, counted per worker, explained, and shown in the processor's /metrics
and the router's /healthz; a matching worker beside it is not flagged."""

from __future__ import annotations

import hashlib
import struct
import urllib.request

import pytest

from kvtier.consumers.hash_check import HashValidator
from kvtier.harness.embedded import free_port
from kvtier.schemas.events import EpochReason, EventBatch
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.health import HashMismatchKind, decode_hash_check
from kvtier.schemas.sglang import BlockStored
from kvtier.schemas.state_keys import ModelKeys
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import (
    bridge_process,
    kvtier_batch,
    model_ready,
    processor_process,
    stop_all,
    wait_until,
    worker_announced,
)
from ..router_helpers import RouterProcess, http

MODEL = "meta-llama/Llama-3.1-8B"
PAGE = 4


def legacy_hashes(tokens: list[int], page_size: int) -> list[int]:
    """Another scheme: each page on its own (no chain), tokens as int64, as an engine that does
    not follow SGLang >= 0.5.6 might hash."""
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        digest = hashlib.sha256(struct.pack(f"<{page_size}q", *tokens[start:start + page_size])).digest()
        out.append(struct.unpack(">q", digest[:8])[0])
    return out


def stored(tokens: list[int], hashes: list[int], parent: int | None = None, **extra) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=PAGE,
                       medium="GPU", **extra)


def batch_of(*events, seq: int = 1, epoch: int = 1, worker: str = "w0",
             reason: EpochReason | None = None) -> EventBatch:
    return kvtier_batch(MODEL, worker, epoch, seq, list(events), reason)


# --- the validator itself (pure) ----------------------------------------------------------
def test_chain_with_parents_matches():
    validator = HashValidator()
    tokens = list(range(100, 132))
    hashes = sglang_block_hashes(tokens, PAGE)
    # first two pages at the root, then the rest as a child run naming its parent
    outcome = validator.check_batch(batch_of(stored(tokens[:8], hashes[:2]),
                                             stored(tokens[8:], hashes[2:], parent=hashes[1])), PAGE)
    assert (outcome.matched, outcome.mismatched, outcome.unverifiable) == (8, {}, 0)
    check = validator.check_of(MODEL, "w0")
    assert check.ok and check.checked == 8


def test_other_scheme_is_a_mismatch_reported_once():
    validator = HashValidator()
    tokens = list(range(100, 116))
    first = validator.check_batch(batch_of(stored(tokens, legacy_hashes(tokens, PAGE))), PAGE)
    assert first.mismatched == {HashMismatchKind.SCHEME: 4}
    assert len(first.to_report) == 1 and "another hash scheme" in first.to_report[0].explanation
    again = validator.check_batch(batch_of(stored(tokens, legacy_hashes(tokens, PAGE)), seq=2), PAGE)
    assert again.mismatched == {HashMismatchKind.SCHEME: 4} and again.to_report == []
    assert validator.check_of(MODEL, "w0").mismatched == 8


def test_namespaced_hashes_are_explained_as_such():
    validator = HashValidator()
    tokens = list(range(100, 108))
    plain = sglang_block_hashes(tokens, PAGE)
    salted = [h ^ 0x5A5A for h in plain]  # any other value: SGLang's namespacing is one-way
    outcome = validator.check_batch(batch_of(stored(tokens, salted, cache_salt="tenant-7")), PAGE)
    assert outcome.mismatched == {HashMismatchKind.NAMESPACE: 2}
    assert "cache_salt" in outcome.to_report[0].explanation


def test_page_size_other_than_announced():
    validator = HashValidator()
    tokens = list(range(100, 108))
    outcome = validator.check_batch(batch_of(stored(tokens, sglang_block_hashes(tokens, PAGE))), announced_page_size=16)
    assert outcome.mismatched == {HashMismatchKind.PAGE_SIZE: 2}
    assert "--page-size 4" in outcome.to_report[0].explanation


def test_unknown_parent_is_unverifiable_not_a_mismatch():
    validator = HashValidator()
    tokens = list(range(100, 116))
    hashes = sglang_block_hashes(tokens, PAGE)
    outcome = validator.check_batch(batch_of(stored(tokens[8:], hashes[2:], parent=hashes[1])), PAGE)
    assert (outcome.matched, outcome.mismatched, outcome.unverifiable) == (0, {}, 2)
    no_tokens = validator.check_batch(batch_of(stored([], hashes[:1]), seq=2), PAGE)
    assert no_tokens.unverifiable == 1


def test_new_engine_process_starts_a_fresh_record():
    validator = HashValidator()
    tokens = list(range(100, 108))
    validator.check_batch(batch_of(stored(tokens, legacy_hashes(tokens, PAGE))), PAGE)
    assert not validator.check_of(MODEL, "w0").ok
    fixed = validator.check_batch(batch_of(stored(tokens, sglang_block_hashes(tokens, PAGE)), epoch=2,
                                           reason=EpochReason.PUBLISHER_RESTART), PAGE)
    assert fixed.matched == 2
    assert validator.check_of(MODEL, "w0").ok
    # a resync of the same engine keeps what was found
    validator.check_batch(batch_of(stored(tokens, legacy_hashes(tokens, PAGE)), epoch=3,
                                   reason=EpochReason.UNRECOVERED_GAP), PAGE)
    validator.check_batch(batch_of(stored(tokens, sglang_block_hashes(tokens, PAGE)), epoch=4,
                                   reason=EpochReason.RESYNC_REQUESTED), PAGE)
    assert validator.check_of(MODEL, "w0").mismatched == 2


def test_digest_memory_is_bounded():
    validator = HashValidator(digest_capacity=50)
    for n in range(40):
        tokens = list(range(n * 1000, n * 1000 + 8))
        validator.check_batch(batch_of(stored(tokens, sglang_block_hashes(tokens, PAGE)), seq=n + 1), PAGE)
    assert len(validator._digests) <= 50
    assert validator.check_of(MODEL, "w0").matched == 80


# --- through the real pipeline --------------------------------------------------------------
def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_mismatched_publisher_is_caught_end_to_end(nats_server, redis_server, redis_client):
    """Two SGLang-format publishers, one hashing like SGLang and one not, through real bridges,
    a real processor and a real router."""
    metrics_port = free_port()
    good, bad = SglangEventPublisher(), SglangEventPublisher()
    processor = processor_process(nats_server.url, redis_server.url, "--metrics-port", str(metrics_port))
    bridges = [bridge_process(good, nats_server.url, "good", MODEL, PAGE),
               bridge_process(bad, nats_server.url, "bad", MODEL, PAGE)]
    router = RouterProcess(redis_server.url)
    try:
        for worker in ("good", "bad"):
            # wait_until calls the lambda in this iteration, before the loop variable moves on
            wait_until(lambda: worker_announced(redis_client, MODEL, worker), timeout=30,  # noqa: B023
                       what=lambda: processor.output()[-2000:])
        tokens = list(range(500, 564))  # 16 pages
        chain = sglang_block_hashes(tokens, PAGE)
        good.publish([stored(tokens[:32], chain[:8]), stored(tokens[32:], chain[8:], parent=chain[7])])
        bad.publish([stored(tokens, legacy_hashes(tokens, PAGE))])
        keys = ModelKeys.for_model(MODEL)

        def recorded():
            raw = redis_client.hgetall(keys.hash_check)
            return {k.decode(): decode_hash_check(v) for k, v in raw.items()}

        wait_until(lambda: {"good", "bad"} <= set(recorded()) and recorded()["good"].checked == 16
                   and recorded()["bad"].checked == 16,  # each is recorded when its worker's batch applies
                   timeout=20, what=lambda: f"{recorded()}\n{processor.output()[-2000:]}")
        checks = recorded()
        assert checks["good"].ok and checks["good"].matched == 16
        assert checks["bad"].mismatched == 16 and checks["bad"].mismatch_kinds == {"hash_scheme": 16}
        assert "another hash scheme" in checks["bad"].explanation
        log = processor.output()
        assert log.count("page hashes do not match") == 1 and "bad" in log

        page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert metric_value(page, "kvtier_processor_hash_mismatch_pages_total", worker="bad", kind="hash_scheme") == 16
        assert metric_value(page, "kvtier_processor_hash_mismatch_pages_total", worker="good") == 0
        assert metric_value(page, "kvtier_processor_hash_checked_pages_total", outcome="matched") == 16

        # /healthz re-reads the hash checks at most once a second
        wait_until(lambda: http("GET", f"{router.url}/healthz")[1]["status"] == "degraded", timeout=5)
        status, health, _ = http("GET", f"{router.url}/healthz")
        assert status == 200 and health["status"] == "degraded"
        assert health["hash_scheme"]["ok"] is False
        assert [w["worker_id"] for w in health["hash_scheme"]["mismatched_workers"]] == ["bad"]
        assert health["hash_scheme"]["mismatched_workers"][0]["kinds"] == {"hash_scheme": 16}
        router_metrics = router.metrics()
        assert metric_value(router_metrics, "router_worker_hash_mismatch_pages", worker="bad") == 16
        assert "the engine uses another hash scheme" in router.output()

        # The consequence the check exists for: the bad worker's pages never match a request.
        # (A fresh store's first model is set up as a rebuild: routers trust no overlap until it
        # is done, which can be after both batches are applied.)
        wait_until(lambda: model_ready(redis_client, MODEL), timeout=20)
        router.wait_index_settled(redis_client, MODEL)
        status, answer, _ = http("POST", f"{router.url}/v1/route",
                                 {"model": MODEL, "token_ids": tokens, "book": False, "explain": True})
        assert status == 200, answer
        overlap = {c["worker_id"]: c["overlap"]["device"] for c in answer["candidates"]}
        assert overlap == {"good": 16, "bad": 0}, f"{answer}\n{router.output()[-3000:]}"
    finally:
        stop_all(router, *bridges, processor)
        good.close()
        bad.close()


def test_simulator_events_pass_the_check():
    """The simulated HiCache worker (demo, replay bench) hashes like SGLang: nothing flagged,
    and children are verified through their parents, not just root pages."""
    from kvtier.sim.hicache_sim import HiCacheSim, SimConfig

    sim = HiCacheSim(SimConfig(page_size=PAGE, device_pages=64, host_pages=128))
    validator = HashValidator()
    prefix = list(range(1000, 1032))
    for n in range(30):
        sim.serve(prefix + [n] * 12 + list(range(n * 50, n * 50 + 8 * (n % 4))), now=n * 0.01)
    sim.advance(10.0)
    outcome = validator.check_batch(batch_of(*sim.drain_events()), PAGE)
    assert outcome.mismatched == {}
    assert outcome.matched > 60
    assert outcome.unverifiable == 0


def test_budget_bounds_the_work_and_known_pages_are_not_recomputed():
    validator = HashValidator(budget_pages_per_s=10)
    runs = []
    for n in range(3):
        tokens = list(range(n * 100, n * 100 + 8 * PAGE))
        runs.append((tokens, sglang_block_hashes(tokens, PAGE)))
    first = validator.check_batch(batch_of(stored(*runs[0])), PAGE, now=0.0)
    assert first.matched == 8
    over = validator.check_batch(batch_of(stored(*runs[1]), seq=2), PAGE, now=0.1)  # 2 + 1 pages left
    assert (over.matched, over.skipped) == (0, 8)
    assert validator.check_of(MODEL, "w0").skipped == 8
    refilled = validator.check_batch(batch_of(stored(*runs[2]), seq=3), PAGE, now=2.0)
    assert refilled.matched == 8
    # the same pages stored again (a host copy): already verified, nothing recomputed
    copy = validator.check_batch(batch_of(stored(*runs[0]), seq=4), PAGE, now=2.0)
    assert (copy.known, copy.matched, copy.skipped) == (8, 0, 0)
