"""Messages the processor cannot apply: stored, with the reason, on the dead-letter subjects
(`dlq_subject`) and acked, so they neither block their partition nor come back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from kvtier.consumers.processor_metrics import DEAD_LETTERS
from kvtier.plumbing.streams import dead_letter_headers
from kvtier.schemas.events import StreamMessage, UnsupportedVersion, WorkerAnnounce, decode_message
from kvtier.schemas.subjects import dlq_subject, parse_events_subject

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

log = logging.getLogger("kvtier.processor")


async def decode_or_dead_letter(nc: NATS, js: JetStreamContext, msg) -> StreamMessage | None:
    """The message decoded, or None once it is dead-lettered: undecodable, or on the subject of
    another worker than the one it names."""
    try:
        message = decode_message(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion) as exc:
        await dead_letter(nc, js, msg, f"undecodable message: {exc}", type(exc).__name__)
        return None
    meta = message.metadata if isinstance(message, WorkerAnnounce) else message
    subject = parse_events_subject(msg.subject)
    if subject is None or not subject.names(meta.model, meta.worker_id):
        await dead_letter(nc, js, msg, f"message for {meta.model}/{meta.worker_id} arrived on subject "
                                       f"{msg.subject}: refusing to apply it to another worker", "subject_mismatch")
        return None
    return message


async def dead_letter(nc: NATS, js: JetStreamContext, msg, reason: str, kind: str) -> None:
    """Store the message in the processor's dead-letter subject, saying why, then ack it."""
    DEAD_LETTERS.labels(kind).inc()
    subject = parse_events_subject(msg.subject)
    model, worker = (subject.model_token, subject.worker_token) if subject else ("unknown", "unknown")
    log.warning("dead-lettering message from %s: %s", msg.subject, reason)
    headers = dead_letter_headers(Kvtier_Reason=reason[:1024], Kvtier_Stage="processor",
                                  Kvtier_Source_Subject=msg.subject)
    if msg.metadata and msg.metadata.sequence:
        headers["Kvtier-Stream-Seq"] = str(msg.metadata.sequence.stream)
        # A message redelivered after its letter was stored (the ack was lost, or the pull
        # was rewound to the ack floor) is stored once: the id names the stored message.
        stored_at = msg.metadata.timestamp.timestamp() if msg.metadata.timestamp else 0.0
        headers["Nats-Msg-Id"] = f"kvtier-dlq:{msg.metadata.sequence.stream}:{stored_at:.6f}"
    data = msg.data
    # With these headers a message near max_payload would be over it (the server then drops
    # the connection): keep what fits, say how long it was (the stream still holds it all).
    limit = (nc.max_payload or 1 << 20) - (8 << 10)
    if len(data) > limit:
        headers["Kvtier-Truncated-From"] = str(len(data))
        data = data[:limit]
    await js.publish(dlq_subject("processor", model, worker), data, headers=headers, timeout=5.0)
    await msg.ack()  # only after the dead letter is stored: nothing is lost
