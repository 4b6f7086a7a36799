"""What `kvtier analytics` is told: `AnalyticsConfig`, each setting declared once with its flag
(kvtier/plumbing/settings.py), so the command's flags come from here and the service only sees
the typed settings. Light to import: the command's parser is built from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.plumbing.settings import non_negative_float, positive_float, positive_int, required, setting, switch


def _model_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more model names (comma-separated)")
    return names


def _flattened(groups: list[list[str]] | list[str] | None) -> list[str] | None:
    """`--models a,b c`: one list per word given, each of one or more names."""
    if not groups:
        return None
    return [n for item in groups for n in (item if isinstance(item, list) else [item])]


@dataclass(kw_only=True)
class AnalyticsConfig:
    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    durable: str = setting(
        "kvtier-analytics", flag="--durable",
        help="Durable consumer name prefix (<name>-events, <name>-decisions); two analytics with different names "
             "count independently.")
    host: str = setting("127.0.0.1", flag="--host", help="Address the HTTP server (/metrics, /healthz) binds to.")
    http_port: int = setting(9464, flag="--http-port", parse=int, help="HTTP port (0: a free one, printed at start).")
    models: list[str] | None = setting(
        None, flag="--models", parse=_model_names, nargs="+", to_field=_flattened,
        help="Only these models (comma- or space-separated; default: every model).")
    writeback_window_s: float = setting(
        2.0, flag="--writeback-window", dest="writeback_window", parse=non_negative_float,
        help="Seconds a page removed from its last tier may wait for its write-back store on a lower tier (then a "
             "demotion, else an eviction; 0: evictions at once).")
    fetch_batch: int = setting(256, flag="--fetch-batch", parse=positive_int, help="Messages pulled at once.")
    ack_wait_s: float = setting(30.0, flag="--ack-wait", dest="ack_wait_s", parse=positive_float,
                                help="Ack wait of the durable consumers.")
    no_rebuild: bool = switch(
        flag="--no-rebuild",
        help="Do not rebuild the tier sets from the events stream at start (faster start on a long stream; resident "
             "pages then count only what is stored from now on).")
    #: Seconds between the service's housekeeping ticks (not a flag: tests shorten it).
    tick_s: float = 1.0

    @property
    def rebuild(self) -> bool:
        return not self.no_rebuild
