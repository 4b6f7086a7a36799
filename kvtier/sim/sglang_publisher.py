"""A publisher that speaks SGLang's KV-event protocol exactly: a PUB socket sending
[topic, seq, payload] and a ROUTER replay socket serving the last `buffer_size` batches.

It exists so that kvtier can be exercised end to end without a GPU: the simulator and the
tests publish through it, and the real `kvtier bridge` consumes it unchanged. Faults that
SGLang can show are reproducible on purpose: a batch lost on the PUB path (kept in the replay
buffer), a batch beyond the buffer, an engine restart (seq back to 0).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from kvtier.schemas.sglang import REPLAY_END_SEQ, SglangEvent, encode_payload, encode_seq


class SglangEventPublisher:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay_endpoint: str | None = "tcp://127.0.0.1:*",
                 topic: str = "", buffer_size: int = 10_000, array_encoding: bool = False,
                 attn_dp_rank: int | None = None, replay_topic_frame: bool = True):
        self.topic = topic.encode()
        self.array_encoding = array_encoding
        self.attn_dp_rank = attn_dp_rank
        self.replay_topic_frame = replay_topic_frame
        self._buffer_size = buffer_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 1_000_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self.seq = 0
        self._ignore_replays = 0
        self._stop = threading.Event()
        self.replay_endpoint = ""
        self._thread: threading.Thread | None = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="sglang-replay", daemon=True)
            self._thread.start()

    def publish(self, events: list[SglangEvent], ts: float | None = None, deliver: bool = True) -> int:
        """Publish one batch; returns its seq. deliver=False loses it on the PUB path (as a
        slow subscriber would) while keeping it in the replay buffer."""
        payload = encode_payload(time.time() if ts is None else ts, events, self.attn_dp_rank, self.array_encoding)
        return self.publish_payload(payload, deliver)

    def publish_payload(self, payload: bytes, deliver: bool = True) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
        if deliver:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload])
        return seq

    def restart(self) -> None:
        """Behave like a new engine process on the same endpoints: seq from 0, empty buffer."""
        with self._lock:
            self.seq = 0
            self._buffer.clear()

    def forget_before(self, seq: int) -> None:
        """Drop buffered batches older than seq (as a full ring buffer would)."""
        with self._lock:
            while self._buffer and self._buffer[0][0] < seq:
                self._buffer.popleft()

    def ignore_replay_requests(self, count: int) -> None:
        """Leave the next `count` replay requests unanswered, as an engine too busy to answer
        in time would."""
        with self._lock:
            self._ignore_replays = count

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # SGLang ignores malformed replay requests too
            client, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                if self._ignore_replays > 0:
                    self._ignore_replays -= 1
                    continue
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                body = [self.topic, encode_seq(seq), payload] if self.replay_topic_frame else [encode_seq(seq), payload]
                self._router.send_multipart([client, b"", *body])
            end = [b"", REPLAY_END_SEQ, b""] if self.replay_topic_frame else [REPLAY_END_SEQ, b""]
            self._router.send_multipart([client, b"", *end])

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
            self._router.close(0)
        self._pub.close(0)
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
