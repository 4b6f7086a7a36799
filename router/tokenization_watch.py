"""The I/O side of the tokenization checks (router/tokenization_check.py keeps the counts): the
proxy (router/proxy.py) hands each checked answer here, which compares the engine's prompt count
at once and, seconds later, asks Redis whether the worker stored the request's last full page
under the router's hash."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from kvtier.schemas.hashes import PageKey
from kvtier.schemas.openai import Usage
from kvtier.schemas.router_health import TokenizerHealth
from kvtier.schemas.routing import RouteRequest, RouteResponse
from kvtier.schemas.state_keys import ModelKeys, page_member
from kvtier.schemas.tiers import Tier

from .core import DEGRADED_ONLY_STALE, DEGRADED_REBUILDING, DEGRADED_STATE_STORE, Router
from .hashing import RequestPages
from .tokenization_check import TokenizationCheck

log = logging.getLogger("kvtier.router.http")

#: A decision degraded by one of these saw no true state of its worker's pages.
_UNTRUSTED_STATE = frozenset({DEGRADED_STATE_STORE, DEGRADED_REBUILDING, DEGRADED_ONLY_STALE})
#: Stored-page checks waiting at once, at most (one Redis command each: a sample is enough).
_MAX_WAITING_PAGE_CHECKS = 256


class TokenizationWatch:
    """Feeds one replica's TokenizationCheck from its proxied answers, and counts the checks in
    router_tokenizer_checks and router_stored_page_checks."""

    def __init__(self, router: Router, stored_page_check_s: float, models: Iterable[str]) -> None:
        self.router = router
        self.metrics = router.metrics
        self.stored_page_check_s = stored_page_check_s
        self.counts = TokenizationCheck()
        for model in models:  # exported as 0 from the start: "no mismatch", not "no data"
            for outcome in ("match", "mismatch"):
                self.metrics.tokenizer_checks.labels(model, outcome)
            for outcome in ("found", "missing"):
                self.metrics.stored_page_checks.labels(model, outcome)
        self._mismatch_logged: dict[str, float] = {}
        self._page_checks: set[asyncio.Task] = set()

    def health(self) -> list[TokenizerHealth]:
        return self.counts.health()

    def cancel(self) -> None:
        """Drop the stored-page checks still waiting (the router is stopping)."""
        for task in list(self._page_checks):
            task.cancel()

    def check_stored_later(self, model: str, decision: RouteResponse, pages: RequestPages | None) -> None:
        """In `stored_page_check_s`, ask Redis whether the worker holds the request's last full
        page under this router's hash (router/tokenization_check.py). Skipped for a decision made
        without the workers' true state (no state store, a store being rebuilt, stale workers
        only), a prompt shorter than a page, or while many checks are already waiting."""
        if pages is None or not len(pages) or len(self._page_checks) >= _MAX_WAITING_PAGE_CHECKS \
                or self.stored_page_check_s <= 0 or _UNTRUSTED_STATE.intersection(decision.degraded):
            return
        task = asyncio.ensure_future(self._check_stored(model, decision.worker_id, pages.keys[-1]))
        self._page_checks.add(task)
        task.add_done_callback(self._page_checks.discard)

    async def _check_stored(self, model: str, worker_id: str, page: PageKey) -> None:
        await asyncio.sleep(self.stored_page_check_s)
        key = ModelKeys.for_model(model).pages(worker_id)
        members = [page_member(tier, page) for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK)]
        try:
            found = await self.router.redis.smismember(key, members)  # type: ignore[misc]  # async client
        except Exception as exc:  # noqa: BLE001 - no verdict without the store
            log.debug("stored-page check of %s on %s skipped: %s", model, worker_id, exc)
            return
        self.counts.record_stored(model, any(found))
        self.metrics.stored_page_checks.labels(model, "found" if any(found) else "missing").inc()

    def check_counts(self, route: RouteRequest, decision: RouteResponse, usage: Usage | None) -> None:
        """The engine's prompt count against the router's (see router/tokenization_check.py);
        an answer without `usage` (a stream that did not ask for it) checks nothing."""
        if usage is None:
            return
        model = route.model
        matched = self.counts.record(model, decision.worker_id, len(route.token_ids), usage,
                                     decision.overlap.reusable_pages() * decision.page_size,
                                     decision.page_size)
        self.metrics.tokenizer_checks.labels(model, "match" if matched else "mismatch").inc()
        now = time.monotonic()
        if not matched and now - self._mismatch_logged.get(model, -3600.0) >= 60.0:
            self._mismatch_logged[model] = now
            log.warning("model %s: worker %s counted %d prompt tokens where this router counted %d: the "
                        "router's tokenizer or chat template (--tokenizer) is not the engine's, so its page "
                        "hashes are not either and routing ignores the cache (see /healthz tokenizers)",
                        model, decision.worker_id, usage.prompt_tokens, len(route.token_ids))
