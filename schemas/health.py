"""Health facts the processor records for routers, `kvtier doctor` and operators to read.

`HashCheck` is stored as JSON in the per-model hash `kvt:{m}:hash_check` (field = worker id),
written by the processor that owns the worker's partition, read by routers (`/healthz`) and
`kvtier doctor`. It says whether the page hashes a worker publishes are the ones kvtier
computes from the same tokens: if not, the router can never match that worker's pages and
routing to it quietly degrades to load balancing, which is exactly what must not be silent.
"""

from __future__ import annotations

import enum

import msgspec

from .limits import guarded


class HashMismatchKind(str, enum.Enum):
    #: The tokens hash to other values under SGLang's sha256 page chain: an engine with another
    #: hash scheme (SGLang < 0.5.6, another engine, a patched build).
    SCHEME = "hash_scheme"
    #: The engine namespaced the hashes (LoRA adapter, cache salt): they are opaque ids a router
    #: cannot compute from the request's tokens alone.
    NAMESPACE = "namespace"
    #: The event's tokens per page differ from the page size the worker announced (the bridge's
    #: --page-size): the router would hash requests at the wrong granularity.
    PAGE_SIZE = "page_size"


class HashCheck(msgspec.Struct, kw_only=True):
    worker_id: str
    #: Stored pages whose hash was recomputed from their tokens.
    checked: int = 0
    matched: int = 0
    mismatched: int = 0
    #: Stored pages with tokens whose parent page was never seen by this processor (its full
    #: digest is unknown, so the chain cannot be recomputed), or without tokens at all.
    unverifiable: int = 0
    #: Stored pages not recomputed because the processor's check budget was spent.
    skipped: int = 0
    #: Mismatches by `HashMismatchKind` value.
    mismatch_kinds: dict[str, int] = {}
    #: The first mismatch in plain words: what differs and what to do about it.
    explanation: str = ""
    updated_ms: int = 0

    @property
    def ok(self) -> bool:
        return self.mismatched == 0


_decoder = msgspec.json.Decoder(HashCheck)


def encode_hash_check(check: HashCheck) -> bytes:
    return msgspec.json.encode(check)


def decode_hash_check(data: bytes | str) -> HashCheck:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_decoder.decode, data)
