"""Hash kinds. Each is its own type so a page hash can never be passed where a
Redis field or a digest is expected (and the type checker says so)."""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from typing import Annotated, NewType, cast

import msgspec

#: SGLang's 64-bit page hash as it travels in KV events: signed int64, the first 8 bytes
#: of the page's sha256 chain digest read big-endian.
BlockHash = NewType("BlockHash", int)

#: A BlockHash rendered as 16 lowercase hex digits of its unsigned value: the form used in
#: Redis keys and fields (fixed width, no sign, sortable, cheap to slice inside Lua).
PageKey = NewType("PageKey", str)

#: The full 32-byte sha256 digest of a page chain; SGLang keys Mooncake objects by its hex.
PageDigest = NewType("PageDigest", bytes)

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

#: A BlockHash as decoded from the wire: out-of-range values are refused at decode time.
WireBlockHash = Annotated[BlockHash, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


def page_key(block_hash: BlockHash) -> PageKey:
    return PageKey(format(block_hash & 0xFFFFFFFFFFFFFFFF, "016x"))


def page_keys_blob(block_hashes: Sequence[BlockHash]) -> str:
    """All page keys concatenated (16 hex digits each), the form the apply script reads."""
    return struct.pack(f">{len(block_hashes)}q", *block_hashes).hex()


def block_hashes_of_keys(blob: str | bytes) -> tuple[BlockHash, ...]:
    """Concatenated PageKeys (16 hex digits each) as BlockHashes, in order."""
    raw = bytes.fromhex(blob.decode() if isinstance(blob, bytes) else blob)
    return cast("tuple[BlockHash, ...]", struct.unpack(f">{len(raw) // 8}q", raw))


def block_hash_from_page_key(key: PageKey | str) -> BlockHash:
    value = int(key, 16)
    return BlockHash(value - (1 << 64) if value > INT64_MAX else value)


def block_hash_of_digest(digest: PageDigest | bytes) -> BlockHash:
    return BlockHash(struct.unpack(">q", digest[:8])[0])


def sglang_page_digests(
    token_ids: Sequence[int], page_size: int, parent: PageDigest | None = None
) -> list[PageDigest]:
    """SGLang (>=0.5.6) page hash chain: digest_i = sha256(digest_{i-1} || tokens as uint32 LE).

    Only full pages are hashed; a trailing partial page has no hash (SGLang never caches it).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    tokens = array.array("I", token_ids)  # uint32, as SGLang packs them
    if sys.byteorder != "little":
        tokens.byteswap()
    data = tokens.tobytes()
    step = page_size * 4
    full = (len(token_ids) // page_size) * step
    sha256 = hashlib.sha256
    digests: list[PageDigest] = []
    # One constructor call per page over parent || page (the same bytes as update() twice):
    # the decision hashes every request, and the calls cost more than the hashing.
    previous = parent or b""
    for start in range(0, full, step):
        previous = sha256(previous + data[start:start + step]).digest()
        digests.append(previous)  # type: ignore[arg-type]  # a PageDigest: 32 bytes
    return digests


def sglang_block_hashes(
    token_ids: Sequence[int], page_size: int, parent: PageDigest | None = None
) -> list[BlockHash]:
    return [block_hash_of_digest(d) for d in sglang_page_digests(token_ids, page_size, parent)]
