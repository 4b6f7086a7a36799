"""The Redis layout of tier state: a contract between the processor (writer) and routers,
replay and analytics (readers).

Every key of one model carries the hash tag `{<model token>}`, so one model's state lives in
one hash slot: the apply script is atomic over it, and Redis Cluster shards by model.

  kvt:{m}:w:<worker>:device set   pages on the worker's GPU      (one set per tier:
  kvt:{m}:w:<worker>:host   set   pages in its host RAM           device, host, disk,
  kvt:{m}:w:<worker>:disk   set   pages on its disk tier          external; a page on
  kvt:{m}:w:<worker>:external set pages it put in a shared store  two tiers is in two)
  kvt:{m}:w:<worker>:state  hash  epoch, seq, stale, ...        (apply bookkeeping)
  kvt:{m}:w:<worker>:meta   str   WorkerMetadata as JSON
  kvt:{m}:leases            zset  worker -> lease expiry (unix ms)
  kvt:{m}:workers           set   every worker with state
  kvt:models                set   model tokens (no tag: read once, outside any script)

Load booked by routers (written only by router/*.lua, atomically with each selection):
  kvt:{m}:load:prefill      hash  worker -> queued prefill pages
  kvt:{m}:load:decode       hash  worker -> active decode pages
  kvt:{m}:bookings          zset  request id -> booking expiry (unix ms)
  kvt:{m}:bk:<request id>   hash  worker, prefill, decode (what a release gives back)

`<page>` is a `PageKey` (16 hex digits). One set per tier, not one page -> bits hash: a
store is a SADD and a remove a SREM, with nothing to read first, which measured ~1.9x
cheaper per transition inside the apply script (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .subjects import subject_token
from .tiers import TIER_PRIORITY, Tier

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
    def leases(self) -> str:
        return f"{self.base}:leases"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    def tier_set(self, worker_id: str, tier: Tier) -> str:
        return f"{self.base}:w:{worker_id}:{tier.value}"

    def tier_sets(self, worker_id: str) -> list[str]:
        """The worker's tier sets in `TIER_PRIORITY` order (device, host, disk, external)."""
        return [self.tier_set(worker_id, tier) for tier in TIER_PRIORITY]

    @property
    def prefill_load(self) -> str:
        return f"{self.base}:load:prefill"

    @property
    def decode_load(self) -> str:
        return f"{self.base}:load:decode"

    @property
    def bookings(self) -> str:
        return f"{self.base}:bookings"

    def state(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:state"

    def meta(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:meta"
