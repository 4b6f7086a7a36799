"""Router test machinery: tier state written through the processor's own apply code (as if
the pipeline had delivered it), router replicas in their own processes, and an HTTP client."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import redis

from kvtier.consumers.apply import TierStateWriter
from kvtier.schemas.events import BridgeCursor, EventBatch, PagesStored, WorkerAnnounce
from kvtier.schemas.hashes import BlockHash, sglang_block_hashes
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata

from .helpers import KvtierProcess, wait_until


def request_tokens(n_pages: int, page_size: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(n_pages * page_size)]


class StateSeeder:
    """Puts workers and their pages into Redis through TierStateWriter (the processor's apply)."""

    def __init__(self, client: redis.Redis, model: str):
        self.client, self.model = client, model
        self.writer = TierStateWriter(client)
        self._seq: dict[str, int] = {}

    def announce(self, worker: str, page_size: int, lease_ttl_s: float = 600.0,
                 layout: MooncakeLayout | None = None, url: str = "") -> None:
        meta = WorkerMetadata(worker_id=worker, model=self.model, page_size=page_size, mooncake=layout,
                              http_endpoint=url)
        self.writer.announce(WorkerAnnounce(metadata=meta, ts=time.time(), lease_ttl_s=lease_ttl_s,
                                            cursor=BridgeCursor(epoch=1, seq=self._seq.get(worker, 0))))

    def store(self, worker: str, tier: Tier, hashes: list[BlockHash]) -> None:
        seq = self._seq.get(worker, 0) + 1
        self._seq[worker] = seq
        batch = EventBatch(worker_id=worker, model=self.model, epoch=1, seq=seq, ts=time.time(),
                           source_ts=time.time(), events=[PagesStored(tier=tier, hashes=list(hashes))])
        result = self.writer.apply(batch)
        assert result.status == 0, result

    def mark_stale(self, worker: str) -> None:
        """What the processor does when a gap never fills: rebase (clear, mark stale)."""
        from kvtier.consumers.apply import ApplyMode

        seq = self._seq.get(worker, 0) + 5  # skip ahead, as after lost batches
        self._seq[worker] = seq
        batch = EventBatch(worker_id=worker, model=self.model, epoch=1, seq=seq, ts=time.time(),
                           source_ts=time.time(), events=[])
        assert self.writer.apply(batch, ApplyMode.REBASE).stale

    def worker(self, worker: str, page_size: int, tokens: list[int] | None = None, device: int = 0,
               host: int = 0, disk: int = 0, layout: MooncakeLayout | None = None, url: str = "") -> None:
        """A live worker holding the first `device` pages of `tokens` on device, the next
        `host` on host and the next `disk` on disk."""
        self.announce(worker, page_size, layout=layout, url=url)
        hashes = sglang_block_hashes(tokens or [], page_size)
        if device:
            self.store(worker, Tier.DEVICE, hashes[:device])
        if host:
            self.store(worker, Tier.HOST, hashes[device:device + host])
        if disk:
            self.store(worker, Tier.DISK, hashes[device + host:device + host + disk])


def http(method: str, url: str, body=None, timeout: float = 10.0, token: str = "") -> tuple[int, dict, dict]:
    """(status, JSON body, headers); 4xx/5xx answers are returned, not raised. `token`: sent as
    the bearer token."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, (json.loads(raw) if raw else {}), dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"raw": raw.decode(errors="replace")}
        return exc.code, payload, dict(exc.headers)


#: (model, request id) -> the owner secret of its booking, as a /v1/route answer named it.
_OWNERS: dict[tuple[str, str], str] = {}


def remember_owner(model: str, answer: dict) -> None:
    """Keep the owner secret of a /v1/route answer, for `release_body`."""
    if answer.get("owner"):
        _OWNERS[(model, answer["request_id"])] = answer["owner"]


def release_body(model: str, request_id: str, stage: str = "complete", **extra) -> dict:
    """A /v1/release body with the owner secret of the booking's answer (`remember_owner`; a
    secret of no booking when none was kept)."""
    return {"model": model, "request_id": request_id, "stage": stage,
            "owner": _OWNERS.get((model, request_id), "not-the-owner"), **extra}


def answers(url: str) -> bool:
    """Whether `url` answers 200 right now (a refused connection is a no, not an error)."""
    try:
        return http("GET", url, timeout=1)[0] == 200
    except OSError:
        return False


#: Flags for tests whose expected logits are hand-computed with the HiCache guide's load
#: scale (1), not kvtier's default (16, see docs/DESIGN.md).
GUIDE_LOAD_SCALE = ("--prefill-load-scale", "1")


class RouterProcess(KvtierProcess):
    """`kvtier router` on a free port, started and stopped by PID."""

    def __init__(self, redis_url: str, *extra: str, nats_url: str = "", env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = ()):
        from kvtier.harness.embedded import free_port

        self.port = free_port()
        args = ["router", "--redis", redis_url, "--http-port", str(self.port)]
        if nats_url:
            args += ["--nats", nats_url]
        super().__init__(*args, *extra, env=env, prefix=prefix)
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = extra[extra.index("--auth-token") + 1] if "--auth-token" in extra else ""
        wait_until(self._up, timeout=20, what=lambda: f"router on {self.url} to answer:\n{self.output()[-2000:]}")

    def _up(self) -> bool:
        if not self.alive():
            raise AssertionError(f"router exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
        return answers(self.url + "/healthz")

    def route(self, model: str, token_ids: list[int], **extra) -> tuple[int, dict, dict]:
        """POST /v1/route, asking for every candidate (`explain`) unless `explain=False` is given:
        most router tests read them. The booking's owner secret is remembered for `release`."""
        answer = self.post("/v1/route", {"model": model, "token_ids": token_ids, "explain": True, **extra})
        remember_owner(model, answer[1])
        return answer

    def release(self, model: str, request_id: str, stage: str = "complete", **extra) -> tuple[int, dict, dict]:
        """POST /v1/release with the owner secret its booking's answer named (on any replica)."""
        return self.post("/v1/release", release_body(model, request_id, stage, **extra))

    def post(self, path: str, body) -> tuple[int, dict, dict]:
        """POST to this router, with its --auth-token when it was started with one."""
        return http("POST", self.url + path, body, token=self.token)

    def index_settled(self, client: redis.Redis, model: str) -> bool:
        """This replica's index of the model follows the feed and has applied all of it, under
        the store's current marker."""
        from kvtier.schemas.state_keys import ModelKeys

        keys = ModelKeys.for_model(model)
        head = int(client.get(keys.changes_counter) or 0)
        marker = (client.hget(keys.incarnation, "id") or b"").decode()
        indexes = {i["model"]: i for i in http("GET", self.url + "/healthz")[1].get("indexes", [])}
        index = indexes.get(keys.model_token)
        return bool(index and index["ready"] and index["change"] == head and index["marker_id"] == marker)

    def wait_index_settled(self, client: redis.Redis, model: str, timeout: float = 20.0) -> None:
        wait_until(lambda: self.index_settled(client, model), timeout=timeout,
                   what=lambda: f"{self.url}'s index of {model} to reach the feed's head: "
                                f"{http('GET', self.url + '/healthz')[1].get('indexes')}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            return response.read().decode()
