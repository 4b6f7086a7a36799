"""`kvtier replay explain <request_id>`: why a router chose the worker it chose, re-derived
from the event stream.

1. Find the decision in KVTIER_DECISIONS (every decision a router made with `--nats`).
2. Rebuild the model's tier state as of the decision's timestamp (kvtier/tools/replay.py: the
   processor's own apply code, into a scratch namespace). Decisions do not record a position
   in KVTIER_EVENTS, so the moment is the decision's time: an event stored just before it but
   not yet applied by a processor then shows up as a difference.
3. Read every candidate's tiered overlap from the rebuilt state with the router's own reader
   (router/state.py `OverlapReader`, read_overlap.lua) at that moment.
4. Re-score with router/scoring.py (`score_terms`: the same function the router's logits come
   from) using the recorded weights, loads and random draw. The shared pool's hits are taken
   as recorded: Mooncake's contents are in no stream and cannot be replayed.
5. Print each candidate's terms, mark the winner, and flag every place where the
   recomputation differs from the record (overlap per tier, logit, winner, candidate set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import cast

import msgspec

from kvtier.consumers.pull import read_backward
from kvtier.plumbing.connections import redis_async_client
from kvtier.router import scoring
from kvtier.router.core import DEGRADED_ONLY_STALE, DEGRADED_STATE_STORE
from kvtier.router.hashing import RequestPages
from kvtier.router.state import OverlapReader, WorkerStatus
from kvtier.schemas.hashes import BlockHash, PageDigest, page_keys_blob
from kvtier.schemas.routing import RouteDecision, TierOverlap, decision_request_id, decode_decision
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.subjects import DECISIONS_PREFIX, DECISIONS_STREAM, decisions_subject
from kvtier.tools.replay import (
    RetentionBoundary,
    StreamReplayError,
    connect,
    iso,
    message_time,
    rebuild,
    scratch_target,
    stream_bounds,
)
from kvtier.tools.settings import ExplainSettings

TIERS = ("device", "host", "disk", "predicted")
_EPS = 1e-9


@dataclass
class Found:
    decision: RouteDecision | None
    seq: int = 0
    stored: float | None = None
    matches: int = 0
    searched: int = 0
    first_seq: int = 0
    last_seq: int = 0
    oldest: float | None = None


async def find_decision(nc, request_id: str, model: str | None = None) -> Found:
    """The latest decision logged with this request id (request ids are unique per booking,
    but dry runs may reuse one)."""
    js = nc.jetstream()
    first, last, count = await stream_bounds(js, DECISIONS_STREAM)
    found = Found(None, first_seq=first, last_seq=last,
                  oldest=await message_time(js, DECISIONS_STREAM, first) if count else None)
    if not count:
        return found
    subject = decisions_subject(model) if model else f"{DECISIONS_PREFIX}.>"
    hit = None

    def look(chunk) -> bool:
        nonlocal hit
        found.searched += len(chunk)
        for msg in chunk:
            try:
                rid = decision_request_id(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if rid == request_id:
                found.matches += 1
                hit = msg  # the latest in the chunk; later chunks had none
        return hit is not None

    # newest first: the decisions one explains are usually recent
    await read_backward(nc, DECISIONS_STREAM, subject, first, last, look)
    if hit is not None:
        found.decision, found.seq, found.stored = decode_decision(hit.data), hit.seq, hit.time
    return found


@dataclass
class Row:
    worker: str
    winner: bool
    status: str  # the worker in the rebuilt state at that moment
    recorded: TierOverlap
    replayed: TierOverlap
    prefill_load: int
    decode_load: int
    page_size: int
    terms: scoring.ScoreTerms
    recorded_logit: float


@dataclass
class Explanation:
    decision: RouteDecision
    rows: list[Row]
    chosen: str  # by the recomputation
    differences: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    probabilities: list[float] | None = None


def _pages_by_size(decision: RouteDecision) -> dict[int, RequestPages]:
    # The walk needs only the page keys; the recorded hashes are the digests' first 8 bytes
    # (full digests are needed only for Mooncake keys, which explain does not query).
    return {size: RequestPages(size, tuple(PageDigest(struct.pack(">q", h)) for h in hashes),
                               page_keys_blob(cast("list[BlockHash]", hashes)))
            for size, hashes in decision.page_hashes.items()}


async def seed_recorded_predictions(client, root: str, decision: RouteDecision) -> None:
    """Predicted pages come from bookings, which no stream holds: take them as recorded. A
    candidate that saw `device + predicted` pages in its first stage had every one of them on
    device or predicted, so the replayed state gets that prefix as predicted (pages the
    replayed state has on device still count as device, exactly as the walk counts them)."""
    pages = _pages_by_size(decision)
    keys = ModelKeys.for_model(decision.model, root)
    pipe = client.pipeline(transaction=False)
    for c in decision.candidates:
        if c.overlap.predicted and c.page_size in pages:
            blob = pages[c.page_size].keys_blob
            prefix = min(c.overlap.device + c.overlap.predicted, len(blob) // 16)
            pipe.hset(keys.predicted(c.worker_id),
                      mapping={blob[i * 16:(i + 1) * 16]: 1 for i in range(prefix)})
    if len(pipe):
        await pipe.execute()


def _status_name(status: WorkerStatus | None) -> str:
    return {None: "not-live", WorkerStatus.CANDIDATE: "live", WorkerStatus.STALE: "stale",
            WorkerStatus.UNHASHED: "unhashed"}[status]


def explain(decision: RouteDecision, views) -> Explanation:
    """Re-score `decision` on the overlaps in `views` (router/state.py WorkerViews read from
    the rebuilt state). Pure: no I/O."""
    weights, u, pages = decision.weights, decision.random_draw, decision.request_pages
    by_worker = {v.worker_id: v for v in views}
    only_stale = DEGRADED_ONLY_STALE in decision.degraded
    expected_status = "stale" if only_stale else "live"
    rows: list[Row] = []
    differences: list[dict] = []
    for c in decision.candidates:
        view = by_worker.get(c.worker_id)
        status = _status_name(view.status if view is not None else None)
        if status != expected_status:
            differences.append({"kind": "candidate", "worker": c.worker_id, "recorded": expected_status,
                                "replayed": status,
                                "detail": f"the router scored {c.worker_id} as a {expected_status} worker; in the "
                                          f"replayed state at that moment it is {status}"})
        if only_stale or view is None:
            replayed = TierOverlap(shared_beyond=c.overlap.shared_beyond)  # the router zeroes stale overlaps
        else:
            replayed = TierOverlap(device=view.overlap.device, host=view.overlap.host, disk=view.overlap.disk,
                                   shared_beyond=c.overlap.shared_beyond, predicted=view.overlap.predicted)
        for tier in TIERS:
            rec, rep = getattr(c.overlap, tier), getattr(replayed, tier)
            if rec != rep:
                differences.append({"kind": "overlap", "worker": c.worker_id, "tier": tier, "recorded": rec,
                                    "replayed": rep,
                                    "detail": f"{c.worker_id} {tier} overlap: recorded {rec}, replayed {rep}"})
        terms = scoring.score_terms(pages, scoring.CandidateInputs(c.worker_id, replayed, c.prefill_load,
                                                                   c.decode_load), weights)
        if abs(terms.logit - c.logit) > _EPS:
            differences.append({"kind": "logit", "worker": c.worker_id, "recorded": c.logit, "replayed": terms.logit,
                                "detail": f"{c.worker_id} logit: recorded {c.logit:g}, recomputed {terms.logit:g}"})
        as_recorded = scoring.score_terms(pages, scoring.CandidateInputs(c.worker_id, c.overlap, c.prefill_load,
                                                                         c.decode_load), weights).logit
        if abs(as_recorded - c.logit) > _EPS:
            differences.append({"kind": "record", "worker": c.worker_id, "recorded": c.logit,
                                "replayed": as_recorded,
                                "detail": f"{c.worker_id}: the recorded logit {c.logit:g} is not the formula on the "
                                          f"recorded inputs ({as_recorded:g}): the record is inconsistent"})
        rows.append(Row(c.worker_id, False, status, c.overlap, replayed, c.prefill_load, c.decode_load, c.page_size,
                        terms, c.logit))
    recorded_ids = {c.worker_id for c in decision.candidates}
    for view in views:
        if view.worker_id not in recorded_ids and _status_name(view.status) == expected_status:
            differences.append({"kind": "candidate", "worker": view.worker_id, "recorded": "absent",
                                "replayed": expected_status,
                                "detail": f"the replayed state has {expected_status} worker {view.worker_id}, which "
                                          "the decision did not consider"})
    chosen = ""
    probabilities = None
    if rows:
        values = [r.terms.logit for r in rows]
        index = scoring.choose(values, weights.temperature, u)
        rows[index].winner = True
        chosen = rows[index].worker
        if weights.temperature > 0:
            probabilities = _softmax(values, weights.temperature)
        recorded_pick = scoring.choose([c.logit for c in decision.candidates], weights.temperature, u)
        if decision.candidates[recorded_pick].worker_id != decision.chosen:
            differences.append({"kind": "record", "worker": decision.chosen, "recorded": decision.chosen,
                                "replayed": decision.candidates[recorded_pick].worker_id,
                                "detail": f"the recorded winner {decision.chosen} is not what the recorded logits and "
                                          f"draw choose ({decision.candidates[recorded_pick].worker_id})"})
    if chosen != decision.chosen:
        differences.append({"kind": "winner", "worker": chosen, "recorded": decision.chosen, "replayed": chosen,
                            "detail": f"winner: recorded {decision.chosen}, recomputed {chosen or 'none'}"})
    notes = []
    if any(c.overlap.predicted for c in decision.candidates):
        notes.append("predicted pages come from routers' bookings, which no stream holds: they are taken as "
                     "recorded (the replayed walk treats the recorded device + predicted prefix as predicted)")
    if decision.shared_pool_queried or any(c.overlap.shared_beyond for c in decision.candidates):
        notes.append("shared pool: hits beyond the device prefix are the recorded ones: the Mooncake pool's "
                     "contents are in no stream and cannot be replayed")
        if any(d["kind"] == "overlap" and d["tier"] == "device" for d in differences):
            notes.append("where the device overlap differs, the recorded shared hits were counted from the "
                         "recorded device prefix")
    else:
        notes.append("shared pool: not queried by this decision (no shared-pool credit); its state could not be "
                     "replayed anyway")
    if only_stale:
        notes.append("the decision had only stale workers: the router scored them by load alone (overlaps 0)")
    if any(d["kind"] in ("overlap", "candidate") for d in differences):
        notes.append("where the router saw other pages or workers than the stream explains, either the live state "
                     "diverged from the stream (see `kvtier replay --diff`) or events were applied around the "
                     "decision's moment (processor lag, lease expiry timing)")
    return Explanation(decision, rows, chosen, differences, notes, probabilities)


def _softmax(values: list[float], temperature: float) -> list[float]:
    low, high = min(values), max(values)
    if high == low:
        return [1 / len(values)] * len(values)
    weights = [math.exp(-((v - low) / (high - low)) / temperature) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


def _why(ex: Explanation) -> str:
    rows, weights, u = ex.rows, ex.decision.weights, ex.decision.random_draw
    if not rows:
        return "no candidates"
    ranked = sorted(rows, key=lambda r: r.terms.logit)
    best = ranked[0].terms.logit
    if weights.temperature > 0:
        chance = {r.worker: p for r, p in zip(rows, ex.probabilities or [])}
        return (f"{ex.chosen} drawn with probability {chance.get(ex.chosen, 0):.3f} at temperature "
                f"{weights.temperature:g} (draw u={u:.6f}); lowest logit {ranked[0].worker} {best:g}")
    ties = [r.worker for r in rows if r.terms.logit == best]
    if len(ties) > 1:
        return (f"{ex.chosen}: lowest logit {best:g}, tied with {', '.join(w for w in ties if w != ex.chosen)}; "
                f"the draw u={u:.6f} picks tie {int(min(u, 1 - 2 ** -53) * len(ties)) + 1} of {len(ties)}")
    runner = ranked[1] if len(ranked) > 1 else None
    if runner is None:
        return f"{ex.chosen}: the only candidate (logit {best:g})"
    return (f"{ex.chosen}: lowest logit {best:g}; next {runner.worker} at {runner.terms.logit:g} "
            f"(margin {runner.terms.logit - best:g})")


def _cell(recorded: int, replayed: int) -> str:
    return str(replayed) if recorded == replayed else f"{replayed}≠{recorded}"


def print_explanation(ex: Explanation, found: Found, replay_report, namespace_note: str) -> None:
    d, w = ex.decision, ex.decision.weights
    print(f"decision {d.request_id}  model {d.model}  router {d.router_id}  at {iso(d.ts)}  "
          f"(KVTIER_DECISIONS seq {found.seq}" + (f", {found.matches} decisions with this id: the latest"
                                                 if found.matches > 1 else "") + ")")
    print(f"  request: {d.request_pages} pages; page sizes {sorted(d.page_hashes)}; degraded: "
          f"{', '.join(d.degraded) or 'no'}; decision latency {d.latency_ms:.2f} ms")
    print(f"  weights: credit {w.overlap_score_credit:g}, host {w.host_cache_hit_weight:g}, disk "
          f"{w.disk_cache_hit_weight:g}, shared {w.shared_cache_multiplier:g}, prefill_load_scale "
          f"{w.prefill_load_scale:g}, temperature {w.temperature:g}; random draw u={d.random_draw:.6f}")
    r = replay_report
    print(f"  state: KVTIER_EVENTS for model {d.model} replayed up to the decision's time: seq "
          f"{r.stream_first_seq}..{r.last_seq or '-'}, {r.messages} messages ({r.batches_applied} batches, "
          f"{r.announces} announcements, {len(r.expired)} leases expired, {len(r.rebased)} rebased); {namespace_note}")
    for warning in r.warnings:
        print(f"  warning: {warning}")
    for note in ex.notes:
        print(f"  {note}")
    print("  logit = prefill_load_scale*adjusted + decode_blocks;  adjusted = max(prefill_blocks - credit, 0);")
    print("  credit = credit*device + host_w*host + disk_w*disk + shared_m*shared_beyond;  "
          "prefill_blocks = request pages + queued prefill  (x≠y: replayed x, recorded y)")
    print(f"    {'worker':<14} {'state':<8} {'device':>7} {'host':>6} {'disk':>6} {'shared':>6} | {'prefill':>7} "
          f"{'decode':>6} | {'blocks':>6} {'-dev':>7} {'-host':>7} {'-disk':>7} {'-shared':>7} {'adjusted':>8} "
          f"{'logit':>9} {'recorded':>9}")
    for row in ex.rows:
        t, o, rec = row.terms, row.replayed, row.recorded
        mark = "*" if row.winner else " "
        print(f"  {mark} {row.worker[:14]:<14} {row.status:<8} {_cell(rec.device, o.device):>7} "
              f"{_cell(rec.host, o.host):>6} {_cell(rec.disk, o.disk):>6} {o.shared_beyond:>6} | "
              f"{row.prefill_load:>7} {row.decode_load:>6} | {t.prefill_blocks:>6} {t.device_credit:>7g} "
              f"{t.host_credit:>7g} {t.disk_credit:>7g} {t.shared_credit:>7g} {t.adjusted:>8g} {t.logit:>9g} "
              f"{row.recorded_logit:>9g}")
    print(f"  winner: {_why(ex)}" + ("" if ex.chosen == d.chosen else f"  -- but the router chose {d.chosen}"))
    if ex.differences:
        print(f"  DIFFERENCES ({len(ex.differences)}): the recomputation does not match the record")
        for diff in ex.differences:
            print(f"    - {diff['detail']}")
    else:
        print("  reproduced: same candidates, overlaps, logits and winner as recorded")


def to_json(ex: Explanation, found: Found, replay_report, namespace: str | None) -> dict:
    d = ex.decision
    return {
        "found": True, "request_id": d.request_id, "model": d.model, "router_id": d.router_id, "ts": d.ts,
        "decision_seq": found.seq, "matches": found.matches, "weights": msgspec.to_builtins(d.weights),
        "random_draw": d.random_draw, "request_pages": d.request_pages, "degraded": d.degraded,
        "recorded_chosen": d.chosen, "recomputed_chosen": ex.chosen, "reproduced": not ex.differences,
        "candidates": [{
            "worker_id": r.worker, "winner": r.winner, "replayed_status": r.status,
            "recorded_overlap": msgspec.to_builtins(r.recorded), "replayed_overlap": msgspec.to_builtins(r.replayed),
            "prefill_load": r.prefill_load, "decode_load": r.decode_load, "page_size": r.page_size,
            "terms": dataclasses.asdict(r.terms), "recorded_logit": r.recorded_logit,
        } for r in ex.rows],
        "probabilities": ex.probabilities, "differences": ex.differences, "notes": ex.notes,
        "replay": replay_report.to_dict(), "namespace_kept": namespace,
    }


async def _explain(settings: ExplainSettings, nats_url: str, redis_url: str) -> tuple[int, dict]:
    """(exit code, the JSON result); the URLs are the settings', once checked given."""
    request_id = settings.request_id
    nc = await connect(nats_url)
    try:
        try:
            found = await find_decision(nc, request_id, settings.model)
        except StreamReplayError as exc:
            return _not_found(request_id, str(exc))
        if found.decision is None:
            scope = f" for model {settings.model}" if settings.model else ""
            held = (f"the {found.searched} decisions{scope} it holds (seq {found.first_seq}..{found.last_seq}, oldest "
                    f"{iso(found.oldest)})" if found.last_seq >= found.first_seq and found.oldest
                    else "it holds no decisions")
            return _not_found(request_id, (
                f"no decision with request id {request_id!r} in {DECISIONS_STREAM}: not among {held}. Either no "
                "router logged it (routers log decisions only with --nats; decisions queued while NATS was away may "
                "be dropped), it was for another model, or it has expired (the stream keeps decisions for 7 days / "
                "4 GiB, oldest first)"))
        decision = found.decision
        if DEGRADED_STATE_STORE in decision.degraded:
            message = (f"decision {decision.request_id} was made without Redis (state-store-unavailable): the router "
                       f"chose {decision.chosen} by its own in-flight count, round robin on ties; there is no "
                       "tier-aware score to re-derive")
            print(message)
            return 0, {"found": True, "request_id": decision.request_id, "reproduced": True, "note": message,
                       "recorded_chosen": decision.chosen}
        scratch = scratch_target(redis_url)
        kept = None
        try:
            try:
                report = await rebuild(nats_url, scratch, model=decision.model, at_time=decision.ts, nc=nc)
            except RetentionBoundary as exc:
                raise StreamReplayError(f"cannot rebuild the state at the decision's moment ({iso(decision.ts)}): "
                                        f"{exc}") from None
            client = redis_async_client(redis_url, socket_timeout=10)
            try:
                await seed_recorded_predictions(client, scratch.root, decision)
                views = await OverlapReader(client, root=scratch.root).read(
                    decision.model, _pages_by_size(decision), now_ms=int(decision.ts * 1000))
            finally:
                await client.aclose()
        finally:
            if settings.keep:
                if settings.ttl_s:
                    scratch.expire(settings.ttl_s)
                kept = scratch.root
            else:
                scratch.drop()
        ex = explain(decision, views)
        note = (f"kept as namespace {kept}" + (f" for {settings.ttl_s}s" if settings.ttl_s else "") if kept
                else f"scratch namespace {scratch.root} dropped")
        print_explanation(ex, found, report, note)
        return (1 if ex.differences else 0), to_json(ex, found, report, kept)
    finally:
        await nc.close()


def _not_found(request_id: str, message: str) -> tuple[int, dict]:
    print(message, file=sys.stderr)
    return 2, {"found": False, "request_id": request_id, "error": message}


def run_explain(settings: ExplainSettings) -> int:
    if not settings.nats_url or not settings.redis_url:
        raise StreamReplayError("kvtier replay explain needs --nats URL and --redis URL (or KVTIER_NATS, KVTIER_REDIS)")
    started = time.monotonic()
    code, result = asyncio.run(_explain(settings, settings.nats_url, settings.redis_url))
    if settings.json:
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        print(json.dumps(result))
    return code
