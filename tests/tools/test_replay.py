"""`kvtier replay`, `kvtier replay explain` and `kvtier events tail` against real servers:
nats-server + a Redis-protocol server, the real `kvtier processor` (and bridge, router), all
on free loopback ports and stopped by PID.

(a) a replay at a past point equals the state the processor had then (snapshots taken
    during a run, each with the stream seq it stood at);
(b) --diff is clean on an untouched state and finds a divergence injected into live Redis;
(c) explain reproduces a real router's decision, and flags what the record cannot explain;
(d) events tail filters; (e) the retention boundary: an older point is refused.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import msgspec
import pytest
import redis

from kvtier.consumers.apply import TierStateWriter
from kvtier.router import scoring
from kvtier.schemas.events import (
    AllCleared,
    BridgeCursor,
    EventBatch,
    PagesRemoved,
    PagesStored,
    WorkerAnnounce,
    encode_message,
)
from kvtier.schemas.hashes import page_key, sglang_block_hashes
from kvtier.schemas.routing import RouteDecision, ScoringWeights, TierOverlap
from kvtier.schemas.state_keys import ModelKeys, page_member
from kvtier.schemas.subjects import DECISIONS_STREAM, EVENTS_STREAM, decisions_subject, events_subject
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import WorkerMetadata
from kvtier.tools.replay import DEFAULT_ROOT, RetentionBoundary, StreamReplayError, read_states, rebuild, scratch_target

from ..helpers import (
    HiCacheWorkload,
    KvtierProcess,
    ReferenceModel,
    RunningPipeline,
    processor_process,
    stop_all,
    wait_until,
)
from ..router_helpers import RouterProcess, http, request_tokens

MODEL = "org/replay-model"
TOKEN = "org_2freplay-model"  # subject_token(MODEL)


# --- helpers -------------------------------------------------------------------------------
def kvtier(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=timeout)


def last_json(result: subprocess.CompletedProcess) -> dict:
    lines = result.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])


def batch(worker: str, epoch: int, seq: int, *events, model: str = MODEL, reason=None) -> EventBatch:
    from kvtier.schemas.events import EpochReason

    now = time.time()
    return EventBatch(worker_id=worker, model=model, epoch=epoch, seq=seq, ts=now, source_ts=now,
                      epoch_reason=EpochReason(reason) if reason else None, events=list(events))


def announce(worker: str, page_size: int = 4, lease_ttl_s: float = 600.0, model: str = MODEL,
             cursor=(1, 0)) -> WorkerAnnounce:
    return WorkerAnnounce(metadata=WorkerMetadata(worker_id=worker, model=model, page_size=page_size),
                          ts=time.time(), lease_ttl_s=lease_ttl_s, cursor=BridgeCursor(epoch=cursor[0], seq=cursor[1]))


def stored(tier: Tier, hashes) -> PagesStored:
    return PagesStored(tier=tier, hashes=list(hashes))


def removed(tier: Tier, hashes) -> PagesRemoved:
    return PagesRemoved(tier=tier, hashes=list(hashes))


async def _publish(nats_url: str, messages) -> list[int]:
    """Publish kvtier messages as a bridge would (batches with their Nats-Msg-Id); stream seqs."""
    import nats

    from kvtier.plumbing.streams import StreamSettings, ensure_streams

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings())
        seqs = []
        for m in messages:
            if isinstance(m, EventBatch):
                ack = await js.publish(events_subject(m.model, m.worker_id), encode_message(m),
                                       headers={"Nats-Msg-Id": m.msg_id})
            else:
                ack = await js.publish(events_subject(m.metadata.model, m.metadata.worker_id), encode_message(m))
            seqs.append(ack.seq)
        return seqs
    finally:
        await nc.close()


def publish(nats_url: str, *messages) -> list[int]:
    return asyncio.run(_publish(nats_url, messages))


async def _stream_info(nats_url: str, stream: str):
    import nats

    nc = await nats.connect(nats_url)
    try:
        return await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()


def stream_info(nats_url: str, stream: str = EVENTS_STREAM):
    return asyncio.run(_stream_info(nats_url, stream))


async def _drained(nats_url: str) -> bool:
    import nats

    nc = await nats.connect(nats_url)
    try:
        consumers = await nc.jetstream().consumers_info(EVENTS_STREAM)
        durable = [c for c in consumers if (c.name or "").startswith("kvtier-processor")]
        return bool(durable) and all(c.num_pending == 0 and c.num_ack_pending == 0 for c in durable)
    finally:
        await nc.close()


def processor_drained(nats_url: str) -> bool:
    """Every message stored so far has been applied and acked by the processor."""
    return asyncio.run(_drained(nats_url))


def applied(client: redis.Redis, worker: str, epoch: int, seq: int, model: str = MODEL) -> bool:
    state = client.hmget(ModelKeys.for_model(model).state(worker), "epoch", "seq")
    return state == [str(epoch).encode(), str(seq).encode()]


def comparable(states) -> dict:
    """Everything a replay must reproduce, per worker: pages per tier, position, stale."""
    return {key: (s.epoch, s.seq, s.stale, frozenset(s.members)) for key, s in states.items()}


def rebuild_at(nats_url: str, redis_url: str, **bound) -> tuple[dict, object]:
    scratch = scratch_target(redis_url)
    try:
        report = asyncio.run(rebuild(nats_url, scratch, **bound))
        return comparable(read_states(scratch.client, scratch.root)), report
    finally:
        scratch.drop()


# --- (a) replay at past points == what the processor had then ----------------------------
@pytest.mark.slow
def test_replay_at_past_points_equals_live_snapshots(nats_server, redis_server, redis_client):
    """A real bridge (w0, HiCache workload) and directly published batches (w1: a gap that the
    processor rebases, then a new epoch) through one real processor; at three points the live
    state is snapshotted with the stream seq and time it stood at; replaying to each point
    gives it back page for page."""
    w1 = [[batch("w1", 1, s, stored(Tier.DEVICE, [1000 + s, 2000 + s])) for s in range(1, 6)]
          + [batch("w1", 1, 6, stored(Tier.HOST, [1001, 1002]), removed(Tier.DEVICE, [1001]))],
          # seq 7 never arrives: the processor waits --gap-timeout, then rebases (clear, stale)
          [batch("w1", 1, 8, stored(Tier.DISK, [3000, 3001]))],
          [batch("w1", 2, 1, stored(Tier.DEVICE, [4000]), reason="bridge_start"),
           batch("w1", 2, 2, AllCleared(), stored(Tier.HOST, [4001, 4002]))]]
    expect_w1 = [(1, 6, False), (1, 8, True), (2, 2, False)]
    snapshots = []
    with RunningPipeline(nats_server.url, redis_server.url, MODEL, processor_args=("--gap-timeout", "0.5")) as run:
        publish(nats_server.url, announce("w1"))
        workload, reference = HiCacheWorkload(seed=5), ReferenceModel()
        for phase in range(3):
            run.publish(workload, reference, 60)
            publish(nats_server.url, *w1[phase])
            run.converge(reference)
            epoch, seq, stale = expect_w1[phase]
            wait_until(lambda e=epoch, s=seq: applied(redis_client, "w1", e, s), timeout=20,
                       what=lambda: f"w1 state {redis_client.hgetall(ModelKeys.for_model(MODEL).state('w1'))}")
            wait_until(lambda: processor_drained(nats_server.url), timeout=20, what="the processor to ack everything")
            for _ in range(20):  # a snapshot no message landed in the middle of
                before = stream_info(nats_server.url).state.last_seq
                live = comparable(read_states(redis_client, DEFAULT_ROOT))
                moment = time.time()
                if stream_info(nats_server.url).state.last_seq == before:
                    break
            assert live[(TOKEN, "w1")][:3] == (epoch, seq, stale)
            snapshots.append((before, moment, live))
            time.sleep(0.05)  # keep later messages strictly after `moment`
    assert len({len(s[2][(TOKEN, "w0")][3]) for s in snapshots}) > 1, "the phases should differ"

    for seq, _moment, live in snapshots:
        replayed, report = rebuild_at(nats_server.url, redis_server.url, at_seq=seq)
        assert replayed == live, f"replay at seq {seq} differs from the live snapshot"
        assert report.last_seq <= seq and report.bound_seq == seq
    # the gap is reported as such, and from phase 2 on the rebase is there
    _, report = rebuild_at(nats_server.url, redis_server.url, at_seq=snapshots[1][0])
    assert [(r["worker"], r["seq"]) for r in report.rebased] == [("w1", 8)]
    assert "gap" in report.rebased[0]["reason"]

    # the same through the CLI, by time and by seq, for one model and one worker
    seq, moment, live = snapshots[1]
    result = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--at-time", repr(moment),
                    "--model", MODEL, "--json")
    assert result.returncode == 0, result.stderr
    out = last_json(result)
    workers = {w["worker"]: w for w in out["workers"]}
    assert set(workers) == {"w0", "w1"} and workers["w1"]["stale"] and workers["w1"]["seq"] == 8
    w0 = live[(TOKEN, "w0")][3]
    assert sum(workers["w0"]["pages"].values()) == len(w0)
    result = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--at-seq", str(seq),
                    "--worker", "w0", "--into", "scratch-a", "--ttl", "60", "--json")
    assert result.returncode == 0, result.stderr
    assert "into namespace scratch-a" in result.stdout and "w0" in result.stdout
    got = read_states(redis_client, "scratch-a")
    assert list(got) == [(TOKEN, "w0")] and frozenset(got[(TOKEN, "w0")].members) == w0
    assert 0 < redis_client.ttl(ModelKeys(TOKEN, "scratch-a").pages("w0")) <= 60
    # the live keys were never touched, and nothing of the scratch state is under kvt:
    assert comparable(read_states(redis_client, DEFAULT_ROOT))[(TOKEN, "w1")][:3] == (2, 2, False)


# --- (b) --diff ----------------------------------------------------------------------------
@pytest.mark.slow
def test_diff_is_clean_then_finds_an_injected_divergence(nats_server, redis_server, redis_client):
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        publish(nats_server.url, announce("a"), announce("b"),
                batch("a", 1, 1, stored(Tier.DEVICE, [1, 2, 3])), batch("a", 1, 2, stored(Tier.HOST, [1, 2])),
                batch("b", 1, 1, stored(Tier.DEVICE, [7, 8])), batch("a", 1, 3, removed(Tier.DEVICE, [3])))
        wait_until(lambda: applied(redis_client, "a", 1, 3) and applied(redis_client, "b", 1, 1))
        base = ["replay", "--nats", nats_server.url, "--redis", redis_server.url, "--diff", "--json"]
        clean = kvtier(*base)
        assert clean.returncode == 0, clean.stdout + clean.stderr
        assert last_json(clean)["diff"] == {"diverging_pages": 0, "workers": []}
        assert "no page diverges" in clean.stdout

        keys = ModelKeys.for_model(MODEL)
        redis_client.srem(keys.pages("a"), page_member(Tier.HOST, page_key(2)))  # lost from live
        redis_client.sadd(keys.pages("b"), page_member(Tier.DISK, page_key(99)))  # never in the stream
        dirty = kvtier(*base)
        assert dirty.returncode == 1, dirty.stdout + dirty.stderr
        diff = last_json(dirty)["diff"]
        assert diff["diverging_pages"] == 2
        by_worker = {w["worker"]: w for w in diff["workers"]}
        assert by_worker["a"]["only_replay"] == {"host": [page_key(2)]} and by_worker["a"]["only_live"] == {}
        assert by_worker["b"]["only_live"] == {"disk": [page_key(99)]} and by_worker["b"]["only_replay"] == {}
        assert "1 only in replay" in dirty.stdout and "1 only in live" in dirty.stdout
        # scoped to the untouched... there is none: scoped to worker b only b is reported
        only_b = kvtier(*base, "--worker", "b")
        assert only_b.returncode == 1 and [w["worker"] for w in last_json(only_b)["diff"]["workers"]] == ["b"]

        # scratch namespaces: --drop, and the live root is refused; --into-db N
        kept = last_json(kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--into", "keepme",
                                "--ttl", "0", "--json"))
        assert kept["replay"]["namespace"] == "keepme" and redis_client.ttl(ModelKeys(TOKEN, "keepme").pages("a")) == -1
        again = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--into", "keepme")
        assert again.returncode == 2 and "already holds" in again.stderr
        dropped = kvtier("replay", "--redis", redis_server.url, "--drop", "keepme", "--json")
        assert dropped.returncode == 0 and last_json(dropped)["dropped"] > 0
        assert not list(redis_client.scan_iter(match="keepme:*"))
        refused = kvtier("replay", "--redis", redis_server.url, "--drop", "kvt")
        assert refused.returncode == 2 and "live tier state" in refused.stderr
        assert redis_client.exists(keys.pages("a"))
        in_db = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--into-db", "3", "--json")
        assert in_db.returncode == 0, in_db.stderr
        db3 = redis.Redis(host="127.0.0.1", port=redis_server.port, db=3)
        assert {m.decode() for m in db3.smembers(keys.pages("a"))} == {
            page_member(Tier.DEVICE, page_key(1)), page_member(Tier.DEVICE, page_key(2)),
            page_member(Tier.HOST, page_key(1)), page_member(Tier.HOST, page_key(2))}
        assert kvtier("replay", "--redis", redis_server.url, "--into-db", "3", "--drop").returncode == 0
        assert db3.dbsize() == 0
        live_db = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--into-db", "0")
        assert live_db.returncode == 2 and "live database" in live_db.stderr
    finally:
        stop_all(processor)


# --- (c) explain ---------------------------------------------------------------------------
async def _decisions(nats_url: str) -> list[tuple[int, RouteDecision]]:
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(DECISIONS_STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(DECISIONS_STREAM, seq)
            out.append((seq, msgspec.msgpack.decode(msg.data, type=RouteDecision)))
        return out
    finally:
        await nc.close()


def logged(nats_url: str, request_id: str) -> RouteDecision | None:
    try:
        decisions = asyncio.run(_decisions(nats_url))
    except Exception:  # noqa: BLE001 - the stream may not exist yet
        return None
    return next((d for _, d in decisions if d.request_id == request_id), None)


async def _publish_decision(nats_url: str, decision: RouteDecision) -> None:
    import nats

    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().publish(decisions_subject(decision.model), msgspec.msgpack.encode(decision))
    finally:
        await nc.close()


def explain(nats_url: str, redis_url: str, request_id: str, *extra: str) -> tuple[int, dict, str]:
    result = kvtier("replay", "explain", request_id, "--nats", nats_url, "--redis", redis_url, "--json", *extra)
    return result.returncode, last_json(result), result.stdout + result.stderr


@pytest.mark.slow
def test_explain_reproduces_a_real_routers_decision_and_flags_differences(nats_server, redis_server, redis_client):
    tokens = request_tokens(8, 4)
    h = sglang_block_hashes(tokens, 4)
    processor = processor_process(nats_server.url, redis_server.url)
    router = None
    try:
        # seeded through the real pipeline: stream -> processor -> Redis
        publish(nats_server.url, announce("a"), announce("b"), announce("c"),
                batch("a", 1, 1, stored(Tier.DEVICE, h[:3]), stored(Tier.HOST, h[:5])),
                batch("b", 1, 1, stored(Tier.DEVICE, h[:2]), stored(Tier.DISK, h[2:8])),
                batch("c", 1, 1, stored(Tier.HOST, h[1:8])),  # not from the root: counts nothing
                batch("a", 1, 2, removed(Tier.DEVICE, h[2:3])))
        wait_until(lambda: applied(redis_client, "a", 1, 2) and applied(redis_client, "c", 1, 1))
        router = RouterProcess(redis_server.url, "--router-id", "replica-x", nats_url=nats_server.url)
        wait_until(lambda: http("GET", router.url + "/healthz")[1]["decision_log"]["connected"], timeout=15)
        status, first, _ = router.route(MODEL, tokens, request_id="req-1", max_new_tokens=16)
        assert status == 200, first
        status, second, _ = router.route(MODEL, tokens, request_id="req-2",
                                         overrides={"disk_cache_hit_weight": 0.9, "prefill_load_scale": 2.0})
        assert status == 200, second
        wait_until(lambda: logged(nats_server.url, "req-2"), timeout=15, what="req-2 in KVTIER_DECISIONS")

        for body in (first, second):
            code, out, text = explain(nats_server.url, redis_server.url, body["request_id"])
            assert code == 0, text
            assert out["reproduced"] and out["differences"] == []
            assert out["recomputed_chosen"] == out["recorded_chosen"] == body["worker_id"]
            got = {c["worker_id"]: c for c in out["candidates"]}
            for c in body["candidates"]:
                mine = got[c["worker_id"]]
                assert mine["replayed_overlap"] == mine["recorded_overlap"] == c["overlap"]
                assert mine["terms"]["logit"] == mine["recorded_logit"] == c["logit"]
                t = mine["terms"]
                assert t["prefill_blocks"] == body["request_pages"] + c["prefill_load"]
                assert t["decode_blocks"] == c["decode_load"]
            assert [c["worker_id"] for c in out["candidates"] if c["winner"]] == [body["worker_id"]]
            assert "reproduced" in text and "* " + body["worker_id"] in text
        assert (first["worker_id"] == "a"
                and {c["worker_id"]: c["overlap"]["disk"] for c in first["candidates"]}["b"] == 6)
        # req-2 saw req-1's booking on a: its recorded load is in the terms
        loaded = {c["worker_id"]: c for c in explain(nats_server.url, redis_server.url, "req-2")[1]["candidates"]}
        assert loaded["a"]["decode_load"] > 0 and loaded["a"]["terms"]["decode_blocks"] == loaded["a"]["decode_load"]

        # live state changed outside the stream: the router sees c holding the whole request on
        # device, the stream never said so -> overlap, logit and winner all differ
        assert router.release(MODEL, "req-1")[0] == 200 and router.release(MODEL, "req-2")[0] == 200
        # Written as a processor writes (so the routers' indexes see it, through the change
        # feed), but never published to the stream.
        assert TierStateWriter(redis_client).apply(batch("c", 1, 2, stored(Tier.DEVICE, h))).status == 0
        router.wait_index_settled(redis_client, MODEL)
        status, third, _ = router.route(MODEL, tokens, request_id="req-3", book=False)
        assert status == 200 and third["worker_id"] == "c", third
        wait_until(lambda: logged(nats_server.url, "req-3"), timeout=15)
        code, out, text = explain(nats_server.url, redis_server.url, "req-3", "--model", MODEL)
        assert code == 1, text
        kinds = {(d["kind"], d.get("worker"), d.get("tier")) for d in out["differences"]}
        assert ("overlap", "c", "device") in kinds and ("logit", "c", None) in kinds and ("winner", "a", None) in kinds
        assert out["recorded_chosen"] == "c" and out["recomputed_chosen"] == "a"
        assert "DIFFERENCES" in text and "device overlap: recorded 8, replayed 0" in text

        # a tampered record: a's recorded host overlap and the winner changed
        original = logged(nats_server.url, "req-1")
        cands = [msgspec.structs.replace(c, overlap=msgspec.structs.replace(c.overlap, host=c.overlap.host + 3))
                 if c.worker_id == "a" else c for c in original.candidates]
        asyncio.run(_publish_decision(nats_server.url, msgspec.structs.replace(
            original, request_id="req-1-tampered", candidates=cands, chosen="b")))
        wait_until(lambda: logged(nats_server.url, "req-1-tampered"), timeout=10)
        code, out, text = explain(nats_server.url, redis_server.url, "req-1-tampered")
        assert code == 1, text
        kinds = {(d["kind"], d.get("worker"), d.get("tier")) for d in out["differences"]}
        assert ("overlap", "a", "host") in kinds and ("record", "a", None) in kinds
        assert ("winner", "a", None) in kinds and out["recomputed_chosen"] == "a"

        # not found: said clearly, exit 2
        code, out, text = explain(nats_server.url, redis_server.url, "no-such-request")
        assert code == 2 and out["found"] is False and "no decision with request id 'no-such-request'" in text
        # explain leaves no scratch state behind
        assert not [k for k in redis_client.scan_iter(match="kvtreplay-*")]
    finally:
        stop_all(*(p for p in (router, processor) if p is not None))


def test_score_terms_are_the_logits():
    """The breakdown explain prints is the function the router's logits come from."""
    weights = ScoringWeights(host_cache_hit_weight=0.6, shared_cache_multiplier=0.3, prefill_load_scale=1.7)
    for overlap, prefill, decode in [(TierOverlap(device=3, host=2, disk=1, shared_beyond=4), 5, 7),
                                     (TierOverlap(device=40), 0, 3), (TierOverlap(), 2, 0)]:
        c = scoring.CandidateInputs("w", overlap, prefill, decode)
        t = scoring.score_terms(10, c, weights)
        assert scoring.logits(10, [c], weights) == [t.logit]
        assert t.credit == scoring.cache_credit(overlap, weights)
        assert t.credit == t.device_credit + t.host_credit + t.disk_credit + t.shared_credit + t.predicted_credit
        assert t.prefill_blocks == 10 + prefill and t.adjusted == max(t.prefill_blocks - t.credit, 0)
        assert t.logit == weights.prefill_load_scale * t.adjusted + t.decode_blocks


# --- (d) events tail -----------------------------------------------------------------------
def tail(nats_url: str, *args: str) -> list[dict]:
    result = kvtier("events", "tail", "--nats", nats_url, "--json", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_events_tail_filters(nats_server):
    publish(nats_server.url, announce("w0"),
            batch("w0", 1, 1, stored(Tier.DEVICE, [1, 2]), stored(Tier.HOST, [1]), reason="bridge_start"),
            batch("w0", 1, 2, removed(Tier.DEVICE, [2]), AllCleared()),
            batch("w1", 1, 1, stored(Tier.DISK, [5, 6, 7, 8, 9])),
            batch("x0", 1, 1, stored(Tier.DEVICE, [11]), model="other/model"))
    time.sleep(0.05)
    middle = time.time()
    time.sleep(0.05)
    publish(nats_server.url, batch("w1", 1, 2, removed(Tier.DISK, [5])))

    everything = tail(nats_server.url, "--last", "100")
    assert [(e["worker"], e["kind"], e["tier"]) for e in everything] == [
        ("w0", "announce", None), ("w0", "stored", "device"), ("w0", "stored", "host"), ("w0", "removed", "device"),
        ("w0", "cleared", None), ("w1", "stored", "disk"), ("x0", "stored", "device"), ("w1", "removed", "disk")]
    assert [e["seq"] for e in everything] == sorted(e["seq"] for e in everything)
    assert [(e["kind"], e["tier"]) for e in tail(nats_server.url, "--worker", "w0", "--kind", "stored",
                                                 "--last", "100")] == [("stored", "device"), ("stored", "host")]
    assert [(e["worker"], e["pages"]) for e in tail(nats_server.url, "--tier", "disk")] == [("w1", 5), ("w1", 1)]
    assert [e["kind"] for e in tail(nats_server.url, "--kind", "announce")] == ["announce"]
    assert [e["worker"] for e in tail(nats_server.url, "--model", "other/model")] == ["x0"]
    assert [e["worker"] for e in tail(nats_server.url, "--model", MODEL, "--kind", "cleared")] == ["w0"]
    assert [(e["worker"], e["kind"]) for e in tail(nats_server.url, "--last", "2")] == [("x0", "stored"),
                                                                                        ("w1", "removed")]
    assert [(e["worker"], e["worker_seq"]) for e in tail(nats_server.url, "--since", repr(middle))] == [("w1", 2)]
    stored_keys = tail(nats_server.url, "--worker", "w1", "--kind", "stored")[0]["page_keys"]
    assert stored_keys == [page_key(x) for x in (5, 6, 7, 8, 9)]

    text = kvtier("events", "tail", "--nats", nats_server.url, "--worker", "w0", "--last", "100").stdout.splitlines()
    assert len(text) == 5
    assert f"{MODEL}/w0 e1:1 stored device 2 pages [" in text[1] and "[new epoch: bridge_start]" in text[1]
    assert " #3 " in text[3] and "removed device 1 page [" in text[3]
    assert "announce page_size 4, lease 600s" in text[0]

    follower = KvtierProcess("events", "tail", "--nats", nats_server.url, "--worker", "w1", "--follow", "--last", "1")
    try:
        wait_until(lambda: "w1 e1:2 removed disk" in follower.output(), timeout=20, what=follower.output)
        publish(nats_server.url, batch("w1", 1, 3, stored(Tier.HOST, [42])), batch("w0", 1, 3, stored(Tier.HOST, [43])))
        wait_until(lambda: "w1 e1:3 stored host 1 page" in follower.output(), timeout=20, what=follower.output)
    finally:
        assert follower.stop() == 0, follower.output()
    assert "w0" not in follower.output()


# --- (e) retention -------------------------------------------------------------------------
@pytest.mark.slow
def test_replay_refuses_a_point_older_than_retention(nats_server, redis_server, redis_client):
    """A processor given --stream-max-bytes updates the existing stream: its oldest messages
    go. Replay then refuses a point before the first retained message, and a replay of what
    is left says the worker's history is truncated (rebased and marked stale), which --diff
    shows against the live state that saw everything."""
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        publish(nats_server.url, announce("w0"),
                *[batch("w0", 1, s, stored(Tier.DEVICE, range(s * 10, s * 10 + 8))) for s in range(1, 41)])
        wait_until(lambda: applied(redis_client, "w0", 1, 40))
        first_time = time.time()
    finally:
        stop_all(processor)
    size = stream_info(nats_server.url).state.bytes
    processor = processor_process(nats_server.url, redis_server.url, "--stream-max-bytes", str(size // 2))
    try:
        wait_until(lambda: stream_info(nats_server.url).config.max_bytes == size // 2, timeout=20,
                   what=processor.output)
        info = stream_info(nats_server.url)
        assert info.state.first_seq > 2 and info.state.bytes <= size // 2
        assert "changing retention" in processor.output()

        old = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--at-seq", "1")
        assert old.returncode == 2
        assert "older than the first retained message" in old.stderr and f"seq {info.state.first_seq}" in old.stderr
        before = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url,
                        "--at-time", repr(first_time - 3600))
        assert before.returncode == 2 and "older than the first retained message" in before.stderr
        with pytest.raises(RetentionBoundary):
            asyncio.run(rebuild(nats_server.url, scratch_target(redis_server.url), at_seq=1))
        with pytest.raises(StreamReplayError, match="past the stream's last message"):
            asyncio.run(rebuild(nats_server.url, scratch_target(redis_server.url), at_seq=info.state.last_seq + 5))

        rest = kvtier("replay", "--nats", nats_server.url, "--redis", redis_server.url, "--diff", "--json")
        assert rest.returncode == 1, rest.stdout + rest.stderr
        out = last_json(rest)
        (rebase,) = out["replay"]["rebased"]  # the first retained batch (stream seq 1 was the announcement)
        assert rebase["seq"] == info.state.first_seq - 1 and rebase["reason"].startswith("history truncated")
        assert "past retention" in rest.stderr
        (w0,) = out["workers"]
        assert w0["stale"] and w0["seq"] == 40
        assert out["diff"]["diverging_pages"] > 0
        assert all(not w["only_replay"] for w in out["diff"]["workers"])  # replay holds less, never more
    finally:
        stop_all(processor)


def test_explain_rescoring_is_pure_and_covers_sampling_ties_and_stale_only():
    """`explain()` on hand-made inputs: temperature sampling, a tie broken by the draw, a
    decision among stale workers only, and a live worker the decision did not consider."""
    from kvtier.router.state import WorkerStatus, WorkerView
    from kvtier.schemas.routing import CandidateScore
    from kvtier.tools.explain import explain as explain_decision

    def decision(weights, u, cands, degraded=()):
        values = scoring.logits(8, [scoring.CandidateInputs(w, o, p, d) for w, o, p, d in cands], weights)
        chosen = cands[scoring.choose(values, weights.temperature, u)][0]
        return RouteDecision(request_id="r", model=MODEL, router_id="x", ts=time.time(), weights=weights,
                             random_draw=u, page_hashes={4: [1, 2]}, request_pages=8, chosen=chosen,
                             degraded=list(degraded),
                             candidates=[CandidateScore(worker_id=w, logit=v, overlap=o, prefill_load=p,
                                                        decode_load=d, page_size=4)
                                         for (w, o, p, d), v in zip(cands, values)])

    def view(w, device=0, host=0, status=WorkerStatus.CANDIDATE):
        return WorkerView(w, status, 4, TierOverlap(device=device, host=host), 0, 0)

    hot = ScoringWeights(temperature=0.7)
    cands = [("a", TierOverlap(device=4, shared_beyond=2), 3, 1), ("b", TierOverlap(host=6), 0, 0)]
    ex = explain_decision(decision(hot, 0.93, cands), [view("a", 4), view("b", host=6)])
    assert not ex.differences and ex.probabilities and abs(sum(ex.probabilities) - 1) < 1e-9
    tie = [("a", TierOverlap(device=2), 0, 0), ("b", TierOverlap(device=2), 0, 0)]
    for u in (0.1, 0.9):
        ex = explain_decision(decision(ScoringWeights(), u, tie), [view("a", 2), view("b", 2)])
        assert not ex.differences and ex.chosen == ("a" if u < 0.5 else "b")
    stale = [("a", TierOverlap(), 5, 0), ("b", TierOverlap(), 1, 0)]
    ex = explain_decision(decision(ScoringWeights(), 0.5, stale, ["only-stale-workers"]),
                          [view("a", 8, status=WorkerStatus.STALE), view("b", status=WorkerStatus.STALE)])
    assert not ex.differences and ex.chosen == "b"
    ex = explain_decision(decision(ScoringWeights(), 0.5, tie), [view("a", 2), view("b", 2), view("new", 8)])
    assert [(d["kind"], d["worker"]) for d in ex.differences] == [("candidate", "new")]
