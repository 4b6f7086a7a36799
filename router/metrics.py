"""The router's Prometheus metrics, in a registry of its own per router (tests and benches
run several routers in one process).

With `--processes N` each process keeps its values in prometheus_client's multiprocess files
and /metrics of any of them reads all (`replica_registry`): counters and histograms sum over
the processes; each gauge says how the processes' values combine (`multiprocess_mode`: the
sum for what each holds a share of, the worst for a state)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
                    0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: What users feel: a first token within milliseconds (a cached prefix on a fast engine) to tens of
#: seconds (a long prompt recomputed on a busy one).
_USER_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 4.0, 6.0,
                         10.0, 20.0, 40.0, 80.0)
_PAGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._decisions_by_mode: dict[str, Counter] = {}
        self._series: dict[int, set[tuple[str, ...]]] = {}  # replace_series: the label sets set last
        # Registered in this order, which is the order /metrics lists them in.
        self._add_decision_metrics(r)
        self._add_request_metrics(r)
        self._add_state_store_metrics(r)
        self.proxy_requests = Counter("router_proxy_requests", "Proxied /generate requests by outcome",
                                      ["outcome"], registry=r)
        self._add_index_metrics(r)
        self._add_proxy_metrics(r)
        self._add_upstream_metrics(r)
        self._add_admission_metrics(r)
        self.state_store_up.set(1)

    def _add_decision_metrics(self, r: CollectorRegistry) -> None:
        """How decisions were made, what they saw, and what they read instead."""
        self.decisions = Counter("router_decisions", "Routing decisions by how they were made "
                                 "(kv: tier-aware; fallback: state store unavailable)", ["mode"], registry=r)
        self.decision_latency = Histogram("router_decision_latency_seconds",
                                          "Time from a parsed request to a booked decision",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.shared_cache_hit_rate = Histogram(
            "router_shared_cache_hit_rate", "Fraction of request blocks found in the shared pool (0.0-1.0)",
            buckets=tuple(i / 10 for i in range(11)), registry=r)
        self.shared_cache_beyond_blocks = Histogram(
            "router_shared_cache_beyond_blocks",
            "Blocks in the shared pool beyond the selected worker's device overlap", buckets=_PAGE_BUCKETS, registry=r)
        self.chosen_overlap = Histogram("router_chosen_overlap_pages",
                                        "Overlap of the chosen worker with the request, by tier",
                                        ["tier"], buckets=_PAGE_BUCKETS, registry=r)
        self.request_pages = Histogram("router_request_pages", "Full pages per routed request",
                                       buckets=_PAGE_BUCKETS, registry=r)
        # Every decision observes these: the labelled children are looked up once.
        self.chosen_overlap_by_tier = tuple(self.chosen_overlap.labels(tier)
                                            for tier in ("device", "host", "disk", "shared_beyond"))
        self.full_reads = Counter("router_full_reads",
                                  "Decisions that read the model's state from Redis instead of this replica's copies "
                                  "of it (a round trip more), by why: index_not_ready, index_behind, rebuilding, "
                                  "no_fresh_worker, state_kept_moving", ["reason"], registry=r)
        self.fallbacks = Counter("router_fallback_decisions", "Decisions made without tier state, by reason",
                                 ["reason"], registry=r)
        self.shared_pool_errors = Counter("router_shared_pool_errors",
                                          "Shared-pool queries that failed or timed out (scored without it)",
                                          ["reason"], registry=r)
        self.page_size_mismatch = Counter("router_page_size_mismatch",
                                          "Workers skipped for shared-pool credit: page size differs from the router's",
                                          registry=r)
        self.scoring_mismatch = Counter("router_scoring_mismatch",
                                        "Decisions where the in-Redis selection and router/scoring.py disagreed",
                                        registry=r)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Refused requests, releases, and the decision log's publishing."""
        self.bad_requests = Counter("router_bad_requests", "Requests refused with a 4xx, by status",
                                    ["status"], registry=r)
        self.releases = Counter("router_releases", "Booking releases by stage and whether a booking was found",
                                ["stage", "found"], registry=r)
        self.releases_lost = Counter("router_releases_lost",
                                     "Releases of proxied requests that failed (Redis did not answer): their "
                                     "bookings hold load until --booking-ttl", registry=r)
        self.rate_samples_refused = Counter(
            "router_rate_samples_refused",
            "First-token times a client reported that taught no worker's rates, by reason (budget: the "
            "client's share of a worker's samples this minute was spent; late: longer than the booking has "
            "lived)", ["reason"], registry=r)
        self.decision_log_published = Counter("router_decision_log_published",
                                              "Decisions published to JetStream", registry=r)
        self.decision_log_dropped = Counter("router_decision_log_dropped",
                                            "Decisions not published (queue full or NATS error)", registry=r)

    def _add_state_store_metrics(self, r: CollectorRegistry) -> None:
        """Redis, the load booked in it, and what is routed without it."""
        self.state_store_up = Gauge("router_state_store_up", "1 while the last Redis call succeeded",
                                    multiprocess_mode="livemin", registry=r)
        self.load_reconciled = Counter("router_load_reconciled",
                                       "Times a model's booked load had drifted from its live bookings and was "
                                       "recomputed from them", registry=r)
        self.fallback_in_flight = Gauge("router_fallback_in_flight",
                                        "Requests this replica routed without Redis and still counts as in flight "
                                        "(bounded, expiring)", multiprocess_mode="livesum", registry=r)
        self.partial_workers = Gauge("router_partial_workers",
                                     "Workers whose state began after their engine's first batch (routed to, "
                                     "but missing what the engine held before)", ["model"],
                                     multiprocess_mode="livemax", registry=r)

        self.worker_rate = Gauge("router_worker_rate",
                                 "Each worker's learned rate per kind of work (compute, host_load, l3_load, queued): a "
                                 "multiplier on the prior's seconds per token (2 = twice as slow), learned from "
                                 "its first tokens", ["model", "worker", "kind"], multiprocess_mode="livemax",
                                 registry=r)
        self.worker_rate_samples = Gauge("router_worker_rate_samples",
                                         "First tokens each worker's learned rates were fitted on",
                                         ["model", "worker"], multiprocess_mode="livemax", registry=r)
        self.ttft_prediction_error = Gauge(
            "router_ttft_prediction_error",
            "How far each worker's first tokens came from what its learned rates predicted just before each, over "
            "about the last 20, as a fraction of the true time: stat=mape (mean absolute) or bias (mean signed; "
            "> 0: predicted too long)", ["model", "worker", "stat"], multiprocess_mode="livemax", registry=r)
        self.ttft_predictions_compared = Gauge("router_ttft_predictions_compared",
                                               "First tokens compared with their prediction, per worker",
                                               ["model", "worker"], multiprocess_mode="livemax", registry=r)

    def _add_index_metrics(self, r: CollectorRegistry) -> None:
        """This replica's in-memory index of the workers' pages, and their hashes' checks."""
        self.worker_hash_mismatch = Gauge(
            "router_worker_hash_mismatch_pages",
            "Stored pages whose published hash is not SGLang's chain over their tokens (the router can never "
            "match them), per worker, as recorded by the processors", ["model", "worker"],
            multiprocess_mode="livemax", registry=r)
        self.index_entries = Gauge("router_index_entries",
                                   "(page, tier) entries in this replica's in-memory tier index, per model",
                                   ["model"], multiprocess_mode="livemax", registry=r)
        self.index_lag = Histogram("router_index_lag_seconds",
                                   "From a change feed entry's append in Redis to its application to this "
                                   "replica's index", buckets=_LATENCY_BUCKETS, registry=r)
        self.index_bootstraps = Counter("router_index_bootstraps",
                                        "Times this replica built a model's index from Redis, by reason (start, "
                                        "gap: entries trimmed or lost, marker: the store's state was replaced, "
                                        "malformed)", ["reason"], registry=r)
        self.index_ready = Gauge("router_index_ready",
                                 "1 while the model's index follows the feed (decisions read it), 0 while it "
                                 "bootstraps (decisions walk in Redis)", ["model"],
                                 multiprocess_mode="livemin", registry=r)

    def _add_proxy_metrics(self, r: CollectorRegistry) -> None:
        """Proxied requests (--proxy): tokenizing, the latencies users feel, and the tokenization checks."""
        self.tokenizer_cache_bytes = Gauge("router_tokenizer_cache_bytes",
                                           "What the tokenizer's piece cache holds (bytes, as it counts them "
                                           "against --tokenizer-cache-mb), per model", ["model"],
                                           multiprocess_mode="livesum", registry=r)
        self.tokenize_seconds = Histogram("router_tokenize_seconds",
                                          "Tokenizing an OpenAI-API request (chat template included), in the pool",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.tokenize_timeouts = Counter("router_tokenize_timeouts",
                                         "OpenAI-API requests refused (413) because their rendering and "
                                         "tokenizing took longer than --tokenize-timeout", registry=r)
        # Proxied requests (--proxy): what the user feels, by the worker chosen, the routing mode
        # (kv, load, round-robin, random) and the tier that held most of the chosen worker's
        # overlap (device, host, disk, shared; none without overlap), so modes can be A/B-ed live.
        user_labels = ["worker", "mode", "tier"]
        self.ttft = Histogram("router_ttft_seconds",
                              "Proxied request received to its first byte back from the worker (time to first "
                              "token as the client sees it, less the network to the client)", user_labels,
                              buckets=_USER_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("router_request_seconds",
                                         "Proxied request received to its last byte back from the worker",
                                         user_labels, buckets=_USER_LATENCY_BUCKETS, registry=r)
        self.proxy_overhead = Histogram("router_proxy_overhead_seconds",
                                        "The router's own time on a proxied request: received to the first byte "
                                        "sent to the worker (body read, tokenization, decision)",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.tokenizer_checks = Counter("router_tokenizer_checks",
                                        "Proxied text requests whose prompt length the worker reported, by "
                                        "whether it equals the router's (mismatch: the router's tokenizer or "
                                        "chat template is not the engine's, so its page hashes are not either)",
                                        ["model", "outcome"], registry=r)
        self.tokenizer_unchecked = Counter("router_tokenizer_unchecked",
                                           "Proxied chats routed on their text without a tokenization check: "
                                           "parts the router cannot tokenize as the engine does (images, audio)",
                                           ["model"], registry=r)
        self.token_ids_handed_over = Counter("router_token_ids_handed_over",
                                             "Proxied text completions sent to the engine as the router's token "
                                             "ids (--hand-over-token-ids), so the engine did not tokenize them again",
                                             ["model"], registry=r)
        self.stored_page_checks = Counter("router_stored_page_checks",
                                          "Proxied text requests whose worker was asked, seconds later, for the "
                                          "request's last full page under the router's hash, by outcome (found, "
                                          "missing: the engine tokenized it otherwise, evicted it already, or "
                                          "publishes no events)", ["model", "outcome"], registry=r)

    def _add_upstream_metrics(self, r: CollectorRegistry) -> None:
        """Workers failing proxied requests: failures, migrations, open circuits."""
        self.upstream_failures = Counter(
            "router_upstream_failures", "Proxied requests a worker failed before the first byte of its answer, by "
            "reason (refused, timeout, disconnected, status_500/502/503/504, status_5xx: any other 5xx, malformed: "
            "an answer that ended before its first byte or a stream that does not begin with an event)",
            ["reason"], registry=r)
        self.migrations = Counter("router_migrations",
                                  "Proxied requests routed again to another worker after one failed before its "
                                  "first byte (--migration-limit)", registry=r)
        self.circuit_open = Gauge("router_worker_circuit_open",
                                  "1 while this replica leaves a worker out after failing to reach it "
                                  "(--breaker-failures in a row)", ["model", "worker"],
                                  multiprocess_mode="livemax", registry=r)

    def _add_admission_metrics(self, r: CollectorRegistry) -> None:
        """Client connections, the admission queue, and the drain."""
        self.connections_closed = Counter("router_connections_closed",
                                          "Client connections the router closed, by reason (idle: no request "
                                          "head in --header-timeout; header_timeout: a head begun, not finished; "
                                          "body_timeout; keepalive_timeout; evicted: an idle one closed for a new "
                                          "one past --max-connections; refused: past it with none idle)",
                                          ["reason"], registry=r)
        self.queue_depth = Gauge("router_queue_depth",
                                 "Requests waiting in this replica's queue for a worker under its busy thresholds",
                                 multiprocess_mode="livesum", registry=r)
        self.queue_wait = Histogram("router_queue_wait_seconds", "Time requests waited in the queue (placed or not)",
                                    buckets=_USER_LATENCY_BUCKETS, registry=r)
        self.admission_refusals = Counter("router_admission_refusals",
                                          "Requests refused with Retry-After, by reason (queue_full: 429, "
                                          "queue_timeout and draining: 503)", ["reason"], registry=r)
        self.draining = Gauge("router_draining", "1 while this replica drains (SIGTERM): new requests get 503",
                              multiprocess_mode="livemax", registry=r)

    def decisions_by_mode(self, mode: str):
        child = self._decisions_by_mode.get(mode)
        if child is None:
            child = self._decisions_by_mode[mode] = self.decisions.labels(mode)
        return child

    def replace_series(self, gauge: Gauge, values: dict[tuple[str, ...], float]) -> None:
        """Set `gauge` to exactly `values` (label values -> value): series set before and not
        now go (with --processes, where prometheus_client cannot remove a series from its
        files, they are set to 0 instead)."""
        before = self._series.setdefault(id(gauge), set())
        gone = before - values.keys()
        if gone and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            for labels in gone:
                gauge.labels(*labels).set(0)
        elif gone:
            for labels in gone:
                gauge.remove(*labels)
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        self._series[id(gauge)] = set(values)

    def full_reads_by_reason(self, reason: str):
        return self.full_reads.labels(reason)


def replica_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """What /metrics serves: `registry` for a router of one process; with `--processes N`
    (prometheus_client's multiprocess files in PROMETHEUS_MULTIPROC_DIR), every process's
    values together."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return registry
    from prometheus_client import multiprocess

    combined = CollectorRegistry()
    multiprocess.MultiProcessCollector(combined)
    return combined
