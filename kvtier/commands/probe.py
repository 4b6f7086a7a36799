"""`kvtier probe hicache` (kvtier/tools/probe.py). Its flags are ProbeSettings' declarations
(kvtier/tools/settings.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import EnvDefaults, add_common, add_flags, read_settings
from kvtier.tools.settings import ProbeSettings


def register(sub) -> None:
    probe = sub.add_parser("probe", help="Probe a worker with a fixed protocol and judge what the telemetry proves.")
    probe_sub = probe.add_subparsers(dest="probe", required=True, parser_class=EnvDefaults)
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
    add_flags(ph, ProbeSettings)
    add_common(ph)
    ph.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.probe import run_probe_cli

    return run_probe_cli(read_settings(ProbeSettings, args))
