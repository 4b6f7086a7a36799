"""A request's pages as the worker sees them: SGLang's page hash chain over the request's
token ids, so the router finds exactly the pages the worker reported. (The Mooncake object
keys of a page are `schemas/mooncake.py`'s `mooncake_object_keys`.)"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import cast

from kvtier.schemas.hashes import BlockHash, PageDigest, PageKey, sglang_page_digests


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

    @cached_property
    def hashes(self) -> tuple[BlockHash, ...]:
        """The BlockHash of each page (a digest's first 8 bytes, big-endian, signed), computed
        once: the index reads them for every worker page size it walks."""
        digests = self.digests
        return cast("tuple[BlockHash, ...]", struct.unpack(f">{len(digests)}q", b"".join(d[:8] for d in digests)))
