"""Is the router tokenizing a model as its engines do? Each proxied text request's prompt
length, as the router counted it, against the engine's own count in its answer's `usage`.

Pure bookkeeping, no I/O: the proxy (router/service.py) feeds it answers, /healthz reads it.
A router whose tokenizer or chat template differs from the engine's hashes other pages than
the engine stores, so its overlaps silently read low; this turns that into a visible fault.
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


@dataclass
class _ModelChecks:
    checked: int = 0
    mismatched: int = 0
    cached_beyond_overlap: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_CHECKS))
    last_mismatch: TokenizerMismatch | None = None


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

    def health(self) -> list[TokenizerHealth]:
        return [TokenizerHealth(model=model, checked=c.checked, mismatched=c.mismatched,
                                recent_mismatched=sum(1 for ok in c.recent if not ok), recent_window=len(c.recent),
                                last_mismatch=c.last_mismatch, cached_beyond_overlap=c.cached_beyond_overlap)
                for model, c in sorted(self._models.items())]
