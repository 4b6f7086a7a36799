"""Wire types: SGLang's two encodings, kvtier's messages, hashes, tiers, subjects."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.schemas.events import (
    AllCleared,
    BridgeCursor,
    EventBatch,
    PagesRemoved,
    PagesStored,
    UnsupportedVersion,
    WorkerAnnounce,
    decode_message,
    encode_message,
)
from kvtier.schemas.hashes import (
    BlockHash,
    block_hash_from_page_key,
    page_key,
    page_keys_blob,
    sglang_block_hashes,
)
from kvtier.schemas.sglang import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    decode_payload,
    encode_payload,
)
from kvtier.schemas.subjects import events_subject, name_of_token, subject_token
from kvtier.schemas.tiers import Tier, UnknownMedium, tier_of_medium
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata


def test_sglang_hash_chain_matches_the_verified_vector():
    assert sglang_block_hashes(list(range(100, 116)), 4) == [
        -7118152853857507680, -5037572900866013165, -8052603281837994718, 5043830065565855565]
    assert sglang_block_hashes(list(range(100, 118)), 4)[:4] == sglang_block_hashes(list(range(100, 116)), 4)
    assert len(sglang_block_hashes(list(range(100, 118)), 4)) == 4  # partial page: no hash


@given(st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=50))
def test_page_keys_round_trip(hashes):
    blob = page_keys_blob([BlockHash(h) for h in hashes])
    keys = [blob[i:i + 16] for i in range(0, len(blob), 16)]
    assert keys == [page_key(BlockHash(h)) for h in hashes]
    assert [block_hash_from_page_key(k) for k in keys] == hashes


EVENTS = [BlockStored(block_hashes=[1, -2], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                      block_size=4, lora_id=None, medium="CPU_PINNED"),
          BlockRemoved(block_hashes=[3], medium="GPU"), AllBlocksCleared()]


@pytest.mark.parametrize("array_encoding", [False, True])
def test_both_sglang_encodings_decode_to_the_same_events(array_encoding):
    payload = encode_payload(12.5, EVENTS, attn_dp_rank=1, array_encoding=array_encoding)
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw[1][0], list if array_encoding else dict)
    decoded = decode_payload(payload)
    assert (decoded.ts, decoded.attn_dp_rank, decoded.events, decoded.rejected) == (12.5, 1, EVENTS, [])


def test_sglang_decoding_tolerates_newer_fields_and_old_short_arrays():
    newer = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4,
                                           "token_ids": [1], "block_size": 1, "lora_id": None, "medium": None,
                                           "lora_name": "x", "extra_keys": None, "group_idx": 0}]])
    assert decode_payload(newer).events[0].block_hashes == [5]
    short = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1], 1], ["BlockRemoved", [5]]]])
    events = decode_payload(short).events
    assert events[0].medium is None and events[1].medium is None  # omitted default: GPU
    assert tier_of_medium(events[1].medium) == Tier.DEVICE


def test_a_bad_event_is_isolated_from_its_batch():
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU"], {"type": "Mystery"}, ["BlockRemoved", [2]]]])
    decoded = decode_payload(payload)
    assert [e.block_hashes for e in decoded.events] == [[1], [2]]
    assert len(decoded.rejected) == 1 and decoded.rejected[0][0] == 1 and "Mystery" in decoded.rejected[0][2]


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode(["x", []])])
def test_malformed_batches_raise_a_clear_error(payload):
    with pytest.raises(MalformedBatch, match="not an SGLang event batch"):
        decode_payload(payload)


def test_hashes_outside_int64_are_refused():
    payload = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1 << 63], "GPU"]]])
    assert "<= 9223372036854775807" in decode_payload(payload).rejected[0][2]


@pytest.mark.parametrize("medium,tier", [(None, Tier.DEVICE), ("GPU", Tier.DEVICE), ("device", Tier.DEVICE),
                                         ("CPU_PINNED", Tier.HOST), ("CPU", Tier.HOST), ("CPU_TIER1", Tier.HOST),
                                         ("DISK", Tier.DISK), ("CPU_TIER2", Tier.DISK), ("NVME", Tier.DISK),
                                         ("STORAGE", Tier.DISK), ("EXTERNAL", Tier.EXTERNAL),
                                         ("SHARED", Tier.EXTERNAL), ("REMOTE", Tier.EXTERNAL),
                                         ("NETWORK", Tier.EXTERNAL)])
def test_medium_alias_table(medium, tier):
    assert tier_of_medium(medium) == tier


def test_unknown_medium_names_the_known_ones():
    with pytest.raises(UnknownMedium, match="unknown medium 'TAPE'; known: .*CPU_PINNED"):
        tier_of_medium("TAPE")


def test_kvtier_messages_round_trip_and_stay_forward_compatible():
    batch = EventBatch(worker_id="w", model="m", epoch=3, seq=9, ts=1.0, source_ts=0.5,
                       events=[PagesStored(tier=Tier.HOST, hashes=[1], page_size=16), PagesRemoved(tier=Tier.DEVICE,
                                                                                             hashes=[1]), AllCleared()])
    assert decode_message(encode_message(batch)) == batch
    announce = WorkerAnnounce(metadata=WorkerMetadata(worker_id="w", model="m", page_size=16,
                                                      mooncake=MooncakeLayout(tp_size=2)),
                              ts=1.0, lease_ttl_s=10, cursor=BridgeCursor(epoch=3, seq=9))
    assert decode_message(encode_message(announce)) == announce
    raw = msgspec.msgpack.decode(encode_message(batch))
    raw["added_in_a_later_minor"] = {"x": 1}
    assert decode_message(msgspec.msgpack.encode(raw)) == batch
    raw["v"] = 2
    with pytest.raises(UnsupportedVersion, match="v2 is newer"):
        decode_message(msgspec.msgpack.encode(raw))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_decoders_never_crash_on_garbage(data):
    try:
        decode_message(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnsupportedVersion):
        pass
    try:
        decode_payload(data)
    except MalformedBatch:
        pass


def test_subjects_are_safe():
    assert subject_token("meta-llama/Llama-3.1-8B") == "meta-llama_2fLlama-3_2e1-8B"
    # one-to-one: names that differ only in punctuation keep apart (they once shared one state)
    names = ["org/chat-model", "org_chat-model", "org chat-model", "org.chat-model", "a/b", "a.b", "a_2fb", "é"]
    assert len({subject_token(n) for n in names}) == len(names)
    assert [name_of_token(subject_token(n)) for n in names] == names
    assert events_subject("a.b", "w*1") == "kvtier.events.a_2eb.w_2a1"
    with pytest.raises(ValueError):
        subject_token("")


def test_events_subjects_parse_into_their_tokens():
    from kvtier.schemas.subjects import EventsSubject, parse_events_subject

    stored = parse_events_subject(f"{events_subject('org/model-1', 'w.0')}.5")
    assert stored == EventsSubject("org_2fmodel-1", "w_2e0", 5)
    assert stored.names("org/model-1", "w.0") and not stored.names("org/model-1", "w1")
    assert parse_events_subject(events_subject("m", "w")) == EventsSubject("m", "w", None)
    for other in ("kvtier.control.m.w", "kvtier.events.m", "kvtier.events.m.w.x", "kvtier.events.m.w.1.2",
                  "kvtier.events..w.1", "x.events.m.w.1"):
        assert parse_events_subject(other) is None, other


@pytest.mark.parametrize("kind, field, extra", [
    ("route", "token_ids", {"model": "m"}),
    ("generate", "input_ids", {}),
    ("completion", "prompt", {"model": "m"}),
])
def test_token_ids_outside_uint32_are_refused_with_their_path(kind, field, extra):
    """Token ids in request bodies are decoded as plain ints and checked as uint32 after
    (schemas/routing.py check_token_ids): the same refusal, at the same path, as a bound."""
    from kvtier.schemas.openai import CompletionRequest
    from kvtier.schemas.routing import GenerateRequest, RouteRequest

    decoder = msgspec.json.Decoder({"route": RouteRequest, "generate": GenerateRequest,
                                    "completion": CompletionRequest}[kind])
    for bad in (-2, 1 << 32, 1 << 70):
        with pytest.raises(msgspec.ValidationError, match=rf"got {bad} - at `\$\.{field}\[1\]`"):
            decoder.decode(msgspec.json.encode({**extra, field: [0, bad, 3]}))
    ok = decoder.decode(msgspec.json.encode({**extra, field: [0, (1 << 32) - 1]}))
    assert getattr(ok, field) == [0, (1 << 32) - 1]
    with pytest.raises(msgspec.ValidationError, match=rf"Expected `int`, got `bool` - at `\$\.{field}\[0\]`"):
        decoder.decode(msgspec.json.encode({**extra, field: [True]}))
