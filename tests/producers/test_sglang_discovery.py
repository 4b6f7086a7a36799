"""`kvtier bridge --sglang-url`: worker metadata learned from SGLang's own HTTP replies.

The replies are served by a small aiohttp server on a free loopback port. Their parts come
from SGLang 0.5.23's OWN code wherever it runs without torch (installed wheel, loaded by
tests/sglang_loader.py): the `kv_events` block is `runtime_context.describe_kv_events_publisher`
applied to a minimal server-args object, and the L3 layout reply is what the
`/get_hicache_l3_cache_layout` handler returns, built with `hicache_storage.disabled_l3_layout`
and `merge_l3_layouts`. Those two functions and the two helpers `describe_kv_events_publisher`
imports from `arg_groups.overrides` live in modules whose imports reach torch, so their
definitions are compiled from the wheel's source file without the rest of the module. The other
parts (top-level server arguments, a Mooncake store's per-scheduler layout) are recorded shapes
citing the SGLang source lines. Then the real `kvtier bridge --sglang-url`, nats-server,
`kvtier processor` and Redis, with kvtier's SGLang-format ZMQ publishers; processes are stopped
by PID.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import pathlib
import subprocess
import sys
import threading
import time
import types
from types import SimpleNamespace

import msgspec
import pytest
import zmq
from aiohttp import web

from kvtier.consumers.apply import read_worker_pages
from kvtier.harness.embedded import free_port, port_is_free
from kvtier.producers.sglang_discovery import (
    DiscoveryError,
    WorkerFlags,
    discover,
    fetch,
    manual_settings,
)
from kvtier.schemas.hashes import sglang_block_hashes
from kvtier.schemas.sglang import BlockStored
from kvtier.schemas.sglang_server import L3CacheLayout, ServerInfo
from kvtier.schemas.state_keys import ModelKeys
from kvtier.schemas.worker import AttentionKind, MooncakeLayout, WorkerMetadata
from kvtier.sim.sglang_publisher import SglangEventPublisher

from ..helpers import KvtierProcess, processor_process, stop_all, wait_until, worker_announced
from ..sglang_loader import load_kv_events, sglang_version

MODEL = "Qwen/Qwen3-8B"
#: SGLang's Mooncake config prefix for that model: the model name with "/" -> "-"
#: (mem_cache/storage/mooncake_store/mooncake_store.py:456-473).
PREFIX = "Qwen-Qwen3-8B"
MHA_DECLINED = "External L3 lookup requires rank-replicated/MLA pools"


# --- SGLang's own code ----------------------------------------------------------------------
class SglangCode:
    """The functions of the installed SGLang wheel that build the replies kvtier reads."""

    OVERRIDES = "sglang.srt.arg_groups.overrides"

    def __init__(self) -> None:
        load_kv_events()  # registers the torch-importing parent packages empty; fails with the pip command
        self.root = pathlib.Path(list(sys.modules["sglang"].__path__)[0])
        self.runtime_context = importlib.import_module("sglang.srt.runtime_context")
        self.overrides = {**self._definitions("srt/arg_groups/overrides.py", "kv_event_block_size_of"),
                          **self._definitions("srt/arg_groups/model_override_base.py", "ResolvingConfig",
                                              "resolving_view")}
        self.l3 = self._definitions("srt/mem_cache/hicache_storage.py", "disabled_l3_layout", "merge_l3_layouts",
                                    "_l3_layout_pp_rank", "_l3_layout_stage_independent", "_l3_layout_unavailable")

    def _definitions(self, relpath: str, *names: str) -> dict:
        """Top-level definitions of an SGLang module whose own imports need torch, compiled
        from the wheel's source (nothing copied here), without the module's imports."""
        path = self.root / relpath
        nodes = [node for node in ast.parse(path.read_text()).body if getattr(node, "name", None) in names]
        assert sorted(node.name for node in nodes) == sorted(names), f"{relpath} changed: {names}"
        namespace: dict = {"__name__": "sglang_definitions"}
        exec("from typing import Any, Optional, Sequence", namespace)
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
        return {name: namespace[name] for name in names}

    def kv_events(self, kv_events_config: dict | None, page_size: int = 64, dp_size: int = 1,
                  attn_dp_size: int = 1) -> dict | None:
        """/server_info's `kv_events`: SGLang's describe_kv_events_publisher."""
        args = SimpleNamespace(kv_events_config=json.dumps(kv_events_config) if kv_events_config else None,
                               page_size=page_size, dcp_size=1, dp_size=dp_size, attn_dp_size=attn_dp_size,
                               load_publish_endpoint=None)
        shim = types.ModuleType(self.OVERRIDES)  # the two names it imports from there, SGLang's definitions
        shim.__dict__.update(self.overrides)
        saved = sys.modules.get(self.OVERRIDES)
        sys.modules[self.OVERRIDES] = shim
        try:
            return self.runtime_context.describe_kv_events_publisher(args)
        finally:
            if saved is None:
                del sys.modules[self.OVERRIDES]
            else:
                sys.modules[self.OVERRIDES] = saved

    def l3_reply(self, scheduler_layouts: list[dict | None]) -> dict:
        """What /get_hicache_l3_cache_layout answers for these per-scheduler layouts
        (entrypoints/http_server.py:1204-1218: merge_l3_layouts, else disabled_l3_layout)."""
        merged = self.l3["merge_l3_layouts"](scheduler_layouts)
        return merged or self.l3["disabled_l3_layout"]("No scheduler layout replies")

    def disabled(self, reason: str, **kwargs) -> dict:
        return self.l3["disabled_l3_layout"](reason, **kwargs)


@pytest.fixture(scope="module")
def sgl():
    return SglangCode()


# --- recorded shapes ------------------------------------------------------------------------
def server_info(kv_events: dict | None, **fields) -> dict:
    """GET /server_info of SGLang 0.5.23 around a `kv_events` block: entrypoints/http_server.py
    :863-891 (build_server_info + startup_time, internal_states, version, frontend),
    utils/common.py:3585-3593 (server_args.resolved_dict() + scheduler_info + kv_events),
    server_args.py:316-333 (every ServerArgs field by name; enable_dp_attention re-derived), the
    fields from arg_groups/fields/parallel.py:45-87, schedule.py:143, memory.py:98-180, model.py:51,
    serving.py:168, observability.py:144, and scheduler.py:1940-1950 (scheduler info). Trimmed:
    the real reply has a few hundred more fields, which kvtier ignores (so do these extras)."""
    info = {
        "model_path": MODEL, "served_model_name": MODEL, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "dp_size": 1,
        "attn_dp_size": 1, "enable_dp_attention": False, "page_size": 64, "enable_hierarchical_cache": True,
        "hicache_ratio": 2.0, "hicache_write_policy": "write_through", "hicache_storage_backend": None,
        "hicache_storage_backend_extra_config": None, "kv_events_config": None, "load_publish_endpoint": None,
        "launch_command": "python -m sglang.launch_server --model-path Qwen/Qwen3-8B",
        "status": "ready", "max_total_num_tokens": 812345, "max_req_input_len": 40960,
        "startup_time": 1700000000.0, "internal_states": [{"last_gen_throughput": 0.0}],
        "version": sglang_version(), "frontend": "python", "kv_events": kv_events,
    }
    info.update(fields)
    return info


def mooncake_layout(is_mla: bool, page_size: int = 64, pp_rank: int = 0, pp_size: int = 1,
                    key_prefix: str | None = PREFIX, pools: list[dict] | None = None) -> dict:
    """One scheduler's layout from the Mooncake store's describe_l3_object_layout
    (mem_cache/storage/mooncake_store/mooncake_store.py:808-895): MLA lists the KV pool's key
    suffix "_{mla_suffix}_k" (:944, :1326-1331; mla_suffix "" or the pp rank when PP > 1,
    :631-636); MHA is declined with a reason (:846-851) but still names prefix and stages."""
    if not is_mla:
        return {"enabled": False, "backend": "mooncake", "page_size": page_size,
                "hicache_object_layout": {"pools": [], "key_prefix": key_prefix, "is_mla_backend": False,
                                          "pp_rank": pp_rank, "pp_size": pp_size},
                "reason": MHA_DECLINED}
    suffix = f"_{pp_rank}_k" if pp_size > 1 else "__k"
    return {"enabled": True, "backend": "mooncake", "page_size": page_size,
            "hicache_object_layout": {
                "pools": pools if pools is not None else [{"pool": "kv", "suffixes": [suffix],
                                                           "hit_policy": "all_pages"}],
                "key_prefix": key_prefix, "is_mla_backend": True, "pp_rank": pp_rank, "pp_size": pp_size}}


def events_config(port: int = 5557, replay_port: int | None = 5558, host: str = "*", topic: str = "") -> dict:
    config = {"publisher": "zmq", "endpoint": f"tcp://{host}:{port}", "topic": topic}
    if replay_port:
        config["replay_endpoint"] = f"tcp://{host}:{replay_port}"
    return config


def decoded(info: dict, layout: dict | None) -> tuple[ServerInfo, L3CacheLayout | None]:
    """The replies as kvtier decodes them off the wire."""
    return (msgspec.json.decode(json.dumps(info), type=ServerInfo),
            None if layout is None else msgspec.json.decode(json.dumps(layout), type=L3CacheLayout))


# --- a fake SGLang HTTP server ----------------------------------------------------------------
class FakeSglang:
    """Serves fixed /server_info and /get_hicache_l3_cache_layout replies, and /health, on a free loopback port
    (layout None: no such route, as before SGLang had it; legacy: only /get_server_info)."""

    def __init__(self, info: dict, layout: dict | None, legacy: bool = False, api_key: str = ""):
        self.info, self.layout, self.api_key = info, layout, api_key
        self.requests: list[str] = []
        app = web.Application()
        app.router.add_get("/get_server_info" if legacy else "/server_info", self._info)
        if layout is not None:
            app.router.add_get("/get_hicache_l3_cache_layout", self._layout)
        # SGLang's liveness endpoint (no API key), which the bridge asks before renewing the lease
        app.router.add_get("/health", self._health)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-sglang", daemon=True)
        self._thread.start()

    async def _health(self, request) -> web.Response:
        return web.Response(text="")

    def _authorized(self, request) -> bool:
        self.requests.append(request.path)
        return not self.api_key or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def _info(self, request):
        if not self._authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(self.info)

    async def _layout(self, request):
        if not self._authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(self.layout)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def free_run(n: int) -> int:
    """First of n consecutive free loopback ports."""
    for _ in range(50):
        base = free_port()
        if all(port_is_free(base + i) for i in range(n)):
            return base
    raise AssertionError(f"no {n} consecutive free ports")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "bridge", "--worker-id", "w", "--nats",
                           f"nats://127.0.0.1:{free_port()}", *args], capture_output=True, text=True, timeout=60)


# --- discovery from SGLang's replies ----------------------------------------------------------
def test_mla_worker_is_discovered_over_http(sgl):
    """dp attention 2, TP 2, MLA with a key prefix: everything the bridge announces comes from
    SGLang's replies, fetched over HTTP; the wildcard host becomes the URL's host."""
    kv_events = sgl.kv_events(events_config(5557, 5558), page_size=64, attn_dp_size=2)
    info = server_info(kv_events, tp_size=2, attn_dp_size=2, enable_dp_attention=True,
                       hicache_storage_backend="mooncake", kv_events_config=json.dumps(events_config(5557, 5558)))
    with FakeSglang(info, sgl.l3_reply([mooncake_layout(True), mooncake_layout(True)])) as server:
        served, layout = fetch(server.url + "/", timeout_s=5)
        settings = discover(server.url, served, layout, WorkerFlags())
    assert kv_events["endpoint_host"] == "*" and kv_events["dp_size"] == 2  # SGLang's own descriptor
    assert (settings.endpoint, settings.replay_endpoint) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert (settings.page_size, settings.dp_size, settings.tp_size, settings.pp_size) == (64, 2, 2, 1)
    assert settings.mooncake == MooncakeLayout(attention=AttentionKind.MLA, tp_size=2, pp_size=1, key_prefix=PREFIX)
    assert (settings.model, settings.topic, settings.http_endpoint) == (MODEL, "", server.url)
    assert settings.engine_version == sglang_version()
    assert settings.notes == ()
    assert (settings.hicache_enabled, settings.hicache_write_policy) == (True, info["hicache_write_policy"])


@pytest.mark.parametrize("bind_host", ["*", "0.0.0.0", "[::]"])
def test_wildcard_publisher_host_becomes_the_worker_url_host(sgl, bind_host):
    info, layout = decoded(server_info(sgl.kv_events(events_config(6000, 6001, host=bind_host))),
                           sgl.disabled("HiCache controller is not attached", page_size=64))
    assert info.kv_events.endpoint_host == bind_host
    for url, host in [("http://10.0.0.5:30000", "10.0.0.5"), ("gpu-node-7:30000", "gpu-node-7"),
                      ("http://[fd00::5]:30000", "[fd00::5]")]:
        settings = discover(url, info, layout, WorkerFlags())
        assert settings.endpoint == f"tcp://{host}:6000" and settings.replay_endpoint == f"tcp://{host}:6001"


def test_a_concrete_publisher_host_is_kept_and_explicit_endpoints_win(sgl):
    info, layout = decoded(server_info(sgl.kv_events(events_config(6000, None, host="10.9.9.9", topic="kv"))), None)
    settings = discover("http://10.0.0.5:30000", info, layout, WorkerFlags())
    assert (settings.endpoint, settings.replay_endpoint, settings.topic) == ("tcp://10.9.9.9:6000", "", "kv")
    assert any("no replay endpoint" in note for note in settings.notes)
    settings = discover("http://10.0.0.5:30000", info, layout,
                        WorkerFlags(endpoint="tcp://nat-gw:7000", replay_endpoint="tcp://nat-gw:7001",
                                    model="qwen", http_endpoint="http://lb:80", topic="kv"))
    assert (settings.endpoint, settings.replay_endpoint, settings.model, settings.http_endpoint) == (
        "tcp://nat-gw:7000", "tcp://nat-gw:7001", "qwen", "http://lb:80")


def test_dp_size_counts_every_publisher(sgl):
    """Plain DP replicas and attention-DP groups both publish on base + rank."""
    for dp_size, attn_dp_size in [(2, 1), (1, 4)]:
        info, _ = decoded(server_info(sgl.kv_events(events_config(), dp_size=dp_size, attn_dp_size=attn_dp_size),
                                      dp_size=dp_size, attn_dp_size=attn_dp_size), None)
        assert discover("http://h:1", info, None, WorkerFlags()).dp_size == dp_size * attn_dp_size


def test_l3_disabled_announces_no_mooncake_layout(sgl):
    no_storage = server_info(sgl.kv_events(events_config()))
    for info, reply in [
        (no_storage, sgl.disabled("HiCache controller is not attached", page_size=64)),
        (no_storage, sgl.l3_reply([None, None])),  # no scheduler answered
        (server_info(sgl.kv_events(events_config()), hicache_storage_backend="mooncake"),
         sgl.disabled("Mooncake storage is not attached", backend="file", page_size=64)),
    ]:
        settings = discover("http://h:1", *decoded(info, reply), WorkerFlags())
        assert settings.mooncake is None
    # a storage backend other than Mooncake is not a shared pool the router can query
    info = server_info(sgl.kv_events(events_config()), hicache_storage_backend="file")
    settings = discover("http://h:1", *decoded(info, sgl.disabled("Mooncake storage is not attached", backend="file")),
                        WorkerFlags())
    assert settings.mooncake is None and any("'file'" in note for note in settings.notes)


def test_mha_layout_sglang_declines_is_announced_only_on_request(sgl):
    """SGLang 0.5.23 will not describe MHA keys (they embed the TP rank); kvtier enumerates TP
    ranks, so --hicache-storage-backend mooncake announces them with SGLang's key prefix."""
    info = server_info(sgl.kv_events(events_config()), tp_size=4, hicache_storage_backend="mooncake")
    reply = sgl.l3_reply([mooncake_layout(False)] * 4)
    assert reply["enabled"] is False and reply["reason"] == MHA_DECLINED
    settings = discover("http://h:1", *decoded(info, reply), WorkerFlags())
    assert settings.mooncake is None
    assert any("--hicache-storage-backend mooncake" in note for note in settings.notes)
    settings = discover("http://h:1", *decoded(info, reply), WorkerFlags(hicache_storage_backend="mooncake"))
    assert settings.mooncake == MooncakeLayout(attention=AttentionKind.MHA, tp_size=4, pp_size=1, key_prefix=PREFIX)


def test_pipeline_stages_merged_by_sglang_match_kvtiers_keys(sgl):
    info = server_info(sgl.kv_events(events_config()), pp_size=2, hicache_storage_backend="mooncake")
    reply = sgl.l3_reply([mooncake_layout(True, pp_rank=r, pp_size=2) for r in (0, 1)])
    assert [p["suffixes"] for p in reply["hicache_object_layout"]["pools"]] == [["_0_k"], ["_1_k"]]
    settings = discover("http://h:1", *decoded(info, reply), WorkerFlags())
    assert settings.mooncake == MooncakeLayout(attention=AttentionKind.MLA, pp_size=2, key_prefix=PREFIX)
    # one stage missing: SGLang marks the layout unavailable
    reply = sgl.l3_reply([mooncake_layout(True, pp_rank=0, pp_size=2)])
    assert discover("http://h:1", *decoded(info, reply), WorkerFlags()).mooncake is None


def test_a_layout_kvtier_cannot_check_is_not_announced(sgl):
    """A hybrid model's L3 hit also needs sidecar objects kvtier never queries: announcing the
    KV keys alone would credit pages SGLang cannot load."""
    info = server_info(sgl.kv_events(events_config()), hicache_storage_backend="mooncake")
    pools = [{"pool": "kv", "suffixes": ["__k"], "hit_policy": "all_pages"},
             {"pool": "mamba", "suffixes": ["__mamba"], "hit_policy": "trailing_pages", "trailing_pages": 1}]
    reply = sgl.l3_reply([mooncake_layout(True, pools=pools)])
    settings = discover("http://h:1", *decoded(info, reply), WorkerFlags())
    assert settings.mooncake is None and any("'mamba'" in note for note in settings.notes)
    with pytest.raises(DiscoveryError, match="mamba"):
        discover("http://h:1", *decoded(info, reply), WorkerFlags(hicache_storage_backend="mooncake"))


def test_conflicting_flags_name_both_values(sgl):
    info = server_info(sgl.kv_events(events_config(topic="kv"), page_size=64, attn_dp_size=2), tp_size=2,
                       hicache_storage_backend="mooncake")
    replies = decoded(info, sgl.l3_reply([mooncake_layout(True)]))
    with pytest.raises(DiscoveryError) as err:
        discover("http://h:1", *replies, WorkerFlags(page_size=16, dp_size=1, tp_size=2, topic="",
                                                     mooncake_attention="mha", mooncake_key_prefix="tenant1"))
    message = str(err.value)
    for part in ["--page-size 16", "block_size", "is 64", "--dp-size 1", "is 2", "--topic ''", "'kv'",
                 "--mooncake-attention 'mha'", "is_mla_backend True", "--mooncake-key-prefix 'tenant1'", PREFIX]:
        assert part in message, (part, message)
    assert "--tp-size" not in message  # agreeing flags are fine
    with pytest.raises(DiscoveryError, match="--hicache False but SGLang's enable_hierarchical_cache is True"):
        discover("http://h:1", *replies, WorkerFlags(hicache_enabled=False))
    with pytest.raises(DiscoveryError, match="--hicache-storage-backend 'none' but SGLang's hicache_storage_backend"):
        discover("http://h:1", *replies, WorkerFlags(hicache_storage_backend="none"))
    settings = discover("http://h:1", *replies, WorkerFlags(page_size=64, dp_size=2, mooncake_attention="mla",
                                                            mooncake_key_prefix=PREFIX,
                                                            hicache_storage_backend="mooncake"))
    assert settings.page_size == 64 and settings.mooncake.attention == AttentionKind.MLA


def test_kv_events_off_is_a_clear_error(sgl):
    for config in [None, {"publisher": "zmq", "endpoint": "ipc:///tmp/kv.sock"}, {"publisher": "null"}]:
        descriptor = sgl.kv_events(config)
        assert descriptor is None  # SGLang advertises nothing
        info = server_info(descriptor, kv_events_config=json.dumps(config) if config else None)
        with pytest.raises(DiscoveryError, match=r"does not advertise a KV-event publisher.*--kv-events-config"):
            discover("http://h:1", *decoded(info, None), WorkerFlags())


def test_an_older_server_without_the_descriptor(sgl):
    """Before the kv_events block (and /server_info, and the layout route): the publisher comes
    from the echoed --kv-events-config; without the layout route no Mooncake layout is guessed."""
    info = server_info(None, page_size=32, dp_size=2, hicache_storage_backend="mooncake", version="0.4.6",
                       kv_events_config=json.dumps(events_config(5600, 5700, host="0.0.0.0", topic="t")))
    del info["kv_events"]
    with FakeSglang(info, None, legacy=True) as server:
        served, layout = fetch(server.url, timeout_s=5)
        assert layout is None and server.requests == ["/get_server_info"]
        settings = discover(server.url, served, layout, WorkerFlags())
        assert (settings.endpoint, settings.replay_endpoint, settings.topic) == (
            "tcp://127.0.0.1:5600", "tcp://127.0.0.1:5700", "t")
        assert (settings.page_size, settings.dp_size, settings.mooncake,
                settings.engine_version) == (32, 2, None, "0.4.6")
        assert any("/get_hicache_l3_cache_layout" in note for note in settings.notes)
        settings = discover(server.url, served, layout, WorkerFlags(hicache_storage_backend="mooncake",
                                                                    mooncake_attention="mla"))
        assert settings.mooncake == MooncakeLayout(attention=AttentionKind.MLA)


def test_api_key_and_unreachable_server():
    info = server_info({"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 1, "block_size": 4})
    with FakeSglang(info, None, api_key="s3cret") as server:
        with pytest.raises(DiscoveryError, match="HTTP 401.*--sglang-api-key"):
            fetch(server.url, timeout_s=5)
        assert fetch(server.url, timeout_s=5, api_key="s3cret")[0].kv_events.block_size == 4
    with pytest.raises(DiscoveryError, match=r"cannot reach SGLang at http://127\.0\.0\.1:\d+"):
        fetch(f"127.0.0.1:{free_port()}", timeout_s=2)


def test_without_sglang_url_the_flags_are_required():
    with pytest.raises(DiscoveryError, match="--endpoint, --page-size are required unless --sglang-url"):
        manual_settings(WorkerFlags(model="m"))
    settings = manual_settings(WorkerFlags(endpoint="tcp://h:1", page_size=16, model="m",
                                           hicache_storage_backend="mooncake", tp_size=2))
    assert settings.mooncake == MooncakeLayout(tp_size=2) and settings.dp_size == 1


# --- the command ----------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_refuses_a_conflict_a_silent_server_and_an_unreachable_one(sgl):
    info = server_info(sgl.kv_events(events_config(), page_size=64))
    with FakeSglang(info, sgl.disabled("HiCache controller is not attached", page_size=64)) as server:
        out = run_cli("--sglang-url", server.url, "--page-size", "16")
        assert out.returncode == 2, out.stderr[-2000:]
        assert "--page-size 16 but SGLang's kv_events.block_size" in out.stderr and "is 64" in out.stderr
    with FakeSglang(server_info(None), None) as server:
        out = run_cli("--sglang-url", server.url)
        assert out.returncode == 2 and "--kv-events-config" in out.stderr, out.stderr[-2000:]
    port = free_port()
    out = run_cli("--sglang-url", f"http://127.0.0.1:{port}", "--sglang-timeout", "2")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"kvtier bridge: cannot reach SGLang at http://127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


def bind_publishers(n: int, replay: bool) -> tuple[int, int | None, list[SglangEventPublisher]]:
    """n kvtier SGLang-format publishers on consecutive free ports (and replay ports)."""
    for _ in range(20):
        base, replay_base = free_run(n), (free_run(n) if replay else None)
        publishers: list[SglangEventPublisher] = []
        try:
            for r in range(n):
                publishers.append(SglangEventPublisher(
                    f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{replay_base + r}" if replay else None))
            return base, replay_base, publishers
        except zmq.ZMQError:  # a port taken in between: try another run
            for publisher in publishers:
                publisher.close()
    raise AssertionError("could not bind the publishers")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp2-wildcard-mla", "dp1-no-l3-no-replay"])
def test_bridge_announces_what_sglang_reports(sgl, nats_server, redis_server, redis_client, case):
    """The real `kvtier bridge --sglang-url` (no --endpoint, --page-size, --model, --dp-size):
    its workers' metadata lands in Redis as SGLang reported it, and events published on the
    derived endpoints reach Redis as tier state."""
    dp, page = (2, 16) if case.startswith("dp2") else (1, 8)
    mla = case.endswith("mla")
    base, replay_base, publishers = bind_publishers(dp, replay=mla)
    config = events_config(base, replay_base, host="*" if mla else "127.0.0.1")
    info = server_info(sgl.kv_events(config, page_size=page, attn_dp_size=dp), page_size=page, attn_dp_size=dp,
                       tp_size=2, kv_events_config=json.dumps(config),
                       hicache_storage_backend="mooncake" if mla else None)
    reply = (sgl.l3_reply([mooncake_layout(True, page_size=page)] * dp) if mla
             else sgl.disabled("HiCache controller is not attached", page_size=page))
    workers = [f"w-dp{r}" for r in range(dp)] if dp > 1 else ["w"]
    keys = ModelKeys.for_model(MODEL)
    processes: list[KvtierProcess] = []
    started = time.monotonic()
    try:
        with FakeSglang(info, reply) as server:
            processes.append(processor_process(nats_server.url, redis_server.url))
            bridge = KvtierProcess("bridge", "--sglang-url", server.url, "--worker-id", "w", "--nats", nats_server.url,
                                   "--heartbeat", "0.5")
            processes.append(bridge)
            for worker in workers:
                wait_until(lambda w=worker: worker_announced(redis_client, MODEL, w), timeout=30,
                           what=lambda: "announced\n" + "\n".join(p.output()[-1500:] for p in processes))
            assert {"/server_info", "/get_hicache_l3_cache_layout"} <= set(server.requests)
            layout = (MooncakeLayout(attention=AttentionKind.MLA, tp_size=2, pp_size=1, key_prefix=PREFIX) if mla
                      else None)
            for rank, worker in enumerate(workers):
                meta = msgspec.json.decode(redis_client.get(keys.meta(worker)), type=WorkerMetadata)
                assert (meta.page_size, meta.dp_size, meta.dp_rank, meta.tp_size, meta.engine_worker_id) == (
                    page, dp, rank, 2, "w")
                assert meta.mooncake == layout
                assert meta.kv_events_endpoint == f"tcp://127.0.0.1:{base + rank}"
                assert meta.replay_endpoint == (f"tcp://127.0.0.1:{replay_base + rank}" if mla else "")
                assert (meta.http_endpoint, meta.engine_version) == (server.url, sglang_version())
                assert int(redis_client.hget(keys.page_sizes, worker)) == page
            # the derived endpoints are the right ones: each rank's events become its state
            for rank, (worker, publisher) in enumerate(zip(workers, publishers)):
                tokens = list(range(1000 * rank, 1000 * rank + 3 * page))
                hashes = sglang_block_hashes(tokens, page)
                event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=page,
                                    medium="GPU")

                def landed(w=worker, p=publisher, e=event, h=hashes):
                    if set(read_worker_pages(redis_client, MODEL, w)) == set(h):
                        return True
                    p.publish([e])  # until the subscription is up (no replay socket to fill the gap)
                    time.sleep(0.2)
                    return False

                wait_until(landed, timeout=30, what=lambda: "pages\n" + bridge.output()[-2000:])
            assert "discovered from SGLang" in bridge.output()
    finally:
        codes = stop_all(*reversed(processes))
        for publisher in publishers:
            publisher.close()
    assert codes[0] == 0, processes[-1].output()[-3000:]  # the bridge exits cleanly on SIGTERM
    assert time.monotonic() - started < 60
