"""SGLang's HTTP replies that `kvtier bridge --sglang-url` reads to learn a worker's metadata.

Only the fields kvtier uses are declared; every other field of these (large) replies is
ignored, so newer SGLang versions keep decoding. Shapes as of SGLang 0.5.23:

- `GET /server_info` (`entrypoints/http_server.py` `server_info`): the resolved server
  arguments at top level (`ServerArgs.resolved_dict()`: tp_size, page_size, ...), the
  scheduler's startup info, `version`, and `kv_events`, the KV-event publisher descriptor
  (`runtime_context.describe_kv_events_publisher`; null when publishing is off). Older
  servers answer `GET /get_server_info` with the same top level and may lack `kv_events`.
- `GET /get_hicache_l3_cache_layout`: the HiCache L3 object-key layout for external KV
  routers (`mem_cache/hicache_storage.py` `disabled_l3_layout` / `merge_l3_layouts`, filled
  by the Mooncake store's `describe_l3_object_layout`).
- `POST /generate` (native API): the body kvtier's clients send (`GenerateBody`), and the
  reply's `meta_info`, the worker's own account of a request, which `kvtier probe hicache` and
  the benchmarks read (`kvtier sim-worker` encodes its reply from the same types).
- What a gateway asks before it admits a worker (SGLang's model gateway `smg` asks for
  `/health`, `/v1/models`, `/server_info`, `/model_info` and `/v1/loads`): `ModelList`,
  `ModelInfo`, `VersionReply`, `LoadsReply`. `kvtier sim-worker` answers them from these types
  (with `ServerInfo` for `/server_info`), so a gateway that admits SGLang admits it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .limits import guarded

#: Parallelism sizes are bounded (a bridge opens a socket per DP rank, a router checks
#: 2 x TP x PP objects per page): at most 1024, as in worker.py.
Size = Annotated[int, msgspec.Meta(ge=1, le=1024)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class KvEventsDescriptor(msgspec.Struct, kw_only=True):
    """`/server_info` `kv_events`: where and how the worker publishes KV events."""

    publisher: str
    #: May be a bind wildcard ("*", "0.0.0.0", "[::]"): subscribers substitute the worker
    #: URL's host. IPv6 hosts come bracketed.
    endpoint_host: str
    #: DP rank r publishes on endpoint_port_base + r.
    endpoint_port_base: Port
    topic: str = ""
    #: Page size the events' block hashes are computed at (page_size x DCP size).
    block_size: int
    #: Number of publishers (DP ranks), one per port.
    dp_size: Annotated[int, msgspec.Meta(le=1024)] = 1
    #: ROUTER replay socket of rank r: replay_endpoint_port_base + r (same host rule). Absent
    #: when the worker has no tcp replay endpoint, and in versions before it was advertised.
    replay_endpoint_port_base: Port | None = None


class KvEventsConfig(msgspec.Struct, kw_only=True):
    """The `--kv-events-config` JSON string, as echoed in `/server_info`'s server arguments.
    Read only when a server has no `kv_events` descriptor (older versions)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    #: "default" (SGLang's hashes) or "dynamo" (hashes namespaced by extra_key/cache_salt).
    format: str = "default"


class ServerInfo(msgspec.Struct, kw_only=True):
    """`GET /server_info` (only the fields kvtier uses)."""

    #: UNSET: the server predates the descriptor; None: KV events are not published.
    kv_events: KvEventsDescriptor | None | msgspec.UnsetType = msgspec.UNSET
    kv_events_config: str | None = None
    tp_size: Size = 1
    pp_size: Size = 1
    dp_size: Size = 1
    dcp_size: Annotated[int, msgspec.Meta(le=1024)] = 1
    page_size: int | None = None
    enable_hierarchical_cache: bool = False
    hicache_storage_backend: str | None = None
    hicache_write_policy: str | None = None
    model_path: str | None = None
    served_model_name: str | None = None
    version: str = ""
    #: Read by gateways, not by kvtier (`kvtier sim-worker` sends them as SGLang does).
    hicache_ratio: float | None = None
    context_length: int | None = None
    max_running_requests: int | None = None


class L3Pool(msgspec.Struct, kw_only=True):
    """One pool of a page's objects in the L3 store: its keys are `<digest><suffix>`."""

    pool: str
    suffixes: list[str] = msgspec.field(default_factory=list)
    #: "all_pages" (every page needs these objects) or "trailing_pages".
    hit_policy: str = "all_pages"
    trailing_pages: int | None = None


class L3ObjectLayout(msgspec.Struct, kw_only=True):
    pools: list[L3Pool] = msgspec.field(default_factory=list)
    #: Joined to every key with "_" (SGLang's Mooncake config prefix); None: no prefix.
    key_prefix: str | None = None
    is_mla_backend: bool | None = None
    pp_rank: int | None = None
    pp_size: int = 1


class L3CacheLayout(msgspec.Struct, kw_only=True):
    """`GET /get_hicache_l3_cache_layout`."""

    enabled: bool
    backend: str | None = None
    page_size: int | None = None
    hicache_object_layout: L3ObjectLayout = msgspec.field(default_factory=L3ObjectLayout)
    #: Why the layout is not usable (enabled false).
    reason: str | None = None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`sampling_params` of a native `/generate` body, the knobs kvtier's clients set (an unset
    one is left out, so the server's default applies)."""

    #: Decode steps; `kvtier sim-worker` keeps the engine's batch busy for that many.
    max_new_tokens: int | None = None
    temperature: float | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    """`POST /generate`'s body as kvtier sends it (`kvtier probe hicache`, the benchmarks'
    clients of `kvtier sim-worker`): SGLang's native request, only the fields kvtier sets.
    (A proxying router reads a client's body as `routing.GenerateRequest`.)"""

    input_ids: list[int]
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)


class CachedTokensDetails(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`meta_info.cached_tokens_details`: the cached prompt tokens by tier (SGLang with HiCache)."""

    device: int | None = None
    host: int | None = None
    #: Read from the L3 backend (whose name SGLang adds as `storage_backend`).
    storage: int | None = None
    #: `kvtier sim-worker`'s name for the L3 part.
    l3: int | None = None


class GenerateMetaInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`meta_info` of a `POST /generate` reply (only the fields kvtier reads). `kvtier
    sim-worker` encodes its reply from this type, so the simulator answers what kvtier decodes;
    an unset (None) field is left out of the encoding."""

    prompt_tokens: int | None = None
    #: Prompt tokens not recomputed.
    cached_tokens: int | None = None
    #: null or absent when nothing was cached, and on servers that do not report it.
    cached_tokens_details: CachedTokensDetails | None = None
    #: `kvtier sim-worker`: prompt tokens prefilled (the prompt less the cached pages).
    recomputed_tokens: int | None = None
    #: `kvtier sim-worker`: arrival -> prefill start, simulated seconds.
    queue_s: float | None = None
    #: The worker's time to first token (`kvtier sim-worker`: `ttft_s`).
    ttft_s: float | None = None
    ttft: float | None = None
    #: Request latency (SGLang); with max_new_tokens=1 the first token is the last.
    e2e_latency: float | None = None
    #: `kvtier sim-worker`: > 0 when the rank had already served a request with a later `now`
    #: (this one queued behind later work by that much).
    arrived_behind_s: float | None = None


class GenerateReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    #: `kvtier sim-worker`: the rank that served the request (SGLang does not send it).
    rank: int | None = None
    meta_info: GenerateMetaInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of `GET /v1/models`. A gateway tells SGLang from other engines by `owned_by`."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "sglang"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    """`GET /v1/models`."""

    object: str = "list"
    data: list[ModelCard] = msgspec.field(default_factory=list)


class ModelInfo(msgspec.Struct, kw_only=True):
    """`GET /model_info` (and the older `/get_model_info`)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | None = None
    weight_version: str = "default"
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    model_type: str | None = None
    architectures: list[str] | None = None


class VersionReply(msgspec.Struct, kw_only=True):
    """`GET /version`."""

    version: str


class LoadQueues(msgspec.Struct, kw_only=True):
    """`/v1/loads` `queues`: the waiting requests by why they wait."""

    waiting: int = 0
    grammar: int = 0
    paused: int = 0
    retracted: int = 0
    prealloc_ready: int = 0


class RankLoad(msgspec.Struct, kw_only=True):
    """One DP rank of `GET /v1/loads` (SGLang's `LoadSnapshot`, the core fields and `queues`)."""

    dp_rank: int
    timestamp: float = 0.0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_uncached_tokens: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    queues: LoadQueues = msgspec.field(default_factory=LoadQueues)


class LoadsReply(msgspec.Struct, kw_only=True):
    """`GET /v1/loads[?include=core,queues,...]`."""

    timestamp: str
    version: str
    accelerator: str | None = None
    num_accelerators: int = 1
    loads: list[RankLoad] = msgspec.field(default_factory=list)


_server_info = msgspec.json.Decoder(ServerInfo)
_l3_layout = msgspec.json.Decoder(L3CacheLayout)
_kv_events_config = msgspec.json.Decoder(KvEventsConfig)
#: One request answers an object; a batch of requests a list of them.
_generate_reply = msgspec.json.Decoder(GenerateReply | list[GenerateReply])


def decode_server_info(body: bytes | str) -> ServerInfo:
    """`GET /server_info`; raises msgspec.DecodeError/ValidationError (as do the two below)."""
    return guarded(_server_info.decode, body)


def decode_l3_cache_layout(body: bytes | str) -> L3CacheLayout:
    return guarded(_l3_layout.decode, body)


def decode_kv_events_config(text: bytes | str) -> KvEventsConfig:
    return guarded(_kv_events_config.decode, text)


def decode_generate_meta_info(body: bytes | str) -> GenerateMetaInfo:
    """`POST /generate`'s reply -> its `meta_info` (of the first request, for a batch; empty
    when there is none)."""
    reply = guarded(_generate_reply.decode, body)
    if isinstance(reply, list):
        reply = reply[0] if reply else GenerateReply()
    return reply.meta_info or GenerateMetaInfo()
