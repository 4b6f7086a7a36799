"""The engine's own queue from its Prometheus text (SGLang's `/metrics`, with
`--enable-metrics`): how many requests wait and how many run, per DP rank. Pure."""

from __future__ import annotations

import re

WAITING = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"

_SAMPLE = re.compile(r'^(sglang:num_(?:queue|running)_reqs)(?:\{([^}]*)\})?\s+(\S+)', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def engine_queue(text: str, dp_rank: int, dp_size: int) -> tuple[int, int] | None:
    """(waiting, running) of one DP rank, or None when the text does not tell: no sample of
    either gauge, or several ranks' samples without a `dp_rank` label to tell them apart."""
    totals: dict[str, float] = {}
    own: dict[str, float] = {}
    labelled = False
    for name, labels, value in _SAMPLE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number != number or number < 0:  # NaN or a negative count says nothing
            continue
        rank = dict(_LABEL.findall(labels or "")).get("dp_rank")
        totals[name] = totals.get(name, 0.0) + number
        if rank is not None:
            labelled = True
            if rank == str(dp_rank):
                own[name] = own.get(name, 0.0) + number
    if labelled:
        chosen = own
    elif dp_size == 1:
        chosen = totals
    else:
        return None
    if WAITING not in chosen and RUNNING not in chosen:
        return None
    return int(chosen.get(WAITING, 0)), int(chosen.get(RUNNING, 0))
