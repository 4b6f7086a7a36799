"""docker-compose.yml, deploy/prometheus.yml and the Dockerfile, checked without a Docker engine.

The checker below reads the compose file the way Compose and kvtier will: every kvtier
service's command line goes through kvtier's own parser with the service's KVTIER_* environment
applied as the CLI applies it (`_EnvDefaults` reads os.environ while the parser is built), and
every address a service is given must name a service of the file and a port that service
listens on according to its own command line (or its flags' defaults), bound to an address other
containers can reach. The compose file must be self-contained: the image's own ENV defaults
are not counted. Each check has a negative test that feeds a broken copy of the real files to
the same checker and expects its error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import build_parser
from kvtier.commands.flags import env_name

yaml = pytest.importorskip("yaml", reason="PyYAML reads docker-compose.yml: pip install pyyaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS_FILE = ROOT / "deploy" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

#: KVTIER_* variables read outside the parser (not flags), allowed on any kvtier service.
NON_FLAG_VARIABLES = {"KVTIER_NATS_SERVER_BIN", "KVTIER_REDIS_SERVER_BIN", "KVTIER_MOONCAKE_MASTER_BIN"}

#: Which parsed options hold an address: its kind (nats/redis/http URL, tcp endpoint, one per DP
#: rank for a bridge, or a bare host:port) and the role of the port it must reach (a router's
#: --mooncake-master is the master's admin port, not its RPC or metadata port).
ADDRESS_OPTIONS = {
    "bridge": {"nats": ("nats", "client"), "endpoint": ("tcp", "events"), "replay_endpoint": ("tcp", "replay"),
               "http_endpoint": ("http", "http"), "sglang_url": ("http", "http")},
    "processor": {"nats": ("nats", "client"), "redis": ("redis", "client")},
    "router": {"redis": ("redis", "client"), "nats": ("nats", "client"), "mooncake_master": ("http", "admin")},
    "sim-worker": {"mooncake_rpc": ("hostport", "rpc"), "mooncake_metadata": ("http", "metadata")},
    "analytics": {"nats": ("nats", "client")},
    "inspect": {"redis": ("redis", "client")},
    "doctor": {"nats": ("nats", "client"), "redis": ("redis", "client"), "mooncake_master": ("http", "admin")},
}
DEFAULT_PORTS = {"nats": 4222, "redis": 6379, "rediss": 6379, "redis+cluster": 6379, "rediss+cluster": 6379,
                 "http": 80, "https": 443}
URL_SCHEMES = {"nats": {"nats", "tls"}, "redis": {"redis", "rediss", "redis+cluster", "rediss+cluster"},
               "http": {"http", "https"}, "tcp": {"tcp"}}


# --- reading the files ------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} / ${VAR-default}, resolved to the file's own defaults (the host's
    environment is not consulted, so the check is the same everywhere); $$ is a literal $."""
    if isinstance(value, str):
        def one(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            return m.group(3) if m.group(2) in (":-", "-") else ""
        return _INTERPOLATION.sub(one, value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def load_files() -> tuple[dict, dict]:
    """The compose file and the Prometheus config as plain data: anchors, aliases and merge keys
    expanded into independent copies, so a test can break one service without touching another."""
    compose = json.loads(json.dumps(yaml.safe_load(COMPOSE_FILE.read_text())))
    prometheus = json.loads(json.dumps(yaml.safe_load(PROMETHEUS_FILE.read_text())))
    return _interpolate(compose), prometheus


def _words(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def _environment(spec: dict) -> dict[str, str | None]:
    env = spec.get("environment") or {}
    if isinstance(env, list):
        pairs = {}
        for item in env:
            name, sep, value = str(item).partition("=")
            pairs[name] = value if sep else None
        return pairs
    return {k: (None if v is None else str(v).lower() if isinstance(v, bool) else str(v)) for k, v in env.items()}


def _long_flag(argv: list[str], names: tuple[str, ...], default: str | None = None) -> str | None:
    """The value of a flag written `--name value`, `--name=value` or `-n value` (last one wins)."""
    value = default
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(name + "="):
                value = word.split("=", 1)[1]
    return value


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _host_port(address: str) -> tuple[str, int | None]:
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() else (address, None)


@contextlib.contextmanager
def _kvtier_environment(env: dict[str, str | None]):
    """os.environ as the container sees it, as far as kvtier's parser is concerned."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVTIER_")}
    for name in saved:
        del os.environ[name]
    os.environ.update({k: v for k, v in env.items() if k.startswith("KVTIER_") and v is not None})
    try:
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("KVTIER_")]:
            del os.environ[name]
        os.environ.update(saved)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices.get(command)


def _options(sub: argparse.ArgumentParser) -> set[str]:
    return {opt for action in sub._actions for opt in action.option_strings if opt.startswith("--")}


# --- the model of the file ----------------------------------------------------------------------

@dataclass
class Service:
    name: str
    spec: dict
    kind: str
    argv: list[str]  # kvtier: the arguments after `kvtier`; others: the whole command line
    env: dict[str, str | None]
    profiles: frozenset[str]
    args: argparse.Namespace | None = None
    listens: dict[int, tuple[str, str]] = field(default_factory=dict)  # port -> (bind address, role)

    @property
    def command(self) -> str:
        return self.argv[0] if self.kind == "kvtier" and self.argv else ""


def _kind(spec: dict) -> str:
    image = str(spec.get("image", ""))
    build = spec.get("build")
    build = {"context": build} if isinstance(build, str) else (build or {})
    entrypoint = _words(spec.get("entrypoint"))
    words = entrypoint + _words(spec.get("command"))
    if str(build.get("dockerfile", "")).endswith("mooncake.Dockerfile") or "mooncake_master" in words[:1]:
        return "mooncake-master"
    if image.startswith("lmsysorg/sglang") or "sglang.launch_server" in words:
        return "sglang"
    if entrypoint[:1] == ["kvtier"] or (not entrypoint and (
            (build and str(build.get("context", "")).rstrip("/") in (".", "") and
             str(build.get("dockerfile", "Dockerfile")) == "Dockerfile") or image.startswith("kvtier:"))):
        return "kvtier"
    for prefix, kind in (("nats", "nats"), ("redis", "redis"), ("valkey/valkey", "redis"),
                         ("prom/prometheus", "prometheus"), ("grafana/grafana", "grafana")):
        if image == prefix or image.startswith(prefix + ":"):
            return kind
    return "other"


def _parse_kvtier(service: Service, errors: list[str]) -> None:
    """Run the service through kvtier's parser exactly as the container would."""
    argv, env = service.argv, service.env
    if argv[:1] == ["kvtier"]:
        argv = service.argv = argv[1:]
    for name in env:
        if name.startswith("KVTIER_") and env[name] is None:
            errors.append(f"{service.name}: {name} has no value (it would come from the host's environment)")
    stderr = io.StringIO()
    with _kvtier_environment(env), contextlib.redirect_stderr(stderr):
        try:
            parser = build_parser()
        except (ValueError, argparse.ArgumentTypeError) as exc:  # a KVTIER_* value its flag's type() refuses
            errors.append(f"{service.name}: its environment is refused by kvtier's parser: {exc}")
            return
        sub = _subparser(parser, argv[0]) if argv else None
        if sub is None:
            with contextlib.suppress(SystemExit):
                parser.parse_args(argv)
            errors.append(f"{service.name}: `kvtier {shlex.join(argv)}` is refused: "
                          f"{(stderr.getvalue().strip().splitlines() or ['no subcommand'])[-1]}")
            return
        known = {env_name(flag) for flag in _options(sub)}
        for name in env:
            if name.startswith("KVTIER_") and name not in NON_FLAG_VARIABLES and name not in known:
                errors.append(f"{service.name}: {name} sets no flag of `kvtier {argv[0]}` (a typo is silently ignored)")
        try:
            service.args = parser.parse_args(argv)
        except SystemExit:
            lines = stderr.getvalue().strip().splitlines() or ["refused"]
            errors.append(f"{service.name}: `kvtier {shlex.join(argv)}` with its KVTIER_* environment is refused: "
                          f"{lines[-1]}")
            return
    # argparse checks `choices` only for values on the command line, not for defaults, and
    # _EnvDefaults turns KVTIER_* values into defaults: an invalid choice would pass silently.
    for action in sub._actions:
        value = getattr(service.args, action.dest, None)
        if action.option_strings and action.choices is not None and value is not None and value not in action.choices:
            errors.append(f"{service.name}: {env_name(action.option_strings[-1])}={value} is an invalid choice "
                          f"of {action.option_strings[-1]} ({', '.join(map(str, action.choices))})")


def _kvtier_listens(service: Service) -> dict[int, tuple[str, str]]:
    args, listens = service.args, {}
    if args is None:
        return listens
    if getattr(args, "metrics_port", 0):
        listens[args.metrics_port] = (args.metrics_host, "metrics")
    if service.command in ("router", "analytics"):
        listens[args.http_port] = (args.host, "http")
    elif service.command == "sim-worker":
        if args.http_port:
            listens[args.http_port] = (args.host, "http")
        for rank in range(args.ranks):
            listens[args.port + rank] = (args.host, "events")
            listens[args.replay_port + rank] = (args.host, "replay")
    return listens


def _sglang_events(service: Service) -> dict:
    raw = _long_flag(service.argv, ("--kv-events-config",))
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"invalid": raw}


def _sglang_dp(service: Service) -> int:
    return int(_long_flag(service.argv, ("--dp-size", "--dp"), "1"))


def _other_listens(service: Service) -> dict[int, tuple[str, str]]:
    argv, listens = service.argv, {}
    if service.kind == "nats":
        host = _long_flag(argv, ("-a", "--addr", "--net"), "0.0.0.0")
        listens[int(_long_flag(argv, ("-p", "--port"), "4222"))] = (host, "client")
        monitor = _long_flag(argv, ("-m", "--http_port"))
        if monitor:
            listens[int(monitor)] = (_long_flag(argv, ("--http_host",), host), "monitor")
    elif service.kind == "redis":
        host = _long_flag(argv, ("--bind",), "0.0.0.0").split()[0]
        listens[int(_long_flag(argv, ("--port",), "6379"))] = (host, "client")
    elif service.kind == "mooncake-master":  # gflags: --name=value; defaults of 0.3.13.post1
        rpc_port = _long_flag(argv, ("--rpc_port",), "0")
        rpc_port = rpc_port if rpc_port != "0" else _long_flag(argv, ("--port",), "50051")
        listens[int(rpc_port)] = (_long_flag(argv, ("--rpc_address",), "0.0.0.0"), "rpc")
        listens[int(_long_flag(argv, ("--metrics_port",), "9003"))] = (
            _long_flag(argv, ("--metrics_host",), "0.0.0.0"), "admin")
        if _long_flag(argv, ("--enable_http_metadata_server",), "false").lower() in ("true", "1"):
            # 0.3.13.post1 binds the metadata server to 0.0.0.0 whatever host it is given
            listens[int(_long_flag(argv, ("--http_metadata_server_port",), "8080"))] = ("0.0.0.0", "metadata")
    elif service.kind == "sglang":
        listens[int(_long_flag(argv, ("--port",), "30000"))] = (_long_flag(argv, ("--host",), "127.0.0.1"), "http")
        events = _sglang_events(service)
        for key, role in (("endpoint", "events"), ("replay_endpoint", "replay")):
            if isinstance(events.get(key), str):
                host, port = _host_port(events[key].split("://", 1)[-1])
                for rank in range(_sglang_dp(service) if port else 0):
                    listens[port + rank] = ("0.0.0.0" if host == "*" else host, role)
    elif service.kind == "prometheus":
        host, port = _host_port(_long_flag(argv, ("--web.listen-address",), ":9090"))
        listens[port] = (host or "0.0.0.0", "http")
    elif service.kind == "grafana":  # configured by GF_<SECTION>_<KEY> variables; an empty address: all
        port = int(service.env.get("GF_SERVER_HTTP_PORT") or "3000")
        listens[port] = (service.env.get("GF_SERVER_HTTP_ADDR") or "0.0.0.0", "http")
    return listens


@dataclass
class Compose:
    data: dict
    prometheus: dict
    services: dict[str, Service]
    errors: list[str]

    def of(self, kind: str, command: str = "") -> list[Service]:
        return [s for s in self.services.values() if s.kind == kind and (not command or s.command == command)]


def read_compose(data: dict, prometheus: dict) -> Compose:
    services, errors = {}, []
    for name, spec in (data.get("services") or {}).items():
        kind = _kind(spec)
        argv = _words(spec.get("command"))
        if kind != "kvtier":
            argv = _words(spec.get("entrypoint")) + argv
        service = Service(name, spec, kind, argv, _environment(spec), frozenset(spec.get("profiles") or ()))
        if kind == "kvtier":
            _parse_kvtier(service, errors)
            service.listens = _kvtier_listens(service)
        else:
            service.listens = _other_listens(service)
        services[name] = service
    return Compose(data, prometheus, services, errors)


# --- the checks ------------------------------------------------------------------------------------

def check_commands(c: Compose) -> list[str]:
    """Every kvtier service's command line and KVTIER_* environment is accepted by kvtier's parser."""
    errors = list(c.errors)
    if not c.of("kvtier"):
        errors.append("no service runs kvtier")
    return errors


def _runs_with(source: Service, target: Service) -> bool:
    """Whether target runs whenever source does (a service without profiles always runs)."""
    return not target.profiles or bool(source.profiles and source.profiles <= target.profiles)


def _check_target(c: Compose, source: str, what: str, host: str, port: int | None, errors: list[str],
                  runs_with: Service | None = None, role: str | None = None) -> None:
    target = c.services.get(host)
    if target is None:
        errors.append(f"{source}: {what} names host {host!r}, which is no service of the compose file")
        return
    if port is None:
        errors.append(f"{source}: {what} has no port")
    elif port not in target.listens:
        errors.append(f"{source}: {what} -> {host}:{port}, but {host} listens on "
                      f"{sorted(target.listens) or 'no port known'}")
    elif _is_loopback(target.listens[port][0]):
        errors.append(f"{source}: {what} -> {host}:{port}, but {host} binds that port to "
                      f"{target.listens[port][0]}, unreachable from other containers")
    elif role and target.listens[port][1] != role:
        errors.append(f"{source}: {what} -> {host}:{port}, which is {host}'s {target.listens[port][1]} port, "
                      f"not its {role} port")
    if runs_with is not None and not _runs_with(runs_with, target):
        errors.append(f"{source}: {what} -> {host}, which only runs under profile(s) {sorted(target.profiles)} "
                      f"while {runs_with.name} runs under {sorted(runs_with.profiles) or 'the default profile'}")


def _check_url(c: Compose, service: Service, what: str, url: str, kind: str, role: str, errors: list[str],
               ranks: int = 1) -> None:
    if kind == "hostport":
        host, port = _host_port(url)
        _check_target(c, service.name, f"{what} {url}", host, port, errors, service, role)
        return
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in URL_SCHEMES.get(kind, {kind}):
        errors.append(f"{service.name}: {what} {url!r} is not a {kind} URL")
        return
    try:
        port = parsed.port or DEFAULT_PORTS.get(parsed.scheme)
    except ValueError:
        errors.append(f"{service.name}: {what} {url!r} has an invalid port")
        return
    for rank in range(ranks):
        _check_target(c, service.name, f"{what} {url}" + (f" (rank {rank})" if ranks > 1 else ""),
                      parsed.hostname or "", None if port is None else port + rank, errors, service, role)


def check_addresses(c: Compose) -> list[str]:
    """Every address a service is given names a service of the file and a port it listens on,
    reachable from other containers, and running whenever the service that uses it does."""
    errors: list[str] = []
    for service in c.services.values():
        if service.kind == "kvtier" and service.args is not None:
            args = service.args
            ranks = (getattr(args, "dp_size", None) or 1) if service.command == "bridge" else 1
            for dest, (kind, role) in ADDRESS_OPTIONS.get(service.command, {}).items():
                value = getattr(args, dest, None)
                if value:
                    flag = "--" + {"http_endpoint": "worker-url"}.get(dest, dest.replace("_", "-"))
                    _check_url(c, service, flag, value, kind, role, errors, ranks if kind == "tcp" else 1)
            if service.command == "bridge" and not (args.endpoint or getattr(args, "sglang_url", "")):
                errors.append(f"{service.name}: a bridge needs --endpoint or --sglang-url")
            if service.command == "router" and args.shared_cache_type == "hicache" and not args.mooncake_master:
                errors.append(f"{service.name}: --shared-cache-type hicache needs --mooncake-master")
        if service.kind == "sglang":
            master = service.env.get("MOONCAKE_MASTER")
            if "mooncake" in service.argv and not master:
                errors.append(f"{service.name}: --hicache-storage-backend mooncake needs MOONCAKE_MASTER")
            if master:
                _check_url(c, service, "MOONCAKE_MASTER", master, "hostport", "rpc", errors)
            metadata = service.env.get("MOONCAKE_TE_META_DATA_SERVER")
            if metadata and metadata != "P2PHANDSHAKE":
                _check_url(c, service, "MOONCAKE_TE_META_DATA_SERVER", metadata, "http", "metadata", errors)
            own = service.env.get("MOONCAKE_LOCAL_HOSTNAME")
            if own and own not in (service.name, service.spec.get("hostname")):
                errors.append(f"{service.name}: MOONCAKE_LOCAL_HOSTNAME={own} is not this service's name, so other "
                              "pool clients cannot reach its segment")
        # a probe must hit a port the service itself listens on
        probe = " ".join(_words((service.spec.get("healthcheck") or {}).get("test")))
        for port in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", probe):
            if service.listens and int(port) not in service.listens:
                errors.append(f"{service.name}: its healthcheck probes port {port}, but it listens on "
                              f"{sorted(service.listens)}")
        # published ports: the container side must be listened on, the host side used once
        for entry in service.spec.get("ports") or []:
            target = entry.get("target") if isinstance(entry, dict) else str(entry).rsplit(":", 1)[-1].split("/")[0]
            if service.listens and int(target) not in service.listens:
                errors.append(f"{service.name}: publishes container port {target}, but it listens on "
                              f"{sorted(service.listens)}")
    published: list[tuple[str, str, str]] = []  # (host address, host port, service)
    for service in c.services.values():
        for entry in service.spec.get("ports") or []:
            if isinstance(entry, dict):
                address, port = str(entry.get("host_ip") or ""), str(entry.get("published") or "")
            else:
                parts = str(entry).split("/")[0].split(":")
                address, port = (parts[0], parts[1]) if len(parts) == 3 else ("", parts[0] if len(parts) == 2 else "")
            if not port:
                continue
            for other_address, other_port, other in published:
                if other_port == port and (address == other_address or "" in (address, other_address)
                                           or "0.0.0.0" in (address, other_address)):
                    errors.append(f"{service.name}: host port {port} is published twice (also by {other})")
            published.append((address, port, service.name))
    return errors


def _targets(prometheus: dict) -> dict[str, str]:
    """target -> metrics path, over every static scrape config."""
    found = {}
    for job in prometheus.get("scrape_configs") or []:
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                found[str(target)] = job.get("metrics_path", "/metrics")
    return found


def check_prometheus(c: Compose) -> list[str]:
    """Prometheus scrapes each router's /metrics (on its HTTP port) and each processor's and
    bridge's --metrics-port, and every target is a port a service of the file listens on."""
    errors: list[str] = []
    targets = _targets(c.prometheus)
    servers = c.of("prometheus")
    if not servers:
        errors.append("no prometheus service")
    for server in servers:
        mounts = [str(v) for v in server.spec.get("volumes") or []]
        if not any(Path(m.split(":")[0]).as_posix().lstrip("./") == "deploy/prometheus.yml" for m in mounts):
            errors.append(f"{server.name}: deploy/prometheus.yml is not mounted")
    for service in c.of("kvtier"):
        args = service.args
        if args is None:
            continue
        if service.command in ("router", "analytics"):
            wanted = f"{service.name}:{args.http_port}"
            if targets.get(wanted) != "/metrics":
                errors.append(f"prometheus.yml: {service.command} {service.name} is not scraped at {wanted}/metrics "
                              "(its metrics are on its HTTP port)")
        elif service.command in ("processor", "bridge"):
            if not args.metrics_port:
                if service.command == "processor":
                    errors.append(f"{service.name}: a processor without --metrics-port cannot be scraped")
                continue
            wanted = f"{service.name}:{args.metrics_port}"
            if wanted not in targets:
                errors.append(f"prometheus.yml: {service.command} {service.name} is not scraped at {wanted}")
    for target in targets:
        host, port = _host_port(target)
        _check_target(c, "prometheus.yml", f"target {target}", host, port, errors)
    return errors


def _named_volume(mount: Any) -> tuple[str, str] | None:
    """(source, target) of a named-volume mount; None for a bind mount or a tmpfs."""
    if isinstance(mount, dict):
        if mount.get("type", "volume") != "volume" or not mount.get("source"):
            return None
        return str(mount["source"]), str(mount.get("target", ""))
    parts = str(mount).split(":")
    if len(parts) < 2 or parts[0].startswith((".", "/", "~", "$")):
        return None
    return parts[0], parts[1]


def _on_volume(service: Service, path: str) -> bool:
    for mount in service.spec.get("volumes") or []:
        named = _named_volume(mount)
        if named and (path == named[1] or path.startswith(named[1].rstrip("/") + "/")):
            return True
    return False


def check_volumes(c: Compose) -> list[str]:
    """Named volumes are declared (and declared ones used), bind-mounted files exist, and the
    state that must survive a restart sits on a volume: JetStream's store, Redis' AOF."""
    errors: list[str] = []
    declared = set((c.data.get("volumes") or {}).keys())
    used = set()
    for service in c.services.values():
        for mount in service.spec.get("volumes") or []:
            named = _named_volume(mount)
            if named:
                used.add(named[0])
                if named[0] not in declared:
                    errors.append(f"{service.name}: volume {named[0]} is not declared under top-level volumes")
            elif isinstance(mount, str) and mount.startswith(".") and not (ROOT / mount.split(":")[0]).exists():
                errors.append(f"{service.name}: bind-mounted {mount.split(':')[0]} does not exist")
    for name in sorted(declared - used):
        errors.append(f"volume {name} is declared but no service mounts it")
    for service in c.of("nats"):
        store = _long_flag(service.argv, ("-sd", "--store_dir"))
        if "-js" not in service.argv and "--jetstream" not in service.argv:
            errors.append(f"{service.name}: JetStream is off (no -js)")
        if not store or not _on_volume(service, store):
            errors.append(f"{service.name}: the JetStream store directory ({store or 'none given'}) is not on a "
                          "named volume")
    for service in c.of("redis"):
        if _long_flag(service.argv, ("--appendonly",), "no") != "yes":
            errors.append(f"{service.name}: Redis runs without --appendonly yes")
        if not _on_volume(service, _long_flag(service.argv, ("--dir",), "/data")):
            errors.append(f"{service.name}: Redis' data directory is not on a named volume")
    return errors


def _wants_gpu(spec: dict) -> bool:
    devices = (((spec.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    return bool(spec.get("gpus") or spec.get("runtime") == "nvidia" or any(
        "gpu" in (d.get("capabilities") or []) or d.get("driver") == "nvidia" for d in devices))


def check_profiles(c: Compose) -> list[str]:
    """GPU services (SGLang and anything reserving a GPU) carry `profiles: [gpu]`; the default
    profile asks for no GPU; depends_on targets exist, run whenever their dependents do, and have
    a healthcheck where service_healthy is awaited."""
    errors: list[str] = []
    for service in c.services.values():
        gpu = _wants_gpu(service.spec) or service.kind == "sglang"
        if gpu and sorted(service.profiles) != ["gpu"]:
            errors.append(f"{service.name}: it needs a GPU but carries profiles {sorted(service.profiles)}, "
                          "not [gpu] (the default profile must run without a GPU)")
        depends = service.spec.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {name: {"condition": "service_started"} for name in depends}
        for name, how in depends.items():
            target = c.services.get(name)
            if target is None:
                errors.append(f"{service.name}: depends_on {name}, which is no service")
                continue
            if not _runs_with(service, target):
                errors.append(f"{service.name}: depends_on {name}, which only runs under profile(s) "
                              f"{sorted(target.profiles)}")
            probe = target.spec.get("healthcheck") or {}
            if (how or {}).get("condition") == "service_healthy" and (not probe.get("test") or probe.get("disable")):
                errors.append(f"{service.name}: waits for {name} to be healthy, but {name} has no healthcheck")
    if not [s for s in c.services.values() if not s.profiles and s.kind == "kvtier" and s.command == "sim-worker"]:
        errors.append("the default profile has no kvtier sim-worker")
    gpu_workers = [s for s in c.of("sglang") if s.profiles == {"gpu"}]
    if not gpu_workers:
        errors.append("the gpu profile has no SGLang worker")
    return errors


def check_workers(c: Compose) -> list[str]:
    """One bridge per worker rank: every sim-worker rank has exactly one bridge whose event and
    replay endpoints are that rank's, with the worker's page size; every SGLang worker has a
    bridge, publishes KV events over ZMQ with a replay socket, and names the model its bridge
    announces; worker ids are unique."""
    errors: list[str] = []
    bridges = [s for s in c.of("kvtier", "bridge") if s.args is not None]

    def points_at(address: str | None, host: str) -> int | None:
        if not address:
            return None
        parsed = urllib.parse.urlsplit(address)
        return parsed.port if parsed.hostname == host else None

    for sim in c.of("kvtier", "sim-worker"):
        if sim.args is None:
            continue
        for rank in range(sim.args.ranks):
            mine = [b for b in bridges if points_at(b.args.endpoint, sim.name) is not None and
                    points_at(b.args.endpoint, sim.name) <= sim.args.port + rank <
                    points_at(b.args.endpoint, sim.name) + (b.args.dp_size or 1)]
            if len(mine) != 1:
                errors.append(f"{sim.name}: rank {rank} (events on port {sim.args.port + rank}) has "
                              f"{len(mine)} bridges: {[b.name for b in mine]}")
                continue
            bridge = mine[0]
            offset = sim.args.port + rank - points_at(bridge.args.endpoint, sim.name)
            replay = points_at(bridge.args.replay_endpoint, sim.name)
            if replay is None or replay + offset != sim.args.replay_port + rank:
                errors.append(f"{bridge.name}: the replay endpoint {bridge.args.replay_endpoint!r} is not rank "
                              f"{rank}'s replay socket ({sim.name}:{sim.args.replay_port + rank})")
            if bridge.args.page_size != sim.args.page_size:
                errors.append(f"{bridge.name}: page size {bridge.args.page_size} differs from {sim.name}'s "
                              f"{sim.args.page_size}")
            if not _runs_with(bridge, sim) or not _runs_with(sim, bridge):
                errors.append(f"{bridge.name}: runs under other profiles than {sim.name}")
    for worker in c.of("sglang"):
        events = _sglang_events(worker)
        if events.get("publisher") != "zmq" or not events.get("endpoint") or not events.get("replay_endpoint"):
            errors.append(f"{worker.name}: --kv-events-config must publish over zmq with an endpoint and a "
                          f"replay_endpoint, got {events or 'nothing'}")
        if "--enable-hierarchical-cache" not in worker.argv:
            errors.append(f"{worker.name}: HiCache is off (no --enable-hierarchical-cache)")
        port = next((p for p, (_, role) in worker.listens.items() if role == "http"), None)
        mine = [b for b in bridges if points_at(getattr(b.args, "sglang_url", ""), worker.name) == port
                or points_at(b.args.endpoint, worker.name) is not None]
        if len(mine) != 1:
            errors.append(f"{worker.name}: has {len(mine)} bridges: {[b.name for b in mine]}")
        served = (_long_flag(worker.argv, ("--served-model-name",))
                  or _long_flag(worker.argv, ("--model-path", "--model")))
        for bridge in mine:
            if bridge.args.model and bridge.args.model != served:
                errors.append(f"{bridge.name}: announces model {bridge.args.model!r} but {worker.name} serves "
                              f"{served!r}")
            if not _runs_with(bridge, worker):
                errors.append(f"{bridge.name}: runs without {worker.name}'s profile")
    ids: dict[str, str] = {}
    for bridge in bridges:
        if bridge.args.worker_id in ids:
            errors.append(f"{bridge.name}: worker id {bridge.args.worker_id} is also {ids[bridge.args.worker_id]}'s")
        ids[bridge.args.worker_id] = bridge.name
    return errors


CHECKS: list[Callable[[Compose], list[str]]] = [
    check_commands, check_addresses, check_prometheus, check_volumes, check_profiles, check_workers,
]


def all_errors(data: dict, prometheus: dict) -> list[str]:
    c = read_compose(data, prometheus)
    return [error for check in CHECKS for error in check(c)]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def check_packaging(project: dict) -> list[str]:
    """Every Python package under the package-dir folders is in pyproject's `packages`: a regular
    install (the Docker image) ships only those."""
    setuptools = project["tool"]["setuptools"]
    listed, errors = set(setuptools["packages"]), []
    for name, folder in setuptools["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            package = ".".join([name, *parts])
            if package not in listed:
                errors.append(f"pyproject.toml: {package} ({init.parent.relative_to(ROOT)}) is not in "
                              "[tool.setuptools] packages, so a regular install (the Docker image) lacks it")
    return errors


def check_dockerfile(dockerfile: str, dockerignore: str) -> list[str]:
    """The image is built from everything pyproject.toml packages (package-dir folders, readme),
    none of it is excluded from the build context, it runs as a non-root user, and its
    entrypoint is `kvtier`."""
    project = _pyproject()
    needed = (set(project["tool"]["setuptools"]["package-dir"].values())
              | {"pyproject.toml", project["project"]["readme"]})
    build_stage = dockerfile.split("\nFROM ")[1] if "\nFROM " in dockerfile else dockerfile
    copied = {word.rstrip("/") for line in build_stage.splitlines() if line.startswith("COPY ")
              and "--from" not in line for word in line.split()[1:-1]}
    errors = [f"Dockerfile: {path} is not copied into the build stage" for path in sorted(needed - copied)
              if "." not in copied]
    ignored = [line.strip().rstrip("/") for line in dockerignore.splitlines()
               if line.strip() and not line.startswith("#") and not line.startswith("!")]
    errors += [f".dockerignore: excludes {path}, which the image is built from" for path in sorted(needed)
               if path in ignored]
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    if not users or users[-1] in ("root", "0"):
        errors.append("Dockerfile: the image runs as root")
    if 'ENTRYPOINT ["kvtier"]' not in dockerfile:
        errors.append('Dockerfile: the entrypoint is not ["kvtier"]')
    return errors


# --- the tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files() -> tuple[dict, dict]:
    return load_files()


def test_compose_file_is_consistent(files):
    assert all_errors(*files) == []


def test_every_kvtier_service_is_checked(files):
    c = read_compose(*files)
    commands = {s.name: s.command for s in c.of("kvtier")}
    assert sorted(commands.values()) == sorted(
        ["analytics", "processor", "processor", "router", "router", "sim-worker", "bridge", "bridge", "bridge"]
    ), commands
    assert not [s.name for s in c.services.values() if s.kind == "other"]


def test_gpu_bridge_discovers_its_worker(files):
    """The GPU-profile bridge takes endpoints, page size and DP size from SGLang (--sglang-url)."""
    bridge = read_compose(*files).services["bridge-sglang"]
    assert bridge.args.sglang_url == "http://sglang:30000"
    assert bridge.args.endpoint is None and bridge.args.page_size is None and bridge.args.dp_size is None


def test_dockerfile_builds_from_the_package(files):
    assert check_dockerfile(DOCKERFILE.read_text(), DOCKERIGNORE.read_text()) == []


def test_regular_install_has_every_subpackage():
    """The image installs kvtier with a regular `pip install .`, which packages only what
    pyproject's `packages` lists (an editable install finds every folder, so other tests pass)."""
    assert check_packaging(_pyproject()) == []


def test_packaging_check_catches_a_missing_subpackage():
    project = _pyproject()
    project["tool"]["setuptools"]["packages"].remove("kvtier.router")
    assert any("kvtier.router (router)" in e for e in check_packaging(project))


def _set(path: str, value: Any) -> Callable[[dict, dict], None]:
    """A mutation: 'c.services.router-1.environment.KVTIER_X' = value (None deletes); 'p.' for prometheus."""
    def apply(compose: dict, prometheus: dict) -> None:
        where, *keys = path.split("|")
        node = compose if where == "c" else prometheus
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key = int(keys[-1]) if isinstance(node, list) else keys[-1]
        if value is None:
            del node[key]
        else:
            node[key] = value
    return apply


def _both(*mutations):
    def apply(compose, prometheus):
        for m in mutations:
            m(compose, prometheus)
    return apply


ENV = "c|services|{}|environment|{}"

BROKEN = {
    # commands through kvtier's parser
    "unknown subcommand": (_set("c|services|router-1|command", ["routr"]), "invalid choice"),
    "bad choice in env": (_set(ENV.format("router-1", "KVTIER_ROUTER_MODE"), "fast"), "invalid choice"),
    "env value its type refuses": (_set(ENV.format("bridge-sim-0", "KVTIER_HEARTBEAT"), "soon"), "refused"),
    "misspelt env var": (_set(ENV.format("processor-1", "KVTIER_PARTITONS"), "auto"), "KVTIER_PARTITONS sets no flag"),
    "required flag missing": (_set(ENV.format("processor-2", "KVTIER_REDIS"), None), "--redis"),
    "unknown flag on the command line": (_set("c|services|processor-1|command", ["processor", "--shards", "2"]),
                                         "unrecognized arguments"),
    # addresses
    "no such service": (_set(ENV.format("bridge-sim-0", "KVTIER_NATS"), "nats://nats-server:4222"),
                        "no service of the compose file"),
    "wrong port": (_set(ENV.format("processor-1", "KVTIER_REDIS"), "redis://redis:6380/0"), "redis:6380, but redis"),
    "wrong scheme": (_set(ENV.format("router-2", "KVTIER_REDIS"), "http://redis:6379"), "not a redis URL"),
    "master's metadata port for its admin port": (
        _set(ENV.format("router-1", "KVTIER_MOONCAKE_MASTER"), "http://mooncake-master:8080"),
        "mooncake-master's metadata port, not its admin port"),
    "NATS monitor port for its client port": (_set(ENV.format("processor-2", "KVTIER_NATS"), "nats://nats:8222"),
                                              "nats's monitor port, not its client port"),
    "master port nobody opens": (_set(ENV.format("router-1", "KVTIER_MOONCAKE_MASTER"), "http://mooncake-master:9004"),
                                 "mooncake-master:9004, but"),
    "worker bound to loopback": (_set(ENV.format("sim-worker", "KVTIER_HOST"), "127.0.0.1"),
                                 "unreachable from other containers"),
    "DP rank beyond the worker": (_set(ENV.format("bridge-sim-1", "KVTIER_DP_SIZE"), "2"), "(rank 1)"),
    "nats listens elsewhere": (_set("c|services|nats|command", ["-js", "-sd", "/data", "-p", "4223", "-m", "8222"]),
                               "nats:4222, but nats listens on"),
    "sglang master env": (_set("c|services|sglang|environment|MOONCAKE_MASTER", "mooncake-master:5005"),
                          "MOONCAKE_MASTER"),
    "sglang segment name": (_set("c|services|sglang|environment|MOONCAKE_LOCAL_HOSTNAME", "localhost"),
                            "MOONCAKE_LOCAL_HOSTNAME"),
    "healthcheck on another port": (_set("c|services|router-1|healthcheck|test",
                                         ["CMD", "curl", "-f", "http://127.0.0.1:8001/healthz"]), "healthcheck probes"),
    "published port nobody listens on": (_set("c|services|router-1|ports", ["8001:8080"]), "publishes container port"),
    "grafana moved off its probed port": (_set(ENV.format("grafana", "GF_SERVER_HTTP_PORT"), "3001"),
                                          "grafana: its healthcheck probes port 3000, but it listens on [3001]"),
    "host port published twice": (_set("c|services|router-2|ports", ["8001:8000"]), "published twice"),
    # prometheus
    "processor metrics port not scraped": (_both(_set(ENV.format("processor-2", "KVTIER_METRICS_PORT"), "9200"),
                                                 _set("c|services|processor-2|healthcheck", {"disable": True})),
                                           "processor processor-2 is not scraped at processor-2:9200"),
    "processor without metrics": (_set(ENV.format("processor-1", "KVTIER_METRICS_PORT"), "0"),
                                  "without --metrics-port"),
    "router target missing": (_set("p|scrape_configs|0|static_configs|0|targets", ["router-1:8000"]),
                              "router router-2 is not scraped"),
    "analytics not scraped": (_set("p|scrape_configs|3|static_configs|0|targets", []),
                              "analytics analytics is not scraped at analytics:9464/metrics"),
    "stale target": (_set("p|scrape_configs|1|static_configs|0|targets",
                          ["processor-1:9100", "processor-2:9100", "processor-3:9100"]), "processor-3"),
    "config not mounted": (_set("c|services|prometheus|volumes", ["prometheus-data:/prometheus"]), "not mounted"),
    # volumes
    "undeclared volume": (_set("c|volumes|redis-data", None), "volume redis-data is not declared"),
    "declared volume unused": (_set("c|volumes|spare", {}), "volume spare is declared"),
    "JetStream store off the volume": (_set("c|services|nats|volumes", ["nats-data:/srv"]), "store directory"),
    "JetStream off": (_set("c|services|nats|command", ["-sd", "/data", "-p", "4222", "-m", "8222"]),
                      "JetStream is off"),
    "Redis without AOF": (_set("c|services|redis|command", ["redis-server", "--port", "6379"]), "appendonly"),
    # profiles
    "GPU service in the default profile": (_set("c|services|sglang|profiles", None), "not [gpu]"),
    "default service reserving a GPU": (_set("c|services|sim-worker|deploy", {"resources": {"reservations": {
        "devices": [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]}}}), "needs a GPU"),
    "default bridge of a GPU worker": (_set("c|services|bridge-sglang|profiles", None), "only runs under profile"),
    "waiting on a service without probe": (_set("c|services|sim-worker|healthcheck", {"disable": True}),
                                           "sim-worker has no healthcheck"),
    "depends on nothing": (_set("c|services|router-1|depends_on|natz", {"condition": "service_started"}),
                           "depends_on natz"),
    # workers and their bridges
    "rank without bridge": (_set("c|services|bridge-sim-1", None), "rank 1"),
    "replay socket of another rank": (_set(ENV.format("bridge-sim-1", "KVTIER_REPLAY_ENDPOINT"),
                                           "tcp://sim-worker:5600"), "replay endpoint"),
    "page size differs": (_set(ENV.format("bridge-sim-0", "KVTIER_PAGE_SIZE"), "32"), "page size 32"),
    "duplicate worker id": (_set(ENV.format("bridge-sim-1", "KVTIER_WORKER_ID"), "sim-0"), "worker id sim-0"),
    "SGLang without replay socket": (_set("c|services|sglang|command|-1", '{"publisher":"zmq","endpoint":"tcp://*:5557"}'),
                                     "replay_endpoint"),
    "bridge announces another model": (_set(ENV.format("bridge-sglang", "KVTIER_MODEL"), "Qwen/Qwen3-8B"),
                                       "announces model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_catches_its_breakage(files, case):
    mutate, expected = BROKEN[case]
    compose, prometheus = json.loads(json.dumps(files[0])), json.loads(json.dumps(files[1]))
    mutate(compose, prometheus)
    errors = all_errors(compose, prometheus)
    assert any(expected in e for e in errors), f"{case}: no error mentions {expected!r}; got {errors}"


@pytest.mark.parametrize("edit, expected", [
    (lambda d, i: (d.replace("COPY router/ router/\n", ""), i), "router is not copied"),
    (lambda d, i: (d, i + "schemas\n"), "excludes schemas"),
    (lambda d, i: (d.replace("USER kvtier", "USER root"), i), "runs as root"),
    (lambda d, i: (d.replace('ENTRYPOINT ["kvtier"]', 'ENTRYPOINT ["python"]'), i), "entrypoint"),
])
def test_dockerfile_check_catches_its_breakage(edit, expected):
    dockerfile, ignore = edit(DOCKERFILE.read_text(), DOCKERIGNORE.read_text())
    errors = check_dockerfile(dockerfile, ignore)
    assert any(expected in e for e in errors), errors


def check_flag_tables(doc: str) -> list[str]:
    """docs/DEPLOY.md's flag tables are what kvtier's parser says today."""
    import runpy

    tables = runpy.run_path(str(ROOT / "deploy" / "flag_table.py"))  # (writes no __pycache__ into deploy/)
    try:
        written = tables["section"](doc)
    except ValueError:
        return ["docs/DEPLOY.md: the flag-table markers are missing"]
    wanted = tables["render"]()
    if written == wanted:
        return []
    stale = sorted(set(written.splitlines()) ^ set(wanted.splitlines())) or ["the same lines in another order"]
    message = (f"docs/DEPLOY.md: the flag tables differ from kvtier's parser ({len(stale)} lines, "
               f"e.g. {stale[0][:120]!r}); run `python deploy/flag_table.py --write`")
    return [message]


def test_deploy_doc_flag_tables_match_the_parser():
    assert check_flag_tables((ROOT / "docs" / "DEPLOY.md").read_text()) == []


@pytest.mark.parametrize("edit", [
    lambda doc: "\n".join(line for line in doc.splitlines() if not line.startswith("| `--gap-timeout`")),
    lambda doc: doc.replace("| `--stream-replicas` | `KVTIER_STREAM_REPLICAS` | `1` |",
                            "| `--stream-replicas` | `KVTIER_STREAM_REPLICAS` | `3` |"),
    lambda doc: doc.replace("<!-- END flag tables -->", ""),
])
def test_flag_table_check_catches_drift(edit):
    doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    assert edit(doc) != doc
    assert check_flag_tables(edit(doc))
