"""`kvtier bridge --sglang-url`: learn a worker's metadata from SGLang itself.

At start the bridge reads SGLang's `GET /server_info` (its `kv_events` descriptor and the
resolved server arguments) and `GET /get_hicache_l3_cache_layout`; `discover` turns those
decoded replies plus the operator's explicit flags into the settings of one bridge. It is pure
(no I/O) so every rule is unit-tested; `fetch` is the HTTP part.

Rules:
- Facts about the running engine (page size to hash at, DP publishers, TP/PP, topic, L3
  backend, Mooncake attention kind and key prefix) come from the server. An explicit flag that
  disagrees is a startup error naming both values: a wrong page size or rank count would make
  every routed request miss silently, so there is no override; the escape hatch is to run
  without --sglang-url and give every flag.
- Addresses and names are the operator's to choose: --endpoint / --replay-endpoint (e.g.
  behind NAT), --model, --worker-url replace the derived values.
- A wildcard publisher host ("*", "0.0.0.0", "[::]") becomes the --sglang-url host.
- The Mooncake layout is announced only when SGLang's L3 layout is enabled and kvtier checks
  exactly the objects SGLang requires for a hit (else a warning: routing works without
  shared-pool credit). SGLang 0.5.23 declines to describe MHA layouts (their keys embed the
  TP rank); `--hicache-storage-backend mooncake` then announces kvtier's per-TP-rank layout
  with the key prefix SGLang reported.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import msgspec

from kvtier.schemas.hashes import PageDigest
from kvtier.schemas.mooncake import mooncake_object_keys
from kvtier.schemas.sglang_server import (
    KvEventsDescriptor,
    L3CacheLayout,
    ServerInfo,
    decode_kv_events_config,
    decode_l3_cache_layout,
    decode_server_info,
)
from kvtier.schemas.worker import ONE_RANK, UNSPLIT, AttentionKind, MooncakeLayout

log = logging.getLogger("kvtier.bridge.discovery")

#: Bind wildcards SGLang may advertise as endpoint_host (IPv6 comes bracketed; both spellings).
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})

_KV_EVENTS_HINT = ("start SGLang with --kv-events-config "
                   "'{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}' "
                   "(a tcp:// endpoint: ipc:// and inproc:// are not advertised), or run the bridge without "
                   "--sglang-url and give --endpoint, --page-size and --model")


class DiscoveryError(ValueError):
    """SGLang could not be asked, or its answer cannot drive this bridge (one clear line)."""


@dataclass(frozen=True)
class WorkerFlags:
    """What the operator gave on the command line or in KVTIER_* (None: not given)."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str | None = None
    model: str | None = None
    page_size: int | None = None
    dp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    hicache_storage_backend: str | None = None  # "none" | "mooncake"
    mooncake_attention: str | None = None  # "mha" | "mla"
    mooncake_key_prefix: str | None = None
    http_endpoint: str | None = None
    hicache_enabled: bool | None = None
    hicache_write_policy: str | None = None


@dataclass(frozen=True)
class WorkerSettings:
    """Everything the bridge announces about its worker, resolved."""

    endpoint: str
    replay_endpoint: str
    topic: str
    model: str
    page_size: int
    dp_size: int
    tp_size: int
    pp_size: int
    mooncake: MooncakeLayout | None
    http_endpoint: str
    engine_version: str = ""
    hicache_enabled: bool | None = None
    hicache_write_policy: str = ""
    #: Decisions an operator should know about (logged as warnings at start).
    notes: tuple[str, ...] = ()


def manual_settings(flags: WorkerFlags) -> WorkerSettings:
    """Without --sglang-url: the flags, as before discovery existed."""
    missing = [name for name, value in (("--endpoint", flags.endpoint), ("--page-size", flags.page_size),
                                        ("--model", flags.model)) if not value]
    if missing:
        raise DiscoveryError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required unless "
                             "--sglang-url is given (then they are read from SGLang's /server_info)")
    assert flags.endpoint is not None and flags.model is not None and flags.page_size is not None  # checked above
    tp_size, pp_size = flags.tp_size or UNSPLIT.tp_size, flags.pp_size or UNSPLIT.pp_size
    mooncake = None
    if flags.hicache_storage_backend == "mooncake":
        mooncake = MooncakeLayout(attention=AttentionKind(flags.mooncake_attention or UNSPLIT.attention),
                                  tp_size=tp_size, pp_size=pp_size, key_prefix=flags.mooncake_key_prefix or "")
    return WorkerSettings(
        endpoint=flags.endpoint, replay_endpoint=flags.replay_endpoint or "", topic=flags.topic or "",
        model=flags.model, page_size=flags.page_size, dp_size=flags.dp_size or ONE_RANK, tp_size=tp_size,
        pp_size=pp_size,
        mooncake=mooncake, http_endpoint=flags.http_endpoint or "",
        hicache_enabled=flags.hicache_enabled, hicache_write_policy=flags.hicache_write_policy or "",
    )


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DiscoveryError(f"--sglang-url {url!r} is not an http://HOST:PORT URL of the SGLang server")
    return url


def _url_host(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def discover(sglang_url: str, info: ServerInfo, layout: L3CacheLayout | None,
             flags: WorkerFlags) -> WorkerSettings:
    """The bridge's settings from SGLang's decoded replies (`layout` None: the server has no
    L3 layout endpoint) and the explicit flags. Raises DiscoveryError naming every conflict."""
    url = normalize_url(sglang_url)
    notes: list[str] = []
    conflicts: list[str] = []
    events = _kv_events(url, info, notes)
    if events.publisher != "zmq":
        raise DiscoveryError(f"SGLang at {url} publishes KV events with publisher {events.publisher!r}; "
                             "kvtier bridge reads the zmq publisher")
    page_size, dp_size, tp_size, pp_size, topic = _engine_facts(info, events, flags, conflicts)
    mooncake = _mooncake(info, layout, flags, tp_size, pp_size, page_size, conflicts, notes)
    if conflicts:
        raise DiscoveryError(f"the flags disagree with SGLang at {url}: " + "; ".join(conflicts)
                             + ". Drop those flags to use the server's values (or fix them)")
    if page_size <= 0 or dp_size <= 0:
        raise DiscoveryError(f"SGLang at {url} advertises block_size {page_size} and dp_size {dp_size}; both must be "
                             "positive")
    endpoint, replay = _endpoints(url, events, flags, notes)
    _note_event_format(info, notes)

    model = flags.model or info.served_model_name or info.model_path
    if not model:
        raise DiscoveryError(f"SGLang at {url} reports neither served_model_name nor model_path; give --model")
    return WorkerSettings(
        endpoint=endpoint, replay_endpoint=replay, topic=topic, model=model, page_size=page_size, dp_size=dp_size,
        tp_size=tp_size, pp_size=pp_size, mooncake=mooncake, http_endpoint=flags.http_endpoint or url,
        engine_version=info.version, notes=tuple(notes),
        hicache_enabled=info.enable_hierarchical_cache,
        hicache_write_policy=(info.hicache_write_policy or "") if info.enable_hierarchical_cache else "",
    )


def _engine_facts(info: ServerInfo, events: KvEventsDescriptor, flags: WorkerFlags,
                  conflicts: list[str]) -> tuple[int, int, int, int, str]:
    """(page size, DP ranks, TP size, PP size, topic) as SGLang serves them; each flag that
    disagrees is added to `conflicts`."""

    def fact(flag: str, given, served, what: str):
        if given is not None and given != served:
            conflicts.append(f"{flag} {given!r} but SGLang's {what} is {served!r}")
        return served

    page_size = fact("--page-size", flags.page_size, events.block_size,
                     "kv_events.block_size (the page size it hashes KV events at)")
    dp_size = fact("--dp-size", flags.dp_size, events.dp_size,
                   "kv_events.dp_size (KV-event publishers, one per DP rank)")
    tp_size = fact("--tp-size", flags.tp_size, info.tp_size, "tp_size")
    pp_size = fact("--pp-size", flags.pp_size, info.pp_size, "pp_size")
    topic = fact("--topic", flags.topic, events.topic, "kv_events.topic")
    fact("--hicache", flags.hicache_enabled, info.enable_hierarchical_cache, "enable_hierarchical_cache")
    if info.enable_hierarchical_cache and info.hicache_write_policy:
        fact("--hicache-write-policy", flags.hicache_write_policy, info.hicache_write_policy, "hicache_write_policy")
    return page_size, dp_size, tp_size, pp_size, topic


def _endpoints(url: str, events: KvEventsDescriptor, flags: WorkerFlags, notes: list[str]) -> tuple[str, str]:
    """(KV-event endpoint, replay endpoint or ""): the advertised ones, unless a flag replaces them."""
    host = events.endpoint_host
    if host in WILDCARD_HOSTS:
        host = _url_host(url)
    endpoint = f"tcp://{host}:{events.endpoint_port_base}"
    replay = f"tcp://{host}:{events.replay_endpoint_port_base}" if events.replay_endpoint_port_base else ""
    if flags.endpoint and flags.endpoint != endpoint:
        notes.append(f"--endpoint {flags.endpoint} replaces the advertised {endpoint}")
        endpoint = flags.endpoint
    if flags.replay_endpoint:
        if flags.replay_endpoint != replay:
            notes.append(f"--replay-endpoint {flags.replay_endpoint} replaces the advertised {replay or '(none)'}")
        replay = flags.replay_endpoint
    if not replay:
        notes.append("SGLang advertises no replay endpoint: a missed batch or a bridge restart starts a new epoch "
                     "(the worker's state is rebuilt); add \"replay_endpoint\":\"tcp://*:PORT\" to its "
                     "--kv-events-config to recover them instead")
    return endpoint, replay


def _note_event_format(info: ServerInfo, notes: list[str]) -> None:
    """A note when SGLang's KV events use a format other than "default"."""
    if not info.kv_events_config:
        return
    try:
        configured = decode_kv_events_config(info.kv_events_config)
    except (msgspec.DecodeError, msgspec.ValidationError):
        configured = None
    if configured is not None and configured.format != "default":
        notes.append(f"SGLang's KV events use format {configured.format!r}: requests carrying a cache salt or "
                     "LoRA name hash differently from their tokens and will not match cached pages")


def _kv_events(url: str, info: ServerInfo, notes: list[str]) -> KvEventsDescriptor:
    if isinstance(info.kv_events, KvEventsDescriptor):
        return info.kv_events
    configured = f" (its kv_events_config is {info.kv_events_config!r})" if info.kv_events_config else ""
    if info.kv_events is None or not info.kv_events_config:
        raise DiscoveryError(f"SGLang at {url} does not advertise a KV-event publisher: /server_info has no usable "
                             f"kv_events block{configured}. Fix: {_KV_EVENTS_HINT}")
    # A server that predates the descriptor: read its --kv-events-config instead.
    try:
        config = decode_kv_events_config(info.kv_events_config)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DiscoveryError(f"SGLang at {url} has an unreadable kv_events_config {info.kv_events_config!r}: "
                             f"{exc}") from None
    host, port = _tcp_host_port(config.endpoint)
    if config.publisher == "null" or port is None or not info.page_size:
        raise DiscoveryError(f"SGLang at {url} does not publish KV events kvtier can reach{configured}. "
                             f"Fix: {_KV_EVENTS_HINT}")
    _, replay_port = _tcp_host_port(config.replay_endpoint)
    notes.append("SGLang's /server_info predates the kv_events descriptor: endpoint, topic and ranks are read "
                 "from its kv_events_config, the page size from page_size")
    return KvEventsDescriptor(publisher=config.publisher, endpoint_host=host, endpoint_port_base=port,
                              topic=config.topic, block_size=info.page_size * max(info.dcp_size, 1),
                              dp_size=info.dp_size, replay_endpoint_port_base=replay_port)


def _tcp_host_port(endpoint: str | None) -> tuple[str, int | None]:
    if not endpoint or not endpoint.startswith("tcp://"):
        return "", None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return (host, int(port)) if port.isdigit() and 0 < int(port) <= 65535 else (host, None)


def _mooncake(info: ServerInfo, layout: L3CacheLayout | None, flags: WorkerFlags, tp_size: int, pp_size: int,
              page_size: int, conflicts: list[str], notes: list[str]) -> MooncakeLayout | None:
    wanted = flags.hicache_storage_backend
    backend = info.hicache_storage_backend or "none"
    if wanted is not None and (wanted == "mooncake") != (backend == "mooncake"):
        conflicts.append(f"--hicache-storage-backend {wanted!r} but SGLang's hicache_storage_backend is "
                         f"{info.hicache_storage_backend!r}")
        return None
    if backend != "mooncake":
        if backend != "none":
            notes.append(f"SGLang's HiCache L3 backend is {backend!r}: only a Mooncake pool is shared with the "
                         "router, so no shared-pool layout is announced")
        return None
    if layout is None:  # an SGLang without /get_hicache_l3_cache_layout
        if wanted == "mooncake":
            notes.append("SGLang has no /get_hicache_l3_cache_layout: the Mooncake layout comes from "
                         "--mooncake-attention / --mooncake-key-prefix")
            return MooncakeLayout(attention=AttentionKind(flags.mooncake_attention or UNSPLIT.attention),
                                  tp_size=tp_size,
                                  pp_size=pp_size, key_prefix=flags.mooncake_key_prefix or "")
        notes.append("SGLang has no /get_hicache_l3_cache_layout, so its Mooncake key layout is unknown and none is "
                     "announced; give --hicache-storage-backend mooncake (with --mooncake-attention, "
                     "--mooncake-key-prefix) to announce one")
        return None
    return _mooncake_from_layout(layout, flags, tp_size, pp_size, page_size, conflicts, notes)


def _mooncake_from_layout(layout: L3CacheLayout, flags: WorkerFlags, tp_size: int, pp_size: int, page_size: int,
                          conflicts: list[str], notes: list[str]) -> MooncakeLayout | None:
    """The layout to announce for a Mooncake backend, from SGLang's /get_hicache_l3_cache_layout reply."""
    wanted = flags.hicache_storage_backend
    inner = layout.hicache_object_layout
    # Only the Mooncake store describes itself (attention kind, key prefix); a disabled_l3_layout
    # reply (no controller, no store attached) does not.
    described = inner.is_mla_backend is not None
    attention = flags.mooncake_attention
    prefix = flags.mooncake_key_prefix
    if described:
        served_attention = "mla" if inner.is_mla_backend else "mha"
        served_prefix = inner.key_prefix or ""
        if attention is not None and attention != served_attention:
            conflicts.append(f"--mooncake-attention {attention!r} but SGLang's L3 layout has is_mla_backend "
                             f"{inner.is_mla_backend}")
        if prefix is not None and prefix != served_prefix:
            conflicts.append(f"--mooncake-key-prefix {prefix!r} but SGLang's L3 layout has key_prefix "
                             f"{inner.key_prefix!r}")
        attention, prefix = served_attention, served_prefix
    why = layout.reason or "no reason given"
    if layout.enabled and described:
        assert attention is not None and prefix is not None  # SGLang's own, set above
        candidate = MooncakeLayout(attention=AttentionKind(attention), tp_size=tp_size, pp_size=pp_size,
                                   key_prefix=prefix)
        problem = _unsupported(layout, candidate, page_size)
        if problem is None:
            return candidate
        if wanted == "mooncake":
            conflicts.append(f"--hicache-storage-backend 'mooncake' but {problem}")
        else:
            notes.append(f"{problem}: no Mooncake layout is announced (routing works without shared-pool credit)")
        return None
    if wanted == "mooncake" and described:
        assert attention is not None and prefix is not None  # SGLang's own, set above
        notes.append(f"SGLang reports its L3 layout unusable ({why}); announcing kvtier's {attention.upper()} "
                     f"layout (key prefix {prefix!r}) because --hicache-storage-backend mooncake was given")
        return MooncakeLayout(attention=AttentionKind(attention), tp_size=tp_size, pp_size=pp_size, key_prefix=prefix)
    if wanted == "mooncake":
        conflicts.append(f"--hicache-storage-backend 'mooncake' but SGLang's L3 layout is disabled ({why})")
        return None
    hint = (" (MHA keys embed the TP rank, which kvtier enumerates: give --hicache-storage-backend mooncake to "
            "announce them)" if described and attention == "mha" else "")
    notes.append(f"SGLang's HiCache L3 layout is disabled ({why}): no Mooncake layout is announced{hint}")
    return None


def _unsupported(layout: L3CacheLayout, candidate: MooncakeLayout, page_size: int) -> str | None:
    """Why kvtier's key check would not match what SGLang needs for an L3 hit, or None."""
    if layout.backend not in (None, "mooncake"):
        return f"SGLang's L3 layout is for backend {layout.backend!r}"
    if layout.page_size is not None and layout.page_size != page_size:
        return (f"SGLang's L3 pages hold {layout.page_size} tokens but its KV events hash {page_size}-token pages")
    if layout.hicache_object_layout.pp_size != candidate.pp_size:
        return (f"SGLang's L3 layout spans {layout.hicache_object_layout.pp_size} pipeline stage(s) but the server "
                f"runs pp_size {candidate.pp_size}")
    pools = layout.hicache_object_layout.pools
    others = sorted({p.pool for p in pools if p.pool != "kv"})
    if others:
        return f"SGLang's L3 hits also need objects of pools {others}, which kvtier does not check"
    served = {suffix for p in pools for suffix in p.suffixes}
    stem = (f"{candidate.key_prefix}_" if candidate.key_prefix else "") + bytes(32).hex()
    expected = {key[len(stem):] for key in mooncake_object_keys(PageDigest(bytes(32)), candidate)}
    if served != expected:
        return (f"SGLang's L3 KV objects have key suffixes {sorted(served)}, kvtier's layout checks "
                f"{sorted(expected)}")
    return None


# --- HTTP -----------------------------------------------------------------------------------
def fetch(sglang_url: str, timeout_s: float,
          api_key: str = "") -> tuple[ServerInfo, L3CacheLayout | None]:
    """GET /server_info (or the older /get_server_info) and /get_hicache_l3_cache_layout
    (None when the server has no such endpoint)."""
    url = normalize_url(sglang_url)
    body = _get(url, "/server_info", timeout_s, api_key)
    if body is None:
        body = _get(url, "/get_server_info", timeout_s, api_key)
    if body is None:
        raise DiscoveryError(f"{url} has neither /server_info nor /get_server_info: is it an SGLang server?")
    info = _decode(url, "/server_info", body, decode_server_info)
    body = _get(url, "/get_hicache_l3_cache_layout", timeout_s, api_key)
    layout = None if body is None else _decode(url, "/get_hicache_l3_cache_layout", body, decode_l3_cache_layout)
    return info, layout


def _decode(url: str, path: str, body: bytes, decode):
    try:
        return decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DiscoveryError(f"SGLang's {url}{path} reply is not what kvtier reads: {exc}") from None


def _get(url: str, path: str, timeout_s: float, api_key: str) -> bytes | None:
    """The body of a 200 reply; None on 404; DiscoveryError otherwise."""
    request = urllib.request.Request(url + path, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the engine is never behind a proxy
    try:
        with opener.open(request, timeout=timeout_s) as reply:
            return reply.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        hint = " (the server wants an API key: give --sglang-api-key)" if exc.code in (401, 403) else ""
        raise DiscoveryError(f"SGLang at {url} answered {path} with HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DiscoveryError(f"cannot reach SGLang at {url} ({path}: {reason}). Check that the server is up and that "
                             "--sglang-url is its HTTP address (http://HOST:PORT, as given to --host/--port)") from None


def resolve_worker(flags: WorkerFlags, sglang_url: str, timeout_s: float,
                   api_key: str = "") -> WorkerSettings:
    """The bridge's worker settings: discovered from SGLang when sglang_url is set, else the flags."""
    if not sglang_url:
        return manual_settings(flags)
    info, layout = fetch(sglang_url, timeout_s, api_key)
    settings = discover(sglang_url, info, layout, flags)
    for note in settings.notes:
        log.warning("%s", note)
    mooncake = settings.mooncake
    log.info("discovered from SGLang %s at %s: model %s, page size %d, %d DP rank(s) on %s (replay %s), tp %d pp %d, "
             "Mooncake layout %s", settings.engine_version or "(version unknown)", normalize_url(sglang_url),
             settings.model, settings.page_size, settings.dp_size, settings.endpoint,
             settings.replay_endpoint or "none", settings.tp_size, settings.pp_size,
             f"{mooncake.attention.value} prefix {mooncake.key_prefix!r}" if mooncake else "none")
    return settings
