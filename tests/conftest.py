import os

import pytest
import redis

from kvtier.harness.embedded import NatsServer, RedisServer

# tests/netns needs a private network namespace (the Mooncake master listens on 0.0.0.0);
# tests/test_mooncake_master.py runs it there through tests/netns_runner.py, which sets this.
if os.environ.get("KVTIER_IN_NETNS") != "1":
    collect_ignore = ["netns"]


@pytest.fixture
def nats_server():
    with NatsServer() as server:
        yield server


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()
