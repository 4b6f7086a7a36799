"""Parts started before their broker can serve wait for it instead of exiting: a processor and
a bridge pointed at a nats-server that answers but has no JetStream yet (as a cluster still
electing its meta leader does) warn, keep retrying, and work once JetStream is there."""

from __future__ import annotations

import pytest
import redis

from kvtier.consumers.apply import read_worker_pages
from kvtier.harness.embedded import NatsServer
from kvtier.schemas.sglang import BlockStored
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import bridge_process, model_ready, processor_process, stop_all, wait_until, worker_announced

MODEL = "org/late-jetstream"
WAITING = "JetStream cannot set up the streams yet"


pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def test_processor_and_bridge_wait_for_jetstream(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    publisher = SglangEventPublisher()
    no_jetstream = NatsServer(jetstream=False).start()
    port = no_jetstream.port
    processor = processor_process(no_jetstream.url, redis_server.url)
    bridge = bridge_process(publisher, no_jetstream.url, "w0", MODEL)
    jetstream = None
    try:
        for part in (processor, bridge):
            wait_until(lambda part=part: WAITING in part.output(), timeout=30,
                       what=lambda part=part: f"a warning that JetStream is not there\n{part.output()[-2000:]}")
        # still waiting a few retries later, not exited
        wait_until(lambda: processor.output().count(WAITING) >= 3, timeout=30, what="three retries")
        assert processor.alive() and bridge.alive(), processor.output()[-2000:]

        no_jetstream.stop()
        jetstream = NatsServer(port=port).start()
        wait_until(lambda: worker_announced(client, MODEL, "w0") and model_ready(client, MODEL), timeout=60,
                   what=lambda: f"the worker announced once JetStream is up\nprocessor: {processor.output()[-2000:]}"
                                f"\nbridge: {bridge.output()[-2000:]}")
        publisher.publish([BlockStored(block_hashes=[101, 102], parent_block_hash=None, token_ids=[],
                                       block_size=4, medium="GPU")])
        wait_until(lambda: set(read_worker_pages(client, MODEL, "w0")) == {101, 102}, timeout=30,
                   what=lambda: f"both pages applied\nprocessor: {processor.output()[-2000:]}")
    finally:
        stop_all(bridge, processor)
        publisher.close()
        no_jetstream.stop()
        if jetstream is not None:
            jetstream.stop()
