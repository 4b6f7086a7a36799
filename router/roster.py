"""A replica's copy of what a decision reads besides the overlaps: who is live (with each
lease's expiry), who is stale, each worker's page size, the store's incarnation marker, and
the booked loads at a load version. The lean decision (router/core.py `_route_lean`)
chooses on it and books with book_checked.lua, which books only while the copy is what
Redis holds, so no decision rests on a stale copy:
- the load version names the loads exactly (router/bookings.lua bumps it with every load
  write): a booking at the version the copy holds is a booking on the loads Redis holds;
- the leases zset's and the stale set's sizes, the marker's id, the change counter and the
  chosen worker's own lease are checked in the same step; a worker that
  joined, left or went stale changes one of them;
- what no size shows (a lease renewed: a later expiry; a page size changed) is re-read when
  a cached lease comes to its end and at most `max_age_s` after the copy was read.

The loads are kept current by this replica's own bookings and releases (each answer carries
the version after it: one step past the copy's, the copy applies it; any other, another
replica wrote in between and the next booking's answer brings the loads). Each worker's
learned rates (schemas/rates.py) are part of the loads: release.lua writes them in the call
that bumps the load version, so a copy at the version Redis holds has its rates too."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.schemas.rates import RateFit, decode_fit
from kvtier.schemas.state_keys import ModelKeys, as_text

#: The longest a copy is used before it is read again whatever it holds (seconds): bounds how
#: late a change no check sees (a page size) reaches decisions.
ROSTER_MAX_AGE_S = 1.0


def _pairs(flat_or_map):
    """(field, value) of a hash as HGETALL gives it: a dict, or a flat list (inside a script's answer)."""
    if isinstance(flat_or_map, dict):
        return flat_or_map.items()
    return ((flat_or_map[i], flat_or_map[i + 1]) for i in range(0, len(flat_or_map), 2))


def fits_of(flat_or_map) -> dict[str, RateFit]:
    """The rates hash as HGETALL gives it; a field that is not a fit is left out (the worker
    has no trusted fit: the formula's choice stands)."""
    fits = {}
    for worker, text in _pairs(flat_or_map):
        try:
            fits[as_text(worker)] = decode_fit(text)
        except ValueError:
            continue
    return fits


async def read_fits(redis, model: str) -> dict[str, RateFit]:
    """Every worker's fit of `model` as Redis holds it now (fits_of)."""
    return fits_of(await redis.hgetall(ModelKeys.for_model(model).rates))


def _int_map(flat_or_map) -> dict[str, int]:
    return {as_text(k): int(v) for k, v in _pairs(flat_or_map)}


@dataclass
class Roster:
    """One model's roster at one read (the loads move on with this replica's writes)."""

    read_at: float  # time.monotonic() of the read
    #: worker -> (page size, lease expiry in unix ms), for leases live at the read
    live: dict[str, tuple[int, int]]
    lease_count: int  # members of the leases zset, expired ones included (its ZCARD)
    stale: frozenset[str]
    marker_id: str
    ready: bool
    rebuilding: bool
    change: int  # the change counter at the read
    next_expiry_ms: int  # the earliest live lease's expiry
    load_version: int | None  # None: the loads are not known at any version
    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    #: Each worker's learned rates at the load version (none yet: not in it)
    rates: dict[str, RateFit] = field(default_factory=dict)
    #: The live workers not stale, sorted (the order candidates are scored in), and by page size.
    candidates: list[str] = field(default_factory=list)
    by_size: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.candidates = sorted(w for w in self.live if w not in self.stale)
        for w in self.candidates:
            self.by_size.setdefault(self.live[w][0], []).append(w)

    def due(self, now_ms: int, now: float, max_age_s: float) -> bool:
        """Read it again before deciding: too old, or a lease it holds may have been renewed
        (so while a copy is not due, every lease it holds is live)."""
        return now - self.read_at >= max_age_s or now_ms >= self.next_expiry_ms

    def set_loads(self, version: int, prefill, decode, rates=None) -> None:
        """The loads (and, when given, the rates) Redis holds at `version`."""
        self.load_version = version
        self.prefill, self.decode = _int_map(prefill), _int_map(decode)
        if rates is not None:
            self.rates = fits_of(rates)

    def add(self, worker: str, prefill: int, decode: int, version_after: int, fit: RateFit | None = None) -> None:
        """Apply this replica's own load write (and the fit its release taught), whose answer
        says the version after it."""
        if self.load_version is None or version_after != self.load_version + 1:
            self.load_version = None  # another write came in between: unknown until re-read
            return
        self.load_version = version_after
        if fit is not None:
            self.rates[worker] = fit
        for loads, delta in ((self.prefill, prefill), (self.decode, decode)):
            left = loads.get(worker, 0) + delta
            if left > 0:
                loads[worker] = left
            else:
                loads.pop(worker, None)


class ModelRoster:
    """One model's copy, and the lock its load writes from this replica take, so that this
    replica's own bookings and releases never conflict with each other."""

    def __init__(self, client, model: str, max_age_s: float = ROSTER_MAX_AGE_S):
        self._client = client
        self.keys = ModelKeys.for_model(model)
        self.max_age_s = max_age_s
        self.roster: Roster | None = None
        self.lock = asyncio.Lock()
        self._script = client.register_script(load_lua("kvtier.router", "read_roster.lua"))

    def current(self, now_ms: int) -> Roster | None:
        roster = self.roster
        if roster is None or roster.due(now_ms, time.monotonic(), self.max_age_s):
            return None
        return roster

    async def read(self, now_ms: int) -> Roster:
        """Everything in one script call (read_roster.lua): a snapshot, the loads at the
        version read with them."""
        keys = self.keys
        started = time.monotonic()
        leases, stale, sizes, (ready, rebuilding, marker_id), change, version, prefill, decode, rates = (
            await self._script(keys=[keys.leases, keys.stale_workers, keys.page_sizes, keys.incarnation,
                                     keys.changes_counter, keys.load_version, keys.prefill_load, keys.decode_load,
                                     keys.rates]))
        size_of = _int_map(sizes)
        live = {}
        for i in range(0, len(leases), 2):
            worker, expiry = as_text(leases[i]), int(float(leases[i + 1]))
            if expiry > now_ms:
                live[worker] = (size_of.get(worker, 0), expiry)
        roster = Roster(
            read_at=started, live=live, lease_count=len(leases) // 2, stale=frozenset(as_text(s) for s in stale),
            marker_id=as_text(marker_id), ready=as_text(ready) == "1", rebuilding=as_text(rebuilding) == "1",
            change=int(change or 0), next_expiry_ms=min((expiry for _, expiry in live.values()), default=1 << 62),
            load_version=None)
        roster.set_loads(int(version or 0), prefill, decode, rates)
        self.roster = roster
        return roster

    def forget(self) -> None:
        self.roster = None


class Rosters:
    """Every model's copy in one replica."""

    def __init__(self, client, max_age_s: float = ROSTER_MAX_AGE_S):
        self._client = client
        self._max_age_s = max_age_s
        self.models: dict[str, ModelRoster] = {}

    def model(self, model: str) -> ModelRoster:
        held = self.models.get(model)
        if held is None:
            held = self.models[model] = ModelRoster(self._client, model, self._max_age_s)
        return held
