"""`kvtier analytics` and `kvtier report`: the pure tier model against hand-counted
sequences, then both commands end to end on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.consumers.analytics import AnalyticsCollector, MessageFeeder
from kvtier.consumers.analytics_model import TierAnalytics
from kvtier.schemas.events import (
    AllCleared,
    BridgeCursor,
    EpochReason,
    EventBatch,
    PagesRemoved,
    PagesStored,
    WorkerAnnounce,
    encode_message,
)
from kvtier.schemas.routing import CandidateScore, RouteDecision, ScoringWeights, TierOverlap
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata

from ..helpers import KvtierProcess, publish_batches, stop_all, wait_until

M = "m-analytics"
D, H = Tier.DEVICE, Tier.HOST


def batch(seq, t, *events, epoch=1, reason=None, worker="w0", model=M):
    return EventBatch(worker_id=worker, model=model, epoch=epoch, seq=seq, ts=t, source_ts=t,
                      epoch_reason=EpochReason(reason) if reason else None, events=list(events))


def stored(tier, *pages):
    return PagesStored(tier=tier, hashes=list(pages))


def removed(tier, *pages):
    return PagesRemoved(tier=tier, hashes=list(pages))


def announce(worker="w0", ttl=10.0, model=M, page_size=4):
    return WorkerAnnounce(metadata=WorkerMetadata(worker_id=worker, model=model, page_size=page_size), ts=0.0,
                          lease_ttl_s=ttl, cursor=BridgeCursor(epoch=1, seq=0))


def decision(chosen, candidates, request_pages, queried=False, request_id="r"):
    return RouteDecision(request_id=request_id, model=M, router_id="test", ts=time.time(), weights=ScoringWeights(),
                         random_draw=0.5, page_hashes={}, request_pages=request_pages, chosen=chosen,
                         candidates=[CandidateScore(worker_id=w, logit=0.0, overlap=TierOverlap(**o), prefill_load=0,
                                                    decode_load=0, page_size=4) for w, o in candidates],
                         shared_pool_queried=queried)


#: The crafted sequence of test (a): engine times 100.., expected numbers counted by hand below.
def crafted_sequence() -> list[EventBatch]:
    return [
        batch(1, 100, stored(D, 1, 2, 3, 4), reason="bridge_start"),  # 4 fresh pages on device
        batch(2, 101, stored(H, 1, 2)),  # write-through host copies of 1, 2: copy x2
        batch(3, 103, removed(D, 1, 2)),  # device eviction after the host copy: demotion x2 (lifetime 3, 3)
        batch(4, 104, stored(D, 1)),  # load_back of 1: promotion
        batch(5, 106, removed(H, 2), removed(H, 1)),  # 2 only on host: eviction; 1 still on device: just removed
        batch(5, 106, removed(H, 3)),  # a redelivered seq: skipped
        batch(6, 107, removed(D, 3), removed(D, 99), stored(D, 4)),  # 3: eviction (lifetime 7); 99, 4: no-ops
        batch(7, 108, AllCleared(), stored(D, 5, 6)),  # clears 1, 4 from device; 5, 6 fresh
        batch(1, 110, stored(H, 7), epoch=2, reason="publisher_restart"),  # new epoch drops 5, 6
        batch(8, 111, stored(D, 9), epoch=1),  # the old epoch: skipped
        batch(3, 112, stored(D, 8), epoch=2),  # seq 2 missing: the gap drops 7, then 8 is stored
    ]


EXPECTED_TRANSITIONS = {
    ("stored", "device"): 4 + 1 + 2 + 1, ("stored", "host"): 2 + 1,
    ("removed", "device"): 2 + 1, ("removed", "host"): 2,
    ("copy", "host"): 2, ("demotion", "host"): 2, ("promotion", "device"): 1,
    ("eviction", "host"): 1, ("eviction", "device"): 1,
    ("cleared", "device"): 2, ("new_epoch", "device"): 2, ("gap", "host"): 1,
}


def test_model_counts_a_crafted_sequence_exactly():
    a = TierAnalytics(writeback_window_s=0)
    outcomes = [a.apply_batch(b, at=b.ts).outcome for b in crafted_sequence()]
    assert outcomes == ["applied"] * 5 + ["duplicate"] + ["applied"] * 3 + ["old_epoch", "applied"]
    assert a.transition_totals("kind_tier") == EXPECTED_TRANSITIONS
    assert dict(a.noops) == {(M, "w0", "remove_absent"): 1, (M, "w0", "store_present"): 1}
    assert dict(a.batches) == {(M, "applied"): 9, (M, "duplicate"): 1, (M, "old_epoch"): 1}
    assert dict(a.epochs) == {(M, "w0", "bridge_start"): 1, (M, "w0", "publisher_restart"): 1}
    assert a.resident() == {(M, "w0", "device"): 1, (M, "w0", "host"): 0, (M, "w0", "disk"): 0,
                            (M, "w0", "external"): 0}
    device, host = a.lifetimes[(M, "device")], a.lifetimes[(M, "host")]
    assert (device.count, device.sum, host.count, host.sum) == (3, 3 + 3 + 7, 2, 5 + 5)
    assert a.tracked_page_tiers() == 1 and a.limbo_pages() == 0


def test_write_back_order_is_a_demotion_and_unclaimed_removals_become_evictions():
    a = TierAnalytics(writeback_window_s=2.0)
    a.keep_timeline(origin=0, step_s=1.0)
    a.apply_batch(batch(1, 0, stored(D, 1, 2, 3, 4)), at=0)
    # write_back: remove(GPU) first, store(CPU_PINNED) when the copy lands
    a.apply_batch(batch(2, 10, removed(D, 1)), at=10)
    a.apply_batch(batch(3, 10.5, stored(H, 1)), at=10.5)
    # no write-back follows: an eviction once the window has passed
    a.apply_batch(batch(4, 11, removed(D, 2)), at=11)
    a.advance(12.9)
    assert a.transition_totals("kind_tier").get(("eviction", "device"), 0) == 0 and a.limbo_pages() == 1
    a.advance(13.1)
    # host pressure: remove(CPU_PINNED) then remove(GPU) of a page on both: one eviction
    a.apply_batch(batch(5, 14, stored(H, 3)), at=14)
    a.apply_batch(batch(6, 15, removed(H, 3), removed(D, 3)), at=15)
    # recomputed on device within the window: it had been evicted
    a.apply_batch(batch(7, 16, removed(D, 4)), at=16)
    a.apply_batch(batch(8, 16.5, stored(D, 4)), at=16.5)
    a.finish()
    assert a.transition_totals("kind_tier") == {
        ("stored", "device"): 5, ("stored", "host"): 2, ("removed", "device"): 4, ("removed", "host"): 1,
        ("demotion", "host"): 1, ("copy", "host"): 1, ("eviction", "device"): 3,
    }
    assert a.limbo_pages() == 0
    # each eviction is placed at its removal (11, 15, 16), not where its window closed
    assert {step: n for (step, kind), n in a.timeline.items() if kind == "eviction"} == {11: 1, 15: 1, 16: 1}


def test_lease_expiry_drops_pages_and_quiet_mode_counts_nothing():
    a = TierAnalytics(writeback_window_s=0)
    a.counting = False  # a rebuild: state only
    a.announce(announce(ttl=10), at=0)
    a.apply_batch(batch(1, 1, stored(D, 1, 2), stored(H, 1)), at=1)
    assert not a.transitions and not a.batches
    a.counting = True
    a.apply_batch(batch(2, 2, removed(D, 1)), at=2)  # classified against the rebuilt state
    assert a.transition_totals("kind_tier") == {("removed", "device"): 1, ("demotion", "host"): 1}
    a.advance(9.9)
    assert a.resident()[(M, "w0", "device")] == 1
    a.advance(10.1)
    assert a.resident()[(M, "w0", "device")] == 0 and a.workers[(M, "w0")].expired
    assert a.transition_totals("kind_tier")[("lease_expired", "device")] == 1
    assert a.transition_totals("kind_tier")[("lease_expired", "host")] == 1
    a.announce(announce(ttl=10), at=11)  # back: live again, from an empty state
    assert not a.workers[(M, "w0")].expired


def test_an_older_announce_delivered_again_moves_no_lease_back():
    a = TierAnalytics(writeback_window_s=0)
    a.announce(announce(ttl=10), at=0)
    a.apply_batch(batch(1, 1, stored(D, 1)), at=1)
    a.announce(announce(ttl=10), at=8)  # lease to 18
    a.announce(announce(ttl=10), at=1)  # an older one, delivered again: would set it to 11
    a.advance(15)
    assert not a.workers[(M, "w0")].expired and a.resident()[(M, "w0", "device")] == 1
    a.advance(18.1)
    assert a.workers[(M, "w0")].expired


def test_decisions_hit_tokens_and_shared_pool_rate():
    a = TierAnalytics()
    a.decision(decision("w0", [("w0", {"device": 2, "host": 1, "shared_beyond": 3}), ("w1", {})], 8, queried=True))
    a.decision(decision("w1", [("w0", {"device": 1}), ("w1", {"disk": 2})], 4))
    assert dict(a.decisions) == {(M, "w0"): 1, (M, "w1"): 1}
    assert dict(a.hit_tokens) == {(M, "w0", "device"): 8, (M, "w0", "host"): 4, (M, "w0", "shared_beyond"): 12,
                                  (M, "w1", "disk"): 8}
    assert a.request_tokens[M] == (8 + 4) * 4
    assert a.shared_pool_hit_rate() == pytest.approx(3 / 8)


def test_collector_renders_the_model():
    a = TierAnalytics(writeback_window_s=0)
    feeder = MessageFeeder(a)
    for b in crafted_sequence():
        feeder.event(encode_message(b), b.ts)
    assert feeder.event(b"not msgpack", 200) == "undecodable"
    samples = scrape_text(_render(AnalyticsCollector(a)))
    assert samples[("kvtier_analytics_transitions_total", (("kind", "promotion"), ("model", M), ("tier", "device"),
                                                           ("worker", "w0")))] == 1
    assert samples[("kvtier_analytics_resident_pages", (("model", M), ("tier", "device"), ("worker", "w0")))] == 1
    assert samples[("kvtier_analytics_page_lifetime_seconds_count", (("model", M), ("tier", "device")))] == 3


def _render(collector) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def scrape_text(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.mark.parametrize("command", ["analytics", "report"])
def test_help_explains_every_flag(command):
    from kvtier.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 25 and "[env KVTIER_" in action.help, action.option_strings


# --- end to end --------------------------------------------------------------------------
def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == str(want) for k, want in labels.items()))


class AnalyticsProcess(KvtierProcess):
    def __init__(self, nats_url: str, *extra: str):
        from kvtier.harness.embedded import free_port

        self.port = free_port()
        super().__init__("analytics", "--nats", nats_url, "--http-port", str(self.port), *extra)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def scrape(self) -> dict:
        if not self.alive():
            raise AssertionError(f"analytics exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
        try:
            with urllib.request.urlopen(self.url, timeout=3) as response:
                return scrape_text(response.read().decode())
        except OSError:
            return {}

    def wait_counted(self, stream: str, n: int, timeout: float = 30) -> dict:
        def ready():
            s = self.scrape()
            return s if total(s, "kvtier_analytics_messages_total", stream=stream, outcome="counted") >= n else None

        return wait_until(ready, timeout=timeout,
                          what=lambda: f"{n} {stream} messages counted:\n{self.output()[-2000:]}")


async def publish_decisions(nats_url: str, decisions: list[RouteDecision]) -> None:
    import msgspec
    import nats

    from kvtier.plumbing.streams import ensure_decisions_stream
    from kvtier.schemas.subjects import decisions_subject

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_decisions_stream(js)
    for d in decisions:
        await js.publish(decisions_subject(d.model), msgspec.msgpack.encode(d))
    await nc.close()


def live_sequence(t0: float) -> list[EventBatch]:
    """The crafted sequence with engine times near now (leases and windows run on real time)."""
    return [msgspec_replace(b, ts=t0 + b.ts - 100, source_ts=t0 + b.ts - 100) for b in crafted_sequence()]


def msgspec_replace(b, **changes):
    import msgspec

    return msgspec.structs.replace(b, **changes)


def distinct_msg_ids(batches: list[EventBatch]) -> list[str]:
    """The redelivered seq must reach the stream (a broker-deduplicated publish would not)."""
    return [f"{b.msg_id}:{i}" for i, b in enumerate(batches)]


@pytest.mark.slow
def test_analytics_end_to_end_and_restart_without_double_counting(nats_server):
    t0 = time.time()
    batches = live_sequence(t0)
    asyncio.run(publish_batches(nats_server.url, batches, distinct_msg_ids(batches)))
    asyncio.run(publish_decisions(nats_server.url, [
        decision("w0", [("w0", {"device": 2, "host": 1, "shared_beyond": 3}), ("w1", {})], 8, queried=True),
        decision("w1", [("w0", {"device": 1}), ("w1", {"disk": 2})], 4, request_id="r2"),
    ]))
    analytics = AnalyticsProcess(nats_server.url, "--writeback-window", "0.5")
    try:
        samples = analytics.wait_counted("KVTIER_EVENTS", len(batches))
        samples = analytics.wait_counted("KVTIER_DECISIONS", 2)
        samples = wait_until(lambda: (s := analytics.scrape()) and s.get(
            ("kvtier_analytics_writeback_pending_pages", ())) == 0 and s, timeout=10)
        for (kind, tier), n in EXPECTED_TRANSITIONS.items():
            assert total(samples, "kvtier_analytics_transitions_total", kind=kind, tier=tier) == n, (kind, tier)
        assert total(samples, "kvtier_analytics_resident_pages", tier="device") == 1
        assert total(samples, "kvtier_analytics_page_lifetime_seconds_count", tier="device") == 3
        assert total(samples, "kvtier_analytics_page_lifetime_seconds_sum", tier="device") == pytest.approx(13)
        assert total(samples, "kvtier_analytics_batches_total", outcome="duplicate") == 1
        assert total(samples, "kvtier_analytics_decisions_total", worker="w0") == 1
        assert total(samples, "kvtier_analytics_decisions_total", worker="w1") == 1
        assert total(samples, "kvtier_analytics_predicted_hit_tokens_total", tier="shared_beyond") == 12
        assert total(samples, "kvtier_analytics_predicted_hit_tokens_total", tier="device") == 8
        assert total(samples, "kvtier_analytics_shared_pool_hit_rate") == pytest.approx(3 / 8)
        assert total(samples, "kvtier_analytics_consumer_pending", stream="KVTIER_EVENTS") == 0
        assert analytics.stop() == 0

        # Restarted: nothing is counted twice, and the rebuilt state classifies what follows.
        analytics = AnalyticsProcess(nats_server.url, "--writeback-window", "0.5")
        samples = wait_until(lambda: (s := analytics.scrape()) and total(
            s, "kvtier_analytics_messages_total", stream="KVTIER_EVENTS", outcome="rebuilt") == len(batches)
            and s, timeout=30, what=lambda: f"state rebuilt:\n{analytics.output()[-2000:]}")
        assert total(samples, "kvtier_analytics_transitions_total") == 0
        assert total(samples, "kvtier_analytics_decisions_total") == 0
        assert total(samples, "kvtier_analytics_resident_pages", tier="device") == 1
        more = [batch(4, t0 + 15, stored(H, 8), epoch=2),  # a copy of the page stored before the restart
                batch(5, t0 + 20, removed(D, 8), epoch=2)]  # ... then a demotion, lifetime from before the restart
        asyncio.run(publish_batches(nats_server.url, more))
        asyncio.run(publish_decisions(nats_server.url, [decision("w0", [("w0", {"device": 1})], 2,
                                                                 request_id="r3")]))
        samples = analytics.wait_counted("KVTIER_EVENTS", 2)
        samples = analytics.wait_counted("KVTIER_DECISIONS", 1)
        assert total(samples, "kvtier_analytics_messages_total", stream="KVTIER_EVENTS", outcome="counted") == 2
        assert {(dict(ls)["kind"], dict(ls)["tier"]): v for (n, ls), v in samples.items()
                if n == "kvtier_analytics_transitions_total"} == {
            ("stored", "host"): 1, ("copy", "host"): 1, ("removed", "device"): 1, ("demotion", "host"): 1}
        assert total(samples, "kvtier_analytics_page_lifetime_seconds_count", tier="device") == 1
        # stored at engine time t0 + 12 (seq 3 of epoch 2, before the restart), removed at t0 + 20
        assert total(samples, "kvtier_analytics_page_lifetime_seconds_sum", tier="device") == pytest.approx(8)
        assert total(samples, "kvtier_analytics_decisions_total") == 1
        assert total(samples, "kvtier_analytics_resident_pages", tier="host") == 1
    finally:
        stop_all(analytics)


@pytest.mark.slow
def test_analytics_expires_workers_whose_lease_ran_out(nats_server):
    async def publish():
        import nats

        from kvtier.plumbing.streams import StreamSettings, ensure_streams
        from kvtier.schemas.subjects import events_subject

        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings())
        now = time.time()
        for message in (announce("wl", ttl=1.5), batch(1, now, stored(D, 1, 2, 3), worker="wl")):
            await js.publish(events_subject(M, "wl"), encode_message(message))
        await nc.close()

    asyncio.run(publish())
    analytics = AnalyticsProcess(nats_server.url)
    try:
        samples = analytics.wait_counted("KVTIER_EVENTS", 2)
        samples = wait_until(lambda: (s := analytics.scrape()) and total(
            s, "kvtier_analytics_transitions_total", kind="lease_expired") == 3 and s, timeout=15,
            what=lambda: f"lease expiry:\n{analytics.output()[-2000:]}")
        assert total(samples, "kvtier_analytics_resident_pages", worker="wl") == 0
        assert total(samples, "kvtier_analytics_workers", state="expired") == 1
    finally:
        stop_all(analytics)


@pytest.mark.slow
def test_analytics_counts_a_real_routers_decisions(nats_server, redis_server, redis_client):
    from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens

    tokens = request_tokens(6, 2)
    seeder = StateSeeder(redis_client, M)
    seeder.worker("a", 2, tokens, device=3, host=1)
    seeder.worker("b", 2)
    router = RouterProcess(redis_server.url, nats_url=nats_server.url)
    analytics = AnalyticsProcess(nats_server.url, "--models", M)
    try:
        wait_until(lambda: http("GET", router.url + "/healthz")[1]["decision_log"]["connected"], timeout=10)
        for i in range(3):
            status, body, _ = router.route(M, tokens, request_id=f"real-{i}")
            assert status == 200 and body["worker_id"] == "a", body
            assert router.release(M, f"real-{i}")[0] == 200  # its booked load would send the next one to b
        samples = analytics.wait_counted("KVTIER_DECISIONS", 3)
        assert total(samples, "kvtier_analytics_decisions_total", worker="a") == 3
        # 3 device pages + 1 host page of 2 tokens each, per decision
        assert total(samples, "kvtier_analytics_predicted_hit_tokens_total", worker="a", tier="device") == 3 * 3 * 2
        assert total(samples, "kvtier_analytics_predicted_hit_tokens_total", worker="a", tier="host") == 3 * 1 * 2
        assert total(samples, "kvtier_analytics_request_tokens_total") == 3 * 6 * 2
    finally:
        stop_all(analytics, router)


def run_report(nats_url: str, out: pathlib.Path, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "report", "--nats", nats_url, "--out", str(out),
                           "--json", *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


@pytest.mark.slow
def test_report_writes_plots_and_summary(nats_server, tmp_path):
    t0 = time.time()
    batches = live_sequence(t0)
    early, late = batches[:4], batches[4:]  # stores, copies, demotions, the promotion | the rest
    asyncio.run(publish_batches(nats_server.url, early))
    time.sleep(1.2)
    since = time.time()
    time.sleep(0.2)
    asyncio.run(publish_batches(nats_server.url, late, distinct_msg_ids(late)))
    asyncio.run(publish_decisions(nats_server.url, [
        decision("w0", [("w0", {"device": 2, "host": 1, "shared_beyond": 3}), ("w1", {})], 8, queried=True),
        decision("w1", [("w0", {"device": 1}), ("w1", {"disk": 2})], 4, request_id="r2"),
    ]))

    # the whole history
    summary, _ = run_report(nats_server.url, tmp_path / "all", "--since", str(t0 - 5), "--writeback-window", "0")
    expected_kinds: dict[str, int] = {}
    for (kind, _tier), n in EXPECTED_TRANSITIONS.items():
        expected_kinds[kind] = expected_kinds.get(kind, 0) + n
    assert {k: v for k, v in summary["transitions"].items() if v} == expected_kinds
    assert summary["events"]["batch"] == len(batches) and summary["events"]["history_messages"] == 0
    assert summary["resident_pages_at_end"]["device"] == 1
    assert summary["decisions"] == 2 and summary["decisions_per_worker"] == {"w0": 1, "w1": 1}
    assert summary["predicted_hit_tokens"] == {"device": 8, "host": 4, "disk": 8, "shared_beyond": 12}
    assert summary["shared_pool_hit_rate"] == pytest.approx(3 / 8)
    assert summary["lifetimes"]["device"]["pages"] == 3 and summary["lifetimes"]["host"]["p50_s"] == 5
    out = tmp_path / "all"
    for png in ("resident_pages.png", "transitions.png", "lifetimes.png", "decisions.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    text = (out / "summary.md").read_text()
    assert "| m-analytics | w0 | unleased | 1 | 0 | 0 | 11 | 5 | 2 | 1 | 2 | 2 | 5 | 1 | 8/4/0/12 |" in text, text
    assert "| m-analytics | w1 | unleased | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 1 | 0/0/8/0 |" in text, text
    assert ("11 stored, 5 removed, 2 copies down, 1 promotions, 2 demotions, 2 evictions; dropped: 2 cleared, "
            "2 by a new epoch, 1 by a gap, 0 by lease expiry") in text, text

    # only the window after `since`: the early batches build the state but are not counted
    summary, stdout = run_report(nats_server.url, tmp_path / "late", "--since", repr(since),
                                 "--until", repr(time.time() + 1), "--writeback-window", "0", "--model", M)
    assert summary["events"]["history_messages"] == len(early)
    assert summary["transitions"]["promotion"] == 0 and summary["transitions"]["demotion"] == 0
    assert summary["transitions"]["eviction"] == 2  # page 2 (on host since the early part), page 3
    assert summary["lifetimes"]["device"]["pages"] == 1  # page 3, stored before the window
    assert summary["resident_pages_at_end"]["device"] == 1
    assert "kvtier report:" in stdout
