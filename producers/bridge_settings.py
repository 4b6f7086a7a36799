"""What the operator tells one `kvtier bridge`: `BridgeSettings`, each setting declared once
with its flag (kvtier/plumbing/settings.py), so the command's flags and docs/DEPLOY.md's table
come from here. What the worker turns out to be (discovered from SGLang or given) is resolved
from them in bridge_config.py. Light to import: the command's parser is built from it."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.plumbing.settings import (
    Choice,
    SettingsError,
    choice,
    group,
    on_off,
    positive_float,
    positive_int,
    required,
    setting,
    switch,
    text_choice,
    worker_id_text,
)
from kvtier.plumbing.stream_flags import StreamFlags
from kvtier.schemas.worker import ONE_RANK, UNSPLIT, AttentionKind

#: The engine's health answer is awaited this long at most, or half the lease when that is shorter.
HEALTH_TIMEOUT_S = 5.0


class StorageBackend(Choice):
    """SGLang's --hicache-storage-backend, as far as the bridge cares: an L3 pool or none."""

    NONE = "none"
    MOONCAKE = "mooncake"


@dataclass(kw_only=True)
class BridgeSettings:
    sglang_url: str = setting(
        "", flag="--sglang-url",
        help="The SGLang server's HTTP address (e.g. http://10.0.0.5:30000). At start the bridge reads its "
             "/server_info and /get_hicache_l3_cache_layout and takes the endpoints, page size, DP/TP/PP sizes, "
             "model and Mooncake layout from them; a flag that disagrees with the server is an error.")
    sglang_timeout: float = setting(
        5.0, flag="--sglang-timeout", parse=positive_float,
        help="Seconds to wait for each of SGLang's replies at start (--sglang-url).")
    sglang_api_key: str = setting(
        "", flag="--sglang-api-key",
        help="SGLang's --api-key, sent as a bearer token to /server_info (--sglang-url), if it has one.")
    # None below: not given, so discovered from SGLang (--sglang-url) or SGLang's own default.
    endpoint: str | None = setting(
        None, flag="--endpoint",
        help="The worker's ZMQ PUB endpoint to connect to, e.g. tcp://10.0.0.5:5557 (the 'endpoint' of "
             "--kv-events-config with '*' replaced by the worker's address). DP rank r uses port + r. Required "
             "unless --sglang-url is given.")
    replay_endpoint: str | None = setting(
        None, flag="--replay-endpoint",
        help="The worker's ZMQ replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558. Without it a gap or a bridge "
             "restart cannot be recovered and starts a new epoch (the worker's state is rebuilt). Discovered with "
             "--sglang-url when SGLang has one.")
    topic: str | None = setting(None, flag="--topic",
                                help="ZMQ topic to subscribe to ('' = all, SGLang's default).")
    worker_id: str = required(
        flag="--worker-id", parse=worker_id_text,
        help="Stable id of this worker (letters, digits, '_', '-'); routers return it. With --dp-size N>1 rank r "
             "becomes <worker-id>-dp<r>.")
    model: str | None = setting(
        None, flag="--model",
        help="Served model name, as clients send it to the router. Required unless --sglang-url is given (then "
             "SGLang's served_model_name).")
    page_size: int | None = setting(
        None, flag="--page-size", parse=positive_int,
        help="SGLang --page-size of the worker (tokens per KV page). Required unless --sglang-url is given.")
    nats_url: str = required(flag="--nats", dest="nats", help="NATS URL, e.g. nats://127.0.0.1:4222.")
    dp_size: int | None = setting(
        None, flag="--dp-size", parse=positive_int,
        help="Attention data-parallel ranks of the worker; each rank publishes on endpoint port + rank (default "
             f"{ONE_RANK}).")
    tp_size: int | None = setting(None, flag="--tp-size", parse=positive_int,
                                  help=f"Tensor-parallel size (Mooncake key layout; default {UNSPLIT.tp_size}).")
    pp_size: int | None = setting(None, flag="--pp-size", parse=positive_int,
                                  help=f"Pipeline-parallel size (Mooncake key layout; default {UNSPLIT.pp_size}).")
    mooncake_attention: AttentionKind | None = choice(
        AttentionKind, None, flag="--mooncake-attention",
        help=f"Attention kind, which decides the Mooncake key layout of a page ({UNSPLIT.attention.value}, the "
             "default: _k/_v per TP rank; mla: one __k key).")
    mooncake_key_prefix: str | None = setting(None, flag="--mooncake-key-prefix",
                                              help="Prefix SGLang puts before Mooncake keys, if any.")
    hicache_storage_backend: StorageBackend | None = choice(
        StorageBackend, None, flag="--hicache-storage-backend",
        help="The worker's SGLang --hicache-storage-backend (default none); with mooncake its key layout is "
             "announced and routers credit it for pages in the shared pool. With --sglang-url, mooncake also "
             "announces an MHA layout that SGLang itself declines to describe.")
    hicache_enabled: bool | None = on_off(
        None, flag="--hicache", dest="hicache",
        help="Whether the worker runs SGLang HiCache (--enable-hierarchical-cache), announced so `kvtier doctor` "
             "can tell a missing host tier from a disabled one (with --sglang-url: read from the server).")
    hicache_write_policy: str | None = text_choice(
        None, flag="--hicache-write-policy", choices=("write_through", "write_through_selective", "write_back"),
        help="The worker's SGLang --hicache-write-policy (with --sglang-url: read from the server).")
    http_endpoint: str | None = setting(
        None, flag="--worker-url",
        help="The engine's HTTP base URL (e.g. http://10.0.0.5:30000), for a router in --proxy mode and for the "
             "bridge's engine health check (--engine-health-path; default: --sglang-url).")
    heartbeat_s: float = setting(2.0, flag="--heartbeat", parse=positive_float,
                                 help="Seconds between announcements (metadata + lease renewal).")
    lease_ttl_s: float = setting(
        10.0, flag="--lease-ttl", parse=positive_float,
        help="Seconds a worker stays live without a heartbeat; then its pages are removed.")
    engine_health_path: str = setting(
        "/health", flag="--engine-health-path",
        help="Path under the worker URL (--worker-url, else --sglang-url) of the engine's health endpoint "
             "(SGLang: /health). Before each heartbeat the bridge GETs it and renews the worker's lease only on a "
             "2xx answer, so a dead or hung engine's lease runs out (--lease-ttl) and routers stop choosing it; a "
             "worker whose engine has not answered yet is not announced. KV events are forwarded either way. '' "
             "turns the check off (the lease is renewed whatever the engine does); without a worker URL there is "
             "nothing to check.")
    engine_health_timeout_s: float | None = setting(
        None, flag="--engine-health-timeout", parse=positive_float,
        help="Seconds to wait for the engine's health answer; none counts as down. SGLang answers /health only "
             "after polling its scheduler for a second or two, so keep this above 2. Must be shorter than "
             f"--lease-ttl (default: {HEALTH_TIMEOUT_S:g}, or half of --lease-ttl when that is shorter).")
    max_batches_per_message: int = setting(512, flag="--max-batches-per-message", parse=positive_int,
                                           help="Engine batches a burst may merge into one NATS message.")
    max_pages_per_message: int = setting(
        16384, flag="--max-pages-per-message", parse=positive_int,
        help="Page transitions per NATS message before it is split (keeps messages under 1 MB).")
    replay_timeout_s: float = setting(
        3.0, flag="--replay-timeout", parse=positive_float,
        help="Seconds to wait for the engine's replay socket to answer; a starting bridge asks up to 3 times, "
             "doubling it, before it begins an epoch without the replay (partial).")
    catch_up_s: float = setting(
        1.0, flag="--catch-up-interval", parse=positive_float,
        help="Seconds without a live engine batch after which the bridge asks the replay socket for anything "
             "newer than what it forwarded: batches the PUB path lost while nothing followed them (a SUB that "
             "connected after the engine's last batch, a reconnect) would otherwise wait for the next batch.")
    drop_token_ids: bool = switch(
        flag="--drop-token-ids",
        help="Do not forward token ids of stored pages (smaller messages; disables hash validation).")
    stream: StreamFlags = group(StreamFlags)

    @property
    def health_path(self) -> str:
        """--engine-health-path; '' when the check is off."""
        return self.engine_health_path.strip()

    @property
    def health_timeout_s(self) -> float:
        if self.engine_health_timeout_s is not None:
            return self.engine_health_timeout_s
        return min(HEALTH_TIMEOUT_S, self.lease_ttl_s / 2)

    def validate(self) -> None:
        """Refuses a health check that cannot work, before anything is contacted."""
        path = self.health_path
        if path and not path.startswith("/"):
            raise SettingsError(f"--engine-health-path {path!r} must start with '/' (e.g. /health), "
                                "or be '' for no check")
        if path and self.health_timeout_s >= self.lease_ttl_s:
            # A healthy engine answering near the timeout would let the lease run out between renewals.
            raise SettingsError(f"--engine-health-timeout ({self.health_timeout_s:g}s) must be shorter than "
                                f"--lease-ttl ({self.lease_ttl_s:g}s)")
