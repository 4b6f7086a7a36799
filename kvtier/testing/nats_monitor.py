"""What nats-server's monitoring (`/jsz?streams=true`, decoded into schemas/jetstream.py) says of
each stream: its bytes, messages and the age of its oldest message. `kvtier bench soak` samples
it; the fuzz table checks it on hostile replies."""

from __future__ import annotations

from kvtier.schemas.jetstream import Jsz, StreamState


def parse_ts(text: str | None) -> float | None:
    """NATS monitoring timestamps: RFC 3339 with nanoseconds."""
    from datetime import datetime

    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
        return base + (float("0." + frac.split("+")[0].split("-")[0]) if frac else 0.0)
    except (ValueError, OverflowError):
        return None


def streams_of(jsz: Jsz, now: float) -> dict[str, dict]:
    """name -> {bytes, messages, age_s} (seconds since the oldest message, at `now`)."""
    out = {}
    for account in jsz.account_details or []:
        for stream in account.stream_detail or []:
            state = stream.state or StreamState()
            first = parse_ts(state.first_ts)
            out[stream.name] = {"bytes": state.bytes, "messages": state.messages,
                                "age_s": round(now - first, 1) if first and state.messages else 0.0}
    return out
