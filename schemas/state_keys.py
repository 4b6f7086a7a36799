"""The Redis layout of tier state: a contract between the processor (writer) and routers,
replay and analytics (readers).

Every key of one model carries the hash tag `{<model token>}`, so one model's state lives in
one hash slot: the apply script is atomic over it, and Redis Cluster shards by model.

  kvt:{m}:w:<worker>:pages  set   the worker's pages, each tagged with its tier: member =
                                  tier bit as one hex digit + PageKey ("1"+16 hex on device,
                                  "2" host, "4" disk, "8" external); a page on two tiers is
                                  two members
  kvt:{m}:w:<worker>:state  hash  epoch, seq, stale, n<bit> page count per tier,
                                  source_seq (the engine's own seq of the last applied
                                  batch: how far into the engine's stream the state is),
                                  tiers_seen (OR of every tier bit ever stored), epoch_floor
                                  (while rebuilding after a loss: older epochs are skipped),
                                  engine_waiting / engine_running / engine_queue_ms (the
                                  engine's own queue at its last announce, when the bridge can
                                  read its /metrics), ...
  kvt:{m}:w:<worker>:meta   str   WorkerMetadata as JSON
  kvt:{m}:leases            zset  worker -> lease expiry (unix ms)
  kvt:{m}:workers           set   every worker with state
  kvt:{m}:stale             set   workers whose state is marked stale (routers skip them)
  kvt:{m}:partial           set   workers whose epoch began after the engine's first batch: routed
                                  to, but missing what the engine held before (apply.lua)
  kvt:{m}:page_size         hash  worker -> page size (routers hash requests at it)
  kvt:{m}:hash_check        hash  worker -> HashCheck JSON (schemas/health.py): do the worker's
                                  published page hashes match SGLang's chain over its tokens
  kvt:{m}:incarnation       hash  the state's incarnation marker: id (random), created_ms, ready
                                  ("1": batches may be applied), rebuilding ("1": workers are
                                  still being rebuilt from the stream), reason, scan_by/scan_ms.
                                  Missing = the state store lost this model's state (a restart
                                  without persistence, FLUSHALL, failover to an empty replica):
                                  apply.lua refuses batches, routers route on load only
  kvt:{m}:rebuild           hash  worker -> "epoch:seq" each worker must reach before the model
                                  counts as rebuilt (written by the processor that rebuilds)
  kvt:{m}:changes           stream the change feed: one entry per write that changed pages sets
                                  (fields n, w, o; schemas/changes.py), appended by the same
                                  script as the write, trimmed by length (--changes-maxlen)
  kvt:{m}:changes:n         str   the model's change counter (the last entry's n)
  kvt:store                 str   set by processors once every model in the stream is accounted
                                  for: while present, a model with no marker and no state is new
  kvt:models                set   model tokens (no tag: read once, outside any script)

Load booked by routers (written only by router/*.lua, atomically with each selection):
  kvt:{m}:load:prefill      hash  worker -> queued prefill pages
  kvt:{m}:load:decode       hash  worker -> active decode pages
  kvt:{m}:load:version      str   bumped with every write to the two load hashes: a replica
                                  that copied the loads at version v books only while it is
                                  still v (router/book_checked.lua)
  kvt:{m}:bookings          zset  request id -> booking expiry (unix ms)
  kvt:{m}:bk:<request id>   hash  worker, prefill, decode (what a release gives back); work,
                                  at (what its first token teaches); owner (the digest of the
                                  secret a /v1/route client must give to release it)
  kvt:{m}:rs:<worker>:<client>  str  first-token samples a client without the router's token
                                  taught the worker this minute (router/rates.py ClientSamples)
  kvt:{m}:rr                str   the model's round-robin turn (--router-mode round-robin)
  kvt:{m}:w:<worker>:predicted  hash  page key -> bookings not yet complete that hold the page
                                  as predicted on this worker (router/README.md); dropped
                                  with the worker's pages when its lease expires

One tier-tagged set per worker rather than one set per tier: a store is still one SADD and
a remove one SREM with nothing read first, and a router's walk asks all tiers of a worker in
one SMISMEMBER, so a cold worker costs one call instead of three (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hashes import PageKey
from .subjects import subject_token
from .tiers import Tier

_TIER_OF_TAG = {format(tier.bit, "x"): tier for tier in Tier}


def page_member(tier: Tier, page: PageKey) -> str:
    """A page's member in its worker's pages set: the tier bit as one hex digit, then the key."""
    return format(tier.bit, "x") + page


def split_member(member: str) -> tuple[Tier, PageKey]:
    return _TIER_OF_TAG[member[0]], PageKey(member[1:])


def as_text(value: bytes | str) -> str:
    """A Redis reply as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value

#: The key root of live tier state. `kvtier replay` rebuilds state under another root (a
#: scratch namespace, e.g. "kvtreplay-1a2b3c4d"): every key above then starts with that root
#: instead of "kvt", same layout, same hash tag. The scripts never build a key from "kvt"
#: themselves: they receive keys from ModelKeys, and the key base only to build keys they
#: alone learn (a worker named by another key, an expired booking; each script says which).
DEFAULT_ROOT = "kvt"
MODELS_KEY = "kvt:models"


def models_key(root: str = DEFAULT_ROOT) -> str:
    """The set of model tokens under a key root (`kvt:models` for live state)."""
    return f"{root}:models"


def store_key(root: str = DEFAULT_ROOT) -> str:
    """`kvt:store`: set by processors once the store's models are accounted for. While it
    exists, a model without an incarnation marker and without state is new (it starts
    empty at once); when it is gone, the store itself was lost and such models are rebuilt
    from the stream like any other."""
    return f"{root}:store"


@dataclass(frozen=True)
class ModelKeys:
    model_token: str
    root: str = DEFAULT_ROOT

    @classmethod
    def for_model(cls, model: str, root: str = DEFAULT_ROOT) -> ModelKeys:
        return cls(subject_token(model), root)

    @property
    def base(self) -> str:
        return f"{self.root}:{{{self.model_token}}}"

    @property
    def leases(self) -> str:
        return f"{self.base}:leases"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    @property
    def stale_workers(self) -> str:
        return f"{self.base}:stale"

    @property
    def partial_workers(self) -> str:
        return f"{self.base}:partial"

    @property
    def page_sizes(self) -> str:
        return f"{self.base}:page_size"

    @property
    def rates(self) -> str:
        """Each worker's learned rates (schemas/rates.py), written by router/learn_rates.lua."""
        return f"{self.base}:rates"

    @property
    def ttft_errors(self) -> str:
        """How far each worker's first-token predictions are off (schemas/rates.py
        PredictionError), written by router/learn_rates.lua beside its fit."""
        return f"{self.base}:ttft_errors"

    @property
    def hash_check(self) -> str:
        return f"{self.base}:hash_check"

    @property
    def incarnation(self) -> str:
        return f"{self.base}:incarnation"

    @property
    def rebuild(self) -> str:
        return f"{self.base}:rebuild"

    @property
    def changes(self) -> str:
        return f"{self.base}:changes"

    @property
    def changes_counter(self) -> str:
        return f"{self.base}:changes:n"

    def pages(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:pages"

    def predicted(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:predicted"

    @property
    def prefill_load(self) -> str:
        return f"{self.base}:load:prefill"

    @property
    def decode_load(self) -> str:
        return f"{self.base}:load:decode"

    @property
    def load_version(self) -> str:
        return f"{self.base}:load:version"

    @property
    def bookings(self) -> str:
        return f"{self.base}:bookings"

    def booking(self, request_id: str) -> str:
        """What one request's booking holds (worker, prefill, decode, predicted pages)."""
        return f"{self.base}:bk:{request_id}"

    @property
    def round_robin(self) -> str:
        return f"{self.base}:rr"

    def session(self, session_id: str) -> str:
        """The worker a conversation last ran on (a string with a TTL: --session-ttl)."""
        return f"{self.base}:session:{session_id}"

    def state(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:state"

    def meta(self, worker_id: str) -> str:
        return f"{self.base}:w:{worker_id}:meta"
