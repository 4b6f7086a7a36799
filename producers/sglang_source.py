"""ZMQ side of the bridge: SGLang's PUB socket and its ROUTER replay socket."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvtier.schemas.sglang import SEQ_BYTES, DecodedBatch, MalformedBatch, decode_payload, decode_seq, encode_seq


@dataclass(frozen=True)
class RawBatch:
    seq: int
    payload: bytes


def parse_pub_frames(frames: list[bytes]) -> RawBatch:
    """PUB message: [topic, seq, payload]."""
    if len(frames) != 3:
        raise MalformedBatch(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return RawBatch(decode_seq(frames[1]), frames[2])


class SglangSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str = "", hwm: int = 100_000):
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.connect(endpoint)

    async def wait(self, timeout_s: float) -> bool:
        """True once a message is queued; False if none came within `timeout_s`."""
        return bool(await self.socket.poll(int(timeout_s * 1000)))  # POLLIN: the default

    async def receive(self, max_messages: int) -> list[list[bytes]]:
        """Wait for one message, then take whatever else is already queued (up to a bound),
        so a burst leaves as one NATS message instead of hundreds."""
        messages = [await self.socket.recv_multipart()]
        while len(messages) < max_messages:
            try:
                messages.append(await self.socket.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
        return messages

    def close(self) -> None:
        self.socket.close(0)


class ReplaySocketError(RuntimeError):
    """SGLang's replay socket gave no complete answer in time, or an answer kvtier cannot read."""


class ReplaySocketClient:
    """Asks SGLang's replay socket for every buffered batch with seq >= start.

    Request `[b"", start_seq]` from a DEALER; replies `[b"", topic, seq, payload]`
    (`[b"", seq, payload]` before 0.5.22) per batch, then an end marker with seq -1.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float = 3.0):
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_s = timeout_s

    async def fetch(self, start_seq: int, timeout_s: float | None = None) -> list[RawBatch]:
        """Every buffered batch from `start_seq`; ReplaySocketError if no frame comes for
        `timeout_s` (default: the client's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            await sock.send_multipart([b"", encode_seq(max(start_seq, 0))])
            batches: list[RawBatch] = []
            while True:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
                except asyncio.TimeoutError:
                    raise ReplaySocketError(f"no complete answer from replay socket {self.endpoint} "
                                            f"within {timeout_s:g}s") from None
                if frames and frames[0] == b"":
                    frames = frames[1:]
                seq_frame, payload = _split_replay(frames)
                seq = decode_seq(seq_frame)
                if seq < 0:
                    return batches
                batches.append(RawBatch(seq, payload))
        finally:
            sock.close(0)


def _split_replay(frames: list[bytes]) -> tuple[bytes, bytes]:
    if len(frames) == 3:  # topic, seq, payload (>= 0.5.22)
        return frames[1], frames[2]
    if len(frames) == 2:  # seq, payload
        return frames[0], frames[1]
    raise ReplaySocketError(f"unexpected replay reply with {len(frames)} frames")


def same_ts(a: float | None, b: float | None) -> bool:
    """Whether two engine timestamps are the same one. NaN counts as equal to itself: a batch
    whose ts is NaN, seen again in a replay, is that batch again, not an engine restart (which
    would begin a new epoch and forward, and dead-letter, everything a second time)."""
    return a == b or (a is not None and b is not None and a != a and b != b)


class SourceSequencer:
    """Decides what an incoming engine seq means. Pure bookkeeping, no I/O.

    The engine numbers batches from 0 and restarts at 0 with a new process. A seq below the
    expected one is either a batch we already forwarded (seen again after a replay: same seq,
    same ts) or a restarted engine (anything else)."""

    ACCEPT, DUPLICATE, GAP, RESTART = "accept", "duplicate", "gap", "restart"

    def __init__(self, remember: int = 8192):
        self.expected: int | None = None
        self._recent: OrderedDict[int, float | None] = OrderedDict()
        self._remember = remember

    def classify(self, seq: int, ts: float | None) -> str:
        if self.expected is None or seq == self.expected:
            return self.ACCEPT
        if seq > self.expected:
            return self.GAP
        return self.DUPLICATE if self.seen(seq, ts) else self.RESTART

    def accepted(self, seq: int, ts: float | None) -> None:
        self.expected = seq + 1
        self._recent[seq] = ts
        while len(self._recent) > self._remember:
            self._recent.popitem(last=False)

    def reset(self) -> None:
        self.expected = None
        self._recent.clear()

    def expect(self, seq: int) -> None:
        """The next batch must be `seq` (e.g. 0 when the engine's replay buffer is empty)."""
        self.expected = seq

    def seen(self, seq: int, ts: float | None) -> bool:
        return seq in self._recent and same_ts(self._recent[seq], ts)


def decode_raw(raw: RawBatch) -> tuple[DecodedBatch | str, float | None]:
    """(decoded batch or the reason it is malformed, engine ts or None)."""
    try:
        decoded = decode_payload(raw.payload)
        return decoded, decoded.ts
    except MalformedBatch as exc:
        return str(exc), None


def batches_after(buffered: list[RawBatch], seq: int, ts: float) -> list[RawBatch] | None:
    """Batches after (seq, ts) if the buffer holds exactly that batch, else None."""
    for i, raw in enumerate(buffered):
        if raw.seq == seq:
            return buffered[i + 1:] if same_ts(decode_raw(raw)[1], ts) else None
    return None


__all__ = ["RawBatch", "SglangSubscriber", "ReplaySocketClient", "ReplaySocketError", "SourceSequencer", "same_ts",
           "parse_pub_frames", "SEQ_BYTES", "decode_raw", "batches_after"]
