"""`kvtier sim-worker --l3 --mooncake-rpc`: the ranks' L3 in a real Mooncake store, written and
looked up as SGLang HiCache's Mooncake backend names a page's objects, so routers ask the master
itself (`kvtier router --shared-cache-type hicache --mooncake-master`)."""

from __future__ import annotations

import concurrent.futures
import logging

from kvtier.schemas.hashes import PageDigest

#: Pages asked for in the first existence query of a run; each next query asks for 4x more, up
#: to the last size (a run that misses early costs one small query, a long hit a few).
_FIRST_QUERY_PAGES, _LAST_QUERY_PAGES = 8, 512


log = logging.getLogger("kvtier.sim.l3")


def _log_failure(done: concurrent.futures.Future) -> None:
    if (exc := done.exception()) is not None:
        log.warning("writing pages to the Mooncake store failed: %s", exc)


class MooncakeStorePool:
    """Every page is written as the objects SGLang HiCache's Mooncake backend writes (MHA, TP 1:
    "<digest hex>_0_k" and "_0_v"), and a page is in the pool only if all of them exist there.
    Every sim-worker given the same master shares the one pool, as HiCache workers do.

    Pages are written behind the request that landed them, on a thread of their own, as
    HiCache's storage backup runs beside its scheduler: a put of a long prompt (two objects a
    page, ~23 us each on loopback) would otherwise hold the sim-worker, and every request
    waiting on it, for milliseconds. A page is in the pool once its put is done; `clear` waits
    for the puts before it."""

    def __init__(self, rpc_address: str, metadata_url: str):
        from kvtier.harness.mooncake import SharedPoolWriter
        from kvtier.schemas.worker import MooncakeLayout

        self.layout = MooncakeLayout()
        self.writer = SharedPoolWriter(rpc_address, metadata_url)
        self._written = 0
        self._backup = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-backup")

    def _keys(self, digest: PageDigest) -> list[str]:
        from kvtier.schemas.mooncake import mooncake_object_keys

        return mooncake_object_keys(digest, self.layout)

    def put(self, digests: list[PageDigest]) -> None:
        keys = [k for d in digests for k in self._keys(d)]
        if keys:
            self._backup.submit(self.writer.put_many, keys, b"\0" * 64).add_done_callback(_log_failure)
            self._written += len(digests)

    def settled(self) -> None:
        """Every put asked for so far is done (a put that failed raises here)."""
        self._backup.submit(lambda: None).result()

    def contains(self, digest: PageDigest) -> bool:
        return all(self.writer.exists(self._keys(digest)))

    def leading(self, digests: list[PageDigest]) -> int:
        found, size = 0, _FIRST_QUERY_PAGES
        while found < len(digests):
            batch = digests[found:found + size]
            keys = [self._keys(d) for d in batch]
            answers, at = self.writer.exists([k for page in keys for k in page]), 0
            for i, page in enumerate(keys):
                if not all(answers[at:at + len(page)]):
                    return found + i
                at += len(page)
            found, size = found + len(batch), min(size * 4, _LAST_QUERY_PAGES)
        return found

    def touch(self, digests: list[PageDigest]) -> None:
        pass  # the master keeps its own account of reads

    def clear(self) -> None:
        """The master's whole pool emptied (every sim-worker's pages, not only these ranks'),
        after the puts asked for before it."""
        self._backup.submit(self.writer.remove_all).result()
        self._written = 0

    def __len__(self) -> int:
        # pages these ranks wrote since start or their last storage flush (the master may have
        # evicted some, and another sim-worker's flush empties the pool under this count)
        return self._written

    def close(self) -> None:
        self._backup.shutdown(wait=True)
        self.writer.close()
