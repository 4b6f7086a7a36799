"""Who may give a booking back and teach the workers' rates (issue 34, defects 1, 8, 9): a
/v1/route booking belongs to the client its answer names the owner secret to; without the
router's token a client's first-token times are bounded (router/rates.py ClientSamples), so
300 made-up times cannot move a predicted-ttft router's decisions; a first token of 0 ms is
a first token. Real router processes on a real Redis."""

from __future__ import annotations

import collections

import pytest

from kvtier.router.rates import CLIENT_SAMPLES
from kvtier.schemas.rates import decode_fit
from kvtier.schemas.state_keys import ModelKeys

from ..helpers import stop_all, wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens
from .test_router_proxy import loads

MODEL = "trust"
PAGE = 4

pytestmark = pytest.mark.slow


def _fits(redis_client) -> dict[str, tuple[float, int]]:
    """Each worker's compute multiplier and samples, as Redis holds them."""
    return {w.decode(): (decode_fit(v).multipliers[0], decode_fit(v).samples)
            for w, v in redis_client.hgetall(ModelKeys.for_model(MODEL).rates).items()}


def test_only_the_client_that_booked_can_release_its_booking(redis_client, redis_server):
    tokens = request_tokens(8, PAGE)
    StateSeeder(redis_client, MODEL).worker("w", PAGE)
    router = RouterProcess(redis_server.url)
    try:
        status, answer, _ = http("POST", router.url + "/v1/route", {"model": MODEL, "token_ids": tokens,
                                                                    "request_id": "mine"})
        assert status == 200 and len(answer["owner"]) >= 16, answer
        release = {"model": MODEL, "request_id": "mine", "stage": "complete"}
        status, body, _ = http("POST", router.url + "/v1/release", release)
        assert status == 400 and "owner" in body["error"], body
        for guess in ("x", answer["owner"][:-1] + ("A" if answer["owner"][-1] != "A" else "B")):
            status, body, _ = http("POST", router.url + "/v1/release", {**release, "owner": guess})
            assert status == 403 and "belongs to another client" in body["error"], body
        assert loads(redis_client, MODEL) != ({}, {})  # still booked
        status, body, _ = http("POST", router.url + "/v1/release", {**release, "owner": answer["owner"]})
        assert status == 200 and body["released"], body
        assert loads(redis_client, MODEL) == ({}, {})
        # a dry run books nothing, and hands out no secret
        assert http("POST", router.url + "/v1/route", {"model": MODEL, "token_ids": tokens, "book": False})[1][
            "owner"] == ""
    finally:
        stop_all(router)


def test_made_up_first_token_times_cannot_move_a_predicted_ttft_router(redis_client, redis_server):
    """The probe of defect 1: 300 bookings released with made-up times (400 ms on worker a, 20 ms
    on b), no token. Each worker learns at most ClientSamples.per_minute of them, each moving
    it at most max_step: a predicted-ttft router still decides exactly as the formula does (a
    twin with the same seed), and the refusals are counted."""
    tokens = request_tokens(64, PAGE)
    seeder = StateSeeder(redis_client, MODEL)
    for worker in ("a", "b"):
        seeder.worker(worker, PAGE)
    liar = RouterProcess(redis_server.url)
    try:
        refusals: collections.Counter[str] = collections.Counter()
        for i in range(150):
            for pair in ("x", "y"):
                status, answer, _ = liar.route(MODEL, tokens, request_id=f"lie-{pair}-{i}", explain=False)
                assert status == 200, answer
                made_up = 400.0 if answer["worker_id"] == "a" else 20.0
                status, body, _ = liar.release(MODEL, f"lie-{pair}-{i}", "first_token", ttft_ms=made_up)
                assert status == 200, body
                refusals[body["sample_refused"]] += 1
                assert liar.release(MODEL, f"lie-{pair}-{i}")[0] == 200
        fits = _fits(redis_client)
        bound = (1 + CLIENT_SAMPLES.max_step) ** CLIENT_SAMPLES.per_minute
        for multiplier, samples in fits.values():
            assert samples <= CLIENT_SAMPLES.per_minute and 1 / bound - 1e-9 <= multiplier <= bound + 1e-9, fits
        assert refusals[""] == sum(samples for _, samples in fits.values())
        # a's 400 ms, told a few ms after booking, are too late to be first tokens; b's past its budget
        assert refusals["late"] > 0 and refusals["budget"] > 0, refusals
        metrics = liar.metrics()
        for reason in ("late", "budget"):
            assert f'router_rate_samples_refused_total{{reason="{reason}"}} {refusals[reason]}.0' in metrics
    finally:
        stop_all(liar)
    priced = RouterProcess(redis_server.url, "--router-mode", "predicted-ttft", "--seed", "5")
    formula = RouterProcess(redis_server.url, "--seed", "5")
    try:
        chosen = [[r.route(MODEL, request_tokens(64, PAGE, seed=i), book=False)[1]["worker_id"] for i in range(40)]
                  for r in (priced, formula)]
        assert chosen[0] == chosen[1] and 0 < chosen[0].count("a") < 40, chosen
    finally:
        stop_all(priced, formula)


def test_a_first_token_longer_than_its_booking_has_lived_teaches_nothing(redis_client, redis_server):
    tokens = request_tokens(16, PAGE)
    StateSeeder(redis_client, MODEL).worker("w", PAGE)
    router = RouterProcess(redis_server.url)
    try:
        assert router.route(MODEL, tokens, request_id="late")[0] == 200
        status, body, _ = router.release(MODEL, "late", "first_token", ttft_ms=60_000.0)
        assert status == 200 and body["sample_refused"] == "late", body
        assert _fits(redis_client) == {}
        assert 'router_rate_samples_refused_total{reason="late"} 1.0' in router.metrics()
    finally:
        stop_all(router)


def test_a_first_token_of_zero_or_under_a_millisecond_is_accepted(redis_client, redis_server):
    """Defect 9: the pipeline replay stopped on a 400 for a first token measured at 0 ms. It is
    a first token: released (200), and its time teaches nothing (0) or teaches what it says."""
    tokens = request_tokens(16, PAGE)
    StateSeeder(redis_client, MODEL).worker("w", PAGE)
    router = RouterProcess(redis_server.url, "--auth-token", "zero-test")
    try:
        for request_id, ttft_ms in (("zero", 0), ("tiny", 0.0004)):
            assert router.route(MODEL, tokens, request_id=request_id)[0] == 200
            status, body, _ = router.release(MODEL, request_id, "first_token", ttft_ms=ttft_ms)
            assert status == 200 and body["released"], body
            assert router.release(MODEL, request_id)[0] == 200
        fits = _fits(redis_client)
        assert fits["w"][1] == 1, fits  # the 0 ms one taught nothing; the 0.4 us one a bounded sample
        assert loads(redis_client, MODEL) == ({}, {})
    finally:
        stop_all(router)


def test_healthz_shows_a_summary_without_the_token_and_everything_with_it(redis_client, redis_server, monkeypatch):
    """Defect 8's other half: /healthz is open (a load balancer checks it without a token) and
    listed the workers' rates, engine queues and circuits to anyone. With --auth-token a reader
    without it gets the status only; kvtier doctor says so, and sees all with the token."""
    from kvtier.tools.doctor import judge, observe

    tokens = request_tokens(16, PAGE)
    StateSeeder(redis_client, MODEL).worker("w", PAGE)
    router = RouterProcess(redis_server.url, "--auth-token", "health-token")
    try:
        assert router.route(MODEL, tokens, request_id="h")[0] == 200
        assert router.release(MODEL, "h", "first_token", ttft_ms=30.0)[0] == 200
        status, summary, _ = http("GET", router.url + "/healthz")
        assert status == 200 and summary["summary_only"] and summary["status"] == "ok", summary
        assert summary["worker_rates"] == [] and summary["models"] == [] and summary["router_id"] == "", summary
        status, full, _ = http("GET", router.url + "/healthz", token="health-token")
        assert status == 200 and not full["summary_only"] and full["models"] == [MODEL], full
        # (the rates in /healthz are re-read every few seconds)
        wait_until(lambda: [r["worker_id"] for r in http("GET", router.url + "/healthz", token="health-token")[1][
            "worker_rates"]] == ["w"], timeout=15)
        findings = judge.check_router_front_door([observe.observe_router(router.url, 3.0)])
        assert [f.check for f in findings] == ["router_details"], findings
        monkeypatch.setenv(observe.ROUTER_TOKEN_VARIABLE, "health-token")
        assert judge.check_router_front_door([observe.observe_router(router.url, 3.0)]) == []
    finally:
        stop_all(router)
