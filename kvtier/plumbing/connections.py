"""Clients for the state store, built from one URL everywhere (processor, router, replay, tools).

  redis://[user:password@]host:port/db     one server
  rediss://...?ssl_ca_certs=/path/ca.pem   the same over TLS (redis-py's URL options apply)
  redis+cluster://host:port                a Redis Cluster, discovered from any node
  rediss+cluster://...                     a Redis Cluster over TLS

All of a model's keys carry the hash tag `{model}`, so every script touches one slot and a
cluster runs them on the node that owns it; models spread across the shards.

Security: an ACL user and password go in the URL (`redis://kvtier:PASSWORD@host:6379/0`, or
`redis://:PASSWORD@...` for `requirepass`); TLS is `rediss://`, verified against the system's
CAs, or against `?ssl_ca_certs=/path/ca.pem` in the URL or `--redis-tls-ca` (KVTIER_REDIS_TLS_CA),
which `configure` makes the process default (and which turns a `redis://` URL into TLS).
Log and error lines show URLs through `redact` only.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def _plain_url(url: str) -> str:
    parts = urlsplit(url)
    return (urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES[parts.scheme])) if parts.scheme in _CLUSTER_SCHEMES
            else url)


_tls_ca = ""


def configure(*, tls_ca: str = "") -> None:
    """Process-wide Redis settings from the command line (kvtier/commands/flags.py): the CA bundle that
    verifies the server's certificate; with it every Redis URL of the process is TLS."""
    global _tls_ca
    if tls_ca and not os.access(tls_ca, os.R_OK):
        raise ValueError(f"--redis-tls-ca: cannot read {tls_ca!r} (no such file, or not readable)")
    _tls_ca = tls_ca


def _secured(url: str, options: dict) -> tuple[str, dict]:
    if not _tls_ca or "ssl_ca_certs" in options or "ssl_ca_certs=" in urlsplit(url).query:
        return url, options
    parts = urlsplit(url)
    scheme = {"redis": "rediss", "redis+cluster": "rediss+cluster"}.get(parts.scheme, parts.scheme)
    return urlunsplit(parts._replace(scheme=scheme)), {**options, "ssl_ca_certs": _tls_ca}


def redis_client(url: str, **options):
    """A synchronous client (redis.Redis, or redis.cluster.RedisCluster for a cluster URL)."""
    url, options = _secured(url, options)
    if is_cluster_url(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(_plain_url(url), **_cluster_options(options))
    import redis

    return redis.Redis.from_url(url, **options)


def redis_async_client(url: str, *, max_connections: int = 0, pool_wait_s: float = 0.0, **options):
    """An asyncio client (redis.asyncio.Redis, or its RedisCluster for a cluster URL).

    `max_connections` > 0 bounds the pool, and a caller finding it full waits up to
    `pool_wait_s` for a connection to come back instead of failing at once: redis-py's default
    pool raises "Too many connections" the moment it is full, which a router under a burst took
    for Redis being down (routing hundreds of requests without tier state, and losing their
    releases)."""
    url, options = _secured(url, options)
    if is_cluster_url(url):
        from redis.asyncio.cluster import RedisCluster

        if max_connections:
            options = {**options, "max_connections": max_connections}
        return RedisCluster.from_url(_plain_url(url), **_cluster_options(options))
    import redis.asyncio

    pool: redis.asyncio.ConnectionPool
    if max_connections:
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                             timeout=pool_wait_s, **options)
    else:
        pool = redis.asyncio.ConnectionPool.from_url(url, **options)
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return redis.asyncio.Redis.from_pool(pool)


def _hiredis_packing(connection_class):
    """`connection_class` packing commands with hiredis's C packer, as redis-py's synchronous
    client does and its asyncio client does not: a router decision's booking carries two dozen
    arguments, which the Python packer takes ~24 us to write and hiredis ~2 (BENCHMARKS.md).
    Without hiredis, the class as it is."""
    try:
        import hiredis
    except ImportError:
        return connection_class
    import redis.exceptions

    class HiredisPacking(connection_class):
        def pack_command(self, *args):
            # The same splitting of a command name written with its subcommand ("CONFIG GET").
            if isinstance(args[0], str):
                args = (*args[0].encode().split(), *args[1:])
            elif b" " in args[0]:
                args = (*args[0].split(), *args[1:])
            if any(isinstance(a, bool) for a in args):
                raise redis.exceptions.DataError("Invalid input of type: 'bool'. Convert to a bytes, string, int "
                                                 "or float first.")
            try:
                return [hiredis.pack_command(tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a
                                                   for a in args))]
            except TypeError as exc:
                raise redis.exceptions.DataError(str(exc)) from None

    HiredisPacking.__name__ = HiredisPacking.__qualname__ = f"HiredisPacking{connection_class.__name__}"
    return HiredisPacking


def _cluster_options(options: dict) -> dict:
    # A cluster client manages its own per-node connections and health.
    return {k: v for k, v in options.items() if k != "health_check_interval"}


def redact(url: str) -> str:
    """A URL without its password, for logs and error messages (`user:***@`, and a
    `password=` in the query string)."""
    url = re.sub(r"(//[^:/@]*:)[^/]*@", r"\1***@", str(url))  # up to the last @ (an unquoted @ in it)
    return re.sub(r"(?i)([?&](?:password|pass|token)=)[^&#\s]*", r"\1***", url)
