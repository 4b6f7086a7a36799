"""Errors a user can act on, turned into one clear line instead of a traceback."""

from __future__ import annotations

import errno


def user_facing(exc: BaseException) -> str | None:
    from kvtier.bench.dynamo_side import DynamoMissing
    from kvtier.consumers.pull import StreamReadError
    from kvtier.harness.embedded import MissingServerBinary, ServerStartError
    from kvtier.harness.mooncake import MooncakeError
    from kvtier.plumbing.streams import StreamMismatch
    from kvtier.plumbing.tokenizer import TokenizerError

    if isinstance(exc, (MissingServerBinary, ServerStartError, StreamMismatch, StreamReadError, DynamoMissing,
                        MooncakeError, TokenizerError, ValueError)):
        return str(exc)
    try:
        import redis

        if isinstance(exc, redis.ConnectionError):
            return f"cannot reach Redis: {exc}"
    except ImportError:
        pass
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EADDRINUSE):
        return str(exc)
    name = type(exc).__name__
    if name in ("NoServersError",):
        return "cannot reach NATS (no servers available); check --nats"
    return None
