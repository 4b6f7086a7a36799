"""The scoring weights as command-line flags: one definition for `kvtier router` and every
replay that scores a policy, so a setting `kvtier tune` prints can be replayed as it is."""

from __future__ import annotations

import argparse

from kvtier.schemas.routing import ScoringWeights


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_scoring_weight_arguments(p: argparse.ArgumentParser) -> None:
    """The scoring formula's weights (docs/DESIGN.md), the same flags wherever a policy is scored;
    the defaults are ScoringWeights'."""
    d = ScoringWeights()
    p.add_argument("--overlap-score-credit", type=_non_negative_float, default=d.overlap_score_credit,
                   help="Credit per device page.")
    p.add_argument("--host-cache-hit-weight", type=_non_negative_float, default=d.host_cache_hit_weight,
                   help="Credit per host page.")
    p.add_argument("--disk-cache-hit-weight", type=_non_negative_float, default=d.disk_cache_hit_weight,
                   help="Credit per disk page.")
    p.add_argument("--prefill-load-scale", type=_non_negative_float, default=d.prefill_load_scale,
                   help="Weight of the (adjusted) prefill pages against decode pages (the Dynamo guide's "
                        "default is 1; docs/DESIGN.md says why kvtier's is 16).")
    p.add_argument("--temperature", type=_non_negative_float, default=d.temperature,
                   help="0: best score, ties at random; >0: softmax sampling over normalised scores.")
    p.add_argument("--shared-cache-multiplier", type=_non_negative_float, default=d.shared_cache_multiplier,
                   help="Credit per shared-pool page beyond the device prefix (0: query but ignore).")
    p.add_argument("--predicted-page-weight", type=_non_negative_float, default=d.predicted_page_weight,
                   help="Credit per predicted page (like --overlap-score-credit for device pages).")


def scoring_weights_from(args: argparse.Namespace) -> ScoringWeights:
    return ScoringWeights(
        overlap_score_credit=args.overlap_score_credit, host_cache_hit_weight=args.host_cache_hit_weight,
        disk_cache_hit_weight=args.disk_cache_hit_weight, shared_cache_multiplier=args.shared_cache_multiplier,
        prefill_load_scale=args.prefill_load_scale, temperature=args.temperature,
        predicted_page_weight=args.predicted_page_weight)
