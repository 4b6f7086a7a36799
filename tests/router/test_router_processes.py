"""`kvtier router --processes N`: one replica serving one port from N processes (SO_REUSEPORT),
against a real Redis-protocol server. The port spreads new connections over the processes;
their bookings stay exact (each sees every other's, through Redis); /metrics and /healthz of
the port describe every process; a PUT /v1/admission reaches every process; SIGTERM stops them
all cleanly, and one process dying stops the replica (crash-only)."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections import Counter

import pytest

from ..helpers import wait_until
from ..router_helpers import RouterProcess, StateSeeder, http, request_tokens

MODEL = "processes-model"
PAGE = 4


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def processes(router: RouterProcess) -> list[dict]:
    """The processes /healthz lists; [] when nothing answers on the port."""
    try:
        status, body, _ = http("GET", router.url + "/healthz", timeout=5, token=router.token)
    except OSError:
        return []
    return body.get("processes", []) if status in (200, 503) else []


def all_up(router: RouterProcess, n: int) -> bool:
    found = processes(router)
    return len(found) == n and all(p["status"] == "ok" and p["indexes_ready"] for p in found)


def metric(router: RouterProcess, line_start: str) -> float:
    with urllib.request.urlopen(router.url + "/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    return 0.0


def test_one_port_two_processes_exact_bookings_and_one_view(redis_client, redis_server):
    seeder = StateSeeder(redis_client, MODEL)
    for w in ("w0", "w1", "w2", "w3"):
        seeder.worker(w, PAGE)
    tokens = request_tokens(8, PAGE)
    router = RouterProcess(redis_server.url, "--processes", "2", "--auth-token", "t")
    auth = {"Authorization": "Bearer t"}
    try:
        wait_until(lambda: all_up(router, 2), timeout=60,
                   what=lambda: f"{processes(router)}\n{router.output()[-3000:]}")
        before = sum(p["decisions"] for p in processes(router))
        # Each request on a new connection (urllib): the kernel spreads them over both processes.
        chosen = []
        for i in range(40):
            request = urllib.request.Request(router.url + "/v1/route", method="POST", headers={
                "Content-Type": "application/json", **auth}, data=json.dumps(
                {"model": MODEL, "token_ids": tokens, "request_id": f"r{i}"}).encode())
            with urllib.request.urlopen(request, timeout=10) as reply:
                chosen.append(json.loads(reply.read())["worker_id"])
        # every booking seen by the next decision, whichever process made it
        assert sorted(Counter(chosen).values()) == [10, 10, 10, 10], Counter(chosen)
        found = processes(router)
        assert [p["index"] for p in found] == [0, 1] and len({p["pid"] for p in found}) == 2
        assert all(p["decisions"] > before // 2 for p in found), found  # both served some
        assert sum(p["decisions"] for p in found) - before == 40
        # /metrics counts the whole replica, whichever process answers
        assert metric(router, 'router_decisions_total{mode="kv"}') == sum(p["decisions"] for p in found)
        assert metric(router, 'router_index_ready{model="' + MODEL + '"}') == 1.0

        # A threshold change reaches every process: each worker holds 2 decode pages now.
        request = urllib.request.Request(router.url + "/v1/admission", method="PUT", headers=auth,
                                         data=json.dumps({"busy_decode_pages": 2, "queue_size": 0}).encode())
        with urllib.request.urlopen(request, timeout=10) as reply:
            answer = json.loads(reply.read())
        assert answer["busy_decode_pages"] == 2 and answer["scope"] == "replica", answer
        assert answer["applied"] == ["process 0", "process 1"] and answer["not_applied"] == [], answer
        for _ in range(12):
            request = urllib.request.Request(router.url + "/v1/route", method="POST", headers={
                "Content-Type": "application/json", **auth}, data=json.dumps(
                {"model": MODEL, "token_ids": tokens, "book": False}).encode())
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError("a process routed past the busy threshold set through another")
            except urllib.error.HTTPError as exc:
                assert exc.code == 429 and exc.headers["Retry-After"], exc.read()  # queue of 0: full
        assert router.stop() == 0  # SIGTERM: every process drains and exits
        assert processes(router) == []
    finally:
        router.stop()


def test_a_process_that_dies_stops_the_replica(redis_client, redis_server):
    StateSeeder(redis_client, MODEL).worker("w0", PAGE)
    router = RouterProcess(redis_server.url, "--processes", "2")
    try:
        wait_until(lambda: all_up(router, 2), timeout=60, what=lambda: router.output()[-3000:])
        victim = processes(router)[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not router.alive(), timeout=30, what=lambda: router.output()[-3000:])
        assert router.proc.returncode != 0
        assert "stopping the replica" in router.output(), router.output()[-3000:]
        assert processes(router) == []  # the other process went with it: the port is closed
    finally:
        router.stop()
