"""Bad input, fuzzed (issue 7 part 3).

Every decoder of input kvtier does not control returns a valid typed value or raises its
module's documented errors, never anything else, never hangs, and a valid message
round-trips (in process, hypothesis profile "ci"; the fuzz table shared with `kvtier bench
fuzz` is kvtier/testing/fuzz_table.py). Through the real processes: a bridge fed fuzzed
engine payloads dead-letters each bad one with a reason and applies the valid batches around them; a
processor fed fuzzed stream messages (odd subjects included) likewise; a router fed fuzzed
HTTP requests answers 4xx naming the problem, never 5xx, and keeps serving.

The regression tests below each keep the input that found a bug, with what it did before.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvtier.schemas.events import (
    BridgeCursor,
    EventBatch,
    PagesStored,
    WorkerAnnounce,
    decode_control,
    decode_message,
    encode_message,
)
from kvtier.schemas.sglang import (
    MAX_EVENTS_PER_BATCH,
    MAX_PAGES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
    BlockStored,
    MalformedBatch,
    decode_event,
    decode_payload,
)
from kvtier.schemas.tiers import Tier
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata, decode_worker_metadata
from kvtier.testing import fuzz_table as fuzz

CI = fuzz.profile()  # "ci" unless KVTIER_FUZZ_PROFILE names another
#: Through real processes an example takes a second: report a failure as found, unshrunk.
NO_SHRINK = (Phase.explicit, Phase.generate)
#: Quick byte mutants checked beside each drawn input.
MUTANTS = 3
TARGETS = fuzz.decoder_targets()


# --- every decoder, in process --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_decoder_returns_a_typed_value_or_its_documented_error(target):
    check = target.checker(MUTANTS)
    examples = 8 if target.name.endswith(".huge") else CI.max_examples

    @settings(CI, max_examples=examples)
    @given(st.data())
    def run(data):
        check(data.draw(target.strategy))

    run()


@settings(CI, max_examples=100)
@given(fuzz.kvtier_messages())
def test_valid_stream_messages_round_trip_exactly(message):
    assert decode_message(encode_message(message)) == message


@settings(CI, max_examples=100)
@given(fuzz.sglang_payloads())
def test_valid_engine_payloads_decode_whole(payload):
    from kvtier.producers.convert import convert_batch

    decoded = decode_payload(msgspec.msgpack.encode(payload))
    assert not decoded.rejected and len(decoded.events) == len(payload[1])
    assert not convert_batch(decoded).rejected
    for raw, event in zip(payload[1], decoded.events):
        kind = raw["type"] if isinstance(raw, dict) else raw[0]
        hashes = raw.get("block_hashes", []) if isinstance(raw, dict) else (raw[1] if len(raw) > 1 else [])
        assert type(event).__name__ == kind and getattr(event, "block_hashes", []) == hashes


def test_every_listed_decoder_is_fuzzed():
    names = {t.name for t in TARGETS}
    assert names >= {"sglang.payload", "sglang.event", "sglang.frames", "events.message", "events.control",
                     "health.hash_check", "worker.metadata", "sglang_server.server_info", "sglang_server.l3_layout",
                     "mooncake.batch_query_reply", "routing.route", "routing.release", "routing.generate",
                     "router_health.healthz", "sglang_server.generate_reply", "jetstream.jsz",
                     "routing.decision"}


# --- huge arrays: bounded time and memory -----------------------------------------------------
def _payload(events) -> bytes:
    return msgspec.msgpack.encode([1.0, events])


def test_a_million_page_event_is_decoded_and_split_to_fit_nats_messages():
    from kvtier.producers.convert import convert_batch
    from kvtier.producers.message_chunks import ENVELOPE_BYTES as _ENVELOPE_BYTES
    from kvtier.producers.message_chunks import chunk_by_pages as _chunk_by_pages

    n = 1_000_000
    payload = _payload([{"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": -1,
                         "token_ids": list(range(n)), "block_size": 1, "medium": "GPU"}])
    started = time.perf_counter()
    events = convert_batch(decode_payload(payload)).events
    chunks = _chunk_by_pages(events, 16384, (1 << 20) - _ENVELOPE_BYTES)
    sizes = [len(encode_message(EventBatch(worker_id="w" * 256, model="m" * 256, epoch=(1 << 53) - 1,
                                           seq=(1 << 53) - 1, ts=1.0, source_ts=1.0, events=c))) for c in chunks]
    elapsed = time.perf_counter() - started
    assert elapsed < 15, elapsed
    assert max(sizes) <= (1 << 20) - 1024, max(sizes)  # room for the Nats-Msg-Id header
    pieces = [e for c in chunks for e in c]
    assert [h for e in pieces for h in e.hashes] == list(range(n))
    assert [e.parent for e in pieces] == [-1] + [e.hashes[-1] for e in pieces[:-1]]  # the chain is kept
    assert all(len(msgspec.msgpack.decode(e.token_ids)) == len(e.hashes) for e in pieces)  # tokens travel along


@settings(CI, max_examples=200)
@given(st.integers(1, 300), st.integers(1, 5), st.integers(1, 50), st.integers(200, 3000), st.booleans(),
       st.sampled_from([None, "lora:" + "x" * 500]))
def test_split_to_fit_keeps_the_state_the_chain_and_the_tokens(n, page_size, max_pages, max_bytes, tokens, ns):
    from kvtier.producers.convert import encoded_size_bound, split_to_fit
    from kvtier.schemas.events import pack_token_ids

    token_ids = list(range(100_000, 100_000 + n * page_size)) if tokens else []
    event = PagesStored(tier=Tier.HOST, hashes=list(range(n)), parent=-7, page_size=page_size,
                        token_ids=pack_token_ids(token_ids), namespace=ns)
    pieces = split_to_fit(event, max_pages, max_bytes)
    assert [h for p in pieces for h in p.hashes] == event.hashes
    assert [p.parent for p in pieces] == [-7] + [p.hashes[-1] for p in pieces[:-1]]
    assert all(len(p.hashes) <= max_pages for p in pieces)
    assert all(encoded_size_bound(p) <= max_bytes or len(p.hashes) == 1 for p in pieces)
    # the bound covers the event itself: a batch holding it is at most that much larger than an empty one
    def batch_bytes(events) -> int:
        return len(encode_message(EventBatch(worker_id="w", model="m", epoch=1, seq=1, ts=1.0, source_ts=1.0,
                                             events=events)))

    assert all(batch_bytes([p]) - batch_bytes([]) <= encoded_size_bound(p) for p in pieces)
    carried = [t for p in pieces for t in msgspec.msgpack.decode(p.token_ids)]
    one_page = PagesStored(tier=Tier.HOST, hashes=[0], page_size=page_size,
                           token_ids=pack_token_ids(token_ids[:page_size]), namespace=ns)
    # the tokens travel with their pages, unless one page with its tokens is over the budget
    assert carried == token_ids or (not carried and encoded_size_bound(one_page) > max_bytes)


@pytest.mark.parametrize("field,limit", [("block_hashes", MAX_PAGES_PER_EVENT), ("token_ids", MAX_TOKENS_PER_EVENT)])
def test_an_event_over_the_limits_is_refused_from_its_header(field, limit):
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [],
             "block_size": 1, field: [0] * (limit + 1)}
    payload = _payload([event, ["BlockRemoved", [5], "GPU"]])
    started = time.perf_counter()
    decoded = decode_payload(payload)
    assert time.perf_counter() - started < 2
    assert [type(e).__name__ for e in decoded.events] == ["BlockRemoved"]  # the good event still applies
    assert f"Expected `array` of length <= {limit} - at `$.{field}`" in decoded.rejected[0][2]


def test_a_batch_over_the_event_limit_and_lying_headers_are_malformed():
    with pytest.raises(MalformedBatch, match=f"length <= {MAX_EVENTS_PER_BATCH}"):
        decode_payload(_payload([["AllBlocksCleared"]] * (MAX_EVENTS_PER_BATCH + 1)))
    started = time.perf_counter()
    for lie in (b"\x92\xcb" + bytes(8) + b"\xdd\xff\xff\xff\xff\xc0",  # 4 billion events, then nothing
                b"\x92\xcb" + bytes(8) + b"\x91\xdb\xff\xff\xff\xff"):  # a 4 GB string
        with pytest.raises(MalformedBatch, match="length <= 65536|truncated"):
            decode_payload(lie)
    with pytest.raises(msgspec.DecodeError, match="truncated"):
        decode_message(b"\xdf\xff\xff\xff\xff")
    assert time.perf_counter() - started < 0.5


# --- regressions: each keeps the input that found a bug -----------------------------------
DEEP = b"\x91" * 5000 + b"\xc0"


def test_deep_nesting_is_a_decode_error_not_a_recursion_error():
    """Before: RecursionError. In the bridge it escaped `_decode` (only MalformedBatch was
    caught) and ended the bridge, again at each restart (the replay buffer holds the batch);
    in the processor it failed the whole fetch, redelivered forever: the partition stalled.
    Through the router it was a 500."""
    from kvtier.router.refusals import decode_body as _decode
    from kvtier.schemas.health import decode_hash_check
    from kvtier.schemas.routing import RouteRequest

    with pytest.raises(MalformedBatch, match="nested too deeply"):
        decode_payload(b"\x92\xcb" + bytes(8) + b"\x91" + DEEP)
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):  # a newer engine's field, deep
        decode_event(b"\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01\xa1x" + DEEP)
    batch = msgspec.msgpack.encode({"kind": "batch", "worker_id": "w", "model": "m", "epoch": 1, "seq": 1,
                                    "ts": 1.0, "source_ts": 1.0})
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):  # an ignored field, deep
        decode_message(b"\x88" + batch[1:] + b"\xa1z" + DEEP)
    deep_json = b'{"model":"m","token_ids":[1],"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    for decode in (lambda b: _decode(b, RouteRequest), decode_control, decode_hash_check, decode_worker_metadata):
        with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
            decode(deep_json)


def test_an_empty_model_or_worker_id_is_refused_at_decode():
    """Before: decoded, then `subject_token("")` raised ValueError in the processor's subject
    check, outside every handler: the fetch was nak'ed and redelivered forever."""
    for name in ("model", "worker_id"):
        message = {"kind": "batch", "worker_id": "w", "model": "m", "epoch": 1, "seq": 1, "ts": 1.0,
                   "source_ts": 1.0, name: ""}
        with pytest.raises(msgspec.ValidationError, match=f"length >= 1 - at `\\$.{name}`"):
            decode_message(msgspec.msgpack.encode(message))
    with pytest.raises(msgspec.ValidationError, match="length >= 1"):
        decode_worker_metadata(b'{"worker_id":"","model":"m","page_size":1}')


def test_epochs_and_seqs_beyond_exact_lua_numbers_are_refused():
    """The apply script compares (epoch, seq) as doubles: above 2**53 neighbours compare equal
    (a batch taken for its predecessor's duplicate); a cursor epoch of 2**64 made a restarted
    bridge begin epoch 2**64 + 1, which msgpack cannot encode."""
    base = {"kind": "batch", "worker_id": "w", "model": "m", "epoch": 1, "seq": 1, "ts": 1.0, "source_ts": 1.0}
    for field, value in (("epoch", 1 << 53), ("seq", (1 << 64) - 1)):
        with pytest.raises(msgspec.ValidationError, match=f"<= 9007199254740991 - at `\\$.{field}`"):
            decode_message(msgspec.msgpack.encode({**base, field: value}))
    announce = encode_message(WorkerAnnounce(metadata=WorkerMetadata(worker_id="w", model="m", page_size=1), ts=1.0,
                                             lease_ttl_s=10, cursor=BridgeCursor(epoch=1, seq=1)))
    raw = msgspec.msgpack.decode(announce)
    raw["cursor"]["epoch"] = (1 << 64) - 1
    with pytest.raises(msgspec.ValidationError, match="cursor.epoch"):
        decode_message(msgspec.msgpack.encode(raw))
    with pytest.raises(msgspec.ValidationError, match="<= 100000000000.0 - at `\\$.ts`"):
        decode_message(msgspec.msgpack.encode({**base, "ts": float("inf")}))


def test_stored_tokens_that_are_not_token_ids_are_unverifiable_not_an_error():
    """Before: the hash check's `token_ids_of` raised ValidationError after the batch was
    applied: the processor logged a traceback and redelivered the fetched messages."""
    from kvtier.consumers.hash_check import HashValidator

    validator = HashValidator(budget_pages_per_s=None)
    for tokens in ({"x": 1}, [1 << 40], [-1], [[1, 2]], "abc"):
        batch = EventBatch(worker_id="w", model="m", epoch=1, seq=1, ts=1.0, source_ts=1.0, events=[
            PagesStored(tier=Tier.DEVICE, hashes=[7], page_size=1,
                        token_ids=msgspec.Raw(msgspec.msgpack.encode(tokens)))])
        outcome = validator.check_batch(decode_message(encode_message(batch)), None, None)
        assert outcome.unverifiable == 1 and not outcome.mismatched


@pytest.mark.parametrize("ts", [float("nan"), -5.0, float("inf"), 1e300, 0.0])
def test_an_engine_batch_with_a_bad_timestamp_is_forwarded_with_the_bridges_clock(ts):
    """Before: the bridge copied SGLang's ts into `source_ts`; the processor refused the whole
    kvtier batch (ts >= 0), so the good events were dead-lettered, the next batch showed a
    gap, and after --gap-timeout the worker's state was cleared and marked stale."""
    from kvtier.producers.convert import source_timestamp

    assert source_timestamp(ts, 1234.5) == 1234.5
    assert source_timestamp(1.7e9, 1234.5) == 1.7e9
    assert fuzz.check_sglang_payload(msgspec.msgpack.encode([ts, [["BlockRemoved", [1], "GPU"]]]))


def test_a_mooncake_layout_with_millions_of_objects_per_page_is_refused():
    """Before: an announcement with tp_size 10**9 made every routing decision of the model (with
    --shared-cache-type hicache) enumerate 2 * 10**9 Mooncake keys per page."""
    meta = {"worker_id": "w", "model": "m", "page_size": 1, "mooncake": {"attention": "mha", "tp_size": 1000,
                                                                         "pp_size": 1000}}
    with pytest.raises(msgspec.ValidationError, match="objects per page; at most 4096"):
        decode_worker_metadata(json.dumps(meta))
    meta["mooncake"]["tp_size"] = 10 ** 9
    with pytest.raises(msgspec.ValidationError, match="<= 1024 - at `\\$.mooncake.tp_size`"):
        decode_worker_metadata(json.dumps(meta))
    assert MooncakeLayout(attention="mla", tp_size=1024, pp_size=8).objects_per_page == 8


def test_control_requests_are_typed():
    assert decode_control(b'{"request":"resync","reason":"state is stale"}').request == "resync"
    for bad in (b"[]", b'{"request":1}', b"\xff", b""):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_control(bad)


# --- through the real processes -------------------------------------------------------------
@pytest.fixture
def router_stack(redis_server):
    stack = fuzz.RouterStack(redis_server.url)
    yield stack
    stack.close()


@pytest.mark.slow
def test_router_http_api_fuzzed(router_stack):
    """Every request gets 200 or a 4xx whose JSON error names the problem (the decoder's own
    message for a malformed body), never a 5xx or a hang; the router serves afterwards."""
    statuses: dict[int, int] = {}

    @settings(CI, max_examples=150, deadline=None, phases=NO_SHRINK)
    @given(fuzz.router_requests(router_stack.model))
    def run(request):
        path, body, _kind = request
        status = fuzz.check_router_exchange(router_stack, path, body)
        statuses[status] = statuses.get(status, 0) + 1

    run()
    fuzz.check_router_still_serves(router_stack)
    assert statuses.get(200, 0) >= 8 and sum(n for s, n in statuses.items() if s >= 400) >= 50, statuses


@pytest.mark.slow
def test_router_survives_unreadable_worker_metadata_in_redis(router_stack):
    """Before: metadata in Redis that is not JSON raised msgspec.DecodeError out of the worker
    directory (only ValidationError was caught): every decision for the model was a 500 and
    housekeeping took the state store for down (routing degraded to round robin)."""
    from kvtier.schemas.state_keys import ModelKeys

    keys = ModelKeys.for_model(router_stack.model)
    router_stack.client.set(keys.meta("w0"), b'{"worker_id": "w0", "model": ')
    router_stack.client.set(keys.meta("w1"), b"[" * 5000 + b"]" * 5000)
    time.sleep(2.5)  # past the directory cache (2 s) and a housekeeping pass
    for _ in range(3):
        status, raw = router_stack.request("POST", "/v1/route", fuzz.encode_json(
            {"model": router_stack.model, "token_ids": list(range(1, 17)), "book": False}))
        assert status == 200 and not json.loads(raw)["degraded"], raw
    status, raw = router_stack.request("GET", "/healthz", b"")
    assert status == 200 and json.loads(raw)["state_store"]["ok"], raw


@pytest.fixture
def bridge_stack(nats_server, redis_server):
    stack = fuzz.BridgeStack(nats_server.url, redis_server.url)
    yield stack
    stack.close()


@pytest.mark.slow
def test_bridge_dead_letters_fuzzed_engine_input_and_applies_the_rest(bridge_stack):
    """A raw SGLang-format PUB sends fuzzed payloads and frames between valid batches: each bad
    payload, event or frame set is one dead letter with a reason (from the bridge; the
    processor refuses nothing the bridge forwards) and Redis holds exactly the valid events."""
    totals = {"items": 0, "dead": 0}

    @settings(CI, max_examples=12, deadline=None, phases=NO_SHRINK)
    @given(st.lists(fuzz.engine_items(), min_size=1, max_size=10))
    def run(items):
        totals["dead"] += bridge_stack.run(items)
        totals["items"] += len(items)

    run()
    assert totals["dead"] >= 5, totals


@pytest.mark.slow
def test_bridge_splits_an_event_larger_than_a_nats_message(bridge_stack):
    """Before: one engine event of 200,000 pages (a long prompt at page size 1) made a kvtier
    batch over the server's max_payload; nats-py raised MaxPayloadError, the bridge exited, and
    at each restart it met the same batch in the replay buffer."""
    n = 200_000
    items = [("payload", _payload([{"type": "BlockStored", "block_hashes": list(range(n)), "parent_block_hash": None,
                                    "token_ids": list(range(n)), "block_size": 1, "medium": "CPU_PINNED"}])),
             ("payload", _payload([["BlockRemoved", list(range(0, n, 2)), "CPU_PINNED"]]))]
    assert bridge_stack.run(items, timeout=60) == 0
    assert len(bridge_stack.state()) == n // 2


@pytest.mark.slow
def test_bridge_dead_letters_a_payload_larger_than_a_nats_message(bridge_stack):
    """Before: the dead letter of a 3 MB bad payload was itself over max_payload: the bridge
    exited with MaxPayloadError. Now it is kept up to what the server takes, and says so."""
    big = b"\xc1" + bytes(3 << 20)
    good = _payload([["BlockStored", [9], None, [], 4, None, "GPU"]])
    assert bridge_stack.run([("payload", big), ("payload", good)]) == 1
    letter = asyncio.run(bridge_stack._letters_since(0))[-1]
    assert letter[2]["Kvtier-Truncated-From"] == str(len(big)) and big.startswith(letter[3])


@pytest.mark.slow
def test_bridge_ignores_bad_control_messages(bridge_stack):
    """Garbage on the bridge's control subject (not JSON, deep, wrong types, unknown requests)
    is logged and ignored: no new epoch, and the bridge keeps forwarding."""
    import nats

    from kvtier.schemas.state_keys import ModelKeys
    from kvtier.schemas.subjects import control_subject

    assert bridge_stack.run([("payload", _payload([["BlockStored", [3], None, [], 4, None, "GPU"]]))]) == 0
    epoch = bridge_stack.client.hget(ModelKeys.for_model(bridge_stack.MODEL).state(bridge_stack.WORKER), "epoch")

    async def send():
        nc = await nats.connect(bridge_stack.nats_url)
        subject = control_subject(bridge_stack.MODEL, bridge_stack.WORKER)
        for data in (b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'{"request":' + b"[" * 5000 + b"]" * 5000 + b"}",
                     b'{"request":["resync"]}', b'{"request":"reboot"}', b"", b"null", b'{"reason":"x"}'):
            await nc.publish(subject, data)
        await nc.flush()
        await nc.close()

    asyncio.run(send())
    assert bridge_stack.run([("payload", _payload([["BlockStored", [4], None, [], 4, None, "GPU"]]))]) == 0
    assert bridge_stack.client.hget(ModelKeys.for_model(bridge_stack.MODEL).state(bridge_stack.WORKER),
                                    "epoch") == epoch
    assert "ignoring unknown control message" in bridge_stack.bridge.tail(20000)


@pytest.fixture
def processor_stack(nats_server, redis_server):
    stack = fuzz.ProcessorStack(nats_server.url, redis_server.url, nats_server.port)
    yield stack
    stack.close()


@pytest.mark.slow
def test_processor_dead_letters_fuzzed_stream_messages_and_applies_the_rest(processor_stack):
    """Fuzzed messages on the events stream (other workers' subjects, odd tokens, subjects
    that are not UTF-8) interleaved with a good worker's batches: each message the processor
    must refuse is one dead letter with a reason, and the good worker's state is exact."""
    totals = {"items": 0, "dead": 0}

    @settings(CI, max_examples=10, deadline=None, phases=NO_SHRINK)
    @given(st.lists(fuzz.stream_items(processor_stack.MODEL, processor_stack.FUZZ), min_size=1, max_size=8),
           fuzz.GOOD_EVENTS)
    def run(items, good):
        totals["dead"] += processor_stack.run(items, good)
        totals["items"] += len(items)

    run()
    assert totals["dead"] >= 5, totals


@pytest.mark.slow
def test_processor_dead_letters_a_subject_that_is_not_utf8(processor_stack):
    """Before: nats-py decodes subjects strictly in its read loop; one message stored on
    `kvtier.events.m\\xff.w` broke the processor's connection at every delivery, so no later
    message of any worker was ever applied."""
    items = [((b"fz-proc" + b"\xff", b"w"), b"anything", True)]
    good = [[PagesStored(tier=Tier.HOST, hashes=[1, 2])]]
    assert processor_stack.run(items, good) == 1
    assert processor_stack.state() == {1: {Tier.HOST}, 2: {Tier.HOST}}


@pytest.mark.slow
def test_processor_dead_letters_a_message_at_the_servers_size_limit(processor_stack):
    """Before: the dead letter of a bad message near max_payload (the message plus the reason
    headers) was over the limit: MaxPayloadError, the fetch redelivered forever."""
    items = [(("fz-proc", "fz"), b"\xc1" * ((1 << 20) - 64), False)]
    good = [[PagesStored(tier=Tier.DEVICE, hashes=[3])]]
    assert processor_stack.run(items, good) == 1
    assert processor_stack.state() == {3: {Tier.DEVICE}}


@pytest.mark.slow
def test_engine_items_cover_every_kind():
    """The strategies reach each kind of bad input (a smoke check of the generators)."""
    kinds = set()

    @settings(CI, max_examples=300)
    @given(fuzz.engine_items())
    def run(item):
        kinds.add(item[0])
        if item[0] == "payload":
            try:
                decoded = decode_payload(item[1])
                kinds.add("rejected_event" if decoded.rejected else "valid")
            except MalformedBatch:
                kinds.add("malformed")

    run()
    assert kinds >= {"payload", "frames", "valid", "malformed", "rejected_event"}, kinds


def test_block_stored_fields_keep_their_types():
    event = decode_event(msgspec.msgpack.encode(["BlockStored", [1], None, [1, 2], 2, None, "GPU"]))
    assert isinstance(event, BlockStored) and event.token_ids == [1, 2]
