"""Mooncake's shared pool as kvtier names and asks it.

- `mooncake_object_keys`: the objects SGLang HiCache's Mooncake backend stores for one page
  (the bridge's SGLang discovery, the simulator and routers all name them through it).
- The master's HTTP existence query, as the router reads it:
  GET /batch_query_keys?keys=k1,k2 -> {"success": true, "data": {"k1": {"ok": true, ...},
  "k2": {"ok": false, "error": "OBJECT_NOT_FOUND"}}}. Other fields are ignored. `kvtier
  sim-worker`'s stand-in for the master encodes its replies from the same types.
"""

from __future__ import annotations

import msgspec

from .hashes import PageDigest
from .limits import guarded
from .worker import AttentionKind, MooncakeLayout


class KeyStatus(msgspec.Struct, frozen=True):
    ok: bool = False
    error: str | None = None  # "OBJECT_NOT_FOUND" when absent; null when present


class BatchQueryReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The reply; encoded, an unset `data` or `error` is left out (as the master does)."""

    #: UNSET: the body has no `success` at all, so it is not a query reply (another HTTP server
    #: on that port); falsy like False.
    success: bool | msgspec.UnsetType = msgspec.UNSET
    data: dict[str, KeyStatus] | None = None
    error: str | None = None


_decoder = msgspec.json.Decoder(BatchQueryReply)


def decode_batch_query_reply(body: bytes) -> BatchQueryReply:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_decoder.decode, body)


def mooncake_object_keys(digest: PageDigest, layout: MooncakeLayout) -> list[str]:
    """Every object SGLang HiCache stores in Mooncake for one page under `layout`; the page is
    in the shared pool only if all of them exist.

    MHA: K and V per TP rank, "{hex}_{tp}_k" / "{hex}_{tp}_v" ("{tp}_{pp}" when PP > 1).
    MLA: one latent object shared by the TP ranks, "{hex}__k"; "{hex}_{pp}_k" per PP rank
    when PP > 1.
    An optional key prefix is joined with "_".
    """
    stem = digest.hex()
    if layout.key_prefix:
        stem = f"{layout.key_prefix}_{stem}"
    pp_ranks = range(layout.pp_size)
    if layout.attention == AttentionKind.MLA:
        if layout.pp_size == 1:
            return [f"{stem}__k"]
        return [f"{stem}_{pp}_k" for pp in pp_ranks]
    keys: list[str] = []
    for tp in range(layout.tp_size):
        for pp in pp_ranks:
            rank = f"{tp}" if layout.pp_size == 1 else f"{tp}_{pp}"
            keys.append(f"{stem}_{rank}_k")
            keys.append(f"{stem}_{rank}_v")
    return keys
