"""A request's pages as the worker sees them: SGLang's page hash chain over the request's
token ids (so the router finds exactly the pages the worker reported), and the Mooncake
object keys SGLang HiCache writes for each page."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.schemas.hashes import BlockHash, PageDigest, PageKey, sglang_page_digests
from kvtier.schemas.worker import AttentionKind, MooncakeLayout


@dataclass(frozen=True)
class RequestPages:
    """The request's full pages at one page size (a trailing partial page is never cached).

    `keys_blob` is every PageKey concatenated (16 hex digits each), the form the Redis walk
    takes; a PageKey is the hex of the digest's first 8 bytes, so it is sliced, not computed."""

    page_size: int
    digests: tuple[PageDigest, ...]
    keys_blob: str

    @classmethod
    def of(cls, token_ids: Sequence[int], page_size: int) -> RequestPages:
        digests = tuple(sglang_page_digests(token_ids, page_size))
        return cls(page_size, digests, b"".join(d[:8] for d in digests).hex())

    def __len__(self) -> int:
        return len(self.digests)

    @property
    def keys(self) -> tuple[PageKey, ...]:
        blob = self.keys_blob
        return tuple(PageKey(blob[i:i + 16]) for i in range(0, len(blob), 16))

    @property
    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(BlockHash(h) for h in struct.unpack(f">{len(self.digests)}q", bytes.fromhex(self.keys_blob)))


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
