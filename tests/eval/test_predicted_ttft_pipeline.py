"""`--router-mode predicted-ttft` through the real pipeline (bridge, JetStream, processor, Redis,
two router replicas): on a cluster whose workers differ in speed, the routers learn each
worker's rates from the first-token times their releases carry (release.lua's fit) and, once
every fit is trusted, move requests off the formula's choice to clearly faster workers,
deciding exactly as the in-process model (PredictedTtftModel) does, and holding the very same
fits, to the last bit."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from kvtier.eval.lockstep import run_lockstep
from kvtier.eval.policies import PredictedTtftModel, RouterModel, worker_id
from kvtier.eval.trace import SAMPLE_TRACE, load_trace, prepare
from kvtier.router.roster import fits_of
from kvtier.schemas.rates import decode_error
from kvtier.schemas.routing import ScoringWeights
from kvtier.schemas.state_keys import ModelKeys, as_text
from kvtier.sim.sim_cluster import ClusterShape

SHAPE = ClusterShape(workers=4, page_size=64, device_pages=256, host_pages=1024, l3=True,
                     worker_speeds=(1.0, 1.0, 0.5, 0.5))


def run(policy, requests):
    return asyncio.run(run_lockstep(policy, requests, SHAPE, ScoringWeights(), SHAPE.l3, 3))


async def held_fits(redis_url: str, model: str) -> tuple[dict, dict]:
    """The fits and the prediction errors Redis holds for `model`'s workers."""
    from kvtier.plumbing.connections import redis_async_client

    client = redis_async_client(redis_url)
    try:
        keys = ModelKeys.for_model(model)
        errors = {as_text(w): decode_error(raw) for w, raw in (await client.hgetall(keys.ttft_errors)).items()}
        return fits_of(await client.hgetall(keys.rates)), errors
    finally:
        await client.aclose()


@pytest.mark.slow
def test_predicted_ttft_routers_learn_and_decide_as_the_model():
    from kvtier.eval.pipeline import PipelinePolicy, running_stack

    # 280: by then every worker has FasterPick.min_samples first tokens behind a fit within
    # FasterPick.max_error of them (the slow ones' settle last)
    requests = prepare(load_trace(SAMPLE_TRACE, 280), SHAPE.page_size)
    model = PredictedTtftModel("predicted_ttft", 4, 64, ScoringWeights(), True, 0.005, 3)
    modelled = run(model, requests)
    plain = run(RouterModel("tier_aware_shared", 4, 64, ScoringWeights(), True, 0.005, 3), requests)
    # the override matters on this cluster: the model decides otherwise than the plain formula
    assert [o.rank for o in modelled.outcomes] != [o.rank for o in plain.outcomes]
    with tempfile.TemporaryDirectory() as log_dir, running_stack(log_dir) as stack:
        policy = PipelinePolicy("predicted", stack, 4, 64, 0.005, 3, shared=True,
                                router_args=["--router-mode", "predicted-ttft"])
        routed = run(policy, requests)
        fits, errors = asyncio.run(held_fits(stack.redis_url, policy.model))
    assert [o.rank for o in routed.outcomes] == [o.rank for o in modelled.outcomes]
    served = [(o.ttft_s, o.recomputed_tokens, o.hit_pages, o.tpot_s) for o in routed.outcomes]
    assert served == [(o.ttft_s, o.recomputed_tokens, o.hit_pages, o.tpot_s) for o in modelled.outcomes]
    assert all(not o.degraded for o in routed.outcomes)
    # what every replica reads from Redis is the model's fit of each worker, bit for bit
    assert fits == {worker_id(r): fit for r, fit in enumerate(model.fits) if fit.samples}
    # and how far each first token came from its prediction, as the replay reports it
    assert errors == {worker_id(r): error for r, error in enumerate(model.errors) if error.samples}
    slow = [model.fits[r].multipliers[0] for r in (2, 3)]
    fast = [model.fits[r].multipliers[0] for r in (0, 1)]
    assert min(slow) > 1.7 * max(fast), (slow, fast)  # twice as slow, learned within 15%
