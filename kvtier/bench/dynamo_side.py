"""Side by side: Dynamo's Rust `RadixTree.apply_event` (package `ai-dynamo-runtime`, optional)
on the device-tier part of the same events the ingest bench sends through kvtier.

Dynamo's tree is single-tier and in-process (no broker, no store, no durability), so this
is the rate of its index alone. Events are turned into Dynamo's JSON before timing; the
clock stops when a `find_matches` issued after the last event returns (the tree applies
events on its own thread, in order)."""

from __future__ import annotations

import json
import time
from typing import Any

from kvtier.schemas.events import EventBatch, PagesRemoved, PagesStored, decode_message
from kvtier.schemas.tiers import Tier

U64 = 1 << 64


class DynamoMissing(RuntimeError):
    pass


def dynamo_apply_rate(payloads: list[tuple[str, int, bytes, int]]) -> dict[str, float | None]:
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        raise DynamoMissing(
            "the Dynamo side-by-side needs ai-dynamo-runtime: pip install -e '.[bench-dynamo]'") from None
    worker_ids: dict[str, int] = {}
    events: list[tuple[int, bytes]] = []
    transitions = 0
    for n, (worker, _seq, data, _) in enumerate(payloads):
        wid = worker_ids.setdefault(worker, len(worker_ids))
        message = decode_message(data)
        if not isinstance(message, EventBatch):
            continue
        for event in message.events:
            if not isinstance(event, (PagesStored, PagesRemoved)) or event.tier != Tier.DEVICE:
                continue  # Dynamo's tree has one tier, and no "everything cleared"
            hashes = [h % U64 for h in event.hashes]
            body: dict[str, dict[str, Any]]
            if isinstance(event, PagesStored):
                body = {"stored": {"parent_hash": None,
                                   "blocks": [{"block_hash": h, "tokens_hash": h} for h in hashes]}}
            else:
                body = {"removed": {"block_hashes": hashes}}
            events.append((wid, json.dumps({"event_id": n, "data": body, "dp_rank": 0}).encode()))
            transitions += len(hashes)
    tree = RadixTree()
    start = time.perf_counter()
    for wid, blob in events:
        tree.apply_event(wid, blob)
    tree.find_matches([1])  # queued behind every event: returns once they are applied
    elapsed = time.perf_counter() - start
    return {"dynamo_transitions": transitions, "dynamo_seconds": round(elapsed, 4),
            "dynamo_transitions_per_s": round(transitions / elapsed) if elapsed > 0 else None}
