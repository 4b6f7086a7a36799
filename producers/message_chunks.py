"""Cutting a batch's tier events into messages the NATS server accepts (pure)."""

from __future__ import annotations

from kvtier.producers.convert import encoded_size_bound, split_to_fit
from kvtier.schemas.events import TierEvent

#: Room in a message for everything but its events: the batch's other fields (names of up
#: to 256 characters, 4 bytes each at worst) and the headers (Nats-Msg-Id).
ENVELOPE_BYTES = 8 << 10


def max_payload(nc) -> int:
    return getattr(nc, "max_payload", 0) or (1 << 20)


def chunk_by_pages(events: list[TierEvent], max_pages: int, max_bytes: int = 1 << 62) -> list[list[TierEvent]]:
    """Events in messages of at most `max_pages` pages and `max_bytes` bytes of events; an
    event larger than either alone is split first (convert.split_to_fit), so no message is
    ever refused by the server for its size."""
    chunks: list[list[TierEvent]] = []
    current: list[TierEvent] = []
    pages = used = 0
    for event in events:
        for piece in split_to_fit(event, max_pages, max_bytes):
            size = len(getattr(piece, "hashes", ())) or 1
            cost = encoded_size_bound(piece)
            if current and (pages + size > max_pages or used + cost > max_bytes):
                chunks.append(current)
                current, pages, used = [], 0, 0
            current.append(piece)
            pages += size
            used += cost
    if current:
        chunks.append(current)
    return chunks
