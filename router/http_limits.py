"""How long each phase of a client connection may take, and how many connections a server may
hold: the settings router/http_guard.py enforces (plain data, no aiohttp)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpLimits:
    """How long each phase of an HTTP connection may take, and how many connections there may be.

    All times are in seconds and must be positive."""

    #: A complete request head (request line and headers) must arrive within this long of the
    #: accept (first request) or of its first byte (later requests on a keep-alive connection).
    #: 10 s: a head is a few hundred bytes that any live client sends in one packet; a client
    #: that needs longer is stalled or hostile (slowloris), and each one holds a descriptor.
    header_timeout_s: float = 10.0
    #: A request body must be complete within this long of its head. 30 s: the router's bodies are
    #: token-id lists and prompts, kilobytes to a few megabytes; even its largest allowed body
    #: (``--max-body-bytes``, 32 MiB) needs only ~1.1 MB/s. A body shorter than its Content-Length
    #: or a chunked body that never ends would otherwise hold the connection forever.
    body_timeout_s: float = 30.0
    #: An idle keep-alive connection (between requests) is closed after this long. 20 s: long
    #: enough to reuse a connection across bursts, and longer than the idle timeouts of the common
    #: client pools (aiohttp's client 15 s, httpx 5 s), so that those clients close first and never
    #: send a request on a connection the server is just closing. A reverse proxy or load balancer
    #: in front that pools connections must use a shorter idle timeout than this.
    keepalive_timeout_s: float = 20.0
    #: Open client connections allowed at once (0: no cap). Past it, a new connection closes the
    #: least recently active idle one, or is itself closed if all are busy. 1024: far more than
    #: the router's clients need, and few enough that a flood of idle sockets cannot use up the
    #: process's descriptors; lowered further to fit ``RLIMIT_NOFILE`` minus ``reserved_fds``.
    max_connections: int = 1024
    #: Descriptors kept out of the cap for everything else the process opens: Redis, NATS and
    #: Mooncake connections, upstream connections in proxy mode, log and model files.
    reserved_fds: int = 128

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"HttpLimits.{name} must be positive, got {value!r}")
        if self.max_connections < 0:
            raise ValueError(f"HttpLimits.max_connections must be >= 0 (0: no cap), got {self.max_connections}")
        if self.reserved_fds < 0:
            raise ValueError(f"HttpLimits.reserved_fds must be >= 0, got {self.reserved_fds}")

    def effective_max_connections(self) -> int:
        """The cap actually enforced (0: none): ``max_connections``, lowered to the process's soft
        ``RLIMIT_NOFILE`` minus ``reserved_fds`` (at least half the limit), so that idle client
        sockets can never take the descriptors the rest of the process needs. With no cap
        (``max_connections=0``) the descriptor limit is not applied either."""
        if self.max_connections == 0:
            return 0
        soft = _soft_nofile()
        if soft is None:
            return self.max_connections
        return max(1, min(self.max_connections, max(soft - self.reserved_fds, soft // 2)))


def _soft_nofile() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)
