"""`kvtier probe hicache` (kvtier/tools/probe.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import EnvDefaults, add_common, positive_float, positive_int, worker_id_text


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
    ph.add_argument("--worker-url", required=True,
                    help="The worker's HTTP base: http://HOST:PORT for SGLang, http://HOST:PORT/w/<rank> for a "
                         "`kvtier sim-worker` rank (POST <worker-url>/generate).")
    ph.add_argument("--worker-id", required=True, type=worker_id_text,
                    help="The worker's kvtier id (as its bridge publishes it; rank r of --dp-size N: <id>-dp<r>).")
    ph.add_argument("--model", required=True, help="The model name the worker's bridge publishes under.")
    ph.add_argument("--nats", required=True, help="NATS URL holding KVTIER_EVENTS, e.g. nats://127.0.0.1:4222.")
    ph.add_argument("--redis", required=True, help="Redis URL holding the tier state, e.g. redis://127.0.0.1:6379/0.")
    ph.add_argument("--page-size", type=positive_int, default=None,
                    help="The worker's page size (default: as its bridge announced it in Redis).")
    ph.add_argument("--prefix-tokens", type=positive_int, default=2048,
                    help="Length of the test prefix (rounded up to whole pages).")
    ph.add_argument("--evict-prefixes", type=int, default=64,
                    help="At most this many other prefixes (each as long) before series C; the probe stops as soon "
                         "as Redis shows no prefix page on device, and sends all of them without tier state.")
    ph.add_argument("--seed", type=int, default=None, help="Seed of the random token ids (default: a fresh one, "
                                                           "printed; the same seed repeats the same prompts).")
    ph.add_argument("--watch-timeout", type=positive_float, default=5.0,
                    help="Seconds to wait for a request's events on the stream.")
    ph.add_argument("--request-timeout", type=positive_float, default=300.0, help="Seconds each request may take.")
    ph.add_argument("--api-key", default="", help="Bearer token for the worker's HTTP API (SGLang --api-key).")
    ph.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    add_common(ph)
    ph.set_defaults(run=run)


def run(args) -> int:
    from kvtier.tools.probe import run_probe_cli

    return run_probe_cli(args)
