"""One Redis connection shared by every coroutine of a process, for the router's two commands
per decision (book_checked.lua and release.lua).

redis-py's asyncio client takes a connection from its pool for each command and gives it back
after the reply: ~55-120 µs of Python per command on this project's machines, more than
the decision's own hashing. Redis answers the commands of one connection in the order they
were sent, so any number of coroutines can share one: each writes its command and waits for
the reply at its place in a queue: no pool to take a connection from or wait on. ~16 µs of
client CPU per command with 16 in flight on this project's machine, against redis-py's ~55.

Failures read as redis-py's, so callers handle them as they did: an error reply raises
redis.exceptions.ResponseError, a lost or refused connection ConnectionError, a reply later than
the timeout TimeoutError. After a timeout or a loss the connection is dropped and every command
waiting on it fails (nothing waits on a connection that may never answer); the next command
opens a new one. Only plain TCP and Unix sockets: for TLS and Redis Cluster `for_client`
answers None and the caller keeps redis-py.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import hiredis
import redis.exceptions


class MultiplexedRedis:
    def __init__(self, *, host: str = "", port: int = 6379, path: str = "", db: int = 0,
                 username: str | None = None, password: str | None = None, timeout_s: float | None = None):
        self._address = (host, port, path)
        self._hello: list[tuple[Any, ...]] = []
        if password:
            self._hello.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            self._hello.append(("SELECT", db))
        self.timeout_s = timeout_s
        self._connection: _Connection | None = None
        self._opening: asyncio.Lock | None = None

    @classmethod
    def for_client(cls, client) -> MultiplexedRedis | None:
        """The same server as a redis.asyncio.Redis `client`, with its socket timeout; None
        where this class does not speak the client's transport (TLS, a cluster, anything else)."""
        pool = getattr(client, "connection_pool", None)
        if pool is None:
            return None
        import redis.asyncio.connection as connection

        kind = pool.connection_class
        options = pool.connection_kwargs
        common = dict(db=int(options.get("db") or 0), username=options.get("username"),
                      password=options.get("password"), timeout_s=options.get("socket_timeout"))
        if issubclass(kind, connection.SSLConnection):
            return None
        if issubclass(kind, connection.UnixDomainSocketConnection):
            return cls(path=options["path"], **common)
        if issubclass(kind, connection.Connection):
            return cls(host=options.get("host", "localhost"), port=int(options.get("port", 6379)), **common)
        return None

    async def execute(self, *args: Any) -> Any:
        """Send one command; its reply (bytes, int, list, ...) or the error it raises."""
        connection = self._connection
        if connection is None or not connection.open:
            connection = await self._connected()
        reply = connection.send(args)
        # A timer rather than wait_for: no task per command. A caller that stops waiting
        # cancels its reply, which keeps its place in the queue (its answer is skipped).
        timer = None
        if self.timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, connection, reply)
        try:
            result = await reply
        finally:
            if timer is not None:
                timer.cancel()
        if isinstance(result, redis.exceptions.ResponseError):
            raise result
        return result

    def _expire(self, connection: _Connection, reply: asyncio.Future) -> None:
        if not reply.done():
            self._drop(connection, redis.exceptions.TimeoutError(f"no reply from Redis in {self.timeout_s} s"))

    async def run_script(self, sha: str, script: str | bytes, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA, or EVAL with the script's text when this server has not seen it yet."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.execute("EVAL", script, len(keys), *keys, *args)

    async def close(self) -> None:
        if self._connection is not None:
            self._drop(self._connection, redis.exceptions.ConnectionError("the connection was closed"))

    async def _connected(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.open:
            return connection
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:  # one connection opened however many commands wait for it
            if self._connection is not None and self._connection.open:
                return self._connection
            self._connection = await self._open()
            return self._connection

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, path = self._address
        try:
            if path:
                opening = loop.create_unix_connection(_Connection, path)
            else:
                opening = loop.create_connection(_Connection, host, port)
            _, connection = await asyncio.wait_for(opening, self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            where = path or f"{host}:{port}"
            raise redis.exceptions.ConnectionError(f"cannot reach Redis at {where}: {exc or type(exc).__name__}") \
                from None
        for command in self._hello:
            try:
                reply = await asyncio.wait_for(connection.send(command), self.timeout_s)
            except asyncio.TimeoutError:
                self._drop(connection, redis.exceptions.TimeoutError("Redis did not answer the connection's set-up"))
                raise redis.exceptions.TimeoutError("Redis did not answer the connection's set-up") from None
            if isinstance(reply, redis.exceptions.ResponseError):
                self._drop(connection, reply)
                raise redis.exceptions.AuthenticationError(str(reply)) if command[0] == "AUTH" else reply
        return connection

    def _drop(self, connection: _Connection, error: Exception) -> None:
        connection.fail(error)
        if self._connection is connection:
            self._connection = None


class _Connection(asyncio.Protocol):
    """Commands out in order, replies matched to them in the same order."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=redis.exceptions.ResponseError)
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self._transport: asyncio.Transport | None = None
        self.open = False

    def connection_made(self, transport) -> None:
        self._transport = transport
        self.open = True

    def send(self, args: tuple[Any, ...]) -> asyncio.Future:
        reply = asyncio.get_running_loop().create_future()
        reply.add_done_callback(_retrieved)
        if not self.open or self._transport is None:
            reply.set_exception(redis.exceptions.ConnectionError("the connection to Redis was lost"))
            return reply
        self._waiting.append(reply)
        self._transport.write(hiredis.pack_command(args))
        return reply

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while self._waiting:
            reply = self._reader.gets()
            if reply is False:
                return
            waiter = self._waiting.popleft()
            if not waiter.done():  # its caller may have stopped waiting (cancelled)
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(redis.exceptions.ConnectionError(f"the connection to Redis was lost: {exc or 'closed'}"))

    def fail(self, error: Exception) -> None:
        self.open = False
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if self._transport is not None:
            self._transport.close()


def _retrieved(reply: asyncio.Future) -> None:
    """Mark a failed reply's error as seen: a caller that stopped waiting (timed out,
    cancelled) never reads it, and asyncio would log each as never retrieved."""
    if not reply.cancelled():
        reply.exception()
