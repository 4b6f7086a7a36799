"""`kvtier inspect`: what Redis holds for each worker, per tier, and how it got there."""

from __future__ import annotations

import json
import sys
import time

import redis

from kvtier.plumbing.connections import redis_client
from kvtier.schemas.events import ENGINE_QUEUE_FIELDS, engine_queue_from_fields
from kvtier.schemas.rates import PredictionError, RateFit, decode_error, decode_fit
from kvtier.schemas.state_keys import MODELS_KEY, ModelKeys, as_text
from kvtier.schemas.tiers import TIER_PRIORITY
from kvtier.tools.settings import InspectSettings


def collect(client: redis.Redis, model: str | None = None, worker: str | None = None) -> list[dict]:
    tokens = ([ModelKeys.for_model(model).model_token] if model
              else sorted(as_text(t) for t in client.smembers(MODELS_KEY)))
    now_ms = time.time() * 1000
    rows = []
    for token in tokens:
        keys = ModelKeys(token)
        workers = [worker] if worker else sorted(as_text(w) for w in client.smembers(keys.workers))
        for worker_id in workers:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(keys.state(worker_id))
            pipe.zscore(keys.leases, worker_id)
            pipe.hget(keys.rates, worker_id)
            pipe.hget(keys.ttft_errors, worker_id)
            state, lease, rates, errors = pipe.execute()
            state = {as_text(k): as_text(v) for k, v in state.items()}
            applied_ms = float(state.get("applied_ms", 0) or 0)
            rows.append({
                "model": token, "worker": worker_id,
                "lease_left_s": round((lease - now_ms) / 1000, 1) if lease is not None else None,
                "epoch": int(state.get("epoch", 0) or 0), "seq": int(state.get("seq", 0) or 0),
                "source_seq": int(state.get("source_seq", -1) or -1),
                "stale": state.get("stale") == "1", "stale_reason": state.get("stale_reason", ""),
                "partial": state.get("partial") == "1",
                "last_epoch_reason": state.get("last_epoch_reason", ""), "gaps": int(state.get("gaps", 0) or 0),
                "applied_ago_s": round((now_ms - applied_ms) / 1000, 1) if applied_ms else None,
                "pages": {tier.value: int(state.get(f"n{tier.bit}", 0) or 0) for tier in TIER_PRIORITY},
                # the engine's own queue at the last announce (null where the bridge cannot read it)
                "engine_queue": {"waiting": queue.waiting, "running": queue.running,
                                 "read_ago_s": round(now_ms / 1000 - queue.read_ts, 1)}
                if (queue := engine_queue_from_fields([state.get(f) for f in ENGINE_QUEUE_FIELDS])) else None,
                # what the routers learned of its speed from its first tokens (null: nothing yet)
                "rates": _rates_row(rates, errors),
            })
    return rows


def _rates_row(text, errors) -> dict | None:
    if text is None:
        return None
    try:
        fit: RateFit = decode_fit(text)
    except ValueError:
        return None
    try:
        error = decode_error(errors) if errors is not None else PredictionError()
    except ValueError:
        error = PredictionError()
    compute, host, l3, queued = fit.multipliers
    # ttft_*: how far its first tokens came from what the rates predicted (PredictionError)
    return {"compute": round(compute, 3), "host_load": round(host, 3), "l3_load": round(l3, 3),
            "queued": round(queued, 3),
            "samples": fit.samples, "relative_error": round(fit.relative_error, 3),
            "ttft_mape": round(error.mape, 3), "ttft_bias": round(error.bias, 3), "ttft_compared": error.samples}


def run_inspect(settings: InspectSettings) -> int:
    client = redis_client(settings.redis_url, socket_timeout=5)
    rows = collect(client, settings.model, settings.worker)
    if settings.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("no workers in Redis yet" + (f" for model {settings.model!r}" if settings.model else ""),
              file=sys.stderr)
        return 1
    header = (f"{'model':<20} {'worker':<16} {'lease':>6} {'device':>8} {'host':>8} {'disk':>7} {'ext':>5} "
              f"{'epoch':>14} {'seq':>7} {'applied':>8}  state")
    print(header)
    for r in rows:
        lease = "dead" if r["lease_left_s"] is None or r["lease_left_s"] < 0 else f"{r['lease_left_s']}s"
        ago = "-" if r["applied_ago_s"] is None else f"{r['applied_ago_s']}s"
        status = f"STALE ({r['stale_reason']})" if r["stale"] else ("PARTIAL" if r["partial"] else "ok")
        if r["gaps"]:
            status += f", {r['gaps']} gaps"
        if (queue := r["engine_queue"]) is not None:
            status += f", engine {queue['waiting']} waiting / {queue['running']} running"
        if (rates := r["rates"]) is not None:
            status += f", rates x{rates['compute']:g} compute ({rates['samples']} first tokens)"
            if rates["ttft_compared"]:
                status += f", TTFT predicted {rates['ttft_mape']:.0%} off (bias {rates['ttft_bias']:+.0%})"
        p = r["pages"]
        print(f"{r['model'][:20]:<20} {r['worker'][:16]:<16} {lease:>6} {p['device']:>8} {p['host']:>8} "
              f"{p['disk']:>7} {p['external']:>5} {r['epoch']:>14} {r['seq']:>7} {ago:>8}  {status}")
    return 0
