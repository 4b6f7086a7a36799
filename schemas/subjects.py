"""NATS names: subjects, stream and consumer names. Tokens are made subject-safe here only."""

from __future__ import annotations

import re

import msgspec

EVENTS_STREAM = "KVTIER_EVENTS"
DLQ_STREAM = "KVTIER_DLQ"
EVENTS_PREFIX = "kvtier.events"
DLQ_PREFIX = "kvtier.dlq"
CONTROL_PREFIX = "kvtier.control"
DECISIONS_STREAM = "KVTIER_DECISIONS"
DECISIONS_PREFIX = "kvtier.decisions"

_UNSAFE = re.compile(r"[^A-Za-z0-9\-]")


def _escaped(match: re.Match) -> str:
    return "".join(f"_{byte:02x}" for byte in match.group().encode("utf-8", "surrogatepass"))


def subject_token(name: str) -> str:
    """Make a model or worker name one safe subject token, one-to-one: letters, digits and '-'
    stay, every other byte of its UTF-8 becomes '_' and two hex digits ('meta-llama/Llama-3.1-8B'
    -> 'meta-llama_2fLlama-3_2e1-8B'). One-to-one because the token names the model's keys in
    Redis and its subjects: a lossy mapping made 'a/b', 'a.b' and 'a_b' share one tier state."""
    if not name:
        raise ValueError("empty name cannot be a subject token")
    return _UNSAFE.sub(_escaped, name)


_ESCAPE = re.compile(r"(?:_[0-9a-f]{2})+")


def name_of_token(token: str) -> str:
    """The name `subject_token` made `token` from (its inverse)."""
    return _ESCAPE.sub(lambda m: bytes.fromhex(m.group().replace("_", "")).decode("utf-8", "surrogatepass"), token)


def events_subject(model: str, worker_id: str) -> str:
    return f"{EVENTS_PREFIX}.{subject_token(model)}.{subject_token(worker_id)}"


def stored_events_subject_pattern(model: str, worker_id: str) -> str:
    """The subject as the stream stores it: a partition token is appended by the stream's
    subject transform, so the publisher need not know the partition count."""
    return f"{events_subject(model, worker_id)}.*"


def partition_of(model: str, worker_id: str, partitions: int) -> int:
    """The partition the stream's subject transform puts a worker in: nats-server's
    partition(n, 1, 2), FNV-1a 32 over the model and worker tokens concatenated, mod n."""
    h = 0x811C9DC5
    for byte in (subject_token(model) + subject_token(worker_id)).encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % partitions


def partition_filter(partition: int) -> str:
    return f"{EVENTS_PREFIX}.*.*.{partition}"


def partition_transform_dest(partitions: int) -> str:
    return f"{EVENTS_PREFIX}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{partition({partitions},1,2)}}}}"


def control_subject(model: str, worker_id: str) -> str:
    return f"{CONTROL_PREFIX}.{subject_token(model)}.{subject_token(worker_id)}"


def dlq_subject(stage: str, model: str = "unknown", worker_id: str = "unknown") -> str:
    return f"{DLQ_PREFIX}.{stage}.{subject_token(model or 'unknown')}.{subject_token(worker_id or 'unknown')}"


def decisions_subject(model: str) -> str:
    return f"{DECISIONS_PREFIX}.{subject_token(model)}"


def pull_next_subject(stream: str, consumer: str) -> str:
    """Where a JetStream pull request (schemas/jetstream.py `PullRequest`) on `consumer` of
    `stream` is published."""
    return f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


class EventsSubject(msgspec.Struct, frozen=True):
    """An events subject read back from the stream: `kvtier.events.<model>.<worker>.<partition>`
    (the partition token appended by the stream's transform; None on a subject as published)."""

    model_token: str
    worker_token: str
    partition: int | None

    def names(self, model: str, worker_id: str) -> bool:
        """Whether this is the subject of that model's worker (the processor applies a message
        only to the worker its subject names)."""
        return (self.model_token, self.worker_token) == (subject_token(model), subject_token(worker_id))


def parse_events_subject(subject: str) -> EventsSubject | None:
    """The tokens of an events subject, published or stored; None for any other subject."""
    tokens = subject.split(".")
    if len(tokens) not in (4, 5) or f"{tokens[0]}.{tokens[1]}" != EVENTS_PREFIX or not tokens[2] or not tokens[3]:
        return None
    if len(tokens) == 4:
        return EventsSubject(tokens[2], tokens[3], None)
    return EventsSubject(tokens[2], tokens[3], int(tokens[4])) if tokens[4].isdigit() else None
