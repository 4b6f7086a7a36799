"""What the evaluation commands are told (`kvtier bench replay`, `kvtier tune`, `kvtier demo`,
`kvtier bench synth-trace`): one settings class each, every setting declared once with its flag
(kvtier/plumbing/settings.py), so the commands' flags come from here and kvtier/eval/ only ever
sees the typed settings. The trace and the simulated cluster are one class, `ClusterFlags`,
that each command holds. Light to import: the command line's parser is built from it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvtier.eval.synth_trace import SynthParams
from kvtier.plumbing.settings import (
    flag_group,
    group,
    non_negative_float,
    non_negative_int,
    on_off,
    positive_float,
    positive_int,
    setting,
    switch,
    text_choice,
)
from kvtier.router.weight_flags import add_scoring_weight_arguments, scoring_weights_from
from kvtier.schemas.routing import ScoringWeights
from kvtier.sim.cost_model import CostModel, add_cost_model_arguments, cost_model_from_args
from kvtier.sim.hicache_sim import WRITE_POLICIES
from kvtier.sim.sim_cluster import ClusterShape, Slowdown, parse_speeds

T = TypeVar("T")


def _flag_text(read: Callable[[str], T]) -> Callable[[str], T]:
    """`read` as a flag's type: its ValueError becomes argparse's usage error, message and all."""

    def parse(text: str) -> T:
        try:
            return read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


@dataclass(kw_only=True)
class ClusterFlags:
    """The trace and the simulated cluster a replay runs on."""

    trace: str | None = setting(
        None, flag="--trace",
        help="Trace file (Mooncake FAST'25 JSONL format, .gz too); default: the whole public conversation trace "
             "shipped with kvtier (kvtier/data).")
    requests: int | None = setting(None, flag="--requests", parse=positive_int, help="Only the first N requests.")
    workers: int = setting(8, flag="--workers", parse=positive_int, help="Simulated workers.")
    page_size: int = setting(64, flag="--page-size", parse=positive_int, help="Tokens per KV page.")
    device_pages: int = setting(2048, flag="--device-pages", parse=positive_int, help="GPU pool per worker, in pages.")
    host_pages: int = setting(16384, flag="--host-pages", parse=non_negative_int,
                              help="Host pool per worker, in pages (0: HiCache off).")
    l3_pages: int | None = setting(None, flag="--l3-pages", parse=positive_int,
                                   help="Shared L3 pool, in pages (default: the workers' host pools together).")
    no_l3: bool = switch(flag="--no-l3", help="No shared L3 pool in the simulated cluster.")
    write_policy: str = text_choice("write_through", choices=WRITE_POLICIES, flag="--write-policy", help="")
    dma_delay_ms: float = setting(2.0, flag="--dma-delay-ms", parse=non_negative_float,
                                  help="Simulated device->host copy time before the host store event.")
    worker_speeds: tuple[float, ...] = setting(
        (), flag="--worker-speeds", parse=_flag_text(parse_speeds), metavar="F,F,...",
        help="One speed factor per worker on its prefill throughput and load-back bandwidths (0.5: a worker at half "
             "speed; default: all 1). The routers are not told.")
    slowdown: list[Slowdown] = setting(
        [], flag="--slowdown", parse=_flag_text(Slowdown.parse), metavar="RANK:FACTOR@SECONDS", repeat=True,
        help="Worker RANK runs at FACTOR times its speed from SECONDS of trace time after the first request on "
             "(repeatable).")
    cost: CostModel = flag_group(add_cost_model_arguments, cost_model_from_args, CostModel)

    def shape(self) -> ClusterShape:
        return ClusterShape(workers=self.workers, page_size=self.page_size, device_pages=self.device_pages,
                            host_pages=self.host_pages, write_policy=self.write_policy, l3=not self.no_l3,
                            l3_pages=self.l3_pages, dma_delay_s=self.dma_delay_ms / 1000, cost=self.cost,
                            worker_speeds=tuple(self.worker_speeds), slowdowns=tuple(self.slowdown))


_LAG_HELP = "Trace milliseconds between an engine event and routers seeing it"


@dataclass(kw_only=True)
class ReplayBench:
    """`kvtier bench replay` (kvtier/eval/replay.py)."""

    cluster: ClusterFlags = group(ClusterFlags)
    policies: str = setting(
        "", flag="--policies",
        help="Comma-separated subset of: random, round_robin, least_load, device_only, tier_aware, "
             "tier_aware_shared, oracle, ttft_oracle; and predicted_ttft (the router model that moves requests "
             "to workers faster at learned rates, in process) and tier_aware_redrawn (the formula with its ties "
             "broken by other random draws: how far it moves from itself), which run only when named.")
    via: str = text_choice(
        "pipeline", choices=("pipeline", "model"), flag="--via",
        help="kvtier's policies through the real pipeline (bridge, JetStream, processor, Redis, two routers) or "
             "through the router's decision computed in process on the same information.")
    visibility_lag_ms: float = setting(5.0, flag="--visibility-lag-ms", parse=non_negative_float,
                                       help=f"{_LAG_HELP} (0: the ideal).")
    predicted_pages: bool = on_off(False, flag="--predicted-pages",
                                   help="kvtier policies book predicted pages (the routers' --predicted-pages).")
    weights: ScoringWeights = flag_group(add_scoring_weight_arguments, scoring_weights_from, ScoringWeights)
    seed: int = setting(1, flag="--seed", parse=int, help="")
    seeds: str = setting("", flag="--seeds", help="Comma-separated seeds: every figure is the median over them.")
    plot: str = setting("", flag="--plot", metavar="PNG", help="Draw the policies beside the oracle and bounds.")
    realtime: bool = switch(
        flag="--realtime", help="Replay on the wall clock through the live pipeline (measures the machine, not the "
                                "policy).")
    time_scale: float = setting(30.0, flag="--time-scale", parse=positive_float,
                                help="With --realtime: trace seconds per wall second.")
    suite: bool = switch(
        flag="--suite", help="Run every workload of the suite (kvtier/eval/workloads.py) on equal workers and on "
                             "half at half speed, in process, over seeds, and print one table of ratios to "
                             "tier_aware (--trace is not read).")
    held_out: bool = switch(flag="--held-out", help="With --suite: the seeds kept out of any tuning.")
    workloads: str = setting("", flag="--workloads",
                             help="With --suite: comma-separated subset of conversation, synthetic, agentic, "
                                  "shared_prompts, bursty (default: all).")
    json: bool = switch(flag="--json", help="Print one JSON object as the last line.")


@dataclass(kw_only=True)
class TuneSettings:
    """`kvtier tune` (kvtier/eval/tune.py); its --requests default is 2000 (the command sets it)."""

    cluster: ClusterFlags = group(ClusterFlags)
    policy: str = text_choice(
        "tier_aware", choices=("tier_aware", "predicted_ttft"), flag="--policy",
        help="The router model whose weights are searched: tier_aware (the formula; tier_aware_shared with L3) or "
             "predicted_ttft (the formula, overridden for workers faster at the rates it learns from first tokens).")
    budget: int = setting(24, flag="--budget", parse=positive_int, help="Settings to try (the defaults included).")
    holdout: float = setting(0.3, flag="--holdout", parse=float,
                             help="Share of the trace (its end) kept out of the search, to check the best settings "
                                  "on.")
    visibility_lag_ms: float = setting(5.0, flag="--visibility-lag-ms", parse=non_negative_float,
                                       help=f"{_LAG_HELP}.")
    seed: int = setting(1, flag="--seed", parse=int, help="")
    json: bool = switch(flag="--json", help="Print one JSON object as the last line.")

    def validate(self) -> None:
        if not 0.0 <= self.holdout < 1.0:
            from kvtier.plumbing.settings import SettingsError

            raise SettingsError(f"--holdout must be in [0, 1), got {self.holdout}")


@dataclass(kw_only=True)
class DemoSettings:
    """`kvtier demo` (kvtier/eval/demo.py); its cluster defaults are the command's (a smaller cluster)."""

    cluster: ClusterFlags = group(ClusterFlags)
    no_sweep: bool = switch(flag="--no-sweep", help="Skip the host-pool / L3 sweep.")
    out: str = setting("kvtier-demo", flag="--out", help="Folder for report.json and policies.png.")
    seed: int = setting(1, flag="--seed", parse=int, help="")


@dataclass(kw_only=True)
class SynthTraceSettings:
    """`kvtier bench synth-trace` (kvtier/eval/synth_trace.py)."""

    out: str = setting("-", flag="--out", help="Output file ('-': standard output); its statistics go to stderr.")
    requests: int = setting(SynthParams.requests, flag="--requests", parse=positive_int, help="")
    duration: float = setting(SynthParams.duration_s, flag="--duration", parse=positive_float,
                              help="Trace span in seconds.")
    seed: int = setting(1, flag="--seed", parse=int, help="")
