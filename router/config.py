"""What one `kvtier router` replica is told: `RouterConfig`, each setting declared once with its
flag (kvtier/plumbing/settings.py), so the command's flags and docs/DEPLOY.md's table come from
here. A default lives where the setting is used when that class is also built on its own
(RouterSettings, HttpLimits, AdmissionSettings, ScoringWeights); the declaration names it there.
From it come the core's RouterSettings and the HTTP edge's ServiceSettings. Light to import:
the command's parser is built from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec

from kvtier.plumbing.settings import (
    SettingsError,
    choice,
    flag_group,
    model_and_path,
    non_negative_float,
    non_negative_int,
    on_off,
    positive_float,
    positive_int,
    required,
    setting,
    switch,
)
from kvtier.schemas.routing import AdmissionSettings, ScoringWeights

from .http_limits import HttpLimits
from .processes import ProcessSlot
from .service_settings import ServiceSettings
from .settings import BOOKING_TTL_S, RouterMode, RouterSettings, SharedCacheType, StateSource
from .weight_flags import add_scoring_weight_arguments, scoring_weights_from

_ADMISSION = AdmissionSettings()  # (a msgspec Struct: its defaults are read off an instance)
_MB = 1 << 20
#: Router modes that pick by a baseline rule instead of the score (RouterSettings.selection).
_BASELINES = (RouterMode.ROUND_ROBIN, RouterMode.RANDOM)


@dataclass(kw_only=True)
class RouterConfig:
    redis_url: str = required(flag="--redis", dest="redis",
                              help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    nats_url: str = setting("", flag="--nats", dest="nats",
                            help="NATS URL for the decision log (kvtier.decisions.<model>); '' = off.")
    host: str = setting("127.0.0.1", flag="--host", help="Address the HTTP server binds to.")
    http_port: int = setting(8000, flag="--http-port", parse=int, help="HTTP port (0: a free one, printed at start).")
    router_mode: RouterMode = choice(
        RouterMode, RouterMode.KV, flag="--router-mode",
        help="kv: tier-aware scoring; predicted-ttft: the formula's choice, moved to a worker clearly faster at "
             "the rates learned from first-token times (for workers that differ in speed; equal workers: the "
             "formula's); load: booked load only (cache weights 0); "
             "round-robin / random: baselines for A/B tests (the turn is shared by every replica; decisions still "
             "report the scores and book load).")
    seed: int | None = setting(
        None, flag="--seed", parse=int,
        help="Seed the random draws that break ties (reproducible decisions, e.g. in replays).")
    shared_cache_type: SharedCacheType = choice(
        SharedCacheType, SharedCacheType.NONE, flag="--shared-cache-type",
        help="hicache: credit pages workers can fetch from the shared Mooncake pool.")
    mooncake_master: str = setting(
        "", flag="--mooncake-master",
        help="The Mooncake master's HTTP address (its metrics port, serving /batch_query_keys). Asked for every "
             "decision: with --shared-cache-type hicache to credit the pages workers can fetch from the pool; with "
             "--learn-rates on (the default) to price them in the work the rates learn from either way.")
    shared_cache_timeout_ms: float = setting(
        50.0, flag="--shared-cache-timeout-ms", parse=positive_float,
        help="Budget for the shared-pool query; past it the decision scores without it.")
    weights: ScoringWeights = flag_group(add_scoring_weight_arguments, scoring_weights_from, ScoringWeights)
    predicted_pages: bool = on_off(
        RouterSettings.predicted_pages, flag="--predicted-pages",
        help="Book each request's pages as predicted device pages on its worker until it completes, visible to "
             "every replica (pages its events may not show yet). Pays off when requests sharing a new context "
             "arrive together (fan-out); costs Redis memory per in-flight page (BENCHMARKS.md).")
    learn_rates: bool = on_off(
        RouterSettings.learn_rates, flag="--learn-rates",
        help="Learn each worker's rates from its first tokens (every booking keeps the work it predicted; the "
             "first token's release fits the worker's rates in Redis, shown in /healthz, metrics and kvtier "
             "inspect). Costs about 25-45 us of Redis time per request (BENCHMARKS.md); --router-mode "
             "predicted-ttft needs it.")
    state_source: StateSource = choice(
        StateSource, RouterSettings.state_source, flag="--state-source",
        help="Where decisions read tier overlaps. index: an in-memory index of every model, built from Redis "
             "and kept current from its change feed (kvt:{model}:changes), so a decision costs Redis only the "
             "liveness read and the booking; until a model's index is ready, decisions walk in Redis and say so "
             "(degraded: index-not-ready). redis: the walk in Redis for every decision (also what "
             "--predicted-pages on uses). mirror, the index's former name, still reads as index.")
    page_size: int | None = setting(
        RouterSettings.router_page_size, flag="--page-size", parse=positive_int,
        help="Expected worker page size; workers announcing another get no shared-pool credit (default: trust "
             "each worker's announced size).")
    booking_ttl_s: float = setting(
        BOOKING_TTL_S, flag="--booking-ttl", parse=positive_float,
        help="Seconds a booking holds load if never released (a router died mid-request).")
    state_timeout_ms: float = setting(
        250.0, flag="--state-timeout-ms", parse=positive_float,
        help="Redis call budget; past it the decision routes by load/round robin.")
    max_request_tokens: int = setting(
        1 << 18, flag="--max-request-tokens", parse=positive_int,
        help="Longest token_ids accepted (longer: 413). The overlap walk of a request grows with its pages; a "
             "10^6-token request takes ~0.6 s of Redis time here, past the default --state-timeout-ms, and would "
             "send this replica to load-only routing for everyone: raise both together for very long contexts.")
    max_body_bytes: int = setting(32 << 20, flag="--max-body-bytes", parse=positive_int,
                                  help="Largest request body (413).")
    max_new_tokens: int = setting(
        1 << 20, flag="--max-new-tokens", parse=positive_int,
        help="Largest output budget accepted (max_tokens, max_completion_tokens, max_new_tokens; larger: 400). A "
             "budget is booked as decode load, so an absurd one would push every other request elsewhere.")
    max_prompt_bytes: int = setting(
        2 << 20, flag="--max-prompt-bytes", parse=positive_int,
        help="With --proxy: largest text prompt tokenized here (UTF-8 bytes; a chat's messages together, each "
             "counted at least 32 bytes for what the template wraps it in), else 413, checked before rendering "
             "or tokenizing (~1 s of CPU per MB).")
    max_chat_messages: int = setting(
        4096, flag="--max-chat-messages", parse=positive_int,
        help="With --proxy: most messages in one chat (/v1/chat/completions), else 413 before its template is "
             "rendered (a chat of many empty messages costs rendering, not bytes of text).")
    tokenize_timeout_s: float = setting(
        10.0, flag="--tokenize-timeout", parse=positive_float,
        help="With --proxy: longest one request's chat template and tokenizer may take (seconds), else 413; "
             "what bounds a prompt's cost whatever its shape.")
    #: A request finding every connection busy waits for one instead of being routed as if
    #: Redis were down: a busy pool is load, not an outage.
    redis_max_connections: int = setting(
        256, flag="--redis-max-connections", parse=positive_int,
        help="Redis connections of this replica; when all are busy a request waits for one (up to "
             "--redis-pool-wait-ms) rather than routing without tier state.")
    redis_pool_wait_ms: float = setting(
        2000.0, flag="--redis-pool-wait-ms", parse=positive_float,
        help="How long a request waits for a free Redis connection before the replica routes without tier state.")
    upstream_connections_per_worker: int = setting(
        256, flag="--upstream-connections-per-worker", parse=positive_int,
        help="With --proxy: connections kept open to each worker, a pool per worker (slow streams on one never "
             "hold back another); past it a request waits up to --upstream-connect-timeout.")
    upstream_connect_timeout_s: float = setting(
        5.0, flag="--upstream-connect-timeout", parse=positive_float,
        help="With --proxy: seconds to reach a worker (a free connection included); past it the request migrates "
             "to another worker.")
    upstream_idle_timeout_s: float = setting(
        600.0, flag="--upstream-idle-timeout", parse=positive_float,
        help="With --proxy: longest silence from a worker (no byte of its answer) before the request fails "
             "(before the first byte: it migrates).")
    upstream_timeout_s: float = setting(
        0.0, flag="--upstream-timeout", parse=non_negative_float,
        help="With --proxy: longest whole proxied request in seconds; 0: no limit.")
    engine_api_key: str = setting(
        "", flag="--engine-api-key",
        help="With --proxy: sent to workers as 'Authorization: Bearer <key>' (SGLang's --api-key); prefer the "
             "environment variable. The client's Authorization is never forwarded.")
    migration_limit: int = setting(
        2, flag="--migration-limit", parse=non_negative_int,
        help="With --proxy: times a request whose worker refuses, times out or fails before the first byte is "
             "routed again among the other candidates (0: never).")
    breaker_failures: int = setting(
        RouterSettings.breaker_failures, flag="--breaker-failures", parse=positive_int,
        help="A worker this replica failed to reach this many times in a row is left out of the candidates for "
             "--breaker-backoff seconds (doubling while it keeps failing).")
    header_timeout_s: float = setting(
        HttpLimits.header_timeout_s, flag="--header-timeout", parse=positive_float,
        help="Seconds a client has to send a whole request head (line and headers); past it the connection is "
             "closed (408 if a head was begun): slowloris.")
    body_timeout_s: float = setting(
        HttpLimits.body_timeout_s, flag="--body-timeout", parse=positive_float,
        help="Seconds a client has to send a request's body after its head; past it 408 and the connection is "
             "closed (a body shorter than its Content-Length, an endless chunked one).")
    keepalive_timeout_s: float = setting(
        HttpLimits.keepalive_timeout_s, flag="--keepalive-timeout", parse=positive_float,
        help="Seconds an idle keep-alive connection stays open between requests (a load balancer in front that "
             "pools connections must use a shorter idle timeout).")
    max_connections: int = setting(
        HttpLimits.max_connections, flag="--max-connections", parse=non_negative_int,
        help="Client connections open at once (0: no cap; also kept under the descriptor limit less 128); past it "
             "a new one closes the longest-idle one, or is closed if none is idle.")
    busy_prefill_tokens: int = setting(
        _ADMISSION.busy_prefill_tokens, flag="--busy-prefill-tokens", parse=non_negative_int,
        help="A worker with this many prompt tokens booked and not yet prefilled takes no new request (0: no "
             "threshold); when every candidate is busy, requests wait in the queue. Changeable at run time: PUT "
             "/v1/admission.")
    busy_decode_pages: int = setting(
        _ADMISSION.busy_decode_pages, flag="--busy-decode-pages", parse=non_negative_int,
        help="A worker with this many KV pages booked for running requests (prompt + output budget) takes no new "
             "request (0: no threshold).")
    queue_size: int = setting(
        _ADMISSION.queue_size, flag="--queue-size", parse=non_negative_int,
        help="Requests that may wait for a worker under its thresholds; past it: 429 with Retry-After.")
    queue_timeout_s: float = setting(
        _ADMISSION.queue_timeout_s, flag="--queue-timeout", parse=non_negative_float,
        help="Seconds a request may wait in the queue; past it: 503 with Retry-After.")
    drain_timeout_s: float = setting(
        30.0, flag="--drain-timeout", parse=non_negative_float,
        help="On SIGTERM: new requests get 503 + Retry-After while those in flight finish, for up to this many "
             "seconds; then what is left is cut (its bookings released) and the router exits.")
    session_ttl_s: float = setting(
        RouterSettings.session_ttl_s, flag="--session-ttl", parse=positive_float,
        help="Seconds a conversation's X-Session-Id keeps it on the worker that served it last.")
    breaker_backoff_s: float = setting(
        RouterSettings.breaker_backoff_s, flag="--breaker-backoff", parse=positive_float,
        help="Seconds a worker is left out after --breaker-failures failures in a row.")
    proxy: bool = switch(
        flag="--proxy",
        help="Also serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) and "
             "SGLang's /generate: route, forward the body unchanged to the worker, stream the answer back.")
    default_model: str = setting("", flag="--model", dest="model", help="Model of proxied requests that name none.")
    tokenizers: list[tuple[str, str]] = setting(
        [], flag="--tokenizer", dest="tokenizer", repeat=True, parse=model_and_path, metavar="MODEL=PATH",
        help="With --proxy: the folder of MODEL's tokenizer files (tokenizer.json, tokenizer_config.json with its "
             "chat template), read from disk only, e.g. a snapshot in the local Hugging Face cache. The OpenAI "
             "API's text prompts and chats are tokenized with it exactly as SGLang does, so the router finds the "
             "pages the engine holds. Repeat for each model.")
    router_id: str = setting(RouterSettings.router_id, flag="--router-id",
                             help="Name in the decision log (default: random).")
    auth_token: str = setting(
        "", flag="--auth-token",
        help="Require 'Authorization: Bearer <token>' on every path but /healthz (/v1/route, /v1/release, "
             "/generate; /metrics with --protect-metrics), else 401; prefer the environment variable or "
             "--auth-token-file. Empty: no auth.")
    auth_token_file: str = setting(
        "", flag="--auth-token-file", metavar="FILE",
        help="Read the --auth-token from this file (surrounding whitespace ignored).")
    protect_metrics: bool = switch(
        flag="--protect-metrics", help="With an auth token, /metrics requires it too (/healthz always stays open).")
    tokenizer_cache_mb: float = setting(
        256.0, flag="--tokenizer-cache-mb", parse=non_negative_float,
        help="Per model, the ids of text pieces seen before (between the special tokens a chat template writes) "
             "kept for the next request: a conversation's next turn encodes only its new text (0: encode every "
             "prompt whole).")
    hand_over_token_ids: bool = switch(
        flag="--hand-over-token-ids",
        help="With --proxy: send a text completion (/v1/completions) to the engine as the router's token ids, so "
             "the engine does not tokenize it again (SGLang takes a prompt of ids as it is). Chats go as they came "
             "(the OpenAI chat API takes no ids), and so does a completion with echo.")
    processes: int = setting(
        1, flag="--processes", parse=positive_int,
        help="Serve the port from this many processes (SO_REUSEPORT; each its own index and copies, kept "
             "consistent by Redis as replicas are): one replica on as many cores. /metrics and /healthz of the "
             "port describe every process.")
    #: This process's place in a replica of several (--processes); None: a replica of one.
    process: ProcessSlot | None = None

    @property
    def shared_cache_timeout_s(self) -> float:
        return self.shared_cache_timeout_ms / 1000

    @property
    def state_timeout_s(self) -> float:
        return self.state_timeout_ms / 1000

    @property
    def redis_pool_wait_s(self) -> float:
        return self.redis_pool_wait_ms / 1000

    def validate(self) -> None:
        if self.router_mode is RouterMode.PREDICTED_TTFT and not self.learn_rates:
            raise SettingsError("--router-mode predicted-ttft prices by the rates the routers learn: it needs "
                                "--learn-rates on")
        if self.shared_cache_type is SharedCacheType.HICACHE and not self.mooncake_master:
            raise SettingsError("--shared-cache-type hicache needs --mooncake-master http://HOST:PORT (the master's "
                                "HTTP port serving /batch_query_keys)")
        self.bearer_token()  # a token file that cannot be read, or flags that contradict, fail here

    def bearer_token(self) -> str:
        """The router's bearer token, from --auth-token or --auth-token-file (not both)."""
        token = self.auth_token.strip()
        if self.auth_token_file:
            if token:
                raise SettingsError("give --auth-token or --auth-token-file, not both")
            try:
                with open(self.auth_token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as exc:
                raise SettingsError(f"--auth-token-file: cannot read {self.auth_token_file!r} "
                                    f"({exc.strerror or exc})") from None
            if not token:
                raise SettingsError(f"--auth-token-file {self.auth_token_file!r} is empty")
        if self.protect_metrics and not token:
            raise SettingsError("--protect-metrics needs --auth-token or --auth-token-file")
        return token

    def for_process(self, slot: ProcessSlot | None) -> RouterConfig:
        """This config for one process of a replica of several: the replica's port, a name per
        process in the decision log, a seed per process."""
        if slot is None:
            return self
        return dataclasses.replace(
            self, process=slot, http_port=slot.port,
            router_id=f"{self.router_id}-p{slot.index}" if self.router_id else self.router_id,
            seed=None if self.seed is None else self.seed + slot.index)

    def scoring_weights(self) -> ScoringWeights:
        if self.router_mode is not RouterMode.LOAD:
            return self.weights
        # Cache-blind modes are the same machinery with every cache weight at zero: the
        # choice is then by booked load alone, ties broken at random.
        return msgspec.structs.replace(self.weights, overlap_score_credit=0.0, host_cache_hit_weight=0.0,
                                       disk_cache_hit_weight=0.0, shared_cache_multiplier=0.0)

    def router_settings(self, shared_cache: bool) -> RouterSettings:
        """The core's settings; `shared_cache`: the shared pool's pages are credited."""
        return RouterSettings(
            weights=self.scoring_weights(), shared_cache=shared_cache, router_page_size=self.page_size,
            booking_ttl_s=self.booking_ttl_s, router_id=self.router_id, predicted_pages=self.predicted_pages,
            state_source=self.state_source, breaker_failures=self.breaker_failures,
            breaker_backoff_s=self.breaker_backoff_s, session_ttl_s=self.session_ttl_s, admission=self.admission(),
            selection=self.router_mode.value if self.router_mode in _BASELINES else "score",
            faster_pick=self.router_mode is RouterMode.PREDICTED_TTFT, learn_rates=self.learn_rates)

    def admission(self) -> AdmissionSettings:
        return AdmissionSettings(busy_prefill_tokens=self.busy_prefill_tokens,
                                 busy_decode_pages=self.busy_decode_pages, queue_size=self.queue_size,
                                 queue_timeout_s=self.queue_timeout_s)

    def service_settings(self) -> ServiceSettings:
        """The HTTP edge's settings."""
        return ServiceSettings(
            process=self.process, max_request_tokens=self.max_request_tokens, max_body_bytes=self.max_body_bytes,
            proxy=self.proxy, default_model=self.default_model, max_new_tokens=self.max_new_tokens,
            max_prompt_bytes=self.max_prompt_bytes, max_chat_messages=self.max_chat_messages,
            tokenize_timeout_s=self.tokenize_timeout_s,
            upstream_connections_per_worker=self.upstream_connections_per_worker,
            upstream_connect_timeout_s=self.upstream_connect_timeout_s,
            upstream_idle_timeout_s=self.upstream_idle_timeout_s, upstream_timeout_s=self.upstream_timeout_s,
            engine_api_key=self.engine_api_key, migration_limit=self.migration_limit,
            drain_timeout_s=self.drain_timeout_s,
            http_limits=HttpLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                                   keepalive_timeout_s=self.keepalive_timeout_s,
                                   max_connections=self.max_connections),
            auth_token=self.bearer_token(), protect_metrics=self.protect_metrics, tokenizers=dict(self.tokenizers),
            tokenizer_cache_bytes=int(self.tokenizer_cache_mb * _MB), hand_over_token_ids=self.hand_over_token_ids,
            routing_mode=self.router_mode.value)
