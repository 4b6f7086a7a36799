"""Worker rates learned by real `kvtier router` replicas against a real Redis-protocol server:
each booking keeps the work its decision predicted, the first token's release teaches the
worker's fit (release.lua), every replica reads the same rates (/healthz, metrics, `kvtier
inspect`) and how far their predictions were off, `--router-mode predicted-ttft` overrides the
formula's choice at them, and a bad first-token time is refused with a clear 400."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvtier.router.rates import FASTER_PICK, RATE_PRIOR
from kvtier.schemas.state_keys import ModelKeys

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens

MODEL = "org/rates-model"
PAGE = 4
#: The true compute multipliers of the two workers: "slow" takes three times the prior's time.
TRUTH = {"fast": 1.0, "slow": 3.0}
#: First tokens taught to each worker: enough for slow's fit, which starts at the prior (a
#: third of its time), to come within FasterPick.max_error of them.
ROUNDS = 50

pytestmark = pytest.mark.slow  # real routers: a second or more


#: The routers' token: a client that holds it teaches in full (router/rates.py ClientSamples
#: bounds the others; tests/router/test_rate_trust.py).
TOKEN = "rates-test-token"


def release(router: RouterProcess, request_id: str, stage: str, ttft_ms: float | None = None):
    return router.release(MODEL, request_id, stage, **({} if ttft_ms is None else {"ttft_ms": ttft_ms}))


def rates_of(router: RouterProcess) -> dict[str, dict]:
    return {r["worker_id"]: r for r in http("GET", router.url + "/healthz", token=router.token)[1]["worker_rates"]}


def test_first_tokens_teach_every_replica_the_workers_rates_and_predicted_ttft_prices_them(
        redis_client, redis_server):
    tokens = request_tokens(64, PAGE)  # 256 tokens, nothing cached anywhere: all of it is computed
    seeder = StateSeeder(redis_client, MODEL)
    for worker in TRUTH:
        seeder.worker(worker, PAGE)
    learner = RouterProcess(redis_server.url, "--auth-token", TOKEN)
    priced = RouterProcess(redis_server.url, "--router-mode", "predicted-ttft", "--auth-token", TOKEN)
    # the same mode on the full read (select_and_book.lua's override), not the lean copy's
    full_read = RouterProcess(redis_server.url, "--router-mode", "predicted-ttft", "--state-source", "redis",
                              "--auth-token", TOKEN)
    try:
        for i in range(ROUNDS):
            # two requests at once: the second goes to the other worker, so both are sampled
            chosen = {}
            for name in ("a", "b"):
                status, body, _ = learner.route(MODEL, tokens, request_id=f"{name}{i}")
                assert status == 200, body
                chosen[f"{name}{i}"] = body["worker_id"]
            assert sorted(chosen.values()) == ["fast", "slow"]
            for request_id, worker in chosen.items():
                ttft_ms = len(tokens) / RATE_PRIOR.compute_tokens_per_s * TRUTH[worker] * 1000
                status, body, _ = release(learner, request_id, "first_token", ttft_ms)
                assert status == 200, body
                # each first token that teaches says what the rates predicted for it, and how far off
                predicted = body["predicted_ttft_ms"]
                assert predicted > 0 and body["ttft_error"] == pytest.approx((predicted - ttft_ms) / ttft_ms), body
                if i == 0:  # the prior's prediction: right for fast, a third of slow's time
                    assert body["ttft_error"] == pytest.approx(0.0 if worker == "fast" else -2 / 3), body
                # a booking teaches once: a second first-token release of it learns nothing
                status, body, _ = release(learner, request_id, "first_token", 1.0)
                assert status == 200 and body["predicted_ttft_ms"] is None and body["ttft_error"] is None
                assert release(learner, request_id, "complete")[0] == 200

        # both replicas show what the releases taught, whichever replica took them
        taught = dict.fromkeys(TRUTH, ROUNDS)
        for router in (learner, priced):
            wait_until(lambda r=router: {w: x["samples"] for w, x in rates_of(r).items()} == taught,
                       timeout=15, what=lambda r=router: f"rates in {r.url}/healthz: {rates_of(r)}")
            learned = rates_of(router)
            for worker, truth in TRUTH.items():
                assert abs(learned[worker]["compute"] - truth) < 0.10 * truth, learned
                # every first token compared; slow's first ones were up to 67% off, the fit's
                # since then close, and the mean follows the last ~20
                assert learned[worker]["ttft_compared"] == ROUNDS, learned
                assert learned[worker]["ttft_mape"] < 0.1 and abs(learned[worker]["ttft_bias"]) < 0.1, learned
                # and the fit's own error is within FasterPick.max_error: it is trusted
                assert learned[worker]["relative_error"] < FASTER_PICK.max_error, learned
            assert learned["slow"]["ttft_mape"] > learned["fast"]["ttft_mape"], learned
        assert http("GET", priced.url + "/healthz", token=priced.token)[1]["pricing"] == "learned-rates"
        assert http("GET", learner.url + "/healthz", token=learner.token)[1]["pricing"] == "formula"
        metrics = priced.metrics()
        assert 'router_worker_rate{kind="compute"' in metrics and 'worker="slow"' in metrics
        slow_series = [line for line in metrics.splitlines() if 'worker="slow"' in line]
        mape = [line for line in slow_series
                if line.startswith("router_ttft_prediction_error{") and 'stat="mape"' in line]
        assert len(mape) == 1 and 0 < float(mape[0].split()[-1]) < 0.1, slow_series
        assert any(line.startswith("router_ttft_predictions_compared{") and line.endswith(f" {ROUNDS}.0")
                   for line in slow_series), slow_series

        # on idle workers the formula ties them (a coin toss, by each decision's draw); both
        # paths of predicted-ttft override it to fast, whose first token comes in a third of the time
        fast_ms = len(tokens) / RATE_PRIOR.compute_tokens_per_s * 1000
        for router in (priced, full_read):
            answers = [router.route(MODEL, tokens, book=False)[1] for _ in range(8)]
            assert [a["worker_id"] for a in answers] == ["fast"] * 8, (router.url, answers)
            # each says what it predicts: 256 tokens at fast's rate, nothing queued ahead
            assert all(a["predicted_ttft_ms"] == pytest.approx(fast_ms, rel=0.1) for a in answers), answers
        assert learner.route(MODEL, tokens, book=False)[1]["predicted_ttft_ms"] is None  # the formula's mode
        status, body, _ = priced.route(MODEL, tokens, request_id="held")
        assert body["worker_id"] == "fast", body
        # the decision says what it predicts: 256 tokens at fast's rate, nothing queued ahead
        assert body["predicted_ttft_ms"] == pytest.approx(fast_ms, rel=0.1), body
        # fast holds one request like this one: the formula sends the next to the idle slow
        # worker, and so does the override: fast would wait less, but it would become the
        # busiest worker at decode, which the formula weighs for TPOT (rates.faster_than_formula)
        for router in (learner, priced, full_read):
            assert router.route(MODEL, tokens, book=False)[1]["worker_id"] == "slow", router.url
        assert release(learner, "held", "complete")[0] == 200

        # a first token with no client time: the router takes the time since its booking
        status, body, _ = priced.route(MODEL, tokens, request_id="timed")
        assert status == 200
        worker = body["worker_id"]
        time.sleep(0.02)  # the router measures in ms: a first token in the booking's own ms says nothing
        assert release(priced, "timed", "first_token")[0] == 200
        wait_until(lambda: rates_of(priced)[worker]["samples"] == ROUNDS + 1, timeout=15,
                   what=lambda: f"a sample from the booking's time: {rates_of(priced)}")

        inspected = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", "--redis", redis_server.url,
                                    "--model", MODEL, "--json"], capture_output=True, text=True, timeout=60)
        assert inspected.returncode == 0, inspected.stderr
        rows = {r["worker"]: r for r in json.loads(inspected.stdout)}
        assert abs(rows["slow"]["rates"]["compute"] - 3.0) < 0.3 and rows["slow"]["rates"]["samples"] >= ROUNDS
        assert rows["slow"]["rates"]["ttft_compared"] >= ROUNDS and rows["slow"]["rates"]["ttft_mape"] < 0.3, rows
        table = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", "--redis", redis_server.url,
                                "--model", MODEL], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0 and "TTFT predicted" in table.stdout, table
    finally:
        stop_all(learner, priced, full_read)


def test_a_bad_first_token_time_gets_a_clear_400(redis_client, redis_server):
    StateSeeder(redis_client, MODEL).worker("w", PAGE)
    router = RouterProcess(redis_server.url)
    try:
        for ttft, message in ((-5, "$.ttft_ms"), ("soon", "$.ttft_ms"), (1e12, "$.ttft_ms")):
            status, body, _ = release(router, "x", "first_token", ttft)
            assert status == 400 and message in body["error"], (ttft, status, body)
        for ttft in (12.5, 0, 0.0004):  # well formed (a first token under a millisecond too), nothing booked
            assert release(router, "x", "first_token", ttft)[0] == 404
    finally:
        stop_all(router)


def test_a_router_told_not_to_learn_keeps_no_work_and_learns_nothing(redis_client, redis_server):
    from ..helpers import KvtierProcess

    tokens = request_tokens(16, PAGE)
    StateSeeder(redis_client, MODEL + "-quiet").worker("w", PAGE)
    router = RouterProcess(redis_server.url, "--learn-rates", "off")
    try:
        status, body, _ = router.route(MODEL + "-quiet", tokens, request_id="q1")
        assert status == 200, body
        keys = ModelKeys.for_model(MODEL + "-quiet")
        assert redis_client.hget(keys.booking("q1"), "work") is None
        status, _, _ = router.release(MODEL + "-quiet", "q1", "first_token", ttft_ms=40.0)
        assert status == 200 and redis_client.hgetall(keys.rates) == {}
    finally:
        stop_all(router)
    # pricing by rates that are never learned is refused at start, with what to do
    refused = KvtierProcess("router", "--redis", redis_server.url, "--http-port", "0", "--router-mode",
                            "predicted-ttft", "--learn-rates", "off")
    assert refused.proc.wait(20) == 2
    assert "needs --learn-rates on" in refused.output()
