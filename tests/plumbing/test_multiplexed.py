"""The router's shared Redis connection (kvtier/plumbing/multiplexed.py) against a real server:
many coroutines' commands on one connection each get their own reply, an error reply or a
caller that stops waiting does not shift the others, a script the server lost is sent again
whole, a stopped server gives a TimeoutError and a dead one a ConnectionError (then a fresh
connection serves again), a password and a database in the URL are used, and transports it does
not speak stay with redis-py."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis
import redis.exceptions

from kvtier.harness.embedded import RedisServer
from kvtier.plumbing.connections import redis_async_client
from kvtier.plumbing.multiplexed import MultiplexedRedis


@pytest.fixture()
def server():
    with RedisServer() as s:
        yield s


def _shared(url: str, timeout_s: float = 2.0) -> MultiplexedRedis:
    shared = MultiplexedRedis.for_client(redis_async_client(url, socket_timeout=timeout_s))
    assert shared is not None
    return shared


def test_concurrent_commands_each_get_their_own_reply_and_errors_stay_in_place(server):
    async def go():
        shared = _shared(server.url)
        await asyncio.gather(*(shared.execute("SET", f"k{i}", f"v{i}") for i in range(300)))
        await shared.execute("SET", "text", "x")

        async def read(i: int):
            if i % 7 == 0:  # a wrong-type error between the others' replies
                with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                    await shared.execute("HGET", "text", "field")
                return None
            return await shared.execute("GET", f"k{i}")

        replies = await asyncio.gather(*(read(i) for i in range(300)))
        assert replies == [None if i % 7 == 0 else f"v{i}".encode() for i in range(300)]
        await shared.close()

    asyncio.run(go())


def test_a_caller_that_stops_waiting_shifts_no_reply(server):
    async def go():
        shared = _shared(server.url)
        await asyncio.gather(*(shared.execute("SET", f"c{i}", f"v{i}") for i in range(40)))
        tasks = [asyncio.ensure_future(shared.execute("GET", f"c{i}")) for i in range(40)]
        await asyncio.sleep(0)  # every command is sent; no reply read yet
        for task in tasks[::3]:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert [d for i, d in enumerate(done) if i % 3] == [f"v{i}".encode() for i in range(40) if i % 3]
        assert await shared.execute("GET", "c7") == b"v7"
        await shared.close()

    asyncio.run(go())


def test_a_script_the_server_does_not_have_is_sent_whole(server):
    async def go():
        shared = _shared(server.url)
        script = redis.Redis.from_url(server.url).register_script("return {KEYS[1], tonumber(ARGV[1]) + 1}")
        redis.Redis.from_url(server.url).script_flush()
        assert await shared.run_script(script.sha, script.script, ["a"], [41]) == [b"a", 42]
        # now the server has it: EVALSHA alone
        assert redis.Redis.from_url(server.url).script_exists(script.sha) == [True]
        assert await shared.run_script(script.sha, script.script, ["b"], [1]) == [b"b", 2]
        with pytest.raises(redis.exceptions.ResponseError):
            await shared.run_script("0" * 40, "return redis.call('NOSUCHCOMMAND')", [], [])
        await shared.close()

    asyncio.run(go())


def test_a_stopped_server_times_out_and_a_fresh_connection_serves_after(server):
    async def go():
        shared = _shared(server.url, timeout_s=0.3)
        assert await shared.execute("PING") == b"PONG"
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(shared.execute("INCR", "n") for _ in range(5)), return_exceptions=True)
            assert all(isinstance(r, redis.exceptions.TimeoutError) for r in results), results
            assert time.monotonic() - started < 3
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        # the next command gets its own reply, never one the stopped server owed an earlier one
        assert await shared.execute("SET", "after", "1") == b"OK"
        assert await shared.execute("GET", "after") == b"1"
        await shared.close()

    asyncio.run(go())


def test_a_dead_server_is_a_connection_error(server):
    async def go():
        shared = _shared(server.url)
        assert await shared.execute("PING") == b"PONG"
        server.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            await shared.execute("PING")
        with pytest.raises(redis.exceptions.ConnectionError, match="cannot reach Redis"):
            await shared.execute("PING")  # refused: nothing listens there now
        await shared.close()

    asyncio.run(go())


def test_the_urls_password_and_database_are_used(tmp_path):
    config = tmp_path / "redis.conf"
    config.write_text("requirepass s3cret\n")
    with RedisServer(config_file=str(config)) as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"

        async def go():
            shared = _shared(url)
            await shared.execute("SET", "where", "db3")
            await shared.close()
            wrong = _shared(f"redis://:wrong@127.0.0.1:{server.port}/0")
            with pytest.raises(redis.exceptions.AuthenticationError):
                await wrong.execute("PING")

        asyncio.run(go())
        assert redis.Redis.from_url(url).get("where") == b"db3"
        assert redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0").get("where") is None


def test_transports_it_does_not_speak_stay_with_redis_py():
    assert MultiplexedRedis.for_client(redis_async_client("rediss://127.0.0.1:1/0")) is None
    assert MultiplexedRedis.for_client(redis_async_client("redis+cluster://127.0.0.1:1")) is None
    unix = MultiplexedRedis.for_client(redis_async_client("unix:///tmp/kvtier-no-such.sock"))
    assert unix is not None and unix._address[2] == "/tmp/kvtier-no-such.sock"
