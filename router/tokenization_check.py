"""Is the router tokenizing a model as its engines do? Two checks, both on proxied text
requests:

- the prompt's length as the router counted it, against the engine's own count in its
  answer's `usage.prompt_tokens` (any difference is a mismatch);
- a few seconds after the answer, whether the worker holds the request's last full page under
  the router's hash (on any tier). A page hash chains over every token before it, so it is
  stored only if the engine's tokens equal the router's up to there: this catches the
  differences that keep the length (a role name, a date in the template). A page can also be
  missing because the engine evicted it already, or does not cache or publish; so it is judged
  only when most of the recent checks miss.

Pure bookkeeping, no I/O: router/tokenization_watch.py feeds it from the proxy's answers,
/healthz reads it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from kvtier.schemas.openai import Usage
from kvtier.schemas.router_health import TokenizerHealth, TokenizerMismatch

#: How many recent checks per model judge whether it is mismatched now (a fixed tokenizer
#: clears the fault once this many clean answers came back).
RECENT_CHECKS = 100
#: Missing pages are a fault once at least this many of the recent page checks missed, and
#: more than half of them: one evicted page is not.
MIN_MISSING_PAGES = 5


def _recent() -> collections.deque:
    return collections.deque(maxlen=RECENT_CHECKS)


@dataclass
class _ModelChecks:
    checked: int = 0
    mismatched: int = 0
    cached_beyond_overlap: int = 0
    recent: collections.deque = field(default_factory=_recent)
    last_mismatch: TokenizerMismatch | None = None
    pages_checked: int = 0
    pages_missing: int = 0
    recent_pages: collections.deque = field(default_factory=_recent)


class TokenizationCheck:
    def __init__(self) -> None:
        self._models: dict[str, _ModelChecks] = {}

    def record(self, model: str, worker_id: str, router_tokens: int, usage: Usage,
               overlap_tokens: int, page_size: int) -> bool:
        """One answer's usage against what the router counted and saw cached on the worker it
        chose; True when the counts agree."""
        checks = self._models.setdefault(model, _ModelChecks())
        checks.checked += 1
        matched = usage.prompt_tokens == router_tokens
        checks.recent.append(matched)
        if not matched:
            checks.mismatched += 1
            checks.last_mismatch = TokenizerMismatch(worker_id=worker_id, router_tokens=router_tokens,
                                                     engine_tokens=usage.prompt_tokens, at=time.time())
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        if cached > overlap_tokens + max(page_size, 1):
            checks.cached_beyond_overlap += 1
        return matched

    def record_stored(self, model: str, found: bool) -> None:
        """Whether the worker held the request's last full page under the router's hash."""
        checks = self._models.setdefault(model, _ModelChecks())
        checks.pages_checked += 1
        checks.pages_missing += not found
        checks.recent_pages.append(found)

    def health(self) -> list[TokenizerHealth]:
        out = []
        for model, c in sorted(self._models.items()):
            recent_mismatched = sum(1 for ok in c.recent if not ok)
            recent_missing = sum(1 for found in c.recent_pages if not found)
            pages_ok = recent_missing < MIN_MISSING_PAGES or 2 * recent_missing <= len(c.recent_pages)
            out.append(TokenizerHealth(
                model=model, checked=c.checked, mismatched=c.mismatched, recent_mismatched=recent_mismatched,
                recent_window=len(c.recent), last_mismatch=c.last_mismatch,
                cached_beyond_overlap=c.cached_beyond_overlap, pages_checked=c.pages_checked,
                pages_missing=c.pages_missing, recent_pages_missing=recent_missing,
                recent_pages_window=len(c.recent_pages), ok=recent_mismatched == 0 and pages_ok))
        return out
