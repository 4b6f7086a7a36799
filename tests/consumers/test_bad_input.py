"""Bad input is dead-lettered with its reason, and the good input around it still applies."""

import asyncio

import msgspec
import nats
import pytest

from kvtier.consumers.apply import read_worker_pages, read_worker_state
from kvtier.plumbing.streams import StreamSettings, ensure_streams
from kvtier.schemas.events import encode_message
from kvtier.schemas.sglang import BlockStored, encode_seq
from kvtier.schemas.subjects import events_subject

from ..helpers import (
    RunningPipeline,
    kvtier_batch,
    processor_process,
    read_dead_letters,
    wait_until,
)

MODEL = "m-bad"


def stored(h, medium="GPU", block_size=4):
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=block_size, medium=medium)


@pytest.mark.slow
def test_bad_engine_input_is_dead_lettered_and_the_bridge_keeps_going(nats_server, redis_server):
    with RunningPipeline(nats_server.url, redis_server.url, MODEL) as run:
        publisher = run.publisher
        publisher.publish([stored(1)])
        good = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
                                              "token_ids": [], "block_size": 4, "medium": "GPU"}]])
        publisher.publish_payload(good[:-5])  # truncated msgpack
        publisher.publish_payload(msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"],
                                                                 "parent_block_hash": None, "token_ids": [],
                                                                 "block_size": 4}]]))  # wrong type
        publisher.publish([stored(3, medium="SSD_TIER9"), stored(4)])  # unknown medium beside a good event
        publisher.publish([stored(5, block_size=-4)])  # negative page size
        publisher._pub.send_multipart([b"", encode_seq(99)])  # two frames instead of three
        publisher.publish([stored(6, medium="CPU_PINNED")])
        wait_until(lambda: set(read_worker_pages(run.client, MODEL, "w0")) == {1, 4, 6},
                   what=lambda: f"{read_worker_pages(run.client, MODEL, 'w0')}\n{run.bridge.output()[-2000:]}")
        letters = asyncio.run(read_dead_letters(nats_server.url, 5))
        reasons = [headers["Kvtier-Reason"] for _subject, headers, _data in letters]
        assert len(letters) == 5, reasons
        assert all(subject == "kvtier.dlq.bridge.m-bad.w0" for subject, _, _ in letters)
        # each letter has its own dedupe id, which a retry after a lost ack reuses (stored once)
        ids = [headers.get("Nats-Msg-Id") for _subject, headers, _data in letters]
        assert all(ids) and len(set(ids)) == 5, ids
        assert any("truncated" in r for r in reasons), reasons
        assert any("Expected `int`, got `str`" in r for r in reasons), reasons
        assert any("unknown medium 'SSD_TIER9'" in r for r in reasons), reasons
        assert any("page size (block_size) must be positive, got -4" in r for r in reasons), reasons
        assert any("bad ZMQ frames" in r for r in reasons), reasons
        # the truncated payload is kept byte for byte: nothing is lost
        assert any(data == good[:-5] for _, _, data in letters)


@pytest.mark.slow
def test_bad_stream_messages_are_dead_lettered_and_the_processor_keeps_going(nats_server, redis_server, redis_client):
    first = kvtier_batch(MODEL, "w1", 1, 1, [stored(10)])
    second = kvtier_batch(MODEL, "w1", 1, 2, [stored(11)])
    wrong_worker = kvtier_batch(MODEL, "intruder", 1, 1, [stored(12)])
    # a reason quoting a non-ASCII name stays text (nats-py would hand a reader an email Header)
    accented_worker = kvtier_batch(MODEL, "w\u00f6rker", 1, 1, [stored(13)])
    future = msgspec.msgpack.encode({"kind": "batch", "v": 7, "worker_id": "w1", "model": MODEL, "epoch": 1,
                                     "seq": 2, "ts": 1.0, "source_ts": 1.0})
    bad_seq = msgspec.msgpack.encode({"kind": "batch", "worker_id": "w1", "model": MODEL, "epoch": 1, "seq": -3,
                                      "ts": 1.0, "source_ts": 1.0})
    nan_ts = msgspec.msgpack.encode({"kind": "batch", "worker_id": "w1", "model": MODEL, "epoch": 1, "seq": 2,
                                     "ts": float("nan"), "source_ts": 1.0})
    bad_tier = msgspec.msgpack.encode({"kind": "batch", "worker_id": "w1", "model": MODEL, "epoch": 1, "seq": 2,
                                       "ts": 1.0, "source_ts": 1.0, "events": [["stored", "ssd", [1]]]})

    async def publish_raw():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await ensure_streams(js, StreamSettings())
        subject = events_subject(MODEL, "w1")
        await js.publish(subject, encode_message(first))
        for raw in (encode_message(second)[:-3], future, bad_seq, nan_ts, bad_tier, encode_message(wrong_worker),
                    encode_message(accented_worker), "\udcff".encode(
                "utf-8", "surrogatepass")):
            await js.publish(subject, raw)
        await js.publish(subject, encode_message(second))
        await nc.close()

    asyncio.run(publish_raw())
    processor = processor_process(nats_server.url, redis_server.url)
    try:
        wait_until(lambda: read_worker_state(redis_client, MODEL, "w1").get("seq") == "2",
                   what=lambda: processor.output()[-2000:])
        assert set(read_worker_pages(redis_client, MODEL, "w1")) == {10, 11}
        assert not read_worker_pages(redis_client, MODEL, "intruder")
        letters = asyncio.run(read_dead_letters(nats_server.url, 8))
        reasons = [h["Kvtier-Reason"] for _, h, _ in letters]
        assert len(letters) == 8, reasons
        assert all(isinstance(r, str) for r in reasons), reasons
        assert any("m-bad/w\\xf6rker arrived on subject" in r for r in reasons), reasons
        assert all(h["Kvtier-Source-Subject"].startswith("kvtier.events.m-bad.w1.") for _, h, _ in letters)
        expected = ["truncated", "newer than this kvtier", "Expected `int` >= 1 - at `$.seq`",
                    "Expected `float` >= 0.0 - at `$.ts`", "Invalid enum value 'ssd'",
                    "refusing to apply it to another worker"]
        for fragment in expected:
            assert any(fragment in r for r in reasons), (fragment, reasons)
    finally:
        processor.stop()


def test_cli_rejects_bad_flags_with_a_clear_message(capsys):
    import pytest

    from kvtier.cli import main

    for argv, fragment in [
        (["bridge", "--endpoint", "tcp://x:1", "--worker-id", "a.b", "--model", "m", "--page-size", "4",
          "--nats", "nats://x"], "worker id 'a.b' must be"),
        (["bridge", "--endpoint", "tcp://x:1", "--worker-id", "w", "--model", "m", "--page-size", "-4",
          "--nats", "nats://x"], "must be a positive integer, got -4"),
        (["processor", "--nats", "nats://x", "--redis", "redis://x", "--partitions", "a-b"], "invalid"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert fragment in capsys.readouterr().err
