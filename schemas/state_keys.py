"""The Redis layout of tier state: a contract between the processor (writer) and routers,
replay and analytics (readers).

Every key of one model carries the hash tag `{<model token>}`, so one model's state lives in
one hash slot: the apply script is atomic over it, and Redis Cluster shards by model.

  kvt:{m}:b:<page>          hash  worker -> tier bits           (routers read this)
  kvt:{m}:w:<worker>:pages  hash  page -> tier bits             (per-worker reverse index)
  kvt:{m}:w:<worker>:state  hash  epoch, seq, stale, ...        (apply bookkeeping)
  kvt:{m}:w:<worker>:meta   str   WorkerMetadata as JSON
  kvt:{m}:leases            zset  worker -> lease expiry (unix ms)
  kvt:{m}:workers           set   every worker with state
  kvt:models                set   model tokens (no tag: read once, outside any script)

`<page>` is a `PageKey` (16 hex digits); tier bits are `schemas.tiers.TIER_BITS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hashes import PageKey
from .subjects import subject_token

MODELS_KEY = "kvt:models"


@dataclass(frozen=True)
class ModelKeys:
    model_token: str

    @classmethod
    def for_model(cls, model: str) -> "ModelKeys":
        return cls(subject_token(model))

    @property
    def base(self) -> str:
        return f"kvt:{{{self.model_token}}}"

    @property
    def block_prefix(self) -> str:
        return f"{self.base}:b:"

    def block(self, page: PageKey) -> str:
        return f"{self.base}:b:{page}"

    @property
    def leases(self) -> str:
        return f"{self.base}:leases"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    def pages(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:pages"

    def state(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:state"

    def meta(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:meta"
