"""A real Mooncake master: start, stop by PID, and existence queries over its admin HTTP server
for objects written the way SGLang HiCache's Mooncake backend names them.

`GET /batch_query_keys?keys=k1,k2` answers (0.3.13.post1):
    {"success": true,
     "data": {"<present key>": {"ok": true, "error": null,
                                "values": [{"size_": 3, "buffer_address_": …, "protocol_": "tcp",
                                            "transport_endpoint_": "127.0.0.1:P"}],
                                "disk_values": null, "local_disk_values": null, "nof_values": null},
              "<unknown key>": {"ok": false, "error": "OBJECT_NOT_FOUND", "values": null,
                                "disk_values": null, "local_disk_values": null, "nof_values": null}}}
and without `keys`, HTTP 400 with {"success": false, "error": "No keys provided. Use ?keys=key1,key2,..."}.
"""

import hashlib
import json
import os
import socket
import urllib.error
import urllib.request

import pytest

from kvtier.harness.mooncake import MAX_KEYS_PER_QUERY, MooncakeMaster, in_private_netns, query_keys


def digest(label: str) -> str:
    """A 64-hex page digest, as SGLang HiCache names its pages."""
    return hashlib.sha256(label.encode()).hexdigest()


def mha_keys(hex_digest: str, tp_rank: int = 0) -> list[str]:
    """The Mooncake keys of one page for one TP rank under MHA: K and V."""
    return [f"{hex_digest}_{tp_rank}_k", f"{hex_digest}_{tp_rank}_v"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_runs_in_a_private_namespace():
    assert in_private_netns()
    assert os.environ.get("MC_TCP_BIND_ADDRESS") == "127.0.0.1"


def test_master_serves_rpc_metadata_and_admin_on_its_ports(mooncake_master):
    m = mooncake_master
    assert m.rpc_address == f"127.0.0.1:{m.rpc_port}"
    assert m.metadata_url == f"http://127.0.0.1:{m.metadata_port}/metadata"
    assert m.http_url == f"http://127.0.0.1:{m.metrics_port}"
    assert len({m.rpc_port, m.metadata_port, m.metrics_port}) == 3
    assert all(listening(port) for port in (m.rpc_port, m.metadata_port, m.metrics_port))
    with pytest.raises(urllib.error.HTTPError) as no_keys:
        urllib.request.urlopen(f"{m.http_url}/batch_query_keys", timeout=5)
    assert no_keys.value.code == 400
    assert json.loads(no_keys.value.read()) == {
        "success": False, "error": "No keys provided. Use ?keys=key1,key2,..."}
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{m.metadata_url}?key=kvtier-probe", timeout=5)
    assert missing.value.code == 404


def test_written_pages_are_ok_and_unknown_pages_are_not(mooncake_master, shared_pool_writer):
    written = [digest(f"written-{i}") for i in range(4)]
    unknown = digest("never-written")
    for page in written:
        for key in mha_keys(page):
            shared_pool_writer.put(key, b"kv-bytes")
    present = [key for page in written for key in mha_keys(page)]
    absent = mha_keys(unknown) + mha_keys(written[0], tp_rank=1)
    assert shared_pool_writer.exists(present + absent) == [True] * len(present) + [False] * len(absent)

    body = get_json(f"{mooncake_master.http_url}/batch_query_keys?keys=" + ",".join(present + absent))
    assert body["success"] is True
    assert set(body["data"]) == set(present + absent)
    for key in present:
        entry = body["data"][key]
        assert entry["ok"] is True and entry["error"] is None
        assert [replica["size_"] for replica in entry["values"]] == [len(b"kv-bytes")]
    for key in absent:
        assert body["data"][key]["ok"] is False
        assert body["data"][key]["error"] == "OBJECT_NOT_FOUND"
        assert body["data"][key]["values"] is None

    assert query_keys(mooncake_master.http_url, present + absent) == {
        **{key: True for key in present}, **{key: False for key in absent}}


def test_a_query_of_300_keys_in_one_request(mooncake_master, shared_pool_writer):
    pages = [digest(f"batch300-{i}") for i in range(150)]
    keys = [key for page in pages for key in mha_keys(page)]
    shared_pool_writer.put_many(keys[:200], b"v")  # pages 0-99 complete, 100-149 absent
    body = get_json(f"{mooncake_master.http_url}/batch_query_keys?keys=" + ",".join(keys))
    assert len(keys) == 300 and len(body["data"]) == 300
    assert [body["data"][key]["ok"] for key in keys] == [True] * 200 + [False] * 100
    assert query_keys(mooncake_master.http_url, keys) == {key: i < 200 for i, key in enumerate(keys)}


@pytest.mark.parametrize("count", [100, 500, 2000])
def test_long_query_urls_are_answered_whole(mooncake_master, count):
    """The measurement behind MAX_KEYS_PER_QUERY: no URL limit shows up at these sizes."""
    keys = [f"{digest(f'long-{count}-{i}')}_{i % 8}_k" for i in range(count)]
    url = f"{mooncake_master.http_url}/batch_query_keys?keys=" + ",".join(keys)
    assert len(url) > 66 * count
    body = get_json(url)
    assert body["success"] is True and len(body["data"]) == count


def test_query_keys_splits_large_batches_and_encodes_odd_characters(mooncake_master, shared_pool_writer):
    keys = [f"{digest(f'split-{i}')}_0_k" for i in range(MAX_KEYS_PER_QUERY + 50)]
    odd = ["prefix&x=1_0_k", "with space_0_v", "percent%2C_0_k"]
    shared_pool_writer.put_many(keys[::2] + odd, b"v")
    answer = query_keys(mooncake_master.http_url, keys + odd)
    assert answer == {**{key: i % 2 == 0 for i, key in enumerate(keys)}, **{key: True for key in odd}}
    with pytest.raises(ValueError, match="comma"):
        query_keys(mooncake_master.http_url, ["a,b"])
    assert query_keys(mooncake_master.http_url, []) == {}


def test_master_stops_by_pid_and_frees_its_ports():
    master = MooncakeMaster().start()
    pid, ports = master.pid, (master.rpc_port, master.metrics_port, master.metadata_port)
    log_path = master.log_path
    master.cleanup()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not any(listening(port) for port in ports)
    assert not os.path.exists(log_path)
