"""What the benches observe of the processes and servers they run, beside what those report of
themselves: a process's CPU (/proc/<pid>/stat), nats-server's streams (/jsz), Redis's memory,
keys and kvtier's state in it (live entries per tier, leases, bookings, booked load), what a
drained run leaves in Redis, and Redis's own time per command (INFO commandstats, INFO cpu).
A process's memory is `processes.rss_mb`."""

from __future__ import annotations

import os
import re
import time
import urllib.request
from typing import Any

from kvtier.schemas.jetstream import decode_jsz
from kvtier.schemas.state_keys import ModelKeys
from kvtier.testing.nats_monitor import streams_of
from kvtier.testing.processes import rss_mb


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat); None: no such process."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int | None]) -> dict[str, float | None]:
    """CPU seconds so far of each process, and of this one (`bench`)."""
    snap = {name: cpu_seconds(pid) for name, pid in pids.items()}
    snap["bench"] = sum(os.times()[:2])
    return snap


def cores_used(before: dict[str, float | None], after: dict[str, float | None],
               seconds: float) -> dict[str, float | None]:
    """Cores each process used between two snapshots `seconds` apart (1.0 = one core busy;
    None: it was gone)."""
    shares: dict[str, float | None] = {}
    for name, start in before.items():
        end = after[name]
        shares[name] = round((end - start) / seconds, 2) if start is not None and end is not None else None
    return shares


def jetstream_streams(monitor_port: int) -> dict[str, dict]:
    """name -> {bytes, messages, age_s} from nats-server's /jsz."""
    url = f"http://127.0.0.1:{monitor_port}/jsz?streams=true"
    with urllib.request.urlopen(url, timeout=2) as response:
        return streams_of(decode_jsz(response.read()), time.time())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_state(client, model: str) -> dict[str, Any]:
    """Redis memory, key counts, live entries per tier (state hashes), leases and bookings."""
    keys = ModelKeys.for_model(model)
    memory = client.info("memory")
    keyspace = client.info("keyspace").get("db0", {})
    workers = sorted(_text(w) for w in client.smembers(keys.workers))
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.hmget(keys.state(worker), "n1", "n2", "n4", "n8")
    pipe.zcount(keys.leases, int(time.time() * 1000), "+inf")
    pipe.zcard(keys.bookings)
    pipe.hlen(keys.prefill_load)
    pipe.hlen(keys.decode_load)
    replies = pipe.execute()
    per_worker = {}
    for worker, counts in zip(workers, replies):
        per_worker[worker] = [int(c or 0) for c in counts]
    live, bookings, prefill_fields, decode_fields = replies[len(workers):]
    # The change feed is bounded by its length (--changes-maxlen), not by the live pages: its
    # memory is measured apart (every node: SAMPLES 0) and left out of the per-entry figures.
    feed = client.memory_usage(keys.changes, samples=0) or 0
    return {"used_memory": int(memory["used_memory"]), "feed_bytes": int(feed),
            "used_memory_dataset": int(memory.get("used_memory_dataset", 0)),
            "mem_clients": int(memory.get("mem_clients_normal", 0)),
            "used_memory_scripts": int(memory.get("used_memory_scripts", memory.get("used_memory_scripts_eval", 0))),
            "keys": int(keyspace.get("keys", 0)),
            "expires": int(keyspace.get("expires", 0)), "per_worker": per_worker, "live_workers": int(live),
            "bookings": int(bookings), "load_fields": int(prefill_fields) + int(decode_fields)}


class StackSampler:
    """One row of observations of a running stack per `sample` call: every process's RSS (MB)
    and the cores it used since the previous row, Redis's memory (`redis_mem`: used_memory
    less client buffers and the change feed), keys and live (page, tier) entries
    (`entries_n1/2/4/8`, `entries`; `dead_entries`: those of the `watched` workers), live
    workers, pending bookings, each JetStream stream's MB and oldest message's age, and
    decisions/s."""

    def __init__(self, client, model: str, nats_monitor_port: int, watched: set[str]):
        self.client = client
        self.model = model
        self.nats_monitor_port = nats_monitor_port
        self.watched = watched
        self._cpu_prev: dict[str, tuple[float | None, float]] = {}

    def sample(self, t: float, phase: str, pids: dict[str, int | None], decisions: int,
               interval: float) -> dict[str, Any]:
        state = redis_state(self.client, self.model)
        s: dict[str, Any] = {"t": round(t, 2), "phase": phase}
        for name, pid in pids.items():
            s[f"rss_{name}_mb"] = rss_mb(pid)
        for name, pid in pids.items():  # cores used since the previous sample
            used = cpu_seconds(pid)
            before, at = self._cpu_prev.get(name, (None, t))
            s[f"cpu_{name}"] = (round((used - before) / (t - at), 3)
                                if used is not None and before is not None and t > at else None)
            self._cpu_prev[name] = (used, t)
        for key in ("used_memory", "used_memory_dataset", "mem_clients", "used_memory_scripts"):
            s[key] = state[key]
        s["redis_mem"] = state["used_memory"] - state["mem_clients"] - state["feed_bytes"]
        s["feed_mb"] = round(state["feed_bytes"] / 2**20, 3)
        s["keys"] = state["keys"]
        s["expires"] = state["expires"]
        totals = [0, 0, 0, 0]
        dead_entries = 0
        for worker, counts in state["per_worker"].items():
            totals = [a + b for a, b in zip(totals, counts)]
            if worker in self.watched:
                dead_entries += sum(counts)
        for bit, total in zip((1, 2, 4, 8), totals):
            s[f"entries_n{bit}"] = total
        s["entries"] = sum(totals)
        s["dead_entries"] = dead_entries
        s["live_workers"] = state["live_workers"]
        s["bookings"] = state["bookings"]
        try:
            for stream, info in jetstream_streams(self.nats_monitor_port).items():
                s[f"js_{stream}_mb"] = round(info["bytes"] / 2**20, 3)
                s[f"js_{stream}_age_s"] = info["age_s"]
        except OSError:
            pass
        s["decisions_per_s"] = round(decisions / interval, 2) if interval > 0 else None
        return s


def key_kind(key: str) -> str:
    """A key with its worker id and request id left out: kvt:{m}:w:*:state, kvt:{m}:bk:*, ..."""
    parts = key.split(":")
    if len(parts) >= 4 and parts[2] == "w":
        parts[3] = "*"
    elif len(parts) >= 4 and parts[2] == "bk":
        parts[3:] = ["*"]
    return ":".join(parts)


def after_drain(client, model: str, dead_workers: list[str]) -> dict[str, Any]:
    """What a run left in Redis once its requests are drained: bookings and booked load not
    given back, what each of `dead_workers` left (pages, lease, entries, keys without a TTL),
    and every kind of key (`key_kind`) with its count and bytes."""
    keys = ModelKeys.for_model(model)
    state = redis_state(client, model)
    booking_keys = sum(1 for _ in client.scan_iter(match=f"{keys.base}:bk:*", count=1000))
    dead = {}
    leases = {_text(w) for w in client.zrange(keys.leases, 0, -1)}
    prefill = {_text(k) for k in client.hkeys(keys.prefill_load)}
    decode = {_text(k) for k in client.hkeys(keys.decode_load)}
    for worker in dead_workers:
        lingering = []
        if client.exists(keys.meta(worker)) and client.ttl(keys.meta(worker)) == -1:
            lingering.append("meta key")
        if client.sismember(keys.workers, worker):
            lingering.append("workers member")
        if client.hexists(keys.page_sizes, worker):
            lingering.append("page_size field")
        if client.hexists(keys.hash_check, worker):
            lingering.append("hash_check field")
        if client.sismember(keys.stale_workers, worker):
            lingering.append("stale member")
        dead[worker] = {
            "pages_key": bool(client.exists(keys.pages(worker))),
            "lease": worker in leases,
            "entries": sum(state["per_worker"].get(worker, [0])),
            "state_ttl": client.ttl(keys.state(worker)),
            "meta_ttl": client.ttl(keys.meta(worker)),
            "load": worker in prefill or worker in decode,
            "lingering": lingering,
        }
    key_memory: dict[str, list[int]] = {}  # key kind -> [keys, bytes]
    for key in client.scan_iter(count=1000):
        kind = key_kind(_text(key))
        entry = key_memory.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += int(client.memory_usage(key, samples=0) or 0)
    return {"bookings": state["bookings"], "load_fields": state["load_fields"], "booking_keys": booking_keys,
            "key_memory": key_memory,
            "keys": state["keys"], "used_memory": state["used_memory"], "dead_workers": dead}


def _commands_in_scripts() -> frozenset[str]:
    """Commands kvtier's Lua scripts call: INFO commandstats counts them too, beside the
    script call whose time already includes theirs."""
    from importlib import resources

    names = set()
    for package in ("kvtier.router", "kvtier.consumers"):
        for item in resources.files(package).iterdir():
            if item.name.endswith(".lua"):
                names |= {m.lower() for m in re.findall(r"redis\.p?call\('([A-Za-z]+)'", item.read_text())}
    return frozenset(names)


class RedisCost:
    """Redis time over measurements, from the server's own accounting. `command_us`: INFO
    commandstats, each command sent counted once (a script call with everything it called;
    the commands scripts call are left out, not counted twice); `process_us`: the server
    process's CPU time (INFO cpu, user + system), parsing and networking included. Snapshots,
    not resets: measurements of several routers can alternate and each sum up its own."""

    _IN_SCRIPTS: frozenset[str] | None = None

    def __init__(self, client) -> None:
        self.client = client
        if RedisCost._IN_SCRIPTS is None:
            RedisCost._IN_SCRIPTS = _commands_in_scripts()

    def _totals(self, cpu: dict, stats: dict) -> tuple[float, float]:
        skip = self._IN_SCRIPTS or frozenset()
        sent = sum(v["usec"] for k, v in stats.items()
                   if k.startswith("cmdstat_") and k[8:] not in skip and k[8:].split("|")[0] not in ("info", "config"))
        return sent, (cpu["used_cpu_user"] + cpu["used_cpu_sys"]) * 1e6

    def snapshot(self) -> tuple[float, float]:
        return self._totals(self.client.info("cpu"), self.client.info("commandstats"))

    async def snapshot_async(self) -> tuple[float, float]:
        return self._totals(await self.client.info("cpu"), await self.client.info("commandstats"))

    @staticmethod
    def per_decision(spent: tuple[float, float], decisions: int) -> dict[str, float]:
        return {"redis_cpu_us_per_decision": round(spent[0] / decisions, 1),
                "redis_process_cpu_us_per_decision": round(spent[1] / decisions, 1)}
