"""The JetStream bodies kvtier writes or reads itself (nats-py's API covers the rest).

- A pull request: the JSON published on `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`
  (subjects.py `pull_next_subject`) with a reply subject, on which the server delivers up to `batch` messages,
  or status messages when it has none before `expires` (consumers/pull.py `PullStream`).
- nats-server's monitoring endpoint `GET /jsz?streams=true`: each stream's size and oldest
  message, the fields `kvtier bench soak` samples. Every other field is ignored.
"""

from __future__ import annotations

import msgspec

from .limits import guarded


class PullRequest(msgspec.Struct, kw_only=True):
    #: Messages wanted.
    batch: int
    #: Nanoseconds the request stays open (the server answers 408 when it expires).
    expires: int


def encode_pull_request(request: PullRequest) -> bytes:
    return msgspec.json.encode(request)


class StreamState(msgspec.Struct, kw_only=True):
    messages: int = 0
    bytes: int = 0
    #: RFC 3339 with nanoseconds; "0001-01-01T00:00:00Z" when the stream is empty.
    first_ts: str | None = None


class StreamDetail(msgspec.Struct, kw_only=True):
    name: str
    state: StreamState | None = None


class AccountDetail(msgspec.Struct, kw_only=True):
    stream_detail: list[StreamDetail] | None = None


class Jsz(msgspec.Struct, kw_only=True):
    """`GET /jsz?streams=true` (only the fields kvtier reads)."""

    account_details: list[AccountDetail] | None = None


_jsz = msgspec.json.Decoder(Jsz)


def decode_jsz(body: bytes | str) -> Jsz:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_jsz.decode, body)
