"""Clients for the state store, built from one URL everywhere (processor, router, replay, tools).

  redis://[user:password@]host:port/db     one server
  rediss://...?ssl_ca_certs=/path/ca.pem   the same over TLS (redis-py's URL options apply)
  redis+cluster://host:port                a Redis Cluster, discovered from any node
  rediss+cluster://...                     a Redis Cluster over TLS

All of a model's keys carry the hash tag `{model}`, so every script touches one slot and a
cluster runs them on the node that owns it; models spread across the shards.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def _plain_url(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES[parts.scheme])) if parts.scheme in _CLUSTER_SCHEMES else url


def redis_client(url: str, **options):
    """A synchronous client (redis.Redis, or redis.cluster.RedisCluster for a cluster URL)."""
    if is_cluster_url(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(_plain_url(url), **_cluster_options(options))
    import redis

    return redis.Redis.from_url(url, **options)


def redis_async_client(url: str, **options):
    """An asyncio client (redis.asyncio.Redis, or its RedisCluster for a cluster URL)."""
    if is_cluster_url(url):
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(_plain_url(url), **_cluster_options(options))
    import redis.asyncio

    return redis.asyncio.Redis.from_url(url, **options)


def _cluster_options(options: dict) -> dict:
    # A cluster client manages its own per-node connections and health.
    return {k: v for k, v in options.items() if k != "health_check_interval"}


def redact(url: str) -> str:
    """A URL without its password, for logs and error messages."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)
