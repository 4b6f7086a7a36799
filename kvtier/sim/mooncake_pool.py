"""`kvtier sim-worker --l3 --mooncake-rpc`: the ranks' L3 in a real Mooncake store, written and
looked up as SGLang HiCache's Mooncake backend names a page's objects, so routers ask the master
itself (`kvtier router --shared-cache-type hicache --mooncake-master`)."""

from __future__ import annotations

from kvtier.schemas.hashes import PageDigest

#: Pages asked for in the first existence query of a run; each next query asks for 4x more, up
#: to the last size (a run that misses early costs one small query, a long hit a few).
_FIRST_QUERY_PAGES, _LAST_QUERY_PAGES = 8, 512


class MooncakeStorePool:
    """Every page is written as the objects SGLang HiCache's Mooncake backend writes (MHA, TP 1:
    "<digest hex>_0_k" and "_0_v"), and a page is in the pool only if all of them exist there.
    Every sim-worker given the same master shares the one pool, as HiCache workers do."""

    def __init__(self, rpc_address: str, metadata_url: str):
        from kvtier.harness.mooncake import SharedPoolWriter
        from kvtier.schemas.worker import MooncakeLayout

        self.layout = MooncakeLayout()
        self.writer = SharedPoolWriter(rpc_address, metadata_url)
        self._written = 0

    def _keys(self, digest: PageDigest) -> list[str]:
        from kvtier.schemas.mooncake import mooncake_object_keys

        return mooncake_object_keys(digest, self.layout)

    def put(self, digests: list[PageDigest]) -> None:
        keys = [k for d in digests for k in self._keys(d)]
        if keys:
            self.writer.put_many(keys, b"\0" * 64)
            self._written += len(digests)

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
        """The master's whole pool emptied (every sim-worker's pages, not only these ranks')."""
        self.writer.remove_all()
        self._written = 0

    def __len__(self) -> int:
        # pages these ranks wrote since start or their last storage flush (the master may have
        # evicted some, and another sim-worker's flush empties the pool under this count)
        return self._written

    def close(self) -> None:
        self.writer.close()
