"""A pull nobody answers (nats-py's 503 "no responders": in a cluster, the consumer's leader
moving after a node was lost) is asked again for a grace period before the consumer counts as
gone. Against a real nats-server: pulls on a consumer that does not exist yet get 503s; once it
is created, they deliver. It once failed a `kvtier replay` through a 3-node cluster that had
just lost a node."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from kvtier.consumers import pull as pulling
from kvtier.consumers.pull import ConsumerGone, PullStream


async def _scenario(url: str, create_after_s: float | None) -> list[bytes]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="NR", subjects=["nr.>"])
    await js.publish("nr.x", b"hello")
    stream = await PullStream(nc, "NR", "late", max_batch=8).start()
    got: list[bytes] = []
    started = time.monotonic()
    try:
        while not got and time.monotonic() - started < 20:
            if create_after_s is not None and time.monotonic() - started >= create_after_s:
                from nats.js.api import ConsumerConfig

                await js.add_consumer("NR", ConsumerConfig(durable_name="late"))
                create_after_s = None
            got = [m.data for m in await stream.next_batch(timeout=0.2)]
    finally:
        await stream.close()
        await nc.close()
    return got


@pytest.mark.slow
def test_pulls_nobody_answers_are_asked_again_until_the_consumer_answers(nats_server):
    assert asyncio.run(_scenario(nats_server.url, create_after_s=1.5)) == [b"hello"]


def test_a_consumer_that_never_answers_is_gone_after_the_grace(nats_server, monkeypatch):
    monkeypatch.setattr(pulling, "NO_RESPONDERS_GRACE_S", 0.5)
    started = time.monotonic()
    with pytest.raises(ConsumerGone, match="503"):
        asyncio.run(_scenario(nats_server.url, create_after_s=None))
    assert time.monotonic() - started < 10
