"""What the HTTP edge of a router replica is told at start (`kvtier router`'s flags): request
bounds, the proxy's upstream pool and timeouts, drain, auth, tokenizers. Built from RouterConfig
(config.py), where each flag's default is declared; the fields without one here are those."""

from __future__ import annotations

from dataclasses import dataclass, field

from .http_limits import HttpLimits
from .processes import ProcessSlot


@dataclass(kw_only=True)
class ServiceSettings:
    #: This process's place in a replica of several (--processes); None: a replica of one.
    process: ProcessSlot | None = None
    max_request_tokens: int
    max_body_bytes: int
    proxy: bool
    default_model: str  # for proxied requests that name no model
    #: the longest output budget (max_tokens, max_new_tokens) accepted on any path: a budget
    #: is booked as decode load, so an absurd one would push every other request elsewhere
    max_new_tokens: int
    #: the largest text prompt (UTF-8 bytes, all of a chat's messages together) tokenized here;
    #: checked before tokenizing, which costs ~1 s of CPU and ~100 MB per MB of text
    max_prompt_bytes: int
    #: the most messages in one chat: each costs the template a turn to render, text or none
    max_chat_messages: int
    #: the longest one request's rendering and tokenizing may take (seconds), else 413
    tokenize_timeout_s: float
    #: connections kept open to one worker: its own pool, so slow streams on one worker never
    #: hold back requests to another (past it a request waits, up to the connect timeout)
    upstream_connections_per_worker: int
    #: reaching a worker (a free connection of its pool included); past it the request migrates
    upstream_connect_timeout_s: float
    #: the longest silence from a worker (no byte of an answer); past it the request fails
    upstream_idle_timeout_s: float
    #: the longest whole proxied request; 0: no limit (a long generation is never cut)
    upstream_timeout_s: float
    #: sent to workers as `Authorization: Bearer <key>` (an SGLang started with --api-key);
    #: the client's own Authorization (the router's token) is never forwarded
    engine_api_key: str = field(repr=False)
    #: a request whose worker fails before the first byte of its answer is routed again among
    #: the other candidates, at most this many times
    migration_limit: int
    #: on SIGTERM, how long in-flight requests may take to finish before they are cut
    drain_timeout_s: float
    #: how long each phase of a client connection may take, and how many there may be
    http_limits: HttpLimits
    housekeeping_s: float = 1.0
    #: non-empty: every endpoint but /healthz (and /metrics, unless protect_metrics) requires
    #: `Authorization: Bearer <auth_token>`
    auth_token: str = field(repr=False)
    protect_metrics: bool
    #: model name -> folder of its tokenizer files (tokenizer.json, tokenizer_config.json)
    tokenizers: dict[str, str]
    #: the most each model's tokenizer keeps of pieces seen before (bytes; 0: none), so a
    #: conversation's next turn encodes only its new text (kvtier/plumbing/piece_cache.py)
    tokenizer_cache_bytes: int
    #: a text completion (/v1/completions) goes to the engine as the router's token ids, so the
    #: engine does not tokenize it again; the ids are then the engine's by construction
    hand_over_token_ids: bool
    #: the router's --router-mode, the `mode` label of the proxy's latency histograms
    routing_mode: str
    #: seconds after a proxied text request to check its worker stored its last page under the
    #: router's hash (the events' way through the pipeline takes milliseconds); 0: never
    stored_page_check_s: float = 3.0
