"""What one `kvtier bridge` is told: `BridgeConfig`, and `rank_configs` to fan it out per DP rank."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.plumbing.streams import StreamSettings
from kvtier.producers.engine_health import EngineHealthCheck
from kvtier.schemas.worker import AttentionKind, MooncakeLayout, WorkerMetadata


@dataclass
class BridgeConfig:
    endpoint: str
    worker_id: str
    model: str
    page_size: int
    nats_url: str
    replay_endpoint: str = ""
    topic: str = ""
    dp_rank: int = 0
    dp_size: int = 1
    engine_worker_id: str = ""
    tp_size: int = 1
    pp_size: int = 1
    mooncake_attention: str = "mha"
    mooncake_key_prefix: str = ""
    #: SGLang's --hicache-storage-backend: only a worker with an L3 backend can fetch pages
    #: from the shared pool, so only then is its Mooncake layout announced.
    hicache_storage_backend: str = "none"
    http_endpoint: str = ""
    hicache_enabled: bool | None = None
    hicache_write_policy: str = ""
    #: The engine's version, when learned from its /server_info (`--sglang-url`).
    engine_version: str = ""
    heartbeat_s: float = 2.0
    lease_ttl_s: float = 10.0
    #: None: the lease is renewed whatever the engine does (no worker URL, or the check is off).
    engine_health: EngineHealthCheck | None = None
    max_batches_per_message: int = 512
    max_pages_per_message: int = 16384
    keep_token_ids: bool = True
    replay_timeout_s: float = 3.0
    resync_min_interval_s: float = 2.0
    streams: StreamSettings = field(default_factory=StreamSettings)
    partitions_explicit: bool = False

    def metadata(self) -> WorkerMetadata:
        return WorkerMetadata(
            worker_id=self.worker_id, model=self.model,
            engine_worker_id=self.engine_worker_id or self.worker_id,
            dp_rank=self.dp_rank, dp_size=self.dp_size, page_size=self.page_size,
            tp_size=self.tp_size, pp_size=self.pp_size,
            mooncake=MooncakeLayout(attention=AttentionKind(self.mooncake_attention), tp_size=self.tp_size,
                                    pp_size=self.pp_size, key_prefix=self.mooncake_key_prefix)
            if self.hicache_storage_backend == "mooncake" else None,
            kv_events_endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
            http_endpoint=self.http_endpoint, engine_version=self.engine_version,
            hicache_enabled=self.hicache_enabled, hicache_write_policy=self.hicache_write_policy,
        )


def rank_configs(base: BridgeConfig) -> list[BridgeConfig]:
    """One config per DP rank: rank r listens on the endpoint's port + r (SGLang's rule)."""
    if base.dp_size == 1:
        return [base]
    configs = []
    for rank in range(base.dp_size):
        configs.append(replace(
            base, dp_rank=rank, worker_id=f"{base.worker_id}-dp{rank}", engine_worker_id=base.worker_id,
            endpoint=_port_plus(base.endpoint, rank),
            replay_endpoint=_port_plus(base.replay_endpoint, rank) if base.replay_endpoint else "",
        ))
    return configs


def _port_plus(endpoint: str, offset: int) -> str:
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} has no numeric port to offset for DP ranks")
    return f"{head}:{int(port) + offset}"
