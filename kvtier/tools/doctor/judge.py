"""The checks of `kvtier doctor`: pure functions from the views (`views.py`) to `Finding`s, one per
check; `diagnose()` runs them all and `exit_code()` turns them into the exit status. Nothing here does I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvtier.schemas.health import HashMismatchKind
from kvtier.schemas.subjects import (
    DECISIONS_STREAM,
    DLQ_STREAM,
    EVENTS_STREAM,
)

from .views import (
    DEVICE_BIT,
    Finding,
    LastMessage,
    MooncakeView,
    NatsView,
    Observation,
    RedisView,
    RouterView,
    Status,
    WorkerRecord,
)


# --- helpers ----------------------------------------------------------------------------------
def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _n(count: int, noun: str, plural: str = "") -> str:
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _by_model(workers: Iterable[WorkerRecord]) -> dict[str, list[WorkerRecord]]:
    grouped: dict[str, list[WorkerRecord]] = {}
    for w in workers:
        grouped.setdefault(w.model, []).append(w)
    return dict(sorted(grouped.items()))


def _names(workers: Iterable[WorkerRecord], limit: int = 6) -> str:
    names = [w.worker for w in workers]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def describe_stale(reason: str, gaps: int) -> tuple[str, str]:
    """(why, fix) of a stale worker in plain words."""
    if reason == "lease_expired":
        return ("its lease expired: its bridge stopped announcing it, so its pages were removed",
                ("restart the worker's `kvtier bridge` (or, if the worker is gone for good, ignore it: the "
                 "record expires within a day)"))
    why = (f"batches of it never reached the processor (a gap; {gaps} so far), so its state was cleared "
           "and its bridge asked to resync" if gaps else
           f"its state was cleared ({reason or 'no reason recorded'}) and its bridge asked to resync")
    return (why, ("the bridge starts a new epoch by itself on the resync request; if the worker stays stale, "
                  "check that its bridge runs, has --replay-endpoint, and reaches NATS (kvtier.control.*)"))


# --- checks: pure functions of the views --------------------------------------------------------
def check_nats(nats: NatsView) -> list[Finding]:
    if not nats.reachable:
        return [Finding(check="nats", status=Status.FAIL, subject=nats.url,
                        finding=f"cannot reach NATS: {nats.error}",
                        fix="start nats-server with JetStream (`nats-server -js`) or correct --nats; until it is "
                            "back no event reaches Redis and routers see a frozen view")]
    if not nats.jetstream:
        return [Finding(check="nats", status=Status.FAIL, subject=nats.url,
                        finding=f"NATS answers but JetStream is off ({nats.error})",
                        fix="restart nats-server with -js (and -sd DIR for its storage)")]
    return [Finding(check="nats", status=Status.OK, subject=nats.url, finding="reachable, JetStream on")]


def check_streams(nats: NatsView, routers: Sequence[RouterView] = ()) -> list[Finding]:
    if not nats.reachable or not nats.jetstream:
        return []
    out = []
    events = nats.streams.get(EVENTS_STREAM)
    if events is None or not events.exists:
        out.append(Finding(check="streams", status=Status.FAIL, subject=EVENTS_STREAM,
                           finding="stream does not exist: no bridge or processor has used this NATS",
                           fix="start `kvtier processor --nats URL --redis URL` (it creates the streams) and give "
                               "every bridge the same --nats"))
    else:
        parts = f", {events.partitions} partitions" if events.partitions else ""
        out.append(Finding(check="streams", status=Status.OK, subject=EVENTS_STREAM,
                           finding=f"{_n(events.messages, 'message')}{parts}"))
    dlq = nats.streams.get(DLQ_STREAM)
    if dlq is None or not dlq.exists:
        out.append(Finding(check="streams", status=Status.FAIL, subject=DLQ_STREAM,
                           finding="dead-letter stream does not exist: bad input could not be set aside",
                           fix="start a current `kvtier processor` or `kvtier bridge` (each creates it with the "
                               "events stream)"))
    else:
        out.append(Finding(check="streams", status=Status.OK, subject=DLQ_STREAM,
                           finding=f"exists ({_n(dlq.messages, 'dead letter')})"))
    decisions = nats.streams.get(DECISIONS_STREAM)
    logging_routers = [r.url for r in routers if r.reachable and r.healthz.decision_log.enabled]
    if decisions is not None and decisions.exists:
        out.append(Finding(check="streams", status=Status.OK, subject=DECISIONS_STREAM,
                           finding=f"{_n(decisions.messages, 'routing decision')} logged"))
    elif logging_routers:
        out.append(Finding(check="streams", status=Status.WARN, subject=DECISIONS_STREAM,
                           finding=f"missing although {', '.join(logging_routers)} log decisions",
                           fix="check that those routers' --nats points at this NATS server"))
    else:
        out.append(Finding(check="streams", status=Status.OK, subject=DECISIONS_STREAM,
                           finding="not present (optional: created by routers started with --nats)"))
    return out


def check_redis(redis_view: RedisView) -> list[Finding]:
    if not redis_view.reachable:
        return [Finding(check="redis", status=Status.FAIL, subject=redis_view.url,
                        finding=f"cannot reach Redis: {redis_view.error} (worker, tier, page-size and hash checks "
                                "skipped)",
                        fix="start Redis or correct --redis; meanwhile processors hold events in JetStream and "
                            "routers route by load only")]
    models = ", ".join(redis_view.models) or "none yet"
    return [Finding(check="redis", status=Status.OK, subject=redis_view.url,
                    finding=f"reachable; models: {models}")]


def check_workers(redis_view: RedisView) -> list[Finding]:
    if not redis_view.reachable:
        return []
    if redis_view.requested_model and redis_view.requested_model not in redis_view.models:
        known = ", ".join(redis_view.models) or "none"
        return [Finding(check="workers", status=Status.FAIL, subject=redis_view.requested_model,
                        finding=f"no worker of this model was ever registered (models in Redis: {known})",
                        fix="start a `kvtier bridge --model <model>` per worker (the model name clients send) and "
                            "a `kvtier processor` on the same NATS and Redis")]
    if not redis_view.workers:
        return [Finding(check="workers", status=Status.FAIL, subject="all models",
                        finding="no workers registered in Redis",
                        fix="start a `kvtier bridge` per SGLang worker and a `kvtier processor` on the same NATS "
                            "and Redis (the processor records each worker the bridge announces)")]
    out = []
    for model, workers in _by_model(redis_view.workers).items():
        live = [w for w in workers if w.live]
        dead = [w for w in workers if not w.live]
        if not live:
            reasons = "; ".join(f"{w.worker}: {w.stale_reason or 'no lease'}" for w in dead[:4])
            out.append(Finding(check="workers", status=Status.FAIL, subject=model,
                               finding=f"no live workers: all {len(workers)} leases expired ({reasons})",
                               fix="their bridges stopped announcing them: check each `kvtier bridge` is running "
                                   "and reaches NATS, and that `kvtier processor` runs (it applies the heartbeats)"))
            continue
        stale_live = [w for w in live if w.stale]
        healthy = len(live) - len(stale_live)
        out.append(Finding(check="workers", status=Status.OK, subject=model,
                           finding=f"{healthy} of {len(workers)} workers live and current"
                                   + (f" (live: {_names(live)})" if live else "")))
        for w in stale_live:
            why, fix = describe_stale(w.stale_reason, w.gaps)
            out.append(Finding(check="workers", status=Status.WARN, subject=w.key,
                               finding=f"stale, routers skip it: {why}", fix=fix))
        for w in live:
            if w.partial and not w.stale:
                out.append(Finding(
                    check="workers", status=Status.WARN, subject=w.key,
                    finding="partial: its state began after the engine's first batch (a bridge restart it could not "
                            "prove, an unrecoverable gap or a resync), so it holds only what the engine's replay "
                            "buffer still had; routers still send it work but credit it for fewer pages than it has",
                    fix="nothing to do: it clears by itself once the engine reports a cache flush or has turned its "
                        "device cache over; a larger SGLang replay buffer makes it rarer"))
        for w in dead:
            why, fix = describe_stale(w.stale_reason or "lease_expired", w.gaps)
            out.append(Finding(check="workers", status=Status.WARN, subject=w.key,
                               finding=f"not live: {why}", fix=fix))
    return out


def message_ahead_of(last: LastMessage, w: WorkerRecord) -> bool:
    """The stream holds a batch of this worker that Redis has not applied."""
    return last.seq >= 1 and (last.epoch, last.seq) > (w.epoch, w.seq)


def check_events(redis_view: RedisView, nats: NatsView, window_s: float) -> list[Finding]:
    if not redis_view.reachable:
        return []
    out = []
    for model, workers in _by_model(redis_view.workers).items():
        live = [w for w in workers if w.live and not w.stale]
        flowing = []
        for w in live:
            if w.applied_ago_s is not None and w.applied_ago_s <= window_s:
                flowing.append(w)
                continue
            last = nats.last_messages.get(w.key) if nats.reachable else None
            applied = f"last applied {_ago(w.applied_ago_s)}" if w.applied_ago_s is not None else "none applied yet"
            if last is not None and message_ahead_of(last, w):
                out.append(Finding(
                    check="events", status=Status.FAIL, subject=w.key,
                    finding=f"events reach NATS but are not applied: the stream holds {last.epoch}:{last.seq}, "
                            f"Redis has {w.epoch}:{w.seq} ({applied})",
                    fix="check that `kvtier processor` runs against this NATS and Redis, that its --partitions "
                        "cover every partition, and read its log for errors"))
                continue
            quiet_engine = ("if the worker serves requests, its engine publishes nothing the bridge receives: "
                            "check SGLang's --kv-events-config (publisher zmq; its endpoint must be the bridge's "
                            "--endpoint, port + DP rank; same --topic)")
            if last is not None:
                finding = (f"no KV events in the last {window_s:g}s ({applied}); its bridge is alive (last "
                           f"message {_ago(last.age_s)}), so the engine is idle or not publishing")
            elif nats.reachable:
                finding = f"no KV events in the last {window_s:g}s ({applied}) and no message on its subject"
            else:
                finding = f"no KV events in the last {window_s:g}s ({applied})"
            out.append(Finding(check="events", status=Status.WARN, subject=w.key, finding=finding, fix=quiet_engine))
        if flowing and len(flowing) == len(live):
            out.append(Finding(check="events", status=Status.OK, subject=model,
                               finding=f"all {len(live)} live workers applied events within {window_s:g}s"))
        elif flowing:
            out.append(Finding(check="events", status=Status.OK, subject=model,
                               finding=f"{len(flowing)} of {len(live)} live workers applied events within "
                                       f"{window_s:g}s"))
    return out


_HICACHE_FIX = ("rebuild SGLang with sgl-project/sglang#22894 (emit KV events for L2 host cache insertions); "
                "with --hicache-write-policy write_back host copies appear only after device evictions, so "
                "recheck under load")


def check_tiers(redis_view: RedisView) -> list[Finding]:
    """Did workers with HiCache on ever report a host tier? If every event said GPU, the engine
    lacks the tier-annotated events (the guide's "events always carry only medium=GPU")."""
    if not redis_view.reachable:
        return []
    any_layout = any(w.meta is not None and w.meta.mooncake is not None for w in redis_view.workers)
    out = []
    for model, workers in _by_model(redis_view.workers).items():
        live = [w for w in workers if w.live]
        stored = [w for w in live if w.tier_bits]
        with_host = [w for w in stored if w.tier_bits & ~DEVICE_BIT]
        gpu_only = [w for w in stored if not w.tier_bits & ~DEVICE_BIT]
        problems = []
        for w in gpu_only:
            unknown = w.tiers_seen is None
            since = "" if unknown else " ever"
            if w.hicache or any_layout:
                why = ("its metadata says HiCache is on" if w.hicache
                       else "workers of this deployment advertise a Mooncake layout (HiCache on)")
                status = Status.WARN if unknown else Status.FAIL
                problems.append(Finding(
                    check="tiers", status=status, subject=w.key,
                    finding=f"{why}, but every page it{since} stored was on GPU (no host tier"
                            f"{' now; this processor does not record tiers_seen' if unknown else ' ever'}): the "
                            f"SGLang build lacks the tier events of sglang#22894",
                    fix=_HICACHE_FIX))
            elif with_host:
                problems.append(Finding(
                    check="tiers", status=Status.WARN, subject=w.key,
                    finding=f"only GPU pages{since} while {_names(with_host, 3)} report a host tier: a mixed "
                            "fleet (HiCache off here, or an SGLang build without sglang#22894)",
                    fix="run every worker of a model with the same --enable-hierarchical-cache setting; "
                        + _HICACHE_FIX))
        out.extend(problems)
        if not problems:
            if with_host:
                text = f"host tier reported by {len(with_host)} of {len(live)} live workers"
            elif stored:
                text = f"{_n(len(stored), 'live worker')} {'stores' if len(stored) == 1 else 'store'} on GPU only " \
                       "(HiCache not announced)"
            else:
                text = "no pages stored yet (cannot tell which tiers the engines report)"
            out.append(Finding(check="tiers", status=Status.OK, subject=model, finding=text))
    return out


def _router_page_size(router: RouterView) -> tuple[bool, int | None]:
    """(whether the router reports its --page-size, the size: None = trusts each worker's)."""
    value = router.healthz.page_size
    if value is msgspec.UNSET:
        return False, None
    return True, value if value is not None and value > 0 else None


def check_page_sizes(redis_view: RedisView, routers: list[RouterView]) -> list[Finding]:
    if not redis_view.reachable:
        return []
    out = []
    reachable = [r for r in routers if r.reachable and r.http_status == 200 and not r.error]
    silent = [r.url for r in reachable if not _router_page_size(r)[0]]
    for model, workers in _by_model(redis_view.workers).items():
        live = [w for w in workers if w.live and w.page_size]
        sizes: dict[int, list[WorkerRecord]] = {}
        for w in live:
            sizes.setdefault(w.page_size or 0, []).append(w)  # never 0: only workers with a size
        if len(sizes) > 1:
            listing = "; ".join(f"{size} ({_names(ws, 4)})" for size, ws in sorted(sizes.items()))
            out.append(Finding(
                check="page_size", status=Status.FAIL, subject=model,
                finding=f"workers of one model announce different page sizes: {listing}",
                fix="run every worker of a model with the same SGLang --page-size and give each bridge that "
                    "--page-size (routers hash requests at each worker's size; a worker with a different size "
                    "shares no pages with the others and gets no shared-pool credit from a router with --page-size)"))
        worker_sizes = set(sizes)
        router_problem = False
        for r in reachable:
            known, size = _router_page_size(r)
            if known and size is not None and worker_sizes and worker_sizes != {size}:
                router_problem = True
                differing = sorted(worker_sizes - {size})
                others = ", ".join(str(s) for s in differing)
                out.append(Finding(
                    check="page_size", status=Status.FAIL, subject=f"{r.url} / {model}",
                    finding=f"router has --page-size {size} but workers of {model} use {others}: it gives them no "
                            "shared-pool credit",
                    fix=f"start the router with --page-size {differing[0]} (the workers' --page-size), or "
                        "without --page-size to trust each worker's announced size"))
        if len(sizes) == 1 and not router_problem:
            (size,) = sizes
            note = f"; routers {', '.join(silent)} do not report their --page-size" if silent else ""
            out.append(Finding(check="page_size", status=Status.OK, subject=model,
                               finding=f"all {len(live)} live workers use page size {size}{note}"))
    for r in reachable:
        if r.page_size_mismatches:
            out.append(Finding(
                check="page_size", status=Status.WARN, subject=r.url,
                finding=f"router skipped workers {r.page_size_mismatches:.0f} times for shared-pool credit because "
                        "their page size differs from its --page-size (router_page_size_mismatch_total)",
                fix="make the router's --page-size equal to the workers' --page-size, or drop it"))
    return out


def check_mooncake(mooncake: MooncakeView | None, redis_view: RedisView,
                   routers: list[RouterView]) -> list[Finding]:
    out = []
    live = [w for w in redis_view.workers if w.live] if redis_view.reachable else []
    with_layout = [w.meta.mooncake for w in live if w.meta is not None and w.meta.mooncake is not None]
    shared_routers = [r.url for r in routers if r.reachable and r.healthz.shared_pool.enabled]
    wanted = bool(with_layout or shared_routers)
    if mooncake is not None:
        if mooncake.reachable:
            out.append(Finding(check="mooncake", status=Status.OK, subject=mooncake.url,
                               finding=f"master answers ({mooncake.detail})" if mooncake.detail else "master answers"))
        else:
            users = (f"{len(with_layout)} workers advertise a Mooncake layout" if with_layout
                     else f"routers {', '.join(shared_routers)} query the shared pool" if shared_routers else "")
            out.append(Finding(
                check="mooncake", status=Status.FAIL if wanted else Status.WARN, subject=mooncake.url,
                finding=f"cannot reach the Mooncake master: {mooncake.error}"
                        + (f"; {users}, so routers score without the shared pool (router_shared_cache_hit_rate "
                           "stays 0)" if users else ""),
                fix="check that mooncake_master runs with --metrics_port (its HTTP port, serving "
                    "/batch_query_keys) and the network path from the router hosts to it; routers log 'shared "
                    "pool query failed' meanwhile"))
    if not redis_view.reachable:
        return out
    subject = redis_view.requested_model or "all models"
    if with_layout:
        layouts = sorted({f"{layout.attention.value} tp={layout.tp_size} pp={layout.pp_size}"
                          for layout in with_layout})
        unchecked = "; master not checked (give --mooncake-master)" if mooncake is None else ""
        out.append(Finding(check="mooncake", status=Status.OK, subject=subject,
                           finding=f"{len(with_layout)} of {len(live)} live workers advertise a Mooncake layout "
                                   f"({'; '.join(layouts)}){unchecked}"))
        routers_ok = [r for r in routers if r.reachable]
        if routers_ok and not shared_routers:
            out.append(Finding(
                check="mooncake", status=Status.WARN, subject=", ".join(r.url for r in routers_ok),
                finding="workers have HiCache with Mooncake, but no router asks the shared pool "
                        "(--shared-cache-type is none)",
                fix="start the routers with --shared-cache-type hicache --mooncake-master http://MASTER:METRICS_PORT"))
    elif mooncake is not None or shared_routers:
        out.append(Finding(
            check="mooncake", status=Status.WARN, subject=subject,
            finding="no workers have HiCache enabled: none of the live workers advertises a Mooncake layout",
            fix="start the workers with --hicache-storage-backend mooncake (and give each `kvtier bridge` the "
                "same flag: it announces the key layout routers need)"))
    elif not out:
        out.append(Finding(check="mooncake", status=Status.OK, subject=subject,
                           finding="shared pool not in use (no worker advertises a Mooncake layout; no "
                                   "--mooncake-master given)"))
    return out


def check_routers(routers: list[RouterView]) -> list[Finding]:
    out = []
    for r in routers:
        if not r.reachable:
            out.append(Finding(check="router", status=Status.FAIL, subject=r.url,
                               finding=f"cannot reach the router: {r.error}",
                               fix="check the `kvtier router` process and the --router URL (its --host/--http-port)"))
            continue
        if r.http_status == 503 and not r.error and r.healthz.status == "draining":
            out.append(Finding(check="router", status=Status.WARN, subject=r.url,
                               finding="draining (SIGTERM): it refuses new requests and exits once those in flight "
                                       "finish (--drain-timeout)",
                               fix="expected while a replica is being replaced; otherwise find who stopped it"))
            continue
        if r.http_status != 200 or r.error:
            out.append(Finding(check="router", status=Status.FAIL, subject=r.url,
                               finding=f"/healthz answered HTTP {r.http_status}, {r.error}",
                               fix="is this a kvtier router? check the --router URL (its --host and --http-port)"))
            continue
        h = r.healthz
        state, shared, log = h.state_store, h.shared_pool, h.decision_log
        errors = r.shared_pool_errors or {}
        error_note = ((" (shared-pool errors so far: "
                       + ", ".join(f"{k}={v:.0f}" for k, v in sorted(errors.items())) + ")")
                      if any(errors.values()) else "")
        problems = 0
        if not state.ok:
            problems += 1
            out.append(Finding(check="router", status=Status.FAIL, subject=r.url,
                               finding=f"router cannot reach Redis ({shorten(state.error, 120)}): it "
                                       "routes by load/round robin only",
                               fix="check the router's --redis URL and the network path to Redis"))
        if shared.last_error:
            problems += 1
            message = shared.last_error
            timeout = "no answer within" in message
            out.append(Finding(
                check="router", status=Status.WARN if timeout else Status.FAIL, subject=r.url,
                finding=f"shared-pool queries fail ({shorten(message, 120)}): it scores without the shared pool"
                        + error_note,
                fix=("the master is slow: raise --shared-cache-timeout-ms or check the master's load" if timeout else
                     "check that the router's --mooncake-master (the master's HTTP metrics port) is reachable from "
                     "the router host")))
        if log.enabled and not log.connected:
            problems += 1
            out.append(Finding(check="router", status=Status.WARN, subject=r.url,
                               finding="router cannot publish its decision log (not connected to NATS)",
                               fix="check the router's --nats URL"))
        if problems:
            continue
        parts = [h.routing or "routing",
                 "shared pool " + ("on" if shared.enabled else "off"),
                 "decision log " + ("on" if log.enabled else "off")]
        known, size = _router_page_size(r)
        if known:
            parts.append(f"page size {size}" if size else "page size: each worker's")
        hash_note = ""
        if not h.hash_scheme.ok:
            hash_note = "; degraded by workers failing the hash check (see hash_scheme)"
        out.append(Finding(check="router", status=Status.OK, subject=r.url,
                           finding=f"{h.status or '?'}: " + ", ".join(parts) + error_note + hash_note))
    return out


_HASH_FIXES = {
    HashMismatchKind.SCHEME.value: "run an SGLang whose page hashes are the sha256 page chain (0.5.6 or later); "
                                   "until then routers match none of this worker's pages",
    HashMismatchKind.NAMESPACE.value: "requests with a LoRA adapter or cache salt get namespaced hashes routers "
                                      "cannot compute: expect load-only placement for them, or drop the salt",
    HashMismatchKind.PAGE_SIZE.value: "give the worker's bridge --page-size equal to SGLang's --page-size",
}


def check_hash_scheme(redis_view: RedisView) -> list[Finding]:
    if not redis_view.reachable:
        return []
    out = []
    for model, workers in _by_model(redis_view.workers).items():
        checks = [(w, w.hash_check) for w in workers if w.live and w.hash_check is not None]
        bad = [(w, c) for w, c in checks if c.mismatched > 0]
        for w, c in bad:
            kinds = ", ".join(f"{k}: {n}" for k, n in sorted(c.mismatch_kinds.items())) or "unknown kind"
            main_kind = max(c.mismatch_kinds.items(), key=lambda kv: kv[1])[0] if c.mismatch_kinds else ""
            out.append(Finding(
                check="hash_scheme", status=Status.FAIL, subject=w.key,
                finding=f"{c.mismatched} of {c.checked} checked pages have hashes kvtier cannot reproduce ({kinds}): "
                        f"{c.explanation or 'no explanation recorded'}",
                fix=_HASH_FIXES.get(main_kind, "compare the engine's hashing with SGLang's sha256 page chain")))
        if bad:
            continue
        if not checks:
            out.append(Finding(check="hash_scheme", status=Status.OK, subject=model,
                               finding="no hash checks recorded (processor without --hash-check, bridges with "
                                       "--drop-token-ids, or nothing stored yet)"))
            continue
        checked = sum(c.checked for _, c in checks)
        unverifiable = sum(c.unverifiable for _, c in checks)
        if checked:
            text = (f"{_n(checked, 'page')} of {_n(len(checks), 'worker')} checked, all match SGLang's hash"
                    + (f" ({unverifiable} unverifiable)" if unverifiable else ""))
        elif unverifiable:
            text = (f"no page verifiable yet ({unverifiable} stored without token ids or with a parent this "
                    "processor never saw)")
        else:
            text = "no stored page checked yet"
        out.append(Finding(check="hash_scheme", status=Status.OK, subject=model, finding=text))
    return out


def check_dead_letters(nats: NatsView) -> list[Finding]:
    if not nats.reachable or not nats.jetstream:
        return []
    dlq = nats.streams.get(DLQ_STREAM)
    if dlq is None or not dlq.exists:
        return []
    if dlq.messages == 0:
        return [Finding(check="dead_letters", status=Status.OK, subject=DLQ_STREAM, finding="no dead letters")]
    latest = nats.latest_dead_letters[0] if nats.latest_dead_letters else None
    reasons = "; ".join(
        f"[{d.stage or '?'} {d.subject.split('.', 3)[-1] if d.subject.count('.') >= 3 else d.subject}] "
        f"{shorten(d.reason or 'no reason header', 140)}" for d in nats.latest_dead_letters)
    when = f", latest {_ago(latest.age_s)}" if latest is not None and latest.age_s is not None else ""
    return [Finding(
        check="dead_letters", status=Status.WARN, subject=DLQ_STREAM,
        finding=f"{_n(dlq.messages, 'dead letter')}{when}: {reasons}",
        fix="malformed input was set aside (the rest still applied): fix the producer named in each subject "
            "(stage.model.worker); read them with `nats stream view KVTIER_DLQ`, then `nats stream purge KVTIER_DLQ`")]


def index_behind(router: RouterView, redis_view: RedisView):
    """(model token, what is wrong) for each of the router's in-memory indexes that is not at
    its model's change feed head as Redis was read (nothing for a router that walks in Redis)."""
    if not router.reachable or router.error or not router.healthz.reads_index:
        return
    indexes = {i.model: i for i in router.healthz.indexes}
    for model, head in sorted(redis_view.feeds.items()):
        if redis_view.requested_model and model != redis_view.requested_model:
            continue
        index = indexes.get(model)
        if index is None:
            continue  # built when the router first routes the model
        if not index.ready:
            yield model, (f"index of {model} is being built ({index.last_bootstrap_reason or 'start'}): its "
                          "decisions walk in Redis meanwhile (degraded: index-not-ready)")
        elif index.marker_id != head.marker_id:
            yield model, (f"index of {model} was built under marker {index.marker_id!r}, the store has "
                          f"{head.marker_id!r}: its next decision notices and builds it again")
        elif index.change < head.change:
            yield model, (f"index of {model} is at change {index.change}, the feed at {head.change} "
                          f"(last lag {index.lag_seconds * 1000:.1f} ms)")


def check_router_indexes(redis_view: RedisView, routers: list[RouterView]) -> list[Finding]:
    """Every replica that reads an in-memory index must be at the feed's head (router/index_feed.py)."""
    if not redis_view.reachable:
        return []
    out = []
    for r in routers:
        behind = list(index_behind(r, redis_view))
        for model, what in behind:
            out.append(Finding(check="router_index", status=Status.WARN, subject=f"{r.url} {model}", finding=what,
                               fix="if it stays so: check the router's log for change-feed errors and its "
                                   "router_index_lag_seconds; a replica far behind rebuilds itself from Redis"))
        ready = [i for i in r.healthz.indexes if i.ready] if r.reachable and not r.error else []
        if not behind and ready:
            out.append(Finding(check="router_index", status=Status.OK, subject=r.url,
                               finding=f"{len(ready)} model index(es) at the change feed's head ("
                                       + ", ".join(f"{i.model}: {i.entries:,} entries, change {i.change}"
                                                   for i in ready) + ")"))
    return out


def check_router_tokenizers(routers: list[RouterView]) -> list[Finding]:
    """A proxying router must count each text prompt as its engines do (router/tokenization_check.py):
    a different tokenizer or chat template hashes other pages than the engines store."""
    out = []
    for r in routers:
        if not r.reachable or r.error:
            continue
        for t in r.healthz.tokenizers:
            subject = f"{r.url} {t.model}"
            fix = (f"give the router the engine's own tokenizer files: --tokenizer {t.model}=PATH, the folder the "
                   "engine loads (tokenizer.json, tokenizer_config.json with its chat_template)")
            if t.recent_mismatched:
                last = t.last_mismatch
                example = (f"; last: worker {last.worker_id} counted {last.engine_tokens} prompt tokens, the "
                           f"router {last.router_tokens}" if last is not None else "")
                out.append(Finding(
                    check="router_tokenizer", status=Status.FAIL, subject=subject,
                    finding=f"{t.recent_mismatched} of the last {t.recent_window} proxied text requests were "
                            f"tokenized differently by the router and the engine{example}: the router's page "
                            "hashes are not the engine's, so it routes as if nothing were cached", fix=fix))
            elif not t.ok:
                out.append(Finding(
                    check="router_tokenizer", status=Status.FAIL, subject=subject,
                    finding=f"{t.recent_pages_missing} of the last {t.recent_pages_window} proxied text requests "
                            "left no page under the router's hashes on their worker, though the prompt lengths "
                            "agree: the engine tokenizes the same text into other tokens (a chat template that "
                            "differs in a word, a date), or it does not cache or publish its pages",
                    fix=fix + "; check that the worker publishes KV events (`kvtier doctor` workers, events)"))
            elif t.checked:
                beyond = (f"; {t.cached_beyond_overlap} answer(s) found more cached than the router saw"
                          if t.cached_beyond_overlap else "")
                out.append(Finding(check="router_tokenizer", status=Status.OK, subject=subject,
                                   finding=f"{t.checked} proxied text request(s) counted alike by router and "
                                           f"engine{beyond}"))
    return out


def check_router_front_door(routers: list[RouterView]) -> list[Finding]:
    """Workers a replica leaves out after failing to reach them (its circuit breaker), and
    requests waiting in its queue for a worker under the busy thresholds."""
    out = []
    for r in routers:
        if not r.reachable or r.error:
            continue
        h = r.healthz
        if h.summary_only:
            out.append(Finding(
                check="router_details", status=Status.WARN, subject=r.url,
                finding="the router has --auth-token and showed only a summary of its health: its circuits, "
                        "queue, rates and indexes were not checked",
                fix="give kvtier doctor the routers' token in KVTIER_AUTH_TOKEN"))
        for c in h.open_circuits:
            out.append(Finding(
                check="router_circuit", status=Status.WARN, subject=f"{r.url} {c.model}/{c.worker_id}",
                finding=f"the router left worker {c.worker_id} out after {c.failures} failures in a row before the "
                        f"first byte (tries it again in {c.reopens_in_s:.0f} s)",
                fix="check that engine answers (kvtier_bridge_engine_up, GET <worker-url>/health) and its "
                    "bridge's --worker-url; its requests go to the other workers meanwhile"))
        if h.queue.depth:
            out.append(Finding(
                check="router_queue", status=Status.WARN, subject=r.url,
                finding=f"{h.queue.depth} requests wait for a worker under the busy thresholds (peak "
                        f"{h.queue.peak} of --queue-size {h.queue.size})",
                fix="every candidate is at --busy-prefill-tokens / --busy-decode-pages: add workers, or raise the "
                    "thresholds if the engines have headroom (docs/DEPLOY.md, Admission)"))
    return out


def diagnose(obs: Observation) -> list[Finding]:
    return [
        *check_nats(obs.nats),
        *check_streams(obs.nats, obs.routers),
        *check_redis(obs.redis),
        *check_workers(obs.redis),
        *check_events(obs.redis, obs.nats, obs.events_window_s),
        *check_tiers(obs.redis),
        *check_page_sizes(obs.redis, obs.routers),
        *check_mooncake(obs.mooncake, obs.redis, obs.routers),
        *check_routers(obs.routers),
        *check_router_indexes(obs.redis, obs.routers),
        *check_router_tokenizers(obs.routers),
        *check_router_front_door(obs.routers),
        *check_hash_scheme(obs.redis),
        *check_dead_letters(obs.nats),
    ]


def exit_code(findings: Iterable[Finding], strict: bool = False) -> int:
    statuses = {f.status for f in findings}
    if Status.FAIL in statuses or (strict and Status.WARN in statuses):
        return 1
    return 0
