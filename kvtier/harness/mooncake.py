"""A real Mooncake master for tests and local runs, a small writer that puts objects into its
shared pool, and a standard-library existence query against the master's HTTP admin server.

The master's HTTP metadata server listens on 0.0.0.0 whatever host it is given (checked with
0.3.13.post1: `--http_metadata_server_host=127.0.0.1` is logged but ignored), and the writer's
transfer engine also listens on all interfaces. Run both inside a private network namespace
(`unshare -n`, loopback up), as tests/netns_runner.py does; `in_private_netns()` tells whether
that is the case.

Importing this module never needs the `mooncake` package: only SharedPoolWriter loads it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import msgspec

from kvtier.harness.embedded import MissingServerBinary, ServerStartError, _Server, free_port
from kvtier.schemas.mooncake import decode_batch_query_reply

# Measured with 0.3.13.post1 on loopback, keys of 66 characters (64-hex digest + "_0_k"): the
# master's HTTP server has no practical URL limit — one GET with 400,000 keys (a 27.6 MB URL)
# still answered 200 with every key. Latency grows with the batch: 64 keys p50 0.6 ms, 300 keys
# 1.1 ms, 512 keys 2.5 ms, 2,000 keys 8.5 ms, 60,000 keys 300 ms. The cap is not a limit of the
# master: it bounds the latency and the URL (~35 KB at 512 keys) of one request. A proxy between
# router and master may cap request lines lower (nginx: 8 KiB by default, ~110 such keys).
MAX_KEYS_PER_QUERY = 512

_INSTALL_HINT = "Install it with `pip install mooncake-transfer-engine-non-cuda`"
_LIBRARY_HINT = ("it needs the RDMA verbs library even for TCP: `apt-get install libibverbs1` "
                 "(Debian/Ubuntu)")
_LOADER_ERROR = "error while loading shared libraries"


class MooncakeUnavailable(MissingServerBinary):
    """The mooncake package or its master binary is missing or cannot run here."""


class MooncakeError(RuntimeError):
    """A Mooncake call answered with an error code."""


def _candidates() -> list[Path]:
    # The wheel puts the real binary inside the package and a Python launcher in the venv's bin
    # that execs it. The binary itself comes first: no interpreter start per launch, and a
    # missing shared library shows up as the loader's own message.
    found: list[Path] = []
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
        for location in (spec.submodule_search_locations or []) if spec else []:
            found.append(Path(location) / "mooncake_master")
    for scripts in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found.append(Path(scripts) / "mooncake_master")
    on_path = shutil.which("mooncake_master")
    if on_path:
        found.append(Path(on_path))
    return found


@lru_cache(maxsize=8)
def _check_runs(path: str) -> None:
    """Run `--version` once per binary so that a missing shared library is reported as such
    instead of as a master that died at start."""
    try:
        probe = subprocess.run([path, "--version"], check=False, capture_output=True, text=True,
                               timeout=20, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise MooncakeUnavailable(f"cannot run {path}: {exc}. {_INSTALL_HINT}.") from None
    except subprocess.TimeoutExpired:
        raise MooncakeUnavailable(f"{path} --version did not answer within 20 s") from None
    output = (probe.stderr + probe.stdout).strip()
    if _LOADER_ERROR in output:
        raise MooncakeUnavailable(f"{path} cannot start: {output.splitlines()[-1]}. "
                                  f"Mooncake's master {_LIBRARY_HINT}.")
    if probe.returncode != 0:
        raise MooncakeUnavailable(f"{path} --version failed (exit {probe.returncode}): {output[-500:]}")


def find_mooncake_master() -> str:
    """Path of a `mooncake_master` that runs here: KVTIER_MOONCAKE_MASTER_BIN, else the binary
    inside the installed `mooncake` package, else the venv's bin, else PATH."""
    explicit = os.environ.get("KVTIER_MOONCAKE_MASTER_BIN")
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = _candidates()
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            _check_runs(str(path))
            return str(path)
    where = (f"KVTIER_MOONCAKE_MASTER_BIN={explicit} is not an executable file" if explicit
             else "mooncake_master not found")
    raise MooncakeUnavailable(f"{where}. {_INSTALL_HINT} (it ships the master binary), or put "
                              "mooncake_master on PATH, or set KVTIER_MOONCAKE_MASTER_BIN.")


def in_private_netns() -> bool:
    """True when this process's network namespace has no interface but loopback.

    Comparing /proc/self/ns/net with /proc/1/ns/net is not reliable: reading another process's
    namespace link needs ptrace rights (it fails with EACCES for root in some sandboxes), and in
    a container PID 1 is the container's init, not the host's. An environment marker only says
    that someone meant to isolate the process. What makes the master's 0.0.0.0 listener safe is
    that no interface but `lo` exists, so that is what is checked. /proc/self/net/dev lists the
    interfaces of the caller's namespace (unlike /sys/class/net, which shows the namespace
    that mounted sysfs)."""
    try:
        with open("/proc/self/net/dev") as f:
            lines = f.read().splitlines()[2:]  # two header lines
    except OSError:
        return False
    interfaces = {line.split(":", 1)[0].strip() for line in lines if ":" in line}
    return interfaces == {"lo"}


def require_private_netns(what: str) -> None:
    """Refuse (MooncakeUnavailable) to start a master for `what` outside a private network
    namespace, where its metadata server's 0.0.0.0 listener would face this machine's network."""
    if not in_private_netns():
        raise MooncakeUnavailable(
            f"{what} runs a Mooncake master, whose metadata server (and each writer's transfer engine) "
            "listens on 0.0.0.0: run it in a private network namespace with only loopback, e.g.\n"
            "  unshare -n sh -c 'ip link set lo up && exec <the command>'")


@dataclass
class MooncakeMaster(_Server):
    """`mooncake_master` on free ports with the HTTP metadata server enabled. `port` is the RPC
    port; metrics_port is the HTTP admin server (metrics and /batch_query_keys);
    metadata_port is the HTTP metadata server that writers' transfer engines use."""

    name: str = "mooncake-master"
    host: str = "127.0.0.1"
    metrics_port: int = 0
    metadata_port: int = 0
    extra_args: list[str] = field(default_factory=list)
    _binary: str = field(default="", init=False, repr=False)

    def start(self, timeout: float = 20.0, host: str | None = None) -> MooncakeMaster:
        if host:
            self.host = host
        binary = find_mooncake_master()  # a missing library is reported before any port is taken
        self._binary = binary
        try:
            super().start(timeout)
        except ServerStartError as exc:
            hint = f"\nMooncake's master {_LIBRARY_HINT}." if _LOADER_ERROR in self.tail_log() else ""
            message = (f"mooncake_master did not become ready (rpc {self.host}:{self.port}, admin HTTP "
                       f"{self.metrics_port}, metadata HTTP {self.metadata_port}): {exc}{hint}")
            if self._own_workdir:  # the message already carries the log tail
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir, self._own_workdir = "", False
            raise ServerStartError(message) from None
        return self

    @property
    def rpc_port(self) -> int:
        return self.port

    @property
    def rpc_address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def http_url(self) -> str:
        """Base of the admin HTTP server: `{http_url}/batch_query_keys?keys=…`, `/metrics`."""
        return f"http://{self.host}:{self.metrics_port}"

    def _command(self) -> list[str]:
        # free_port() releases the port it found, so two calls can return the same one
        self.metrics_port = self.metadata_port = self.port
        while self.metrics_port == self.port:
            self.metrics_port = free_port()
        while self.metadata_port in (self.port, self.metrics_port):
            self.metadata_port = free_port()
        return [
            self._binary or find_mooncake_master(),
            f"--rpc_address={self.host}", f"--rpc_port={self.port}",
            f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=true",
            # ignored by 0.3.13.post1 (it binds 0.0.0.0), passed for versions that honour it
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            *self.extra_args,
        ]

    def _ready(self) -> bool:
        # The admin server comes up last (about 1 s after the RPC and metadata servers), so an
        # answer here means the whole master is serving.
        try:
            with urllib.request.urlopen(f"{self.http_url}/batch_query_keys?keys=probe", timeout=0.5) as response:
                return decode_batch_query_reply(response.read()).success is not msgspec.UNSET
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return False


def query_keys(http_url: str, keys: list[str], timeout: float = 2.0) -> dict[str, bool]:
    """Which keys exist in the shared pool, from the master's admin server.

    `GET {http_url}/batch_query_keys?keys=k1,k2` (raw commas) answers
    `{"success": true, "data": {"k1": {"ok": true, "error": null, "values": [replica…], …},
    "k2": {"ok": false, "error": "OBJECT_NOT_FOUND", "values": null, …}}}`. Keys go in batches
    of MAX_KEYS_PER_QUERY. A key containing a comma cannot be asked for (the master splits on
    it); other characters are percent-encoded, which the master decodes."""
    result: dict[str, bool] = {}
    unique = list(dict.fromkeys(keys))
    for key in unique:
        if "," in key or not key:
            raise ValueError(f"cannot query Mooncake key {key!r}: keys must be non-empty and contain no comma")
    for start in range(0, len(unique), MAX_KEYS_PER_QUERY):
        batch = unique[start:start + MAX_KEYS_PER_QUERY]
        url = f"{http_url.rstrip('/')}/batch_query_keys?keys=" + ",".join(
            urllib.parse.quote(key, safe="") for key in batch)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise MooncakeError(f"GET {http_url}/batch_query_keys: HTTP {exc.code}: "
                                f"{exc.read()[:300].decode(errors='replace')}") from None
        try:
            reply = decode_batch_query_reply(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MooncakeError(f"GET {http_url}/batch_query_keys: unreadable reply ({exc}): {raw[:300]!r}") from None
        if not reply.success:
            raise MooncakeError(f"GET {http_url}/batch_query_keys failed: {reply.error!r}")
        data = reply.data or {}
        for key in batch:
            entry = data.get(key)
            result[key] = bool(entry and entry.ok)
    return result


class SharedPoolWriter:
    """Puts objects into a master's shared pool, as an SGLang HiCache worker with the Mooncake
    backend does. The pool lives in this writer's own mounted segment: when the writer closes
    (or stops heartbeating for the master's client_ttl, 10 s by default) its objects are gone."""

    def __init__(self, rpc_address: str, metadata_url: str, *, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = 64 << 20, buffer_bytes: int = 16 << 20) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise MooncakeUnavailable(f"cannot import mooncake.store ({exc}). {_INSTALL_HINT}.") from None
        # Without a bind address the transfer engine looks for a LAN address, finds none in a
        # loopback-only namespace, and setup fails after ~2 s of retries ("not valid LAN address
        # found"). It reads the variable at setup, so setting it here is enough.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_url, segment_bytes, buffer_bytes, "tcp", "", rpc_address)
        if rc != 0:
            self._store = None
            raise MooncakeError(f"Mooncake store setup against master {rpc_address} (metadata {metadata_url}) "
                                f"failed with code {rc}; is the master running and MC_TCP_BIND_ADDRESS set?")

    def _live_store(self):
        if self._store is None:
            raise MooncakeError("SharedPoolWriter is closed")
        return self._store

    def put(self, key: str, value: bytes) -> None:
        rc = self._live_store().put(key, value)
        if rc != 0:
            raise MooncakeError(f"put {key!r} failed with code {rc}")

    def put_many(self, keys: list[str], value: bytes) -> None:
        """Every key gets the same value: enough for existence tests, one round trip."""
        if not keys:
            return
        rc = self._live_store().put_batch(list(keys), [value] * len(keys))
        if rc != 0:
            raise MooncakeError(f"put_batch of {len(keys)} keys failed with code {rc}")

    def exists(self, keys: list[str]) -> list[bool]:
        answers = self._live_store().batch_is_exist(list(keys))
        failed = [key for key, answer in zip(keys, answers) if answer < 0]
        if failed:
            raise MooncakeError(f"existence check failed for {len(failed)} keys, e.g. {failed[0]!r}")
        return [answer == 1 for answer in answers]

    def remove_all(self) -> int:
        """Every object in the pool removed, whoever wrote it (the master's whole pool, not
        this writer's segment): how many. Forced: the master grants a lease (--default_kv_lease_ttl,
        10 s in 0.3.13.post1) on every existence query, and an unforced remove_all skips leased
        objects, so right after traffic it would remove nothing (checked with 0.3.13.post1)."""
        removed = self._live_store().remove_all(True)
        if removed < 0:
            raise MooncakeError(f"remove_all failed with code {removed}")
        return removed

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> SharedPoolWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
