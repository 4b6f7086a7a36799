"""Each worker's learned rates, as kept in Redis (`kvt:{model}:rates`, one field per worker)
and shown by /healthz and `kvtier inspect`: the fit of router/rates.py, declared once.

A rate is a multiplier on the prior's seconds per token (1.0: the worker runs as the prior
says; 2.0: it takes twice as long), for the four kinds of work a first token waits for:
computing the request's own tokens (its recompute), loading host pages back to the GPU,
fetching shared-pool (L3) pages, and the prefill booked ahead of it on the worker (its pages
priced at the compute rate by the prior). The queue is a kind of its own because a booked
page is not a page still to compute: part of it is a load, part of the running prefill is
done, so a queued page takes less time than a recomputed one, by how much depends on the
workload (the replay suite's workloads: docs/benchmarks/replay.md)."""

from __future__ import annotations

import math
import struct

import msgspec

#: The kinds of work, in the order of every tuple below.
WORK_KINDS = ("compute", "host_load", "l3_load", "queued")
KINDS = len(WORK_KINDS)


class RatePrior(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker is assumed to do before anything is learned, in tokens per second
    (Llama-3.1-8B bf16 on one H100: docs/COST_MODEL.md)."""

    compute_tokens_per_s: float = 20000.0
    #: 131,072 KV bytes per token over 25 GB/s of host -> GPU copy.
    host_load_tokens_per_s: float = 190_734.0
    #: Mooncake -> host at 20 GB/s, then the load back.
    l3_load_tokens_per_s: float = 84_771.0

    def seconds_per_token(self) -> tuple[float, float, float, float]:
        """Per kind (WORK_KINDS): a queued token is priced, before anything is learned, as a
        token to compute."""
        compute = 1 / self.compute_tokens_per_s
        return (compute, 1 / self.host_load_tokens_per_s, 1 / self.l3_load_tokens_per_s, compute)


class RateFit(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's online fit: first-token time = sum over kinds of (tokens x prior seconds
    per token x multiplier), by recursive least squares with forgetting."""

    multipliers: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    #: The fit's covariance, row by row (KINDS x KINDS): how unsure each multiplier still is.
    covariance: tuple[float, ...] = tuple(float(i == j) for i in range(KINDS) for j in range(KINDS))
    #: Running mean of the fit's absolute errors relative to its predictions (cuts outliers).
    relative_error: float = 0.0
    samples: int = 0
    #: Errors in a row beyond the outlier bound, signed by their direction (0: the last was within).
    streak: int = 0


#: A fit as Redis holds it: 23 little-endian IEEE doubles (4 multipliers, 16 covariances, mean
#: error, samples, streak), written and read by learn_rates.lua with Lua's `struct`, exact both
#: ways and without the decimal conversions that cost a text form more than the fit itself.
FIT_LAYOUT = struct.Struct(f"<{KINDS + KINDS * KINDS + 3}d")
#: The layout before the queued kind (3 kinds, 15 doubles): not read; learn_rates.lua starts
#: such a worker's fit afresh at its next first token.
OLD_FIT_BYTES = 15 * 8


def encode_fit(fit: RateFit) -> bytes:
    """The fit as Redis holds it (the encoding learn_rates.lua writes)."""
    return FIT_LAYOUT.pack(*fit.multipliers, *fit.covariance, fit.relative_error, fit.samples, fit.streak)


def decode_fit(raw: bytes | str) -> RateFit:
    """ValueError when `raw` is not a fit's encoding."""
    data = raw.encode("latin-1") if isinstance(raw, str) else raw
    if len(data) == OLD_FIT_BYTES:
        raise ValueError("a worker's rates are in the layout before the queued kind; they are learned "
                         "afresh at its next first token")
    if len(data) != FIT_LAYOUT.size:
        raise ValueError(f"a worker's rates are {FIT_LAYOUT.size} bytes, got {len(data)}")
    v = FIT_LAYOUT.unpack(data)
    n, c = KINDS, KINDS + KINDS * KINDS  # where the covariance starts, and where it ends
    samples, streak = v[c + 1], v[c + 2]
    if not all(math.isfinite(x) for x in v) or samples < 0 or samples != int(samples) or streak != int(streak):
        raise ValueError("a worker's rates hold a number that is not finite, or a count that is not whole")
    return RateFit(multipliers=(v[0], v[1], v[2], v[3]), covariance=tuple(v[n:c]), relative_error=v[c],
                   samples=int(samples), streak=int(streak))


class PredictionError(msgspec.Struct, frozen=True, kw_only=True):
    """How far a worker's first-token predictions are off (`kvt:{model}:ttft_errors`, one field
    per worker): each first token that teaches the fit is compared with what the fit predicted
    for its work just before it, as a fraction of the true time. Running means over about the
    last 20 first tokens (router/rates.py `track_error`), so a worker that changes shows."""

    samples: int = 0
    #: Mean absolute percentage error, as a fraction (0.25: predictions 25% off the true time).
    mape: float = 0.0
    #: Mean signed error, as a fraction: > 0, first tokens come sooner than predicted.
    bias: float = 0.0


#: A PredictionError as Redis holds it: samples, mape, bias as 3 little-endian doubles.
ERROR_LAYOUT = struct.Struct("<3d")


def encode_error(error: PredictionError) -> bytes:
    return ERROR_LAYOUT.pack(error.samples, error.mape, error.bias)


def decode_error(raw: bytes | str) -> PredictionError:
    """ValueError when `raw` is not a PredictionError's encoding."""
    data = raw.encode("latin-1") if isinstance(raw, str) else raw
    if len(data) != ERROR_LAYOUT.size:
        raise ValueError(f"a worker's prediction error is {ERROR_LAYOUT.size} bytes, got {len(data)}")
    samples, mape, bias = ERROR_LAYOUT.unpack(data)
    if not all(math.isfinite(x) for x in (samples, mape, bias)) or samples < 0 or samples != int(samples):
        raise ValueError("a worker's prediction error holds a number that is not finite, or a count that is not whole")
    return PredictionError(samples=int(samples), mape=mape, bias=bias)
