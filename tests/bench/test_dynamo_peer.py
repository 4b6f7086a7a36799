"""Dynamo's side of `kvtier bench peers` (kvtier/bench/peers_dynamo.py): 30 paced requests of three
growing conversations through Dynamo's frontend with its KV router over four mocker engines, then
straight to fresh engines. Every request must be served both ways, and the frontend's router must
find conversations cached where round robin finds less. It runs Dynamo where its venv is already
made (KVTIER_DYNAMO_PYTHON, or the cache that scripts/test and `kvtier bench peers` fill; making it fetches
the wheels from PyPI, 700 MB installed, in a minute or two, so a test does not); elsewhere what is
tested is the other half of the bench's promise, that it says in one line why Dynamo did not run.
Its figures are not judged here (this machine is shared)."""

from __future__ import annotations

import pytest

from kvtier.bench.peers_dynamo import run_dynamo_side
from kvtier.testing.dynamo_peer import DynamoMissing, dynamo_python

MODEL = "bench/dynamo-test-model"
REQUESTS = 30

pytestmark = pytest.mark.slow  # a second or more here: `scripts/test -m "not slow"` skips it


def _requests(tokenizer_folder: str) -> list[tuple[float, dict]]:
    from kvtier.testing.peer_load import TracePrompts

    prompts = TracePrompts(tokenizer_folder, block_tokens=128, max_blocks=16)
    return [(i * 0.1, {"model": MODEL, "prompt": prompts.prompt([1000 * (i % 3) + j for j in range(1 + i // 3)]),
                       "stream": True, "max_tokens": 8}) for i in range(REQUESTS)]


def _venv_made() -> str | None:
    try:
        return dynamo_python(install=False)
    except DynamoMissing as exc:
        return str(exc)


@pytest.mark.timeout(180)
def test_dynamo_frontend_beside_the_client_straight_to_its_engines(tmp_path):
    from kvtier.testing.model_tokenizers import write_deepseek_tokenizer

    requests = _requests(write_deepseek_tokenizer(str(tmp_path / "tokenizer")))
    missing = _venv_made()
    report = run_dynamo_side(requests, str(tmp_path), workers=4, install=False)
    if missing is not None and missing.startswith("no Dynamo venv"):
        assert report == {"note": missing}, report
        return
    assert report["note"] == "", report
    front, direct = report["frontend"], report["direct"]
    for side in (front, direct):
        assert (side["requests"], side["served"]) == (REQUESTS, REQUESTS), report
        assert side["ttft_p50_ms"] > 0 and side["ttft_p99_ms"] >= side["ttft_p50_ms"] and side["tpot_p99_ms"] > 0
    assert front["cpu_ms_per_request"] > 0 and front["rss_mb"] > 0, front
    assert front["cached_share"] > direct["cached_share"], report  # the KV router follows the conversations
    assert report["added_ttft_p50_ms"] == front["ttft_p50_ms"] - direct["ttft_p50_ms"]


def test_a_dynamo_that_cannot_run_is_said_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DYNAMO_PYTHON", str(tmp_path / "no-such-python"))
    report = run_dynamo_side([(0.0, {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 2})],
                             str(tmp_path))
    assert report == {"note": f"KVTIER_DYNAMO_PYTHON={tmp_path / 'no-such-python'} is not an interpreter here"}
