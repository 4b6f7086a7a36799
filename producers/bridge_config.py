"""What one `kvtier bridge` runs with: `BridgeConfig`, its settings (bridge_settings.py) with
the worker they resolved to, and `rank_configs` to fan it out per DP rank."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtier.plumbing.streams import StreamSettings
from kvtier.producers.bridge_settings import BridgeSettings
from kvtier.producers.engine_health import EngineHealthCheck
from kvtier.producers.sglang_discovery import WorkerFlags, WorkerSettings
from kvtier.schemas.worker import MooncakeLayout, WorkerMetadata


@dataclass(kw_only=True)
class BridgeConfig:
    #: What the operator said; the settings below it are what they resolved to.
    settings: BridgeSettings
    endpoint: str
    worker_id: str
    model: str
    page_size: int
    replay_endpoint: str
    topic: str
    dp_size: int
    tp_size: int
    pp_size: int
    #: Announced only for a worker with an L3 backend: only it can fetch pages from the shared pool.
    mooncake: MooncakeLayout | None
    http_endpoint: str
    hicache_enabled: bool | None
    hicache_write_policy: str
    #: The engine's version, when learned from its /server_info (`--sglang-url`).
    engine_version: str
    #: None: the lease is renewed whatever the engine does (no worker URL, or the check is off).
    engine_health: EngineHealthCheck | None
    dp_rank: int = 0
    engine_worker_id: str = ""
    resync_min_interval_s: float = 2.0

    @classmethod
    def resolved(cls, settings: BridgeSettings, worker: WorkerSettings) -> BridgeConfig:
        """The bridge's config: the settings, with the worker as discovered or given."""
        health_path = settings.health_path
        return cls(
            settings=settings, endpoint=worker.endpoint, worker_id=settings.worker_id, model=worker.model,
            page_size=worker.page_size, replay_endpoint=worker.replay_endpoint, topic=worker.topic,
            dp_size=worker.dp_size, tp_size=worker.tp_size, pp_size=worker.pp_size, mooncake=worker.mooncake,
            http_endpoint=worker.http_endpoint, hicache_enabled=worker.hicache_enabled,
            hicache_write_policy=worker.hicache_write_policy, engine_version=worker.engine_version,
            engine_health=EngineHealthCheck(url=worker.http_endpoint.rstrip("/") + health_path,
                                            timeout_s=settings.health_timeout_s,
                                            metrics_url=worker.http_endpoint.rstrip("/") + "/metrics")
            if worker.http_endpoint and health_path else None,
        )

    # What the bridge reads straight from the settings.
    @property
    def nats_url(self) -> str:
        return self.settings.nats_url

    @property
    def heartbeat_s(self) -> float:
        return self.settings.heartbeat_s

    @property
    def lease_ttl_s(self) -> float:
        return self.settings.lease_ttl_s

    @property
    def replay_timeout_s(self) -> float:
        return self.settings.replay_timeout_s

    @property
    def catch_up_s(self) -> float:
        return self.settings.catch_up_s

    @property
    def max_batches_per_message(self) -> int:
        return self.settings.max_batches_per_message

    @property
    def max_pages_per_message(self) -> int:
        return self.settings.max_pages_per_message

    @property
    def keep_token_ids(self) -> bool:
        return not self.settings.drop_token_ids

    @property
    def streams(self) -> StreamSettings:
        return self.settings.stream.settings()

    @property
    def partitions_explicit(self) -> bool:
        return self.settings.stream.partitions_explicit

    def metadata(self) -> WorkerMetadata:
        return WorkerMetadata(
            worker_id=self.worker_id, model=self.model,
            engine_worker_id=self.engine_worker_id or self.worker_id,
            dp_rank=self.dp_rank, dp_size=self.dp_size, page_size=self.page_size,
            tp_size=self.tp_size, pp_size=self.pp_size,
            mooncake=self.mooncake,
            kv_events_endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
            http_endpoint=self.http_endpoint, engine_version=self.engine_version,
            hicache_enabled=self.hicache_enabled, hicache_write_policy=self.hicache_write_policy,
        )


def worker_flags(settings: BridgeSettings) -> WorkerFlags:
    """What the settings say about the worker, for discovery to check against SGLang or to fill in."""
    return WorkerFlags(
        endpoint=settings.endpoint, replay_endpoint=settings.replay_endpoint, topic=settings.topic,
        model=settings.model, page_size=settings.page_size, dp_size=settings.dp_size, tp_size=settings.tp_size,
        pp_size=settings.pp_size, hicache_storage_backend=settings.hicache_storage_backend,
        mooncake_attention=settings.mooncake_attention, mooncake_key_prefix=settings.mooncake_key_prefix,
        http_endpoint=settings.http_endpoint, hicache_enabled=settings.hicache_enabled,
        hicache_write_policy=settings.hicache_write_policy,
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
