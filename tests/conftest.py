import pytest
import redis

from kvtier.embedded import NatsServer, RedisServer


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
