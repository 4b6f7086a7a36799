"""`kvtier sim-worker`: simulated SGLang HiCache workers (kvtier/sim/sim_worker.py). Its flags
are SimWorkerSettings' declarations below; the simulated engine's own defaults come from
SimConfig (the sim module holding SimWorkerConfig imports aiohttp, so it is read only in run)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.commands.flags import add_common, add_flags, read_settings, run_until_signal
from kvtier.plumbing.settings import (
    SettingsError,
    flag_group,
    non_negative_float,
    positive_int,
    required,
    setting,
    switch,
    text_choice,
)
from kvtier.sim.cost_model import CostModel, add_cost_model_arguments, cost_model_from_args
from kvtier.sim.hicache_sim import WRITE_POLICIES, SimConfig


@dataclass(kw_only=True)
class SimWorkerSettings:
    ranks: int = setting(1, flag="--ranks", parse=positive_int,
                         help="Simulated workers (DP ranks); rank r publishes on --port + r (bridge: --dp-size).")
    port: int = required(flag="--port", parse=int, help="ZMQ PUB port of rank 0.")
    replay_port: int = required(flag="--replay-port", parse=int, help="ZMQ replay ROUTER port of rank 0.")
    http_port: int = setting(0, flag="--http-port", parse=int, help="HTTP port for requests (0: a free one, printed).")
    host: str = setting("127.0.0.1", flag="--host", help="Address to bind.")
    page_size: int = setting(SimConfig.page_size, flag="--page-size", parse=positive_int, help="Tokens per KV page.")
    device_pages: int = setting(SimConfig.device_pages, flag="--device-pages", parse=positive_int,
                                help="GPU KV pool, in pages.")
    host_pages: int | None = setting(
        None, flag="--host-pages", parse=int,
        help="Host (L2) pool in pages; default --hicache-ratio x device pages; 0 = no HiCache.")
    hicache_ratio: float = setting(2.0, flag="--hicache-ratio", parse=non_negative_float,
                                   help="Host pool / device pool.")
    write_policy: str = text_choice(SimConfig.write_policy, flag="--write-policy", choices=WRITE_POLICIES,
                                    help="HiCache write policy (SGLang's --hicache-write-policy).")
    dma_delay_ms: float = setting(SimConfig.dma_delay_s * 1000, flag="--dma-delay-ms", parse=non_negative_float,
                                  help="Simulated device->host copy time before the host store event.")
    cost: CostModel = flag_group(add_cost_model_arguments, cost_model_from_args, CostModel)
    l3: bool = switch(flag="--l3", help="Write pages to a shared L3 pool and prefetch from it.")
    l3_pages: int | None = setting(None, flag="--l3-pages", parse=positive_int,
                                   help="L3 pool capacity in pages (default: unbounded).")
    mooncake_rpc: str = setting(
        "", flag="--mooncake-rpc",
        help="With --l3: a real Mooncake master's RPC address (host:port) to write and find pages in.")
    mooncake_metadata: str = setting(
        "", flag="--mooncake-metadata",
        help="With --mooncake-rpc: the master's HTTP metadata URL (http://host:port/metadata).")
    tokenizer: str = setting(
        "", flag="--tokenizer",
        help="A tokenizer folder (tokenizer.json, tokenizer_config.json): also serve the OpenAI-compatible API "
             "(/w/<rank>/v1/completions, /w/<rank>/v1/chat/completions), tokenizing as SGLang does.")
    model: str = setting("sim", flag="--model", help="The model name the OpenAI answers carry.")
    pace: bool = switch(
        flag="--pace",
        help="Answer the OpenAI API in wall time: the first byte after the simulated TTFT (its queue included), the "
             "end after the simulated end-to-end latency, as a loaded engine would (for load benches; default: "
             "answer at once and only report the times).")

    def validate(self) -> None:
        if self.mooncake_rpc and not (self.l3 and self.mooncake_metadata):
            raise SettingsError("--mooncake-rpc needs --l3 and --mooncake-metadata")

    def sim(self) -> SimConfig:
        """One simulated engine's settings."""
        host_pages = self.host_pages if self.host_pages is not None else int(self.device_pages * self.hicache_ratio)
        return SimConfig(page_size=self.page_size, device_pages=self.device_pages, host_pages=host_pages,
                         write_policy=self.write_policy, dma_delay_s=self.dma_delay_ms / 1000, cost=self.cost,
                         l3=self.l3)


def register(sub) -> None:
    w = sub.add_parser("sim-worker", help="Simulated SGLang HiCache workers speaking SGLang's KV-event wire format.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(w, SimWorkerSettings)
    add_common(w)
    w.set_defaults(run=run)


def run(args) -> None:
    from kvtier.sim.sim_worker import SimWorkerConfig, run_sim_worker

    settings = read_settings(SimWorkerSettings, args)
    config = SimWorkerConfig(ranks=settings.ranks, port=settings.port, replay_port=settings.replay_port,
                             http_port=settings.http_port, host=settings.host, sim=settings.sim(),
                             l3_pages=settings.l3_pages, mooncake_rpc=settings.mooncake_rpc,
                             mooncake_metadata=settings.mooncake_metadata, tokenizer=settings.tokenizer,
                             model=settings.model, pace=settings.pace)
    run_until_signal(lambda stop: run_sim_worker(config, stop))
