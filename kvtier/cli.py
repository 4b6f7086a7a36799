"""The `kvtier` command. Every flag can also be set by an environment variable
KVTIER_<FLAG> (e.g. --nats -> KVTIER_NATS, --page-size -> KVTIER_PAGE_SIZE); a flag on the
command line wins over the environment."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from kvtier.producers.cost_model import add_cost_model_arguments, cost_model_from_args
from kvtier.router.weight_flags import (
    add_scoring_weight_arguments,
    scoring_weights_from,
)
from kvtier.streams import DEFAULT_PARTITIONS, StreamSettings


def _env_name(flag: str) -> str:
    return "KVTIER_" + flag.lstrip("-").upper().replace("-", "_")


#: Flags whose values are secrets: --help never shows their value (nor one from the environment).
_SECRET_FLAG = re.compile(r"(password|token|api-key)$")


class _HideSecretDefaults(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if getattr(action, "kvtier_secret", False):
            return action.help
        return super()._get_help_string(action)


class _EnvDefaults(argparse.ArgumentParser):
    """ArgumentParser whose options take their default from KVTIER_<FLAG>. An environment
    value is checked like a command-line one (type and choices); a bad one is reported as a
    usage error of the command that uses it, never as a traceback, and never breaks another
    command (the parser of every subcommand is built whichever one runs). Abbreviated flags are
    refused, so adding a flag can never change what an existing command line means."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        if kwargs.get("formatter_class") is argparse.ArgumentDefaultsHelpFormatter:
            kwargs["formatter_class"] = _HideSecretDefaults  # --help shows no secret's value
        super().__init__(*args, **kwargs)
        self._env_errors: list[str] = []

    def add_argument(self, *names, **kwargs):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag and flag != "--help":
            env = _env_name(flag)
            kwargs["help"] = (kwargs.get("help", "") + f" [env {env}]").strip()
            if env in os.environ:
                raw = os.environ[env]
                try:
                    kwargs["default"] = _env_value(raw, kwargs)
                except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                    self._env_errors.append(f"{env}={raw!r} (for {flag}): {exc}")
                    kwargs["default"] = None
                kwargs["required"] = False
        action = super().add_argument(*names, **kwargs)
        if flag and _SECRET_FLAG.search(flag):
            action.kvtier_secret = True
        return action

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._env_errors:
            self.error("; ".join(self._env_errors))
        return super().parse_known_args(args, namespace)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _env_value(raw: str, kwargs: dict):
    if kwargs.get("action") == "store_true":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE[:-1])}")
    value = kwargs["type"](raw) if "type" in kwargs else raw
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"invalid choice (choose from {', '.join(map(str, choices))})")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _worker_id(text: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9_\-]{1,128}", text):
        raise argparse.ArgumentTypeError(
            f"worker id {text!r} must be 1-128 characters of letters, digits, '_' or '-' "
            "(it becomes a NATS subject token and part of Redis keys)")
    return text


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _partition_list(text: str) -> list[int] | str | None:
    if text in ("", "all"):
        return None
    if text == "auto":
        return "auto"
    parts: list[int] = []
    for piece in text.split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            parts.extend(range(int(lo), int(hi) + 1))
        else:
            parts.append(int(piece))
    if any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError("partitions are non-negative integers")
    return sorted(set(parts))


def _url_list(text: str) -> list[str]:
    """One URL or several, comma-separated (for flags given more than once, or from the environment)."""
    return [part.strip() for part in text.split(",") if part.strip()]


class _UrlListAction(argparse.Action):
    """Repeatable flag taking comma-separated URLs; the first use on the command line replaces
    the environment's default instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Log verbosity.")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off).")
    p.add_argument("--metrics-host", default="127.0.0.1", help="Address the metrics server binds to.")
    _add_security_flags(p)


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    """Credentials and TLS for the NATS and Redis connections of a command that makes them
    (kvtier/nats_options.py, kvtier/connections.py). Secrets are best given by environment."""
    options = getattr(p, "_option_string_actions", {})
    if "--nats" in options:
        # (plain add_argument, not a group: a group would bypass _EnvDefaults and its KVTIER_* defaults)
        p.add_argument("--nats-user", default="",
                       help="NATS user (with --nats-password; or user:password@ in the --nats URL).")
        p.add_argument("--nats-password", default="", help="NATS password (prefer the environment variable).")
        p.add_argument("--nats-token", default="",
                       help="NATS authentication token (prefer the environment variable; or TOKEN@ in the URL).")
        p.add_argument("--nats-nkey-seed", default="", metavar="FILE",
                       help="File holding the NKey seed (SU...) of an NKey user.")
        p.add_argument("--nats-creds", default="", metavar="FILE", help="NATS credentials file (user JWT and seed).")
        p.add_argument("--nats-tls-ca", default="", metavar="FILE",
                       help="CA bundle (PEM) that signed the server's certificate; implies TLS (as does tls://).")
        p.add_argument("--nats-tls-cert", default="", metavar="FILE",
                       help="Client certificate (PEM), for servers that verify clients.")
        p.add_argument("--nats-tls-key", default="", metavar="FILE", help="The client certificate's key (PEM).")
    if "--redis" in options:
        p.add_argument("--redis-tls-ca", default="", metavar="FILE",
                       help="CA bundle (PEM) that signed the Redis server's certificate; implies TLS (as do "
                            "rediss:// and ?ssl_ca_certs=FILE in the URL). An ACL user and password go in the URL: "
                            "redis://USER:PASSWORD@host:6379/0.")


def _configure_connections(args) -> None:
    """The one place the NATS options and the Redis TLS settings of this process are built."""
    from kvtier import connections
    from kvtier.nats_options import NatsOptions, configure

    try:
        configure(NatsOptions.from_args(args))
        connections.configure(tls_ca=(getattr(args, "redis_tls_ca", None) or "").strip())
    except ValueError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _add_stream_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream-partitions", type=_positive_int, default=None,
                   help=f"Partitions of the events stream when this process creates it (default "
                        f"{DEFAULT_PARTITIONS}). If the stream exists with another count, giving this flag is an "
                        "error.")
    p.add_argument("--stream-max-age", type=_positive_float, default=None,
                   help="Keep events this many seconds in the stream: how far back `kvtier replay` reaches "
                        "(default 86400 when creating it). Given explicitly, an existing stream is updated to it.")
    p.add_argument("--stream-max-bytes", type=int, default=None,
                   help="Cap the events stream's size in bytes, oldest dropped first (default -1: no cap, when "
                        "creating it). Given explicitly, an existing stream is updated to it.")
    p.add_argument("--stream-replicas", type=_positive_int, default=1,
                   help="JetStream replicas of the streams (1 for a single server, 3 for a cluster).")


def _stream_settings(args) -> tuple[StreamSettings, bool]:
    defaults = StreamSettings()
    return StreamSettings(
        partitions=args.stream_partitions or DEFAULT_PARTITIONS,
        max_age_s=args.stream_max_age if args.stream_max_age is not None else defaults.max_age_s,
        max_bytes=args.stream_max_bytes if args.stream_max_bytes is not None else defaults.max_bytes,
        replicas=args.stream_replicas,
        retention_explicit=args.stream_max_age is not None or args.stream_max_bytes is not None,
    ), args.stream_partitions is not None


def _add_replay_parsers(sub) -> None:
    """`kvtier replay [explain]` and `kvtier events tail` (kvtier/replay.py, explain.py, events_tail.py)."""
    rp = sub.add_parser(
        "replay", help="Rebuild tier state as it was at a stream seq or a time, compare it with the live state, "
                       "or explain a routing decision.",
        description="Read KVTIER_EVENTS from its first retained message up to --at-seq / --at-time (default: its last "
                    "message now) and apply it with the processor's own apply code into a scratch namespace (keys "
                    "<NAMESPACE>:{model}:..., expiring after --ttl; `--drop NAMESPACE` removes them), or into another "
                    "Redis database with --into-db (not on Redis Cluster). --diff compares the result with the live "
                    "state page by page and exits 1 if any page diverges. The stream only reaches back as far as its "
                    "retention (--stream-max-age/--stream-max-bytes of processor and bridge): an older point is "
                    "refused. `kvtier replay explain REQUEST_ID --nats URL --redis URL` re-derives a logged routing "
                    "decision. Exit codes: 0 ok, 1 diverged / not reproduced, 2 refused or not found.")
    rp.add_argument("--nats", default=None, help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    rp.add_argument("--redis", default=None, help="Redis URL of the live state; the scratch state goes there too.")
    rp.add_argument("--model", default=None, help="Only this model (default: every model).")
    rp.add_argument("--worker", default=None, help="Only this worker.")
    at = rp.add_mutually_exclusive_group()
    at.add_argument("--at-time", default=None,
                    help="The state as of this time: ISO 8601 (UTC unless an offset is given), unix seconds, or a "
                         "duration ago (90s, 5m, 2h, 1d).")
    at.add_argument("--at-seq", type=_positive_int, default=None,
                    help="The state after the events stream's message with this sequence (see `kvtier events tail`).")
    into = rp.add_mutually_exclusive_group()
    into.add_argument("--into", default=None, metavar="NAMESPACE",
                      help="Scratch key root to rebuild under (default: a fresh kvtreplay-<hex>); must be empty.")
    into.add_argument("--into-db", type=int, default=None, metavar="N",
                      help="Rebuild under the usual kvt: root in Redis database N instead (not the live one; not "
                           "available on Redis Cluster).")
    rp.add_argument("--ttl", type=int, default=3600,
                    help="Seconds the scratch keys live (0: until `kvtier replay --drop`).")
    rp.add_argument("--diff", action="store_true",
                    help="Compare the rebuilt state with the live one per worker and tier; exit 1 if any page "
                         "diverges.")
    rp.add_argument("--drop", nargs="?", const="", default=None, metavar="NAMESPACE",
                    help="Delete a scratch namespace's keys (with --into-db N: the kvt keys of database N) and exit.")
    rp.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    _add_common(rp)
    rsub = rp.add_subparsers(dest="replay_command", required=False, parser_class=_EnvDefaults)
    ex = rsub.add_parser(
        "explain", help="Why a router chose the worker it chose: re-derive a logged decision from the event stream.",
        description="Find the decision for REQUEST_ID in KVTIER_DECISIONS, rebuild its model's tier state as of the "
                    "decision's time, read each candidate's tiered overlap from it with the router's own reader, "
                    "re-score with the recorded weights, loads and random draw, and print every term of the formula "
                    "per candidate. Flags every difference from the record (overlap per tier, logit, winner, "
                    "candidates) and exits 1 if there is one; 2 if the decision is not found. Shared-pool hits are "
                    "taken as recorded (Mooncake's state cannot be replayed).")
    ex.add_argument("request_id", help="The request id the router logged (its /v1/route request_id).")
    suppress = argparse.SUPPRESS  # options given before `explain` (to `kvtier replay`) still count
    ex.add_argument("--nats", default=suppress, help="NATS URL holding KVTIER_DECISIONS and KVTIER_EVENTS.")
    ex.add_argument("--redis", default=suppress, help="Redis URL (the scratch state is rebuilt there, then dropped).")
    ex.add_argument("--model", default=suppress, help="Search only this model's decisions (faster).")
    ex.add_argument("--keep", action="store_true",
                    help="Keep the rebuilt state (its namespace is printed; it expires after --ttl).")
    ex.add_argument("--ttl", type=int, default=suppress, help="With --keep: seconds the kept keys live (0: forever).")
    ex.add_argument("--json", action="store_true", default=suppress, help="Also print one JSON object last.")

    ev = sub.add_parser("events", help="Look at the events stream (KVTIER_EVENTS).")
    evsub = ev.add_subparsers(dest="events_command", required=True, parser_class=_EnvDefaults)
    tail = evsub.add_parser(
        "tail", help="Print decoded tier events, filtered: time, stream seq, worker, epoch:seq, kind, tier, pages.",
        description="One line per tier event or announcement. Default: the last 10 matching events; --since TIME "
                    "prints from a time on; --follow keeps printing new ones until Ctrl-C/SIGTERM.")
    tail.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    tail.add_argument("--model", default=None, help="Only this model.")
    tail.add_argument("--worker", default=None, help="Only this worker.")
    tail.add_argument("--tier", choices=["device", "host", "disk", "external"], default=None,
                      help="Only stores/removes on this tier.")
    tail.add_argument("--kind", choices=["stored", "removed", "cleared", "announce", "expired"], default=None,
                      help="Only this kind of event.")
    when = tail.add_mutually_exclusive_group()
    when.add_argument("--since", default=None,
                      help="From this time on: ISO 8601, unix seconds, or a duration ago (90s, 5m, 2h).")
    when.add_argument("--last", type=_positive_int, default=None, help="The last N matching events (default 10).")
    tail.add_argument("--follow", action="store_true", help="Keep printing new events as they arrive.")
    tail.add_argument("--json", action="store_true", help="One JSON object per line instead of text.")
    _add_common(tail)


def _add_probe_parsers(sub) -> None:
    """`kvtier probe hicache` (kvtier/probe.py)."""
    probe = sub.add_parser("probe", help="Probe a worker with a fixed protocol and judge what the telemetry proves.")
    probe_sub = probe.add_subparsers(dest="probe", required=True, parser_class=_EnvDefaults)
    ph = probe_sub.add_parser(
        "hicache", help="Did HiCache serve a prefix from host RAM (L2)? Series A/B/C of SGLang's HiCache guide, "
                        "judged from the worker's event stream and tier state.",
        description="Series A: a long seeded-random prefix + question 1; B: the same prefix + question 2; C: other "
                    "prefixes push the prefix out of device memory, then A again. Each request is SGLang's native "
                    "POST <worker-url>/generate (input_ids, max_new_tokens 1). For each series: the prefix pages on "
                    "device/host before it (Redis tier state), the host->device loads seen after it (JetStream "
                    "events), TTFT, cached tokens by tier, and a verdict: 'L2 read proven', 'device hit', "
                    "'recomputed' or 'consistent with reuse, not proven'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ph.add_argument("--worker-url", required=True,
                    help="The worker's HTTP base: http://HOST:PORT for SGLang, http://HOST:PORT/w/<rank> for a "
                         "`kvtier sim-worker` rank (POST <worker-url>/generate).")
    ph.add_argument("--worker-id", required=True, type=_worker_id,
                    help="The worker's kvtier id (as its bridge publishes it; rank r of --dp-size N: <id>-dp<r>).")
    ph.add_argument("--model", required=True, help="The model name the worker's bridge publishes under.")
    ph.add_argument("--nats", required=True, help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    ph.add_argument("--redis", required=True, help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    ph.add_argument("--page-size", type=_positive_int, default=None,
                    help="The worker's page size (default: as its bridge announced it in Redis).")
    ph.add_argument("--prefix-tokens", type=_positive_int, default=2048,
                    help="Length of the test prefix (rounded up to whole pages).")
    ph.add_argument("--evict-prefixes", type=int, default=64,
                    help="At most this many other prefixes (each as long) before series C; the probe stops as soon "
                         "as Redis shows no prefix page on device, and sends all of them without tier state.")
    ph.add_argument("--seed", type=int, default=None, help="Seed of the random token ids (default: a fresh one, "
                                                           "printed; the same seed repeats the same prompts).")
    ph.add_argument("--watch-timeout", type=_positive_float, default=5.0,
                    help="Seconds to wait for a request's events on the stream.")
    ph.add_argument("--request-timeout", type=_positive_float, default=300.0, help="Seconds each request may take.")
    ph.add_argument("--api-key", default="", help="Bearer token for the worker's HTTP API (SGLang --api-key).")
    ph.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    _add_common(ph)


def _model_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more model names (comma-separated)")
    return names


def _add_analytics_parsers(sub) -> None:
    """`kvtier analytics` (consumers/analytics.py) and `kvtier report` (kvtier/report.py)."""
    a = sub.add_parser("analytics", help="Tier statistics from the event and decision streams on /metrics "
                                         "(a durable JetStream consumer of its own).",
                       description="Keeps every worker's pages per tier from KVTIER_EVENTS in memory and counts "
                                   "transitions (stored, removed, copies, promotions, demotions, evictions), page "
                                   "lifetimes per tier, and from KVTIER_DECISIONS the decisions per worker and the "
                                   "predicted hit tokens by tier; serves them as Prometheus metrics. Acks after "
                                   "counting, so a restart continues where it left off; the tier sets are rebuilt "
                                   "from the stream at start.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    a.add_argument("--durable", default="kvtier-analytics",
                   help="Durable consumer name prefix (<name>-events, <name>-decisions); two analytics with "
                        "different names count independently.")
    a.add_argument("--host", default="127.0.0.1", help="Address the HTTP server (/metrics, /healthz) binds to.")
    a.add_argument("--http-port", type=int, default=9464, help="HTTP port (0: a free one, printed at start).")
    a.add_argument("--models", type=_model_names, nargs="+", default=None,
                   help="Only these models (comma- or space-separated; default: every model).")
    a.add_argument("--writeback-window", type=_non_negative_float, default=2.0,
                   help="Seconds a page removed from its last tier may wait for its write-back store on a lower "
                        "tier (then a demotion, else an eviction; 0: evictions at once).")
    a.add_argument("--fetch-batch", type=_positive_int, default=256, help="Messages pulled at once.")
    a.add_argument("--ack-wait", type=_positive_float, default=30.0, dest="ack_wait_s",
                   help="Ack wait of the durable consumers.")
    a.add_argument("--no-rebuild", action="store_true",
                   help="Do not rebuild the tier sets from the events stream at start (faster start on a long "
                        "stream; resident pages then count only what is stored from now on).")
    _add_common(a)

    rep = sub.add_parser("report", help="PNG plots and summary.md of a time window of the event and decision "
                                        "streams.",
                         description="Reads KVTIER_EVENTS (from its first retained message, to rebuild the tier "
                                     "state, counting only the window) and KVTIER_DECISIONS for the window, and "
                                     "writes resident pages per tier over time, transitions per kind over time, "
                                     "lifetime distributions per tier, decisions per worker and predicted hit tokens "
                                     "by tier as PNGs, plus summary.md.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    rep.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    rep.add_argument("--since", required=True,
                     help="Window start: ISO 8601 (UTC without an offset), unix seconds, or a duration ago (30m).")
    rep.add_argument("--until", default="", help="Window end, same forms (default: now).")
    rep.add_argument("--model", default="", help="Only this model (default: every model).")
    rep.add_argument("--out", default="kvtier-report", help="Folder for the PNGs and summary.md.")
    rep.add_argument("--bins", type=_positive_int, default=60, help="Time steps of the plots over time.")
    rep.add_argument("--writeback-window", type=_non_negative_float, default=2.0,
                     help="Seconds a page removed from its last tier may wait for its write-back store on a lower "
                          "tier (then a demotion, else an eviction), as in `kvtier analytics`.")
    rep.add_argument("--json", action="store_true", help="Print one JSON object (the summary) as the last line.")
    _add_common(rep)


async def _run_analytics(args, stop) -> None:
    from kvtier.consumers.analytics import AnalyticsConfig, run_analytics

    models = None
    if args.models:
        models = [n for item in args.models for n in (item if isinstance(item, list) else [item])]
    config = AnalyticsConfig(nats_url=args.nats, durable=args.durable, host=args.host, http_port=args.http_port,
                             models=models, writeback_window_s=args.writeback_window, fetch_batch=args.fetch_batch,
                             ack_wait_s=args.ack_wait_s, rebuild=not args.no_rebuild)
    await run_analytics(config, stop, ready=lambda port: print(
        f"kvtier analytics listening on http://{args.host}:{port}/metrics", flush=True))


def build_parser() -> argparse.ArgumentParser:
    parser = _EnvDefaults(prog="kvtier", description="Tier-aware KV-cache routing for SGLang HiCache clusters.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_EnvDefaults)

    b = sub.add_parser("bridge", help="Forward one SGLang worker's ZMQ KV events to NATS JetStream.",
                       description="Subscribe to an SGLang worker's KV events (--kv-events-config publisher zmq) and "
                                   "publish them, in order and gap-free, to JetStream subject "
                                   "kvtier.events.<model>.<worker>. Recovers missed batches from the engine's replay "
                                   "socket and announces the worker (metadata + lease) every heartbeat.")
    b.add_argument("--sglang-url", default="",
                   help="The SGLang server's HTTP address (e.g. http://10.0.0.5:30000). At start the bridge reads its "
                        "/server_info and /get_hicache_l3_cache_layout and takes the endpoints, page size, DP/TP/PP "
                        "sizes, model and Mooncake layout from them; a flag that disagrees with the server is an "
                        "error.")
    b.add_argument("--sglang-timeout", type=_positive_float, default=5.0,
                   help="Seconds to wait for each of SGLang's replies at start (--sglang-url).")
    b.add_argument("--sglang-api-key", default="",
                   help="SGLang's --api-key, sent as a bearer token to /server_info (--sglang-url), if it has one.")
    b.add_argument("--endpoint", default=None,
                   help="The worker's ZMQ PUB endpoint to connect to, e.g. tcp://10.0.0.5:5557 (the 'endpoint' of "
                        "--kv-events-config with '*' replaced by the worker's address). DP rank r uses port + r. "
                        "Required unless --sglang-url is given.")
    b.add_argument("--replay-endpoint", default=None,
                   help="The worker's ZMQ replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558. Without it a gap or a "
                        "bridge restart cannot be recovered and starts a new epoch (the worker's state is rebuilt). "
                        "Discovered with --sglang-url when SGLang has one.")
    b.add_argument("--topic", default=None, help="ZMQ topic to subscribe to ('' = all, SGLang's default).")
    b.add_argument("--worker-id", required=True, type=_worker_id,
                   help="Stable id of this worker (letters, digits, '_', '-'); routers return it. With --dp-size N>1 "
                        "rank r becomes <worker-id>-dp<r>.")
    b.add_argument("--model", default=None,
                   help="Served model name, as clients send it to the router. Required unless --sglang-url is given "
                        "(then SGLang's served_model_name).")
    b.add_argument("--page-size", default=None, type=_positive_int,
                   help="SGLang --page-size of the worker (tokens per KV page). Required unless --sglang-url is given.")
    b.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    b.add_argument("--dp-size", type=_positive_int, default=None,
                   help="Attention data-parallel ranks of the worker; each rank publishes on endpoint port + rank "
                        "(default 1).")
    b.add_argument("--tp-size", type=_positive_int, default=None,
                   help="Tensor-parallel size (Mooncake key layout; default 1).")
    b.add_argument("--pp-size", type=_positive_int, default=None,
                   help="Pipeline-parallel size (Mooncake key layout; default 1).")
    b.add_argument("--mooncake-attention", choices=["mha", "mla"], default=None,
                   help="Attention kind, which decides the Mooncake key layout of a page (mha, the default: _k/_v per "
                        "TP rank; mla: one __k key).")
    b.add_argument("--mooncake-key-prefix", default=None, help="Prefix SGLang puts before Mooncake keys, if any.")
    b.add_argument("--hicache-storage-backend", choices=["none", "mooncake"], default=None,
                   help="The worker's SGLang --hicache-storage-backend (default none); with mooncake its key layout is "
                        "announced and routers credit it for pages in the shared pool. With --sglang-url, mooncake "
                        "also announces an MHA layout that SGLang itself declines to describe.")
    b.add_argument("--hicache", choices=["on", "off"], default=None,
                   help="Whether the worker runs SGLang HiCache (--enable-hierarchical-cache), announced so "
                        "`kvtier doctor` can tell a missing host tier from a disabled one (with --sglang-url: read "
                        "from the server).")
    b.add_argument("--hicache-write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default=None, help="The worker's SGLang --hicache-write-policy (with --sglang-url: read from "
                                      "the server).")
    b.add_argument("--worker-url", default=None, dest="http_endpoint",
                   help="The engine's HTTP base URL (e.g. http://10.0.0.5:30000), for a router in --proxy mode "
                        "(default: --sglang-url).")
    b.add_argument("--heartbeat", type=_positive_float, default=2.0, dest="heartbeat_s",
                   help="Seconds between announcements (metadata + lease renewal).")
    b.add_argument("--lease-ttl", type=_positive_float, default=10.0, dest="lease_ttl_s",
                   help="Seconds a worker stays live without a heartbeat; then its pages are removed.")
    b.add_argument("--max-batches-per-message", type=_positive_int, default=512,
                   help="Engine batches a burst may merge into one NATS message.")
    b.add_argument("--max-pages-per-message", type=_positive_int, default=16384,
                   help="Page transitions per NATS message before it is split (keeps messages under 1 MB).")
    b.add_argument("--replay-timeout", type=_positive_float, default=3.0, dest="replay_timeout_s",
                   help="Seconds to wait for the engine's replay socket to answer; a starting bridge asks up to "
                        "3 times, doubling it, before it begins an epoch without the replay (partial).")
    b.add_argument("--drop-token-ids", action="store_true",
                   help="Do not forward token ids of stored pages (smaller messages; disables hash validation).")
    _add_stream_flags(b)
    _add_common(b)

    p = sub.add_parser("processor", help="Apply tier events from JetStream to Redis, in order, exactly once.",
                       description="Durable JetStream consumer that keeps each worker's pages per tier in Redis. Run "
                                   "several with disjoint --partitions to share the work; a worker's events always "
                                   "belong to one partition, so they stay in order.")
    p.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    p.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    p.add_argument("--partitions", type=_partition_list, default=None,
                   help="Partitions this processor consumes: 'all' (default), a list like 0-3,6, or 'auto' (claim a "
                        "fair share through Redis leases and take over those of a processor that dies).")
    p.add_argument("--durable-prefix", default="kvtier-processor",
                   help="Durable consumer name prefix; partition k uses <prefix>-p<k>.")
    p.add_argument("--fetch-batch", type=_positive_int, default=256, help="Messages fetched (and pipelined) at once.")
    p.add_argument("--gap-timeout", type=_positive_float, default=10.0, dest="gap_timeout_s",
                   help="Seconds to wait for a missing batch before the worker is cleared, marked stale and asked "
                        "to resync.")
    p.add_argument("--lost-delivery-after", type=_positive_float, default=1.0, dest="lost_delivery_s",
                   help="A gap held back this long is taken for deliveries lost with a pull: the partition's consumer "
                        "is rewound to its ack floor (once per gap), so they come back before --gap-timeout.")
    p.add_argument("--ack-wait", type=_positive_float, default=30.0, dest="ack_wait_s",
                   help="JetStream ack wait of the consumers (redelivery delay of unacked messages).")
    p.add_argument("--reap-interval", type=_positive_float, default=1.0, dest="reap_interval_s",
                   help="Seconds between lease-expiry sweeps.")
    p.add_argument("--partition-lease", type=_positive_float, default=5.0, dest="partition_lease_s",
                   help="With --partitions auto: seconds a partition's lease lasts unrenewed (a dead processor's "
                        "partitions are taken over after it).")
    p.add_argument("--worker-retention", type=_positive_float, default=3600.0, dest="worker_retention_s",
                   help="Seconds a dead worker's leftovers (meta, state, set members) are kept before it is forgotten.")
    p.add_argument("--hash-check", choices=["on", "off"], default="on",
                   help="Recompute SGLang's page hash of every stored page from its tokens and record mismatches per "
                        "worker (kvt:{model}:hash_check, /metrics, the router's /healthz). 'off' saves the CPU "
                        "when the engine's scheme is known to match.")
    p.add_argument("--hash-check-budget", type=_non_negative_float, default=50_000.0,
                   help="Pages the hash check recomputes per second at most (0: no limit); pages over it are "
                        "counted as skipped, pages already verified (host copies, load_backs) are not recomputed.")
    _add_stream_flags(p)
    _add_common(p)

    r = sub.add_parser("router", help="Serve tier-aware routing decisions over HTTP (a stateless replica).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--redis", required=True, help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    r.add_argument("--nats", default="", help="NATS URL for the decision log (kvtier.decisions.<model>); '' = off.")
    r.add_argument("--host", default="127.0.0.1", help="Address the HTTP server binds to.")
    r.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one, printed at start).")
    r.add_argument("--router-mode", choices=["kv", "load", "round-robin", "random"], default="kv",
                   help="kv: tier-aware scoring; load: booked load only (cache weights 0); round-robin / random: "
                        "baselines for A/B tests (the turn is shared by every replica; decisions still report "
                        "the scores and book load).")
    r.add_argument("--seed", type=int, default=None,
                   help="Seed the random draws that break ties (reproducible decisions, e.g. in replays).")
    r.add_argument("--shared-cache-type", choices=["none", "hicache"], default="none",
                   help="hicache: credit pages workers can fetch from the shared Mooncake pool.")
    r.add_argument("--mooncake-master", default="",
                   help="The Mooncake master's HTTP address (its metrics port, serving /batch_query_keys).")
    r.add_argument("--shared-cache-timeout-ms", type=_positive_float, default=50.0,
                   help="Budget for the shared-pool query; past it the decision scores without it.")
    add_scoring_weight_arguments(r)
    r.add_argument("--predicted-pages", choices=["on", "off"], default="off",
                   help="Book each request's pages as predicted device pages on its worker until it completes, "
                        "visible to every replica (pages its events may not show yet). Pays off when requests "
                        "sharing a new context arrive together (fan-out); costs Redis memory per in-flight page "
                        "(BENCHMARKS.md).")
    r.add_argument("--page-size", type=_positive_int, default=None,
                   help="Expected worker page size; workers announcing another get no shared-pool credit "
                        "(default: trust each worker's announced size).")
    r.add_argument("--booking-ttl", type=_positive_float, default=600.0, dest="booking_ttl_s",
                   help="Seconds a booking holds load if never released (a router died mid-request).")
    r.add_argument("--state-timeout-ms", type=_positive_float, default=250.0,
                   help="Redis call budget; past it the decision routes by load/round robin.")
    r.add_argument("--max-request-tokens", type=_positive_int, default=1 << 18,
                   help="Longest token_ids accepted (longer: 413). The overlap walk of a request grows with its "
                        "pages; a 10^6-token request takes ~0.6 s of Redis time here, past the default "
                        "--state-timeout-ms, and would send this replica to load-only routing for everyone: raise "
                        "both together for very long contexts.")
    r.add_argument("--max-body-bytes", type=_positive_int, default=32 << 20, help="Largest request body (413).")
    r.add_argument("--proxy", action="store_true",
                   help="Also serve SGLang's /generate: route, forward to the worker, stream the answer back.")
    r.add_argument("--model", default="", help="Model of proxied requests that name none.")
    r.add_argument("--router-id", default="", help="Name in the decision log (default: random).")
    r.add_argument("--auth-token", default="",
                   help="Require 'Authorization: Bearer <token>' on every path but /healthz (/v1/route, "
                        "/v1/release, /generate; /metrics with --protect-metrics), else 401; prefer the environment "
                        "variable or --auth-token-file. Empty: no auth.")
    r.add_argument("--auth-token-file", default="", metavar="FILE",
                   help="Read the --auth-token from this file (surrounding whitespace ignored).")
    r.add_argument("--protect-metrics", action="store_true",
                   help="With an auth token, /metrics requires it too (/healthz always stays open).")
    _add_common(r)

    w = sub.add_parser("sim-worker", help="Simulated SGLang HiCache workers speaking SGLang's KV-event wire format.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("--ranks", type=_positive_int, default=1,
                   help="Simulated workers (DP ranks); rank r publishes on --port + r (bridge: --dp-size).")
    w.add_argument("--port", type=int, required=True, help="ZMQ PUB port of rank 0.")
    w.add_argument("--replay-port", type=int, required=True, help="ZMQ replay ROUTER port of rank 0.")
    w.add_argument("--http-port", type=int, default=0, help="HTTP port for requests (0: a free one, printed).")
    w.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    w.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per KV page.")
    w.add_argument("--device-pages", type=_positive_int, default=4096, help="GPU KV pool, in pages.")
    w.add_argument("--host-pages", type=int, default=None,
                   help="Host (L2) pool in pages; default --hicache-ratio x device pages; 0 = no HiCache.")
    w.add_argument("--hicache-ratio", type=_non_negative_float, default=2.0, help="Host pool / device pool.")
    w.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through", help="HiCache write policy (SGLang's --hicache-write-policy).")
    w.add_argument("--dma-delay-ms", type=_non_negative_float, default=2.0,
                   help="Simulated device->host copy time before the host store event.")
    add_cost_model_arguments(w)
    w.add_argument("--l3", action="store_true", help="Write pages to a shared L3 pool and prefetch from it.")
    w.add_argument("--l3-pages", type=_positive_int, default=None,
                   help="L3 pool capacity in pages (default: unbounded).")
    w.add_argument("--mooncake-rpc", default="",
                   help="With --l3: a real Mooncake master's RPC address (host:port) to write and find pages in.")
    w.add_argument("--mooncake-metadata", default="",
                   help="With --mooncake-rpc: the master's HTTP metadata URL (http://host:port/metadata).")
    _add_common(w)

    s = sub.add_parser("servers", help="Run embedded nats-server (JetStream) and Redis-protocol servers.",
                       description="Start nats-server with JetStream and a Redis-protocol server on loopback, print "
                                   "their URLs, and stop both on Ctrl-C/SIGTERM.")
    s.add_argument("--nats-port", type=int, default=0, help="NATS port (0: a free one).")
    s.add_argument("--redis-port", type=int, default=0, help="Redis port (0: a free one).")
    _add_common(s)

    i = sub.add_parser("inspect", help="Show each worker's tier state in Redis: pages per tier, epoch, seq, lease.",
                       description="Read what the processors keep in Redis: per worker, pages on each tier, the "
                                   "applied (epoch, seq), how long ago it was applied, its lease, and whether it is "
                                   "stale.")
    i.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    i.add_argument("--model", default=None, help="Only this model (default: every model).")
    i.add_argument("--worker", default=None, help="Only this worker.")
    i.add_argument("--json", action="store_true", help="Print one JSON array instead of a table.")
    _add_common(i)

    dr = sub.add_parser("doctor", help="Check a running deployment (NATS, Redis, workers, tiers, page sizes, Mooncake, "
                                       "routers, hash scheme, dead letters) and say what is wrong and how to fix it.",
                        description="Reads NATS, Redis, each router's /healthz and /metrics and the Mooncake master, "
                                    "and judges each check ok / warn / fail with a one-line finding and a fix. "
                                    "Exit 0 when nothing failed (warnings too fail with --strict), else 1.")
    dr.add_argument("--nats", required=True, help="NATS URL, e.g. nats://127.0.0.1:4222.")
    dr.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0.")
    dr.add_argument("--router", type=_url_list, action=_UrlListAction, default=[],
                    help="A router's base URL, e.g. http://10.0.0.7:8000 (repeat, or comma-separate, for several).")
    dr.add_argument("--mooncake-master", default="",
                    help="The Mooncake master's HTTP (metrics) address, e.g. http://master:9003; probed with "
                         "/batch_query_keys (or GET exactly this URL when it has a path, e.g. .../metrics).")
    dr.add_argument("--model", default=None, help="Only this model (default: every model in Redis).")
    dr.add_argument("--events-window", type=_positive_float, default=300.0,
                    help="Seconds within which a live worker's events should have been applied.")
    dr.add_argument("--timeout", type=_positive_float, default=3.0, help="Seconds each probe may take.")
    dr.add_argument("--strict", action="store_true", help="Exit 1 on warnings too.")
    dr.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    _add_common(dr)

    _add_replay_parsers(sub)
    _add_probe_parsers(sub)
    _add_analytics_parsers(sub)

    d = sub.add_parser("demo", help="Routing policies side by side on a simulated HiCache cluster, beside the "
                                    "oracle and the bounds, and a sweep of where tier awareness pays (embedded "
                                    "servers; kvtier/demo.py).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_cluster_arguments(d)
    d.set_defaults(trace="synthetic:1", requests=600, workers=4, device_pages=2048, host_pages=4096)
    d.add_argument("--no-sweep", action="store_true", help="Skip the host-pool / L3 sweep.")
    d.add_argument("--out", default="kvtier-demo", help="Folder for report.json and policies.png.")
    d.add_argument("--seed", type=int, default=1)
    _add_common(d)

    t = sub.add_parser("tune", help="Search the scoring weights on a lockstep trace replay; print the best settings "
                                    "for TTFT p50, TTFT p99 and recomputed tokens beside the defaults and the oracle.",
                       description="Each trial replays kvtier's router (in process, lockstep) on the trace "
                                   "(kvtier/bench/tune.py).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_cluster_arguments(t)
    t.set_defaults(requests=2000)
    t.add_argument("--budget", type=_positive_int, default=24, help="Settings to try (the defaults included).")
    t.add_argument("--holdout", type=float, default=0.3,
                   help="Share of the trace (its end) kept out of the search, to check the best settings on.")
    t.add_argument("--visibility-lag-ms", type=_non_negative_float, default=5.0,
                   help="Trace milliseconds between an engine event and routers seeing it.")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(t)

    bench = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_EnvDefaults)
    ingest = bench_sub.add_parser("ingest", help="Processor ingest: transitions/s NATS->Redis and event->visible lag.",
                                  description="Publishes pre-built kvtier batches to an embedded JetStream, runs one "
                                              "processor process, and measures block transitions applied per second "
                                              "end to end, then event->visible lag at half that rate.")
    ingest.add_argument("--transitions", type=_positive_int, default=2_000_000,
                        help="Transitions in the throughput phase.")
    ingest.add_argument("--workers", type=_positive_int, default=16, help="Simulated workers.")
    ingest.add_argument("--pages-per-event", type=_positive_int, default=16, help="Hashes per stored/removed event.")
    ingest.add_argument("--events-per-message", type=_positive_int, default=32,
                        help="Events per NATS message (the bridge's batching).")
    ingest.add_argument("--lag-seconds", type=_positive_float, default=10.0, help="Duration of the lag phase.")
    ingest.add_argument("--lag-rate", type=_positive_float, default=None,
                        help="Transitions/s in the lag phase (default: half the measured throughput).")
    ingest.add_argument("--no-token-ids", action="store_true",
                        help="Messages without token ids (as from `kvtier bridge --drop-token-ids`): ~4x smaller.")
    ingest.add_argument("--hash-check", choices=["on", "off"], default="on",
                        help="The processor's hash-scheme check (see `kvtier processor --hash-check`).")
    ingest.add_argument("--hash-check-budget", type=_non_negative_float, default=50_000.0,
                        help="Its pages/s budget (see `kvtier processor --hash-check-budget`; 0: no limit).")
    ingest.add_argument("--dynamo", action="store_true",
                        help="Also time Dynamo's RadixTree.apply_event on the device-tier events of the same messages "
                             "(needs: pip install -e '.[bench-dynamo]').")
    ingest.add_argument("--trace", action="store_true",
                        help="Also print lag p50/max per quarter second of the lag phase (to see bursts).")
    ingest.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(ingest)
    route = bench_sub.add_parser("route", help="Router decision latency and throughput (64 workers, 128-page "
                                               "requests), beside Dynamo's find_matches.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    route.add_argument("--workers", type=_positive_int, default=64, help="Live workers with tier state.")
    route.add_argument("--request-pages", type=_positive_int, default=128, help="Pages per request.")
    route.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per page.")
    route.add_argument("--conversations", type=_positive_int, default=256, help="Distinct 128-page prefixes.")
    route.add_argument("--conversations-per-worker", type=_positive_int, default=24,
                       help="Prefixes each worker caches (random device/host/disk split).")
    route.add_argument("--noise-pages", type=int, default=2000, help="Unrelated pages per worker and tier.")
    route.add_argument("--decisions", type=_positive_int, default=3000, help="Decisions per measurement.")
    route.add_argument("--concurrency", type=_positive_int, default=16, help="Concurrent in-process decisions.")
    route.add_argument("--http-concurrency", type=_positive_int, default=32, help="Concurrent HTTP clients.")
    route.add_argument("--shared-pool", action="store_true",
                       help="Also measure with a real Mooncake master (needs a private network namespace).")
    route.add_argument("--seed", type=int, default=1)
    route.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(route)
    rp = bench_sub.add_parser("replay", help="Replay a Mooncake-format trace on a simulated HiCache cluster, "
                                             "once per routing policy, beside the oracle and the bounds.",
                              description="Lockstep by default: the trace clock moves only when the pipeline has "
                                          "caught up, so the same trace and seed give the same figures on any "
                                          "machine (kvtier/bench/replay.py).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_cluster_arguments(rp)
    rp.add_argument("--policies", default="", help="Comma-separated subset of: random, round_robin, least_load, "
                                                   "device_only, tier_aware, tier_aware_shared, oracle.")
    rp.add_argument("--via", choices=["pipeline", "model"], default="pipeline",
                    help="kvtier's policies through the real pipeline (bridge, JetStream, processor, Redis, two "
                         "routers) or through the router's decision computed in process on the same information.")
    rp.add_argument("--visibility-lag-ms", type=_non_negative_float, default=5.0,
                    help="Trace milliseconds between an engine event and routers seeing it (0: the ideal).")
    rp.add_argument("--predicted-pages", choices=["on", "off"], default="off",
                    help="kvtier policies book predicted pages (the routers' --predicted-pages).")
    add_scoring_weight_arguments(rp)
    rp.add_argument("--seed", type=int, default=1)
    rp.add_argument("--seeds", default="", help="Comma-separated seeds: every figure is the median over them.")
    rp.add_argument("--plot", default="", metavar="PNG", help="Draw the policies beside the oracle and bounds.")
    rp.add_argument("--realtime", action="store_true",
                    help="Replay on the wall clock through the live pipeline (measures the machine, not the policy).")
    rp.add_argument("--time-scale", type=_positive_float, default=30.0,
                    help="With --realtime: trace seconds per wall second.")
    rp.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(rp)
    st = bench_sub.add_parser("synth-trace", help="Write the synthetic high-reuse trace (Mooncake format).",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    st.add_argument("--out", default="-", help="Output file ('-': standard output); its statistics go to stderr.")
    st.add_argument("--requests", type=_positive_int, default=3993)
    st.add_argument("--duration", type=_positive_float, default=1022.0, help="Trace span in seconds.")
    st.add_argument("--seed", type=int, default=1)
    _add_common(st)
    _add_soak_parser(bench_sub)
    _add_faults_parser(bench_sub)
    _add_fuzz_parser(bench_sub)
    return parser


def _add_cluster_arguments(p) -> None:
    """The trace and the simulated cluster of `kvtier bench replay` and `kvtier tune`."""
    p.add_argument("--trace", default=None,
                   help="Trace file (Mooncake FAST'25 JSONL format, .gz too); default: the whole public conversation "
                        "trace shipped with kvtier (kvtier/data).")
    p.add_argument("--requests", type=_positive_int, default=None, help="Only the first N requests.")
    p.add_argument("--workers", type=_positive_int, default=8, help="Simulated workers.")
    p.add_argument("--page-size", type=_positive_int, default=64, help="Tokens per KV page.")
    p.add_argument("--device-pages", type=_positive_int, default=2048, help="GPU pool per worker, in pages.")
    p.add_argument("--host-pages", type=_non_negative_int, default=16384,
                   help="Host pool per worker, in pages (0: HiCache off).")
    p.add_argument("--l3-pages", type=_positive_int, default=None,
                   help="Shared L3 pool, in pages (default: the workers' host pools together).")
    p.add_argument("--no-l3", action="store_true", help="No shared L3 pool in the simulated cluster.")
    p.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through")
    p.add_argument("--dma-delay-ms", type=_non_negative_float, default=2.0,
                   help="Simulated device->host copy time before the host store event.")
    add_cost_model_arguments(p)


def _add_fuzz_parser(bench_sub) -> None:
    """`kvtier bench fuzz` (kvtier/bench/fuzz.py)."""
    fz = bench_sub.add_parser(
        "fuzz", help="Fuzz every decoder of untrusted input (hypothesis), then the real router, bridge and "
                     "processor with bad input; reports cases per target and failures (target 0).",
        description="In process: each decoder (SGLang payloads/events/frames, kvtier stream and control messages, "
                    "worker metadata and hash checks from Redis, SGLang's and Mooncake's HTTP replies, the router's "
                    "request bodies) gets valid messages, perturbed ones (wrong types, NaN/inf, out-of-range ints, "
                    "unknown tiers, invalid UTF-8, deep nesting, huge arrays), byte mutations and random bytes; it "
                    "must return a typed value or raise its documented errors. Then, on embedded servers: fuzzed "
                    "HTTP requests against a real `kvtier router --proxy` (4xx naming the problem, never 5xx), "
                    "fuzzed engine payloads through a real bridge and processor, and fuzzed stream messages through "
                    "a real processor (each bad input dead-lettered with a reason, the good state exact). "
                    "Exit 0 when nothing failed, else 1. Needs hypothesis (pip install -e '.[test]').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fz.add_argument("--cases", type=_positive_int, default=100_000,
                    help="In-process decoder cases in total, shared among the decoders.")
    fz.add_argument("--seed", type=int, default=1, help="Hypothesis seed (one run is reproducible).")
    fz.add_argument("--mutants", type=int, default=15,
                    help="Quick byte mutants checked beside each input hypothesis draws (0: none).")
    fz.add_argument("--process-cases", type=int, default=None,
                    help="Requests through the real router; a 25th of it is the number of examples (of "
                         "about 6 inputs each) through the real bridge, and through the real processor "
                         "(default: cases/50, 100..2000).")
    fz.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(fz)


def _add_faults_parser(bench_sub) -> None:
    """`kvtier bench faults` (kvtier/bench/faults.py)."""
    fp = bench_sub.add_parser(
        "faults", help="A seeded schedule of crashes and outages (processor, bridge, nats-server, Redis with AOF "
                       "and once without persistence, engine restart, paused processor) during a sustained event "
                       "stream; then the live state is compared page for page with a replay of the stream.",
        description="Simulated HiCache engines publish SGLang's wire format to real bridges, nats-server "
                    "(JetStream, file storage), processors and a Redis-protocol server, each in its own process. "
                    "Faults are injected one at a time and each recovery is timed (repair -> every worker caught "
                    "up, none stale, no model rebuilding). At the end the live state is compared with a replay of "
                    "the stream and with every engine's own view. Exit 0 when nothing diverges and every fault "
                    "recovered, else 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fp.add_argument("--faults", type=_positive_int, default=24, help="Faults to inject (>= 11 covers every kind).")
    fp.add_argument("--lease", type=_positive_float, default=5.0,
                    help="The workers' lease in seconds (bridges announce every quarter of it); the long faults "
                         "(processor, all processors, NATS down) last twice as long.")
    fp.add_argument("--seed", type=int, default=1, help="Seed of the schedule, the targets and the workload.")
    fp.add_argument("--duration", type=_positive_float, default=150.0,
                    help="Seconds of event stream the faults are spread over.")
    fp.add_argument("--workers", type=_positive_int, default=4, help="Simulated engines, one bridge each.")
    fp.add_argument("--processors", type=int, choices=[1, 2], default=2,
                    help="Processors, each owning half of the partitions.")
    fp.add_argument("--rate", type=_positive_float, default=40.0, help="Requests per second per engine.")
    fp.add_argument("--log-dir", default="", help="Copy every process's log here.")
    fp.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(fp)


def _add_soak_parser(bench_sub) -> None:
    """`kvtier bench soak` (kvtier/bench/soak.py)."""
    sk = bench_sub.add_parser(
        "soak", help="Steady event and routing load through phases (steady, evict, refill, workers die, tail): "
                     "does memory (processor/router/bridge RSS, Redis, JetStream) track live pages?",
        description="The whole stack as processes on embedded loopback servers, a looping trace-shaped request "
                    "stream routed, served and released; samples RSS, Redis used_memory and keys, live page "
                    "entries per tier, bookings and JetStream bytes; prints per-phase medians and the verdicts. "
                    "Exit 0 when every verdict passes, else 1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sk.add_argument("--minutes", type=_positive_float, default=10.0, help="Length of the load (0.5 to 15).")
    sk.add_argument("--sample-s", type=_positive_float, default=None,
                    help="Seconds between samples (default: the run / 120, within 1..10).")
    sk.add_argument("--rate", type=_positive_float, default=10.0, help="Requests per second (at most 50).")
    sk.add_argument("--warm-up-s", type=_non_negative_float, default=60.0,
                    help="Seconds of trace load before the measured run (not counted in --minutes): the processes' "
                         "bounded caches fill; then every rank is flushed and Redis's baseline taken.")
    sk.add_argument("--sim-workers", type=_positive_int, default=2,
                    help="sim-worker processes, each with its own bridge.")
    sk.add_argument("--ranks", type=_positive_int, default=2, help="Simulated workers per sim-worker.")
    sk.add_argument("--die", type=_positive_int, default=1,
                    help="sim-workers (and their bridges) killed in the die phase.")
    sk.add_argument("--routers", type=_positive_int, default=2, help="Router replicas (1 to 4).")
    sk.add_argument("--page-size", type=_positive_int, default=16, help="Tokens per KV page.")
    sk.add_argument("--device-pages", type=_positive_int, default=1024, help="GPU pool per rank, in pages.")
    sk.add_argument("--host-pages", type=_positive_int, default=4096, help="Host pool per rank, in pages.")
    sk.add_argument("--max-prompt-tokens", type=_positive_int, default=8192, help="Trace prompts cut to this.")
    sk.add_argument("--lease-ttl", type=_positive_float, default=5.0, help="The bridges' --lease-ttl.")
    sk.add_argument("--stream-max-age", type=_positive_float, default=120.0,
                    help="Retention of the events and decisions streams in seconds (JetStream's minimum for the "
                         "events stream: its 120 s duplicate window).")
    sk.add_argument("--trace", default="", help="Mooncake-format trace (default: the sample shipped in kvtier/data).")
    sk.add_argument("--seed", type=int, default=1)
    sk.add_argument("--plot", default="", help="Write a PNG of the series here.")
    sk.add_argument("--json", action="store_true", help="Print one JSON object as the last line.")
    _add_common(sk)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _setup(args) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    if args.command in ("bench", "demo"):
        # SIGTERM unwinds like Ctrl-C, so the embedded servers these start are stopped too.
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _configure_connections(args)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def _run_until_signal(main) -> None:
    """Run an async main(stop_event) until it returns or SIGTERM/SIGINT sets the event."""
    try:
        import uvloop  # type: ignore

        uvloop.install()
    except ImportError:
        pass

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


def _auth_token(args) -> str:
    """The router's bearer token, from --auth-token or --auth-token-file (not both)."""
    token = args.auth_token.strip()
    if args.auth_token_file:
        if token:
            raise SystemExit("kvtier router: give --auth-token or --auth-token-file, not both")
        try:
            with open(args.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"kvtier router: --auth-token-file: cannot read {args.auth_token_file!r} "
                             f"({exc.strerror or exc})") from None
        if not token:
            raise SystemExit(f"kvtier router: --auth-token-file {args.auth_token_file!r} is empty")
    if args.protect_metrics and not token:
        raise SystemExit("kvtier router: --protect-metrics needs --auth-token or --auth-token-file")
    return token


async def _run_router(args, stop) -> None:
    from kvtier.router.service import RouterConfig, ServiceSettings, run_router

    if args.shared_cache_type == "hicache" and not args.mooncake_master:
        raise SystemExit("kvtier router: --shared-cache-type hicache needs --mooncake-master http://HOST:PORT "
                         "(the master's HTTP port serving /batch_query_keys)")
    config = RouterConfig(
        redis_url=args.redis, nats_url=args.nats, host=args.host, http_port=args.http_port,
        router_mode=args.router_mode, shared_cache_type=args.shared_cache_type, mooncake_master=args.mooncake_master,
        shared_cache_timeout_s=args.shared_cache_timeout_ms / 1000, page_size=args.page_size,
        booking_ttl_s=args.booking_ttl_s, state_timeout_s=args.state_timeout_ms / 1000, router_id=args.router_id,
        seed=args.seed,
        weights=scoring_weights_from(args),
        predicted_pages=args.predicted_pages == "on",
        service=ServiceSettings(max_request_tokens=args.max_request_tokens, max_body_bytes=args.max_body_bytes,
                                proxy=args.proxy, default_model=args.model, auth_token=_auth_token(args),
                                protect_metrics=args.protect_metrics),
    )
    await run_router(config, stop, ready=lambda port: print(f"kvtier router listening on http://{args.host}:{port}",
                                                            flush=True))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup(args)
    try:
        if args.command == "bridge":
            from kvtier.producers.bridge import BridgeConfig, run_bridge
            from kvtier.producers.sglang_discovery import WorkerFlags, resolve_worker

            streams, explicit = _stream_settings(args)
            worker = resolve_worker(WorkerFlags(
                endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic, model=args.model,
                page_size=args.page_size, dp_size=args.dp_size, tp_size=args.tp_size, pp_size=args.pp_size,
                hicache_storage_backend=args.hicache_storage_backend, mooncake_attention=args.mooncake_attention,
                mooncake_key_prefix=args.mooncake_key_prefix, http_endpoint=args.http_endpoint,
                hicache_enabled=None if args.hicache is None else args.hicache == "on",
                hicache_write_policy=args.hicache_write_policy,
            ), sglang_url=args.sglang_url, timeout_s=args.sglang_timeout, api_key=args.sglang_api_key)
            layout = worker.mooncake
            config = BridgeConfig(
                endpoint=worker.endpoint, replay_endpoint=worker.replay_endpoint, topic=worker.topic,
                worker_id=args.worker_id, model=worker.model, page_size=worker.page_size, nats_url=args.nats,
                dp_size=worker.dp_size, tp_size=worker.tp_size, pp_size=worker.pp_size,
                mooncake_attention=layout.attention.value if layout else "mha",
                mooncake_key_prefix=layout.key_prefix if layout else "",
                hicache_storage_backend="mooncake" if layout else "none", http_endpoint=worker.http_endpoint,
                engine_version=worker.engine_version, hicache_enabled=worker.hicache_enabled,
                hicache_write_policy=worker.hicache_write_policy,
                heartbeat_s=args.heartbeat_s, lease_ttl_s=args.lease_ttl_s, replay_timeout_s=args.replay_timeout_s,
                max_batches_per_message=args.max_batches_per_message,
                max_pages_per_message=args.max_pages_per_message, keep_token_ids=not args.drop_token_ids,
                streams=streams, partitions_explicit=explicit,
            )
            _run_until_signal(lambda stop: run_bridge(config, stop))
        elif args.command == "processor":
            from kvtier.consumers.processor import Processor, ProcessorConfig

            streams, explicit = _stream_settings(args)
            config = ProcessorConfig(
                nats_url=args.nats, redis_url=args.redis,
                partitions=None if args.partitions == "auto" else args.partitions,
                auto_partitions=args.partitions == "auto",
                durable_prefix=args.durable_prefix, fetch_batch=args.fetch_batch, gap_timeout_s=args.gap_timeout_s,
                lost_delivery_s=args.lost_delivery_s,
                worker_retention_s=args.worker_retention_s, partition_lease_s=args.partition_lease_s,
                ack_wait_s=args.ack_wait_s, reap_interval_s=args.reap_interval_s, streams=streams,
                partitions_explicit=explicit, hash_check=args.hash_check == "on",
                hash_check_budget=args.hash_check_budget,
            )
            _run_until_signal(lambda stop: Processor(config).run(stop))
        elif args.command == "router":
            _run_until_signal(lambda stop: _run_router(args, stop))
        elif args.command == "sim-worker":
            from kvtier.producers.hicache_sim import SimConfig
            from kvtier.producers.sim_worker import SimWorkerConfig, run_sim_worker

            host_pages = args.host_pages if args.host_pages is not None else int(args.device_pages * args.hicache_ratio)
            sim = SimConfig(page_size=args.page_size, device_pages=args.device_pages, host_pages=host_pages,
                            write_policy=args.write_policy, dma_delay_s=args.dma_delay_ms / 1000,
                            cost=cost_model_from_args(args), l3=args.l3)
            if args.mooncake_rpc and not (args.l3 and args.mooncake_metadata):
                raise SystemExit("kvtier sim-worker: --mooncake-rpc needs --l3 and --mooncake-metadata")
            config = SimWorkerConfig(ranks=args.ranks, port=args.port, replay_port=args.replay_port,
                                     http_port=args.http_port, host=args.host, sim=sim, l3_pages=args.l3_pages,
                                     mooncake_rpc=args.mooncake_rpc, mooncake_metadata=args.mooncake_metadata)
            _run_until_signal(lambda stop: run_sim_worker(config, stop))
        elif args.command == "servers":
            from kvtier.embedded import NatsServer, RedisServer

            async def serve(stop):
                with NatsServer(port=args.nats_port) as nats_server, RedisServer(port=args.redis_port) as redis_server:
                    print(f"NATS  {nats_server.url}  (pid {nats_server.pid})")
                    print(f"Redis {redis_server.url}  (pid {redis_server.pid})", flush=True)
                    await stop.wait()

            _run_until_signal(serve)
        elif args.command == "inspect":
            from kvtier.inspect import run_inspect

            return run_inspect(args)
        elif args.command == "doctor":
            from kvtier.doctor import run_doctor

            return run_doctor(args)
        elif args.command == "replay" and args.replay_command == "explain":
            from kvtier.explain import run_explain

            return run_explain(args)
        elif args.command == "replay":
            from kvtier.replay import run_replay

            return run_replay(args)
        elif args.command == "events":
            from kvtier.events_tail import run_events

            return run_events(args)
        elif args.command == "probe" and args.probe == "hicache":
            from kvtier.probe import run_probe_cli

            return run_probe_cli(args)
        elif args.command == "analytics":
            _run_until_signal(lambda stop: _run_analytics(args, stop))
        elif args.command == "report":
            from kvtier.report import run_report

            return run_report(args)
        elif args.command == "demo":
            from kvtier.demo import run_demo

            return run_demo(args)
        elif args.command == "tune":
            from kvtier.bench.tune import run_tune

            return run_tune(args)
        elif args.command == "bench" and args.bench == "replay":
            from kvtier.bench.replay import run_replay_bench

            return run_replay_bench(args)
        elif args.command == "bench" and args.bench == "route":
            from kvtier.bench.route import run_route_bench

            return run_route_bench(args)
        elif args.command == "bench" and args.bench == "ingest":
            from kvtier.bench.ingest import run_ingest_bench

            return run_ingest_bench(args)
        elif args.command == "bench" and args.bench == "soak":
            from kvtier.bench.soak import run_soak_bench

            return run_soak_bench(args)
        elif args.command == "bench" and args.bench == "faults":
            from kvtier.bench.faults import run_fault_bench

            return run_fault_bench(args)
        elif args.command == "bench" and args.bench == "synth-trace":
            from kvtier.bench.synth_trace import run_synth_trace

            return run_synth_trace(args)
        elif args.command == "bench" and args.bench == "fuzz":
            from kvtier.bench.fuzz import run_fuzz_bench

            return run_fuzz_bench(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a CLI reports errors as one clear line
        from kvtier.errors import user_facing

        message = user_facing(exc)
        if message is None:
            raise
        print(f"kvtier {args.command}: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
