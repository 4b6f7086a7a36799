"""The shared Mooncake pool as the router sees it: which of a request's pages any worker
could fetch instead of recomputing. Asked through the master's HTTP existence query, never
by linking the transfer engine; a failure or timeout means "score without it", never "stop"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

import msgspec

from kvtier.schemas.mooncake import decode_batch_query_reply, mooncake_object_keys
from kvtier.schemas.worker import MooncakeLayout

from .hashing import RequestPages

log = logging.getLogger("kvtier.router.shared_pool")

#: Keys per GET: SGLang's keys are ~70 characters, so this keeps each URL near 7 KB, well
#: under common HTTP request-line limits (8 KB).
MAX_KEYS_PER_QUERY = 100


class SharedPoolUnavailable(Exception):
    """The master could not answer in time (timeout, connection refused, bad reply)."""

    def __init__(self, message: str, reason: str = "error"):
        super().__init__(message)
        self.reason = reason  # "timeout" | "error": the label of router_shared_pool_errors_total


@dataclass(frozen=True)
class SharedPages:
    """Which of the request's pages are in the pool under one layout, with
    `beyond(n)` = pages at positions >= n present (docs/DESIGN.md's hits_beyond)."""

    present: tuple[bool, ...]
    _suffix: tuple[int, ...]

    @classmethod
    def of(cls, present: Sequence[bool]) -> SharedPages:
        suffix = [0] * (len(present) + 1)
        for i in range(len(present) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + (1 if present[i] else 0)
        return cls(tuple(present), tuple(suffix))

    def beyond(self, n: int) -> int:
        return self._suffix[min(max(n, 0), len(self.present))]

    @property
    def hits(self) -> int:
        return self._suffix[0]


class SharedPoolClient:
    def __init__(self, master_url: str, timeout_s: float = 0.05, session=None):
        """`master_url`: the master's HTTP base (its metrics port), e.g. http://host:9003."""
        self.base = master_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = session

    async def _ensure_session(self):
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60), raise_for_status=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _query_chunk(self, keys: Sequence[str]) -> dict[str, bool]:
        import yarl

        session = await self._ensure_session()
        # Mooncake splits the keys parameter on raw commas: quote each key, not the commas.
        url = yarl.URL(f"{self.base}/batch_query_keys?keys=" + ",".join(quote(k, safe="") for k in keys),
                       encoded=True)
        async with session.get(url) as response:
            body = await response.read()
            if response.status != 200:
                raise SharedPoolUnavailable(f"HTTP {response.status}: {body[:200]!r}")
        try:
            reply = decode_batch_query_reply(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SharedPoolUnavailable(f"unreadable reply ({exc}): {body[:200]!r}") from None
        if not reply.success and not reply.data:
            raise SharedPoolUnavailable(f"master refused the query: {reply.error or body[:200]!r}")
        return {key: status.ok for key, status in (reply.data or {}).items()}

    async def exists(self, keys: Sequence[str]) -> dict[str, bool]:
        """Existence of each key; chunks are asked concurrently, the whole within the timeout."""
        if not keys:
            return {}
        chunks = [keys[i:i + MAX_KEYS_PER_QUERY] for i in range(0, len(keys), MAX_KEYS_PER_QUERY)]
        try:
            replies = await asyncio.wait_for(asyncio.gather(*(self._query_chunk(c) for c in chunks)),
                                             self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise SharedPoolUnavailable(f"no answer within {self.timeout_s * 1000:.0f} ms", "timeout") from None
        except SharedPoolUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - connection errors of any kind degrade the same way
            raise SharedPoolUnavailable(f"{type(exc).__name__}: {exc}") from None
        merged: dict[str, bool] = {}
        for reply in replies:
            merged.update(reply)
        return merged

    async def pages_present(self, pages: RequestPages,
                            layouts: Sequence[MooncakeLayout]) -> dict[MooncakeLayout, SharedPages]:
        """For each layout, which pages have all their objects in the pool."""
        per_layout = {layout: [mooncake_object_keys(d, layout) for d in pages.digests] for layout in set(layouts)}
        wanted = sorted({k for page_keys in per_layout.values() for keys in page_keys for k in keys})
        found = await self.exists(wanted)
        return {layout: SharedPages.of([all(found.get(k, False) for k in keys) for keys in page_keys])
                for layout, page_keys in per_layout.items()}
