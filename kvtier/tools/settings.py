"""What each operator tool is told: one settings class per tool, each setting declared once with
its flag (kvtier/plumbing/settings.py), so `kvtier <tool>`'s flags come from here and the tool
only ever sees the typed settings. The process's own flags (logging, metrics, NATS and Redis
credentials and TLS: kvtier/commands/flags.py's add_common) are not a tool's and stay there.
Light to import: the command's parser is built from it at every start."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.plumbing.settings import (
    UrlListAction,
    non_negative_float,
    positive_float,
    positive_int,
    required,
    setting,
    switch,
    text_choice,
    url_list,
    worker_id_text,
)

#: Seconds a replay's scratch keys live: `kvtier replay --ttl`, which `explain --ttl` inherits.
SCRATCH_TTL_S = 3600


@dataclass(kw_only=True)
class InspectSettings:
    """`kvtier inspect` (kvtier/tools/inspect.py)."""

    redis_url: str = required(flag="--redis", dest="redis", help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    model: str | None = setting(None, flag="--model", help="Only this model (default: every model).")
    worker: str | None = setting(None, flag="--worker", help="Only this worker.")
    json: bool = switch(flag="--json", help="Print one JSON array instead of a table.")


@dataclass(kw_only=True)
class ProbeSettings:
    """`kvtier probe hicache` (kvtier/tools/probe.py)."""

    worker_url: str = required(
        flag="--worker-url",
        help="The worker's HTTP base: http://HOST:PORT for SGLang, http://HOST:PORT/w/<rank> for a `kvtier "
             "sim-worker` rank (POST <worker-url>/generate).")
    worker_id: str = required(
        flag="--worker-id", parse=worker_id_text,
        help="The worker's kvtier id (as its bridge publishes it; rank r of --dp-size N: <id>-dp<r>).")
    model: str = required(flag="--model", help="The model name the worker's bridge publishes under.")
    nats_url: str = required(flag="--nats", dest="nats",
                             help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    redis_url: str = required(flag="--redis", dest="redis",
                              help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    page_size: int | None = setting(None, flag="--page-size", parse=positive_int,
                                    help="The worker's page size (default: as its bridge announced it in Redis).")
    prefix_tokens: int = setting(2048, flag="--prefix-tokens", parse=positive_int,
                                 help="Length of the test prefix (rounded up to whole pages).")
    evict_prefixes: int = setting(
        64, flag="--evict-prefixes", parse=int,
        help="At most this many other prefixes (each as long) before series C; the probe stops as soon as Redis "
             "shows no prefix page on device, and sends all of them without tier state.")
    seed: int | None = setting(None, flag="--seed", parse=int,
                               help="Seed of the random token ids (default: a fresh one, printed; the same seed "
                                    "repeats the same prompts).")
    watch_timeout_s: float = setting(5.0, flag="--watch-timeout", dest="watch_timeout", parse=positive_float,
                                     help="Seconds to wait for a request's events on the stream.")
    request_timeout_s: float = setting(300.0, flag="--request-timeout", dest="request_timeout", parse=positive_float,
                                       help="Seconds each request may take.")
    api_key: str = setting("", flag="--api-key",
                           help="Bearer token for the worker's HTTP API (SGLang --api-key).")
    json: bool = switch(flag="--json", help="Also print one JSON object as the last line.")


@dataclass(kw_only=True)
class EventsTailSettings:
    """`kvtier events tail` (kvtier/tools/events_tail.py)."""

    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    model: str | None = setting(None, flag="--model", help="Only this model.")
    worker: str | None = setting(None, flag="--worker", help="Only this worker.")
    tier: str | None = text_choice(None, flag="--tier", choices=("device", "host", "disk", "external"),
                                   help="Only stores/removes on this tier.")
    kind: str | None = text_choice(None, flag="--kind",
                                   choices=("stored", "removed", "cleared", "announce", "expired"),
                                   help="Only this kind of event.")
    since: str | None = setting(
        None, flag="--since", exclusive="when",
        help="From this time on: ISO 8601, unix seconds, or a duration ago (90s, 5m, 2h).")
    last: int | None = setting(None, flag="--last", parse=positive_int, exclusive="when",
                               help="The last N matching events (default 10).")
    follow: bool = switch(flag="--follow", help="Keep printing new events as they arrive.")
    json: bool = switch(flag="--json", help="One JSON object per line instead of text.")


@dataclass(kw_only=True)
class ReportSettings:
    """`kvtier report` (kvtier/tools/report.py)."""

    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    since: str = required(
        flag="--since",
        help="Window start: ISO 8601 (UTC without an offset), unix seconds, or a duration ago (30m).")
    until: str = setting("", flag="--until", help="Window end, same forms (default: now).")
    model: str = setting("", flag="--model", help="Only this model (default: every model).")
    out: str = setting("kvtier-report", flag="--out", help="Folder for the PNGs and summary.md.")
    bins: int = setting(60, flag="--bins", parse=positive_int, help="Time steps of the plots over time.")
    writeback_window_s: float = setting(
        2.0, flag="--writeback-window", dest="writeback_window", parse=non_negative_float,
        help="Seconds a page removed from its last tier may wait for its write-back store on a lower tier (then a "
             "demotion, else an eviction), as in `kvtier analytics`.")
    json: bool = switch(flag="--json", help="Print one JSON object (the summary) as the last line.")


@dataclass(kw_only=True)
class DoctorSettings:
    """`kvtier doctor` (kvtier/tools/doctor/)."""

    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    redis_url: str = required(flag="--redis", dest="redis", help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    routers: list[str] = setting(
        [], flag="--router", dest="router", parse=url_list, action=UrlListAction,
        help="A router's base URL, e.g. http://10.0.0.7:8000 (repeat, or comma-separate, for several).")
    mooncake_master: str = setting(
        "", flag="--mooncake-master",
        help="The Mooncake master's HTTP (metrics) address, e.g. http://master:9003; probed with /batch_query_keys "
             "(or GET exactly this URL when it has a path, e.g. .../metrics).")
    model: str | None = setting(None, flag="--model", help="Only this model (default: every model in Redis).")
    events_window_s: float = setting(
        300.0, flag="--events-window", dest="events_window", parse=positive_float,
        help="Seconds within which a live worker's events should have been applied.")
    timeout_s: float = setting(3.0, flag="--timeout", dest="timeout", parse=positive_float,
                               help="Seconds each probe may take.")
    strict: bool = switch(flag="--strict", help="Exit 1 on warnings too.")
    json: bool = switch(flag="--json", help="Also print one JSON object as the last line.")


@dataclass(kw_only=True)
class ReplaySettings:
    """`kvtier replay` (kvtier/tools/replay.py). --nats and --redis are checked by the tool, since
    `--drop` needs no NATS."""

    nats_url: str | None = setting(None, flag="--nats", dest="nats",
                                   help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    redis_url: str | None = setting(None, flag="--redis", dest="redis",
                                    help="Redis URL of the live state; the scratch state goes there too.")
    model: str | None = setting(None, flag="--model", help="Only this model (default: every model).")
    worker: str | None = setting(None, flag="--worker", help="Only this worker.")
    at_time: str | None = setting(
        None, flag="--at-time", exclusive="at",
        help="The state as of this time: ISO 8601 (UTC unless an offset is given), unix seconds, or a duration ago "
             "(90s, 5m, 2h, 1d).")
    at_seq: int | None = setting(
        None, flag="--at-seq", parse=positive_int, exclusive="at",
        help="The state after the events stream's message with this sequence (see `kvtier events tail`).")
    into: str | None = setting(
        None, flag="--into", metavar="NAMESPACE", exclusive="into",
        help="Scratch key root to rebuild under (default: a fresh kvtreplay-<hex>); must be empty.")
    into_db: int | None = setting(
        None, flag="--into-db", parse=int, metavar="N", exclusive="into",
        help="Rebuild under the usual kvt: root in Redis database N instead (not the live one; not available on "
             "Redis Cluster).")
    ttl_s: int = setting(SCRATCH_TTL_S, flag="--ttl", dest="ttl", parse=int,
                         help="Seconds the scratch keys live (0: until `kvtier replay --drop`).")
    diff: bool = switch(
        flag="--diff",
        help="Compare the rebuilt state with the live one per worker and tier; exit 1 if any page diverges.")
    #: None: rebuild; "": --drop without a NAMESPACE (the tool says which one that means).
    drop: str | None = setting(
        None, flag="--drop", nargs="?", const="", metavar="NAMESPACE",
        help="Delete a scratch namespace's keys (with --into-db N: the kvt keys of database N) and exit.")
    json: bool = switch(flag="--json", help="Also print one JSON object as the last line.")


@dataclass(kw_only=True)
class ExplainSettings:
    """`kvtier replay explain` (kvtier/tools/explain.py). Its options but --keep may be given
    before `explain` too, to `kvtier replay`, and count there (`inherit`)."""

    request_id: str = required(flag="request_id",
                               help="The request id the router logged (its /v1/route request_id).")
    nats_url: str | None = setting(None, flag="--nats", dest="nats", inherit=True,
                                   help="NATS URL holding KVTIER_DECISIONS and KVTIER_EVENTS.")
    redis_url: str | None = setting(None, flag="--redis", dest="redis", inherit=True,
                                    help="Redis URL (the scratch state is rebuilt there, then dropped).")
    model: str | None = setting(None, flag="--model", inherit=True,
                                help="Search only this model's decisions (faster).")
    keep: bool = switch(flag="--keep",
                        help="Keep the rebuilt state (its namespace is printed; it expires after --ttl).")
    ttl_s: int = setting(SCRATCH_TTL_S, flag="--ttl", dest="ttl", parse=int, inherit=True,
                         help="With --keep: seconds the kept keys live (0: forever).")
    json: bool = switch(flag="--json", inherit=True, help="Also print one JSON object last.")
