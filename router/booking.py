"""Load booking: the selection among candidates and the booking of the request's load on the
chosen worker happen in one Redis script, so replicas never choose on stale load. Releases
give the load back; bookings of a router that died expire after their TTL."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.plumbing.lua_scripts import load_lua
from kvtier.plumbing.multiplexed import MultiplexedRedis
from kvtier.schemas.rates import RateFit, decode_fit
from kvtier.schemas.routing import ReleaseStage
from kvtier.schemas.state_keys import ModelKeys, as_text

from .rates import (
    CLIENT_SAMPLES,
    ERROR_MEMORY,
    FASTER_PICK,
    FIT_SETTINGS,
    RATE_PRIOR,
    FasterPick,
    TtftColumns,
    Work,
    fit_arguments,
)
from .settings import BOOKING_TTL_S

_COMMON = load_lua("kvtier.router", "bookings.lua")
#: The fit's prior and settings as release.lua passes them to learn_rate (router/rates.py).
_FIT_ARGUMENTS = fit_arguments(RATE_PRIOR, FIT_SETTINGS)
#: What a client's first token may teach, as release.lua takes it.
_CLIENT_ARGUMENTS = [str(CLIENT_SAMPLES.per_minute), repr(CLIENT_SAMPLES.max_step), repr(CLIENT_SAMPLES.late_slack_ms),
                     repr(ERROR_MEMORY)]


def owner_digest(owner: str) -> str:
    """What a booking keeps of its owner's secret: enough to check a release against, nothing a
    reader of Redis could release with."""
    return hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:32]
SWEEP_LIMIT = 256


class AlreadyBooked(Exception):
    def __init__(self, request_id: str, worker_id: str):
        super().__init__(f"request id {request_id!r} already holds a booking on worker {worker_id}; "
                         "release it first or use another request id")
        self.request_id, self.worker_id = request_id, worker_id


@dataclass(frozen=True)
class Selection:
    chosen: int  # index into the candidates given
    prefill_loads: list[int]  # as read just before booking
    decode_loads: list[int]


@dataclass(frozen=True)
class Released:
    found: bool
    worker_id: str
    prefill_pages: int
    decode_pages: int
    load_version: int = 0  # the model's load version after the release (0: nothing found)
    fit: RateFit | None = None  # the worker's rates after a first token that taught them
    not_owner: bool = False  # the booking is there, and the owner given is not its own
    sample_refused: str = ""  # why a client's first token taught nothing (rates.SAMPLE_REFUSALS)
    #: For a first token that taught: what the fit predicted (ms), and how far off that was, as
    #: a fraction of the true time (> 0: predicted too long; rates.track_error).
    predicted_ttft_ms: float | None = None
    ttft_error: float | None = None


class Checked(enum.IntEnum):
    """What book_checked.lua answered."""

    BOOKED = 1  # booked (a dry run: the copy is current)
    ALREADY_BOOKED = -1
    STATE_MOVED = -2  # the roster or the change counter is not the copy's: read it again
    LOADS_MOVED = -3  # here are the loads Redis holds: choose again
    SESSION_ELSEWHERE = -4  # the session keeps another worker
    FEED_AHEAD = -5  # the change feed is past the index the overlaps came from


@dataclass(frozen=True)
class CheckedBooking:
    outcome: Checked
    load_version: int = 0  # BOOKED, LOADS_MOVED
    worker_id: str = ""  # ALREADY_BOOKED, SESSION_ELSEWHERE; BOOKED: the session's worker as found
    change: int = 0  # STATE_MOVED, FEED_AHEAD: the change counter
    prefill: object = None  # LOADS_MOVED: the hashes as HGETALL gives them
    decode: object = None
    rates: object = None  # LOADS_MOVED, when asked for (None: not asked, the copy keeps its own)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _load_keys(keys: ModelKeys) -> list[str]:
    """The keys every booking script is given first (bookings.lua): the load hashes, the
    bookings and the load version."""
    return [keys.prefill_load, keys.decode_load, keys.bookings, keys.load_version]


class LoadBook:
    def __init__(self, client, booking_ttl_s: float = BOOKING_TTL_S):
        """`client`: a redis.asyncio client. The two scripts of every decision (book_checked,
        release) go over one connection shared by all of them where its transport allows
        (kvtier/plumbing/multiplexed.py); everything else through `client`."""
        self._shared = MultiplexedRedis.for_client(client)
        self._select = client.register_script(_COMMON + load_lua("kvtier.router", "select_and_book.lua"))
        self._checked = client.register_script(_COMMON + load_lua("kvtier.router", "book_checked.lua"))
        self._release = client.register_script(_COMMON + load_lua("kvtier.router", "learn_rates.lua")
                                               + load_lua("kvtier.router", "release.lua"))
        self._reconcile = client.register_script(_COMMON + load_lua("kvtier.router", "reconcile_loads.lua"))
        self.ttl_ms = int(booking_ttl_s * 1000)

    async def select_and_book(self, model: str, request_id: str, request_pages: int, decode_pages: int,
                              candidates: Sequence[tuple[str, float, int]], prefill_load_scale: float,
                              temperature: float, u: float, book: bool = True,
                              selection: str = "score", predict: str = "",
                              devices: Sequence[int] = (), faster: TtftColumns | None = None,
                              pick: FasterPick = FASTER_PICK,
                              works: Sequence[tuple[Work, int]] = (), owner: str = "") -> Selection:
        """`candidates`: (worker id, cache credit, pages it need not compute) in a fixed order.
        `selection`: "score" (the formula), "round-robin" or "random" (select_and_book.lua).
        `predict`: the request's page keys blob to predict on the chosen worker past its
        device overlap (`devices`, in candidate order); "" predicts nothing. `faster`: the
        candidates' predicted first tokens: a clearly faster one replaces the formula's choice
        (rates.faster_than_formula by `pick`; None: the formula's).
        `works`: each candidate's predicted work before its booked prefill, with its page size
        (empty: the booking teaches nothing at its first token). `owner`: the secret a client's
        release must give ("": none)."""
        if any("," in c[0] for c in candidates):
            raise ValueError("worker ids must not contain ',' (bridges only announce [A-Za-z0-9_-] ids)")
        keys = ModelKeys.for_model(model)
        args: list[str | int] = [keys.base, _now_ms(), self.ttl_ms, request_id, request_pages, decode_pages,
                                 repr(float(prefill_load_scale)), repr(float(temperature)), repr(float(u)),
                                 1 if book else 0]
        args += (",".join(c[0] for c in candidates), ",".join(repr(float(c[1])) for c in candidates),
                 ",".join(str(c[2]) for c in candidates), selection, predict if book else "",
                 ",".join(str(d) for d in devices) if predict else "",
                 faster.text() if faster is not None else "",
                 ",".join(f"{w.text()} {size}" for w, size in works), owner_digest(owner) if owner else "",
                 repr(float(pick.margin)), repr(float(pick.faster_by)))
        raw = await self._select(keys=[*_load_keys(keys), keys.booking(request_id), keys.round_robin], args=args)
        if int(raw[0]) == -1:
            raise AlreadyBooked(request_id, as_text(raw[1] or b""))
        n = len(candidates)
        return Selection(int(raw[0]) - 1, [int(x) for x in raw[1:1 + n]], [int(x) for x in raw[1 + n:1 + 2 * n]])

    async def book_checked(self, keys: ModelKeys, request_id: str, worker_id: str, prefill_pages: int,
                           decode_pages: int, *, load_version: int | None, change: int | None, lease_count: int,
                           stale_count: int, marker_id: str, book: bool = True, session_id: str | None = None,
                           session_ttl_ms: int = 0, leave_session: bool = False, work: Work | None = None,
                           with_rates: bool = False, owner: str = "") -> CheckedBooking:
        """Book `worker_id`, chosen on a copy of the model's state, only if the copy is what
        Redis holds (book_checked.lua says what each argument is checked against). `change`:
        the change number the overlaps were read at (None: not checked). `work`: what the
        decision predicts its first token waits for, kept for release.lua to learn from;
        `with_rates`: the loads' answer carries the rates too; `owner`: the secret a client's
        release must give ("": none)."""
        session_key = keys.session(session_id) if session_id else keys.base
        raw = await self._run(
            self._checked,
            [*_load_keys(keys), keys.leases, keys.stale_workers, keys.incarnation, keys.changes_counter, session_key,
             keys.booking(request_id), keys.rates],
            [_now_ms(), self.ttl_ms, request_id, worker_id, prefill_pages, decode_pages,
             -1 if load_version is None else load_version, "" if change is None else change, lease_count,
             stale_count, marker_id, 1 if book else 0, session_ttl_ms if session_id else 0,
             1 if leave_session else 0,
             "" if work is None else work.text(),
             1 if with_rates else 0, owner_digest(owner) if owner else ""])
        outcome = Checked(int(raw[0]))
        if outcome is Checked.BOOKED:
            return CheckedBooking(outcome, load_version=int(raw[1]), worker_id=as_text(raw[2] or b""))
        if outcome is Checked.LOADS_MOVED:
            return CheckedBooking(outcome, load_version=int(raw[1]), prefill=raw[2], decode=raw[3],
                                  rates=raw[4] if with_rates else None)
        if outcome in (Checked.STATE_MOVED, Checked.FEED_AHEAD):
            return CheckedBooking(outcome, change=int(raw[1]))
        return CheckedBooking(outcome, worker_id=as_text(raw[1] or b""))

    async def release(self, model: str, request_id: str, stage: ReleaseStage, ttft_ms: float | None = None,
                      owner: str = "", client: str = "") -> Released:
        """`ttft_ms`: the first token's time as the client measured it (None: since the
        booking); a first token teaches the worker's rates when its booking carries work.
        `owner`: the secret the booking's /v1/route answer gave ("": the router's own release,
        not checked); `client`: who reports the time, bounded by ClientSamples ("": trusted)."""
        keys = ModelKeys.for_model(model)
        raw = await self._run(self._release,
                              [*_load_keys(keys), keys.booking(request_id), keys.rates, keys.ttft_errors],
                              [keys.base, request_id, stage.value, _now_ms(), 32,
                               "" if ttft_ms is None else repr(float(ttft_ms)), *_FIT_ARGUMENTS,
                               owner_digest(owner) if owner else "", client, *_CLIENT_ARGUMENTS])
        fit = decode_fit(raw[5]) if raw[5] else None
        found = int(raw[0])
        predicted, off = (as_text(raw[i] or b"") for i in (7, 8))
        return Released(found == 1, as_text(raw[1]), int(raw[2]), int(raw[3]), int(raw[4] or 0), fit,
                        not_owner=found == -1, sample_refused=as_text(raw[6] or b""),
                        predicted_ttft_ms=float(predicted) if predicted else None,
                        ttft_error=float(off) if off else None)

    async def _run(self, script, keys: list, args: list):
        if self._shared is None:
            return await script(keys=keys, args=args)
        return await self._shared.run_script(script.sha, script.script, keys, args)

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()

    async def reconcile(self, model: str) -> bool:
        """Recompute the model's booked loads from its live bookings; True if they had drifted
        (load a lost booking could not give back, now returned)."""
        keys = ModelKeys.for_model(model)
        _, corrected = await self._reconcile(keys=_load_keys(keys), args=[keys.base, _now_ms(), SWEEP_LIMIT])
        return bool(int(corrected))

    async def sweep(self, model: str) -> None:
        """Give back the load of expired bookings (also done a little on every selection)."""
        keys = ModelKeys.for_model(model)
        await self._release(keys=_load_keys(keys), args=[keys.base, "", ReleaseStage.COMPLETE.value, _now_ms(),
                                                          SWEEP_LIMIT])
