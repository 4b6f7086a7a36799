"""Asking the shared pool (Mooncake) which of a request's pages it holds, once per page size
for the layouts the model's workers publish; workers whose page size is not the router's
--page-size get no shared credit, and are warned about once each."""

from __future__ import annotations

import logging

from kvtier.schemas.worker import WorkerMetadata

from .hashing import RequestPages
from .metrics import RouterMetrics
from .settings import RouterSettings
from .shared_pool import SharedPoolClient, SharedPoolUnavailable
from .state import ModelDirectory
from .steps import SharedAnswer

log = logging.getLogger("kvtier.router")


class SharedPoolQuery:
    def __init__(self, shared_pool: SharedPoolClient | None, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.shared_pool = shared_pool
        self.settings = settings
        self.metrics = metrics
        self.last_error = ""  # the last query's failure ("" once one answers)
        self._warned_page_size: set[tuple[str, str]] = set()

    async def pages(self, directory: ModelDirectory, pages_by_size: dict[int, RequestPages]) -> SharedAnswer:
        """{page size: {layout: SharedPages}} for the workers that publish a Mooncake layout."""
        layouts_by_size: dict[int, set] = {}
        for meta in directory.workers.values():
            if meta.mooncake is not None and self._page_size_matches(meta):
                layouts_by_size.setdefault(meta.page_size, set()).add(meta.mooncake)
        result = {}
        try:
            for size, layouts in layouts_by_size.items():
                # only asked when the router has a shared pool (want_shared in route)
                result[size] = await self.shared_pool.pages_present(  # type: ignore[union-attr]
                    pages_by_size[size], list(layouts))
        except SharedPoolUnavailable as exc:
            self.metrics.shared_pool_errors.labels(exc.reason).inc()
            self.last_error = str(exc)
            log.warning("Shared cache query failed (%s); scoring without the shared pool", exc)
            raise
        self.last_error = ""
        return result

    def _page_size_matches(self, meta: WorkerMetadata) -> bool:
        expected = self.settings.router_page_size
        if expected is None or meta.page_size == expected:
            return True
        key = (meta.model, meta.worker_id)
        if key not in self._warned_page_size:
            self._warned_page_size.add(key)
            self.metrics.page_size_mismatch.inc()
            log.warning("worker %s/%s uses page size %d but the router's --page-size is %d: no shared-pool "
                        "credit for it (they must match)", meta.model, meta.worker_id, meta.page_size, expected)
        return False
