"""Dynamo's side of `kvtier bench peers`, for its front door's cost: the same paced, streamed
requests through Dynamo's frontend with its KV router over `workers` of its own mocker engines,
then (on fresh engines, nothing cached) straight to them by Dynamo's runtime client, round robin,
as kvtier's `direct` goes to the sim-workers; the processes: kvtier/testing/dynamo_peer.py. Its
HTTP server leaves Nagle on, so on a kept-alive connection (this client's, as for every door) a
first token can wait for the client's delayed ACK; that wait is part of what it adds."""

from __future__ import annotations

import asyncio
import os
from typing import Any


def run_dynamo_side(requests: list[tuple[float, dict[str, Any]]], work: str, workers: int = 4,
                    page_size: int = 64, device_pages: int | None = None, install: bool = True) -> dict[str, Any]:
    """Per side: TTFT p50/p99, TPOT p99 (ms), served, the prompt share its engines found cached,
    and for the frontend its CPU ms per request and RSS (by PID); the TTFT the frontend adds.
    {"note": why} alone when Dynamo cannot run here."""
    from kvtier.testing import dynamo_peer as dyn
    from kvtier.testing.peer_load import paced
    from kvtier.testing.processes import rss_mb
    from kvtier.testing.samplers import cpu_seconds

    model = requests[0][1]["model"]
    try:
        python = dyn.dynamo_python(install)
        folder = dyn.write_model_folder(os.path.join(work, "dynamo-model"))
        with dyn.dynamo_cluster(python, os.path.join(work, "dynamo-frontend"), folder, model, workers, page_size,
                                device_pages) as cluster:
            pid = cluster.frontend.live_pid if cluster.frontend else None
            before = cpu_seconds(pid)
            sent, wall = asyncio.run(paced([cluster.url], requests))
            after = cpu_seconds(pid)
            spent = after - before if after is not None and before is not None else None
            rss, reuse = rss_mb(pid), dyn.frontend_reuse(cluster.url)
        ids = dyn.token_ids(folder, [body["prompt"] for _, body in requests])
        with dyn.dynamo_cluster(python, os.path.join(work, "dynamo-direct"), folder, model, workers, page_size,
                                device_pages, frontend=False) as cluster:
            direct_sent, direct_wall, direct_reuse = cluster.run_direct(
                [(at, t, body["max_tokens"]) for (at, body), t in zip(requests, ids)])
    except dyn.DynamoMissing as exc:
        return {"note": (str(exc).splitlines() or ["Dynamo did not run"])[0]}
    frontend = {**dyn.door_figures(sent), "rss_mb": rss,
                "cpu_ms_per_request": spent * 1000 / len(sent) if spent is not None else None,
                "cached_share": reuse["cached"] / reuse["prompt"] if reuse["prompt"] else None, "wall_s": wall}
    direct = {**dyn.door_figures(direct_sent), "cpu_ms_per_request": None, "rss_mb": None, "wall_s": direct_wall,
              "cached_share": direct_reuse["cached"] / direct_reuse["prompt"] if direct_reuse["prompt"] else None}
    added = {f"added_{k}": frontend[k] - direct[k] if frontend[k] is not None and direct[k] is not None else None
             for k in ("ttft_p50_ms", "ttft_p99_ms")}
    return {"frontend": frontend, "direct": direct, **added, "workers": workers, "version": dyn.VERSION, "note": ""}
