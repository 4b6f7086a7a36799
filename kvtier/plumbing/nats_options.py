"""How kvtier authenticates to NATS and secures its connections.

One `NatsOptions`, built from the command line and the environment in one place
(`kvtier/commands/flags.py`, `--nats-*` flags, each also `KVTIER_NATS_*`), is used by every NATS
connection a command opens: the services through `kvtier.plumbing.streams.connect_nats` (which keeps
retrying), the one-shot tools through `connect_once` (which fails with one clear line).

  credentials  user/password (`nats://user:pass@host` or --nats-user/--nats-password),
               a token (`nats://TOKEN@host` or --nats-token), an NKey seed file
               (--nats-nkey-seed), or a JWT credentials file (--nats-creds)
  TLS          a `tls://` URL or --nats-tls-ca (the CA that signed the server's certificate),
               optionally a client certificate (--nats-tls-cert, --nats-tls-key)

Credentials in a URL are taken out of it before nats-py sees it, so no URL that reaches a log
line or an error message carries them (`redact_nats` for the ones that come from elsewhere).
When TLS was asked for, a password or token is only sent once the connection is encrypted: a
server (or anything in between) that answers without TLS gets nothing.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit


class NatsOptionsError(ValueError):
    """A --nats-* setting that cannot work (a missing file, two credentials at once)."""


class NatsConnectError(RuntimeError):
    """A one-shot connection that failed; the message is safe to print (no secret in it)."""


@dataclass(frozen=True)
class NatsOptions:
    user: str = ""
    password: str = ""
    token: str = ""
    nkey_seed: str = ""  # path of a file holding an NKey seed ("SU...")
    creds: str = ""  # path of a NATS credentials file (user JWT + NKey seed)
    tls_ca: str = ""  # CA bundle (PEM) to verify the server's certificate with
    tls_cert: str = ""  # client certificate (PEM), for servers that verify clients
    tls_key: str = ""  # its private key (PEM)

    def __repr__(self) -> str:  # never print a secret, even in a traceback or a debug dump
        shown = {f.name: ("***" if f.name in ("password", "token") and getattr(self, f.name) else getattr(self, f.name))
                 for f in dataclasses.fields(self)}
        return "NatsOptions(" + ", ".join(f"{k}={v!r}" for k, v in shown.items() if v) + ")"

    __str__ = __repr__

    # --- built from the command line ----------------------------------------------------
    @classmethod
    def from_args(cls, args) -> NatsOptions:
        """The options of a parsed command line (flags that a command lacks count as unset)."""
        def get(name: str) -> str:
            return (getattr(args, name, None) or "").strip()

        options = cls(user=get("nats_user"), password=getattr(args, "nats_password", None) or "",
                      token=get("nats_token"), nkey_seed=get("nats_nkey_seed"), creds=get("nats_creds"),
                      tls_ca=get("nats_tls_ca"), tls_cert=get("nats_tls_cert"), tls_key=get("nats_tls_key"))
        options.validate()
        return options

    def validate(self) -> None:
        chosen = [name for name, value in (("--nats-user/--nats-password", self.user or self.password),
                                           ("--nats-token", self.token), ("--nats-nkey-seed", self.nkey_seed),
                                           ("--nats-creds", self.creds)) if value]
        if len(chosen) > 1:
            raise NatsOptionsError(f"give one kind of NATS credentials, not {' and '.join(chosen)}")
        if bool(self.user) != bool(self.password):
            raise NatsOptionsError("--nats-user and --nats-password go together (or put both in the URL: "
                                   "nats://USER:PASSWORD@host:4222)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsOptionsError("--nats-tls-cert and --nats-tls-key go together (a client certificate and its key)")
        for flag, path in (("--nats-nkey-seed", self.nkey_seed), ("--nats-creds", self.creds),
                           ("--nats-tls-ca", self.tls_ca), ("--nats-tls-cert", self.tls_cert),
                           ("--nats-tls-key", self.tls_key)):
            if path and not os.access(path, os.R_OK):
                raise NatsOptionsError(f"{flag}: cannot read {path!r} (no such file, or not readable)")
        if self.nkey_seed or self.creds:
            try:
                import nkeys  # noqa: F401 - nats-py signs the server's nonce with it
            except ImportError:
                raise NatsOptionsError("--nats-nkey-seed / --nats-creds need the 'nkeys' package: "
                                       "pip install nkeys") from None

    # --- what nats-py is given ------------------------------------------------------------
    def wants_tls(self, servers: list[str]) -> bool:
        return bool(self.tls_ca or self.tls_cert) or any(urlsplit(s).scheme in ("tls", "wss") for s in servers)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert):
            return None  # nats-py uses the system's CAs when the server requires TLS
        try:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise NatsOptionsError(f"NATS TLS files: {exc}") from None
        return context

    def connect_kwargs(self, url, client) -> dict:
        """Keyword arguments for nats-py's `Client.connect` of `client`: the servers without
        credentials in them, the credentials, the TLS context."""
        servers, user, password, token = split_credentials(url)
        if self.user or self.token or self.nkey_seed or self.creds:
            # credentials from flags win over ones in the URL (which are dropped from it all the same)
            user, password, token = self.user, self.password, self.token
        kwargs: dict = {"servers": servers}
        tls = self.wants_tls(servers)
        context = self.ssl_context()
        if context is not None:
            kwargs["tls"] = context
        guard = _TlsGuard(client) if tls else None
        if user:
            kwargs["user"] = user
            kwargs["password"] = guard.wrap(password) if guard else password
        elif token:
            kwargs["token"] = guard.wrap(token) if guard else token
        if self.nkey_seed:
            kwargs["nkeys_seed"] = self.nkey_seed
        if self.creds:
            kwargs["user_credentials"] = self.creds
        return kwargs

    async def connect(self, url, **options):
        """A nats-py client connected to `url` with these options (nats-py's own semantics for
        `options`: retries, callbacks, timeouts)."""
        import asyncio

        from nats.aio.client import Client

        client = Client()
        if self.wants_tls(nats_servers(url)):
            _quiet_asyncio_tls_eof()
        caller_error_cb = options.pop("error_cb", None)
        tls_failed = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            if caller_error_cb is not None:
                await caller_error_cb(exc)
            if isinstance(exc, ssl.SSLError) and not tls_failed.done():
                tls_failed.set_result(exc)

        attempt = asyncio.ensure_future(client.connect(**self.connect_kwargs(url, client), error_cb=on_error,
                                                       **options))
        try:
            await asyncio.wait({attempt, tls_failed}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            attempt.cancel()
            raise
        if attempt.done():
            tls_failed.cancel()
            attempt.result()  # raises nats-py's error, if any
            return client
        # nats-py 2.x never returns from connect() after a failed TLS handshake (it waits for the
        # plain connection that the handshake replaced, whose socket asyncio already closed):
        # stop waiting and report the handshake's error.
        attempt.cancel()
        try:
            await attempt
        except BaseException:  # noqa: BLE001 - the cancellation we asked for
            pass
        raise tls_failed.result()


def _quiet_asyncio_tls_eof() -> None:
    """asyncio warns 'returning true from eof_received() has no effect when using ssl' each
    time a TLS server closes a stream connection: noise, not a problem. Filtered once."""
    import logging

    logger = logging.getLogger("asyncio")
    if not any(getattr(f, "kvtier_tls_eof", False) for f in logger.filters):
        def drop(record: logging.LogRecord) -> bool:
            return "eof_received() has no effect when using ssl" not in record.getMessage()

        drop.kvtier_tls_eof = True  # type: ignore[attr-defined]
        logger.addFilter(drop)


class _TlsGuard:
    """Hands nats-py a secret only once the connection is encrypted (TLS was asked for)."""

    def __init__(self, client):
        self.client = client

    def wrap(self, secret: str):
        def reveal() -> str:
            if not _is_encrypted(self.client):
                from nats.errors import Error

                raise Error("nats: TLS was required (tls:// or --nats-tls-ca) but the server did not "
                            "offer it; credentials not sent")
            return secret

        return reveal


def _is_encrypted(client) -> bool:
    server = getattr(client, "_current_server", None)
    if getattr(getattr(server, "uri", None), "scheme", "") == "wss":
        return True  # TLS under the WebSocket
    transport = getattr(client, "_transport", None)
    writer = getattr(transport, "_io_writer", None)
    if writer is not None and hasattr(writer, "get_extra_info"):
        return writer.get_extra_info("ssl_object") is not None
    info = getattr(client, "_server_info", None) or {}
    return bool(info.get("tls_required"))


# --- URLs ---------------------------------------------------------------------------------
def nats_servers(url) -> list[str]:
    """One URL, several comma-separated, or a list of them."""
    parts = url if isinstance(url, (list, tuple)) else str(url).split(",")
    servers = [part.strip() for part in parts if part and part.strip()]
    if not servers:
        raise NatsOptionsError(f"no NATS server in {redact_nats(str(url))!r}")
    return servers


def split_credentials(url) -> tuple[list[str], str, str, str]:
    """(servers without userinfo, user, password, token) of a --nats URL. `user:pass@` is a
    user and password, a lone `name@` a token (as nats-py and the Go client read them)."""
    user = password = token = ""
    clean = []
    for server in nats_servers(url):
        parts = urlsplit(server if "://" in server else "nats://" + server)
        if "@" in parts.netloc:
            userinfo, host = parts.netloc.rsplit("@", 1)
            name, sep, secret = userinfo.partition(":")
            if not (user or token):
                if sep:
                    user, password = unquote(name), unquote(secret)
                else:
                    token = unquote(name)
            parts = parts._replace(netloc=host)
        clean.append(urlunsplit(parts))
    return clean, user, password, token


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/,\s]*)@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|pass|token|auth_token)=)[^&#\s]*")


def redact_nats(url: str) -> str:
    """A NATS URL (or several) fit for a log line: `user:***@`, a token as `***@`."""
    def hide(match: re.Match) -> str:
        name, sep, _ = match.group("userinfo").partition(":")
        return match.group("scheme") + (f"{name}:***@" if sep else "***@")

    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(hide, str(url)))


# --- failures, in words -------------------------------------------------------------------
def explain(exc: BaseException | None, causes=None) -> str:
    """One line saying why a connection failed, from nats-py's exception and the errors its
    error callback saw (`causes`: one or a list; nats-py reports 'no servers available', or a
    reset connection, after the real cause): the first that names a credential or TLS problem
    wins, else the last cause, else the exception itself."""
    if isinstance(causes, BaseException):
        causes = [causes]
    causes = [c for c in (causes or []) if c is not None]
    for candidate in [*causes, exc]:
        if candidate is None:
            continue
        text = str(candidate) or type(candidate).__name__
        lower = text.lower()
        if isinstance(candidate, ssl.SSLCertVerificationError) or "certificate verify failed" in lower:
            return (f"TLS: the server's certificate is not trusted ({text}); give the CA that signed it with "
                    "--nats-tls-ca")
        if "authorization violation" in lower or "authentication" in lower:
            return (f"the server refused the credentials ({text.strip()}); check --nats-user/--nats-password, "
                    "--nats-token, --nats-nkey-seed or --nats-creds (or the URL's user:password@)")
        if "tls was required" in lower:
            return text
        if "secure connection" in lower or "tls required" in lower:
            return f"the server requires TLS ({text}); use a tls:// URL or --nats-tls-ca"
        if "certificate required" in lower or "certificate_required" in lower:
            return (f"TLS: the server requires a client certificate ({text}); give it with --nats-tls-cert and "
                    "--nats-tls-key")
        if isinstance(candidate, ssl.SSLError):
            return f"TLS handshake failed ({text})"
    if causes:
        return str(causes[-1]) or type(causes[-1]).__name__
    return (str(exc) or type(exc).__name__) if exc is not None else "unknown error"


async def connect_once(url, name: str, options: NatsOptions | None = None, connect_timeout: float = 5,
                       **extra):
    """Connect for a one-shot command: a bounded attempt, and on failure a NatsConnectError
    whose message says why, with no secret in it."""
    options = options or configured()
    seen: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        seen.append(exc)
        del seen[:-8]  # the recent ones (the callback outlives the connect)

    extra.setdefault("max_reconnect_attempts", 1)
    extra.setdefault("reconnect_time_wait", 0.2)
    try:
        return await options.connect(url, name=name, connect_timeout=connect_timeout, error_cb=on_error, **extra)
    except NatsOptionsError:
        raise
    except Exception as exc:  # noqa: BLE001 - one clear line for any failure to connect
        raise NatsConnectError(f"cannot reach NATS at {redact_nats(url)}: "
                               f"{explain(exc, seen)}") from None


# --- the process's options (set once by the CLI) -------------------------------------------
_configured = NatsOptions()


def configure(options: NatsOptions) -> None:
    """Set the options every NATS connection of this process uses unless given others."""
    global _configured
    _configured = options


def configured() -> NatsOptions:
    return _configured
