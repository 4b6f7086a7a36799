"""`kvtier sim-worker`: simulated SGLang HiCache workers (kvtier/sim/sim_worker.py)."""

from __future__ import annotations

import argparse

from kvtier.commands.flags import add_common, non_negative_float, positive_int, run_until_signal
from kvtier.sim.cost_model import add_cost_model_arguments, cost_model_from_args


def register(sub) -> None:
    w = sub.add_parser("sim-worker", help="Simulated SGLang HiCache workers speaking SGLang's KV-event wire format.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    w.add_argument("--ranks", type=positive_int, default=1,
                   help="Simulated workers (DP ranks); rank r publishes on --port + r (bridge: --dp-size).")
    w.add_argument("--port", type=int, required=True, help="ZMQ PUB port of rank 0.")
    w.add_argument("--replay-port", type=int, required=True, help="ZMQ replay ROUTER port of rank 0.")
    w.add_argument("--http-port", type=int, default=0, help="HTTP port for requests (0: a free one, printed).")
    w.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    w.add_argument("--page-size", type=positive_int, default=64, help="Tokens per KV page.")
    w.add_argument("--device-pages", type=positive_int, default=4096, help="GPU KV pool, in pages.")
    w.add_argument("--host-pages", type=int, default=None,
                   help="Host (L2) pool in pages; default --hicache-ratio x device pages; 0 = no HiCache.")
    w.add_argument("--hicache-ratio", type=non_negative_float, default=2.0, help="Host pool / device pool.")
    w.add_argument("--write-policy", choices=["write_through", "write_through_selective", "write_back"],
                   default="write_through", help="HiCache write policy (SGLang's --hicache-write-policy).")
    w.add_argument("--dma-delay-ms", type=non_negative_float, default=2.0,
                   help="Simulated device->host copy time before the host store event.")
    add_cost_model_arguments(w)
    w.add_argument("--l3", action="store_true", help="Write pages to a shared L3 pool and prefetch from it.")
    w.add_argument("--l3-pages", type=positive_int, default=None,
                   help="L3 pool capacity in pages (default: unbounded).")
    w.add_argument("--mooncake-rpc", default="",
                   help="With --l3: a real Mooncake master's RPC address (host:port) to write and find pages in.")
    w.add_argument("--mooncake-metadata", default="",
                   help="With --mooncake-rpc: the master's HTTP metadata URL (http://host:port/metadata).")
    w.add_argument("--tokenizer", default="",
                   help="A tokenizer folder (tokenizer.json, tokenizer_config.json): also serve the OpenAI-compatible "
                        "API (/w/<rank>/v1/completions, /w/<rank>/v1/chat/completions), tokenizing as SGLang does.")
    w.add_argument("--model", default="sim", help="The model name the OpenAI answers carry.")
    w.add_argument("--pace", action="store_true",
                   help="Answer the OpenAI API in wall time: the first byte after the simulated TTFT (its queue "
                        "included), the end after the simulated end-to-end latency, as a loaded engine would (for "
                        "load benches; default: answer at once and only report the times).")
    add_common(w)
    w.set_defaults(run=run)


def run(args) -> None:
    from kvtier.sim.hicache_sim import SimConfig
    from kvtier.sim.sim_worker import SimWorkerConfig, run_sim_worker

    host_pages = args.host_pages if args.host_pages is not None else int(args.device_pages * args.hicache_ratio)
    sim = SimConfig(page_size=args.page_size, device_pages=args.device_pages, host_pages=host_pages,
                    write_policy=args.write_policy, dma_delay_s=args.dma_delay_ms / 1000,
                    cost=cost_model_from_args(args), l3=args.l3)
    if args.mooncake_rpc and not (args.l3 and args.mooncake_metadata):
        raise SystemExit("kvtier sim-worker: --mooncake-rpc needs --l3 and --mooncake-metadata")
    config = SimWorkerConfig(ranks=args.ranks, port=args.port, replay_port=args.replay_port,
                             http_port=args.http_port, host=args.host, sim=sim, l3_pages=args.l3_pages,
                             mooncake_rpc=args.mooncake_rpc, mooncake_metadata=args.mooncake_metadata,
                             tokenizer=args.tokenizer, model=args.model, pace=args.pace)
    run_until_signal(lambda stop: run_sim_worker(config, stop))
