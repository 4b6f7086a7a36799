"""`kvtier demo`: the main job on embedded defaults, no flags needed.

Starts nats-server (JetStream) and a Redis-protocol server on free loopback ports and one
`kvtier processor`; then, once per routing policy, a `kvtier sim-worker` with a few simulated
SGLang HiCache workers, their `kvtier bridge` and two `kvtier router` replicas, and replays a
sample of the public Mooncake conversation trace (shipped in kvtier/data, see its README)
through them. Prints the policy comparison, writes a JSON report and a PNG plot, and stops
everything it started (also on Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from kvtier.bench.replay import (
    POLICIES,
    SAMPLE_TRACE,
    ClusterShape,
    format_table,
    infinite_cache_bound,
    load_trace,
    progress_bar,
    run_stack_and_replay,
    write_plot,
)

MIN_FREE_MEMORY = 2 << 30


def _free_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_demo(args) -> int:
    free = _free_memory()
    if free is not None and free < MIN_FREE_MEMORY:
        print(f"kvtier demo: only {free / 2**30:.1f} GiB of memory available; the demo runs ~10 processes and "
              f"needs about {MIN_FREE_MEMORY / 2**30:.0f} GiB free", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if cores < 2:
        print("kvtier demo: one CPU core: it will run, but expect about twice the ~2 minutes", file=sys.stderr)
    requests = load_trace(args.trace or str(SAMPLE_TRACE), args.requests)
    shape = ClusterShape(workers=args.workers, page_size=args.page_size, device_pages=args.device_pages,
                         host_pages=args.host_pages)
    span = (requests[-1].timestamp - requests[0].timestamp) / 1000
    print(f"kvtier demo: {len(requests)} requests of the Mooncake conversation trace ({span:.0f}s of trace time, "
          f"replayed x{args.time_scale:g}) on {shape.workers} simulated SGLang HiCache workers "
          f"(page size {shape.page_size}, {shape.device_pages} device + {shape.host_pages} host pages each, "
          f"a shared L3 pool), once per routing policy:")
    started = time.monotonic()
    bound = infinite_cache_bound(requests, shape.page_size)
    results, log_dir = run_stack_and_replay(requests, shape, args.time_scale, list(POLICIES), args.seed,
                                            progress_bar(sys.stdout))
    summary = {name: r.summary(bound) for name, r in results.items()}
    print()
    print(format_table(summary, bound))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"trace": str(args.trace or SAMPLE_TRACE), "requests": len(requests), "bound_tokens": bound,
              "cluster": shape.__dict__, "time_scale": args.time_scale, "policies": summary,
              "seconds": round(time.monotonic() - started, 1), "logs": log_dir}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plotted = write_plot(summary, bound, str(out / "policies.png"))
    shared, device_only = summary["tier_aware_shared"], summary["device_only"]
    saved = 1 - shared["recomputed_tokens"] / device_only["recomputed_tokens"] if device_only["recomputed_tokens"] else 0
    local = shared["hit_tokens"]["device"] + shared["hit_tokens"]["host"]
    local_device_only = device_only["hit_tokens"]["device"] + device_only["hit_tokens"]["host"]
    print(f"\ntier-aware + shared pool vs device-only KV routing: {saved:+.1%} fewer recomputed prefill tokens "
          f"({shared['ratio_to_bound']:.2f}x vs {device_only['ratio_to_bound']:.2f}x the infinite-cache bound), "
          f"{local / max(local_device_only, 1):.2f}x the hits served from the worker's own GPU and host memory.")
    print(f"report: {out / 'report.json'}" + (f", plot: {out / 'policies.png'}" if plotted else
                                               " (no plot: pip install matplotlib)"))
    print(f"took {time.monotonic() - started:.0f}s; process logs in {log_dir}")
    return 0
