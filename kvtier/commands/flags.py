"""What every `kvtier` subcommand shares: the parser class that reads KVTIER_<FLAG> from the
environment, argument types, the flags of a settings class and the settings from them
(`add_flags`, `read_settings`: kvtier/plumbing/settings.py), the common flags (logging,
metrics, credentials and TLS), the trace/cluster flags of demo, tune and bench replay, and
running an async main until a signal."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from kvtier.plumbing.log_limit import limit_log_rate
from kvtier.plumbing.log_records import cap_log_records
from kvtier.plumbing.settings import SECRET_FLAG
from kvtier.plumbing.settings import UrlListAction as UrlListAction
from kvtier.plumbing.settings import add_flags as add_flags
from kvtier.plumbing.settings import non_negative_float as non_negative_float
from kvtier.plumbing.settings import non_negative_int as non_negative_int
from kvtier.plumbing.settings import partition_list as partition_list
from kvtier.plumbing.settings import positive_float as positive_float
from kvtier.plumbing.settings import positive_int as positive_int
from kvtier.plumbing.settings import read_settings as read_settings
from kvtier.plumbing.settings import url_list as url_list
from kvtier.plumbing.settings import worker_id_text as worker_id_text


def env_name(flag: str) -> str:
    return "KVTIER_" + flag.lstrip("-").upper().replace("-", "_")


class HideSecretDefaults(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):
        if getattr(action, "kvtier_secret", False):
            return action.help
        return super()._get_help_string(action)


class EnvDefaults(argparse.ArgumentParser):
    """ArgumentParser whose options take their default from KVTIER_<FLAG>. An environment
    value is checked like a command-line one (type and choices); a bad one is reported as a
    usage error of the command that uses it, never as a traceback, and never breaks another
    command (the parser of every subcommand is built whichever one runs). Abbreviated flags are
    refused, so adding a flag can never change what an existing command line means."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        if kwargs.get("formatter_class") is argparse.ArgumentDefaultsHelpFormatter:
            kwargs["formatter_class"] = HideSecretDefaults  # --help shows no secret's value
        super().__init__(*args, **kwargs)
        self._env_errors: list[str] = []

    def add_argument(self, *names, **kwargs):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag and flag != "--help":
            env = env_name(flag)
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
        if flag and SECRET_FLAG.search(flag):  # --help shows no value of it, nor one from the environment
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
    if kwargs.get("action") == "append":  # a repeatable flag: its values comma-separated, each read alone
        return [_env_value(part.strip(), {**kwargs, "action": None}) for part in raw.split(",") if part.strip()]
    value = kwargs["type"](raw) if "type" in kwargs else raw
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"invalid choice (choose from {', '.join(map(str, choices))})")
    return value


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="Log verbosity.")
    p.add_argument("--log-rate-limit", type=int, default=20, metavar="N",
                   help="At most N log records of one kind (logger and message) a minute; the rest are counted "
                        "in the next one written, so a flood of bad requests cannot fill the disk (0: no limit).")
    p.add_argument("--log-max-record-bytes", type=non_negative_int, default=4096, metavar="BYTES",
                   help="Cut each log record (message and traceback) to BYTES of UTF-8, ending it with how many "
                        "bytes were cut, so text a client sends (a request line, headers) cannot make huge records "
                        "(0: no cap).")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off).")
    p.add_argument("--metrics-host", default="127.0.0.1", help="Address the metrics server binds to.")
    add_security_flags(p)


def add_security_flags(p: argparse.ArgumentParser) -> None:
    """Credentials and TLS for the NATS and Redis connections of a command that makes them
    (kvtier/plumbing/nats_options.py, kvtier/plumbing/connections.py). Secrets are best given by environment."""
    options = getattr(p, "_option_string_actions", {})
    if "--nats" in options:
        # (plain add_argument, not a group: a group would bypass EnvDefaults and its KVTIER_* defaults)
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


def configure_connections(args) -> None:
    """The one place the NATS options and the Redis TLS settings of this process are built."""
    from kvtier.plumbing import connections
    from kvtier.plumbing.nats_options import NatsOptions, configure

    try:
        configure(NatsOptions.from_args(args))
        connections.configure(tls_ca=(getattr(args, "redis_tls_ca", None) or "").strip())
    except ValueError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def setup(args) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack
    if args.command in ("bench", "demo"):
        # SIGTERM unwinds like Ctrl-C, so the embedded servers these start are stopped too.
        signal.signal(signal.SIGTERM, interrupt)
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_log_rate(getattr(args, "log_rate_limit", 0))
    cap_log_records(getattr(args, "log_max_record_bytes", 0))
    configure_connections(args)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)


def run_until_signal(main) -> None:
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
