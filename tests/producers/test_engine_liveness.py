"""A worker's lease lives only while its engine answers: the real `kvtier bridge` asks the
engine's GET /health before each renewal. The engine is a real `kvtier sim-worker` (SGLang's
wire format: ZMQ PUB, replay ROUTER, HTTP with /health), killed by PID and restarted on the
same ports, beside a real nats-server with JetStream, a Redis-protocol server and a real
`kvtier processor`. Leases are read as routers read them: members of the model's leases zset
whose expiry is still ahead (router/state.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.harness.embedded import free_port
from kvtier.schemas.state_keys import ModelKeys
from kvtier.sim.sim_worker import free_port_block

from ..helpers import KvtierProcess, processor_process, stop_all, wait_until
from ..router_helpers import RouterProcess, http

MODEL = "liveness-model"
WORKER = "w0"
HEARTBEAT_S, LEASE_TTL_S, HEALTH_TIMEOUT_S = 0.5, 2.0, 1.0
#: What a loaded 2-core machine may add to a bound: scheduling, a publish, a Redis round trip.
SLACK_S = 1.0
DOWN_LOG = "the engine does not answer GET"
UP_LOG = "the engine answers GET"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def http_status(url: str) -> int | None:
    """The status `url` answers with right now; None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


class Engine:
    """A `kvtier sim-worker` on fixed ports, so a restarted one is the same engine to the bridge."""

    def __init__(self):
        self.zmq_port, self.replay_port, self.http_port = free_port_block(1), free_port_block(1), free_port()
        self.worker_url = f"http://127.0.0.1:{self.http_port}/w/0"
        self.processes: list[KvtierProcess] = []

    def start(self, device_pages: int = 64) -> None:
        self.processes.append(KvtierProcess(
            "sim-worker", "--port", str(self.zmq_port), "--replay-port", str(self.replay_port),
            "--http-port", str(self.http_port), "--page-size", "4", "--device-pages", str(device_pages)))
        wait_until(lambda: http_status(self.worker_url + "/health") == 200, timeout=30,
                   what=lambda: "the sim-worker's /health\n" + self.processes[-1].output()[-2000:])

    def kill(self) -> None:
        self.processes[-1].kill()  # SIGKILL: no goodbye, as a crashed engine


def start_bridge(nats_url: str, engine: Engine, metrics_port: int, *extra: str) -> KvtierProcess:
    return KvtierProcess(
        "bridge", "--endpoint", f"tcp://127.0.0.1:{engine.zmq_port}",
        "--replay-endpoint", f"tcp://127.0.0.1:{engine.replay_port}", "--replay-timeout", "0.5",
        "--worker-id", WORKER, "--model", MODEL, "--page-size", "4", "--nats", nats_url,
        "--worker-url", engine.worker_url, "--heartbeat", str(HEARTBEAT_S), "--lease-ttl", str(LEASE_TTL_S),
        "--engine-health-timeout", str(HEALTH_TIMEOUT_S), "--metrics-port", str(metrics_port), *extra)


def lease_live(client) -> bool:
    now_ms = int(time.time() * 1000)
    return WORKER.encode() in client.zrangebyscore(ModelKeys.for_model(MODEL).leases, f"({now_ms}", "+inf")


def bridge_metric(port: int, name: str, **labels: str) -> float | None:
    """The sample `name` with `labels` on the bridge's /metrics (summed over other labels); None if
    absent, or if the bridge serves no metrics yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == name and labels.items() <= s.labels.items()]
    return sum(values) if values else None


def engine_up(port: int) -> float | None:
    return bridge_metric(port, "kvtier_bridge_engine_up", worker=WORKER)


def health_failures(port: int) -> float:
    return bridge_metric(port, "kvtier_bridge_engine_health_failures_total", worker=WORKER) or 0.0


@pytest.fixture
def stack(nats_server, redis_server, redis_client):
    processes: list[KvtierProcess] = [processor_process(nats_server.url, redis_server.url)]
    engine = Engine()
    yield nats_server.url, redis_client, engine, processes
    stop_all(*reversed(processes), *engine.processes)


def test_a_dead_engine_loses_its_lease_and_gets_it_back_when_it_answers_again(stack):
    nats_url, client, engine, processes = stack
    engine.start()
    metrics = free_port()
    bridge = start_bridge(nats_url, engine, metrics)
    processes.append(bridge)
    wait_until(lambda: lease_live(client), timeout=30, what=lambda: "a live lease\n" + bridge.output()[-2000:])
    assert engine_up(metrics) == 1 and health_failures(metrics) == 0

    engine.kill()
    killed = time.monotonic()
    # The last renewal rests on an answer from before the kill: its lease ends a TTL later.
    wait_until(lambda: not lease_live(client), timeout=LEASE_TTL_S + HEARTBEAT_S + SLACK_S,
               what=lambda: "the dead engine's lease to run out\n" + bridge.output()[-2000:])
    assert time.monotonic() - killed >= LEASE_TTL_S - HEARTBEAT_S - SLACK_S  # it was the lease that ran out
    # and it stays out: heartbeats go on, renewing nothing, each failure counted, one warning in all
    failed = health_failures(metrics)
    time.sleep(3 * HEARTBEAT_S)
    assert not lease_live(client)
    assert engine_up(metrics) == 0 and health_failures(metrics) >= failed + 2
    assert bridge_metric(metrics, "kvtier_bridge_engine_health_failures_total", worker=WORKER,
                         reason="unreachable")
    assert bridge.output().count(DOWN_LOG) == 1, bridge.output()[-3000:]

    engine.start()  # the same ports: the same engine, back
    wait_until(lambda: lease_live(client), timeout=10 * HEARTBEAT_S + SLACK_S,
               what=lambda: "the lease back\n" + bridge.output()[-2000:])
    assert engine_up(metrics) == 1
    assert bridge.output().count(UP_LOG) == 1, bridge.output()[-3000:]
    assert bridge.alive()


def test_a_worker_whose_engine_never_answered_is_not_announced(stack):
    nats_url, client, engine, processes = stack
    metrics = free_port()
    bridge = start_bridge(nats_url, engine, metrics)  # nothing listens on the engine's ports yet
    processes.append(bridge)
    wait_until(lambda: health_failures(metrics) >= 4, timeout=30,
               what=lambda: "failed health checks\n" + bridge.output()[-2000:])
    # not even a lease that has run out: the worker was never announced
    assert client.zscore(ModelKeys.for_model(MODEL).leases, WORKER) is None
    assert engine_up(metrics) == 0 and bridge.output().count(DOWN_LOG) == 1

    engine.start()
    wait_until(lambda: lease_live(client), timeout=10 * HEARTBEAT_S + SLACK_S,
               what=lambda: "a live lease once the engine answers\n" + bridge.output()[-2000:])
    assert engine_up(metrics) == 1


def test_with_the_check_off_the_lease_is_renewed_whatever_the_engine_does(stack):
    nats_url, client, engine, processes = stack
    engine.start()
    metrics = free_port()
    bridge = start_bridge(nats_url, engine, metrics, "--engine-health-path", "")
    processes.append(bridge)
    wait_until(lambda: lease_live(client), timeout=30, what=lambda: "a live lease\n" + bridge.output()[-2000:])
    engine.kill()
    killed_ms = time.time() * 1000
    # Renewals go on after the kill: the lease comes to end well past the point where a checked
    # one would have run out. Read as the lease's end moving on, not as one look at a live lease,
    # so a moment's lag between bridge and Redis on a loaded machine cannot fail it.
    beyond_ms = killed_ms + (LEASE_TTL_S + 4 * HEARTBEAT_S) * 1000
    wait_until(lambda: (client.zscore(ModelKeys.for_model(MODEL).leases, WORKER) or 0) > beyond_ms,
               timeout=4 * LEASE_TTL_S + 10 * SLACK_S,
               what=lambda: "renewals after the kill\n" + bridge.output()[-2000:])
    assert engine_up(metrics) is None and DOWN_LOG not in bridge.output()


@pytest.mark.parametrize("flags, message", [
    (["--engine-health-path", "health"], "must start with '/'"),
    (["--engine-health-timeout", "10", "--lease-ttl", "10"], "must be shorter than --lease-ttl"),
])
def test_a_health_check_that_cannot_work_is_refused_at_start(flags, message):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "bridge", "--endpoint", "tcp://127.0.0.1:1",
                          "--worker-id", WORKER, "--model", MODEL, "--page-size", "4", "--nats", "nats://127.0.0.1:1",
                          "--worker-url", "http://127.0.0.1:1", *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_engines_own_queue_is_published_beside_its_state(stack):
    """The bridge reads the engine's /metrics (SGLang's sglang:num_queue_reqs and
    num_running_reqs) after each health answer and announces it; the processor keeps it in the
    worker's state, where `kvtier inspect` shows it."""
    nats_url, client, engine, processes = stack
    engine.start(device_pages=65536)
    processes.append(start_bridge(nats_url, engine, free_port()))
    wait_until(lambda: lease_live(client), timeout=30, what=lambda: processes[-1].output()[-2000:])
    state_key = ModelKeys.for_model(MODEL).state(WORKER)
    wait_until(lambda: client.hget(state_key, "engine_waiting") == b"0", timeout=10,  # idle: nothing waits
               what=lambda: f"the state's engine fields: {client.hgetall(state_key)}")
    # three prompts of 65,536 tokens at one simulated moment: over 3 s of prefill each
    for seed in range(3):
        prompt = [(seed * 7919 + i) % 50_000 for i in range(65_536)]
        body = json.dumps({"input_ids": prompt, "now": 1000.0}).encode()
        request = urllib.request.Request(engine.worker_url + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
    wait_until(lambda: client.hget(state_key, "engine_running") == b"1"
               and int(client.hget(state_key, "engine_waiting") or 0) >= 1, timeout=10,
               what=lambda: f"the state's engine fields: {client.hgetall(state_key)}")
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", "--redis", redis_url(client), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)
    assert row["engine_queue"]["running"] == 1 and row["engine_queue"]["waiting"] >= 1, row
    assert 0 <= row["engine_queue"]["read_ago_s"] < 10, row
    router = RouterProcess(redis_url(client))
    processes.append(router)

    def healthz_queues():
        return [q for q in http("GET", router.url + "/healthz")[1]["engine_queues"] if q["worker_id"] == WORKER]

    [queue] = wait_until(healthz_queues, timeout=15, what=lambda: router.output()[-2000:])
    # the counts move with the engine's clock; what the router shows is the announce's, and fresh
    assert queue["model"] == MODEL and queue["running"] in (0, 1) and 0 <= queue["read_ago_s"] < 10, queue


def redis_url(client) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}"
