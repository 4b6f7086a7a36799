"""The router's wire types: the HTTP API (`/v1/route`, `/v1/release`) and the decision log
(`kvtier.decisions.<model>` on JetStream). Declared once; the service decodes request bodies
straight into these structs, so a wrong type, a negative token id or an unknown override
name is refused with a path-precise message (e.g. "at `$.token_ids[3]`")."""

from __future__ import annotations

import array
import enum
from typing import Annotated

import msgspec

from .events import UnsupportedVersion
from .limits import guarded

#: SGLang hashes token ids as uint32: anything outside is not a token id. Lists of them are
#: declared `list[int]` and checked by `check_token_ids` in the struct's `__post_init__`: a
#: per-element msgspec bound made decoding 8,192 ids take 320 µs against 166 for plain ints,
#: and packing them as uint32 checks the same bound in 47 µs (tests/router/test_router.py's bad bodies).
UINT32_MAX = 0xFFFFFFFF


def check_token_ids(ids: list[int], field: str) -> None:
    """Raise ValueError (msgspec reports it as a ValidationError) naming the first id of `ids`
    outside uint32, at its path `$.<field>[i]`, as msgspec's own bound would."""
    try:
        array.array("I", ids)
    except OverflowError:
        bad = next(i for i, t in enumerate(ids) if not 0 <= t <= UINT32_MAX)
        raise ValueError(f"Expected `int` >= 0 and <= {UINT32_MAX}, got {ids[bad]} - at `$.{field}[{bad}]`") from None

Weight = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:\-]+$")]
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]
#: A booking's owner secret as the router hands it out (secrets.token_urlsafe).
OwnerSecret = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]

DECISION_SCHEMA_VERSION = 1


class ScoringWeights(msgspec.Struct, frozen=True, kw_only=True):
    """The scoring formula's knobs (docs/DESIGN.md). Defaults are the Dynamo HiCache guide's but
    one: `prefill_load_scale` is 16, not 1 (docs/DESIGN.md says why)."""

    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.5
    prefill_load_scale: float = 16.0
    temperature: float = 0.0
    #: Credit per predicted page: a page of a request booked on the worker and not yet
    #: complete, which its events may not show yet (router/README.md).
    predicted_page_weight: float = 1.0


class RouteOverrides(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request overrides of any weight; an unknown name is an error, not a silent no-op."""

    overlap_score_credit: Weight | None = None
    host_cache_hit_weight: Weight | None = None
    disk_cache_hit_weight: Weight | None = None
    shared_cache_multiplier: Weight | None = None
    prefill_load_scale: Weight | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] | None = None
    predicted_page_weight: Weight | None = None

    def applied_to(self, weights: ScoringWeights) -> ScoringWeights:
        changes = {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not None}
        return msgspec.structs.replace(weights, **changes) if changes else weights


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    token_ids: list[int]  # each a uint32: check_token_ids in __post_init__
    request_id: RequestId | None = None
    overrides: RouteOverrides | None = None
    #: Expected output tokens, booked as decode pages with the prompt (0 = prompt only).
    max_new_tokens: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 0
    #: Book load on the chosen worker (False: a dry run that only scores).
    book: bool = True
    #: A conversation's id: its requests stay on the worker that served it last while that
    #: worker is live and under its busy thresholds (kept in Redis for --session-ttl).
    session_id: SessionId | None = None
    #: List every candidate with its logit, overlap and loads in the answer (`candidates`);
    #: without it the answer names the winner only (the decision log always has them all).
    explain: bool = False

    def __post_init__(self) -> None:
        check_token_ids(self.token_ids, "token_ids")


class TierOverlap(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's overlap with a request, in pages, by the walk of docs/DESIGN.md: `device` is the
    device prefix, `host` continues it on host, `disk` continues that on disk;
    `shared_beyond` counts shared-pool pages at positions >= `device`."""

    device: int = 0
    host: int = 0
    disk: int = 0
    shared_beyond: int = 0
    #: Pages of the prefix not on device yet but predicted there: booked by a request on this
    #: worker that has not completed (they extend the device prefix; `shared_beyond` counts
    #: from the end of both).
    predicted: int = 0

    def dominant_tier(self) -> str:
        """The tier holding most of this overlap: "device" (predicted pages included), "host",
        "disk" or "shared"; "none" when there is no overlap. Ties go to the faster tier."""
        tiers = (("device", self.device + self.predicted), ("host", self.host), ("disk", self.disk),
                 ("shared", self.shared_beyond))
        name, pages = max(tiers, key=lambda tier: tier[1])  # the first of equal ones
        return name if pages else "none"

    def reusable_pages(self) -> int:
        """Pages of the prefix the worker can reuse by this view: its own tiers in a row, or its
        device prefix continued from the shared pool, whichever reaches further."""
        device = self.device + self.predicted
        return max(device + self.host + self.disk, device + self.shared_beyond)


class CandidateScore(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    logit: float
    overlap: TierOverlap
    prefill_load: int
    decode_load: int
    page_size: int


class RouteResponse(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    worker_id: str
    logit: float
    overlap: TierOverlap
    request_pages: int
    page_size: int
    #: Every candidate scored, when the request asked (`explain`); empty otherwise.
    candidates: list[CandidateScore] = []
    #: Empty when every input was available; otherwise what the decision had to do without,
    #: e.g. "state-store-unavailable" (routed by load/round robin) or "shared-pool-unavailable".
    degraded: list[str] = []
    booked: bool = True
    worker_url: str = ""
    #: With a session id: "kept" (its worker is also the formula's choice), "overrode" (its
    #: worker was chosen over the formula's), "" (no session, or its worker was not available).
    affinity: str = ""
    #: The booking's owner secret (POST /v1/route with `book`): /v1/release of this booking
    #: needs it. "" on dry runs, and on the proxy's own bookings, which no client releases.
    owner: str = ""
    #: With --router-mode predicted-ttft: the chosen worker's first token as its learned rates
    #: predict it (its work and the prefill booked ahead), in ms; None before its fit is
    #: trusted (router/rates.py FasterPick), or in another mode. Its release's `ttft_error`
    #: says how far off the rates were.
    predicted_ttft_ms: float | None = None


#: Upper bounds of the busy thresholds (`AdmissionSettings`, `AdmissionChange` and the settings
#: stored for the deployment in Redis all use them). Far past any engine: the largest KV pools
#: hold ~10^7 tokens, and an H100 prefills ~10^4-10^5 tokens/s, so 10^9 queued prompt tokens is
#: hours of prefill and 10^8 pages more KV than any pool holds. A larger value is a typo (or a
#: unit mistake), refused with a 400 instead of silently switching the threshold off.
MAX_BUSY_PREFILL_TOKENS = 1_000_000_000
MAX_BUSY_DECODE_PAGES = 100_000_000
#: The queue's bounds: a million waiting requests, an hour's wait.
MAX_QUEUE_SIZE = 1_000_000
MAX_QUEUE_TIMEOUT_S = 3600.0

BusyPrefillTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_BUSY_PREFILL_TOKENS)]
BusyDecodePages = Annotated[int, msgspec.Meta(ge=0, le=MAX_BUSY_DECODE_PAGES)]
QueueSize = Annotated[int, msgspec.Meta(ge=0, le=MAX_QUEUE_SIZE)]
QueueTimeout = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_QUEUE_TIMEOUT_S)]


class AdmissionSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Busy thresholds per worker and the router's queue (GET/PUT /v1/admission). A worker at
    or over a threshold takes no new request; when every candidate is, a request waits in the
    queue. 0: no threshold."""

    busy_prefill_tokens: BusyPrefillTokens = 0
    busy_decode_pages: BusyDecodePages = 0
    queue_size: QueueSize = 256
    queue_timeout_s: QueueTimeout = 10.0


class AdmissionChange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """PUT /v1/admission: the fields given change, the others stay as they are."""

    busy_prefill_tokens: BusyPrefillTokens | msgspec.UnsetType = msgspec.UNSET
    busy_decode_pages: BusyDecodePages | msgspec.UnsetType = msgspec.UNSET
    queue_size: QueueSize | msgspec.UnsetType = msgspec.UNSET
    queue_timeout_s: QueueTimeout | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, int | float]:
        """The fields this change sets, by name."""
        return {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not msgspec.UNSET}

    def applied_to(self, current: AdmissionSettings) -> AdmissionSettings:
        return msgspec.structs.replace(current, **self.given())


class AdmissionAnswer(AdmissionSettings, frozen=True, kw_only=True):
    """PUT /v1/admission's answer: the settings now in force (the same fields as GET's answer),
    and where. A change reaches this replica's processes only: other replicas keep their own
    settings until they are told too (docs/USING.md)."""

    #: "replica": the change holds on the replica that took the PUT, not on the deployment.
    scope: str = "replica"
    #: The router id of the replica that took the PUT.
    router_id: str = ""
    #: The processes of that replica (`--processes N`) that applied it, and those that did not
    #: answer (each named "process <i>").
    applied: list[str] = []
    not_applied: list[str] = []


class ReleaseStage(str, enum.Enum):
    FIRST_TOKEN = "first_token"  # prefill done: the prefill pages leave the worker's queue
    COMPLETE = "complete"  # finished or abandoned: everything the request booked is released


class ReleaseRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    request_id: RequestId
    stage: ReleaseStage = ReleaseStage.COMPLETE
    #: At first token: how long the first token took as the client measured it, in ms (None:
    #: the router takes the time since its booking). It teaches the worker's rates.
    #: 0 (a first token under the clock's resolution) is a first token too: it teaches nothing.
    ttft_ms: Annotated[float, msgspec.Meta(ge=0.0, le=86_400_000.0)] | None = None
    #: The secret the booking's /v1/route answer named (`owner`): only its holder may release
    #: the booking, or teach the worker's rates by its first token.
    owner: OwnerSecret


class ReleaseResponse(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    released: bool
    worker_id: str = ""
    prefill_pages: int = 0
    decode_pages: int = 0
    #: Why the first token's time taught the worker's rates nothing ("": it taught, or there
    #: was nothing to teach): "budget" (this client's samples of the worker this minute are
    #: spent), "late" (longer than the booking had lived). router/rates.py ClientSamples.
    sample_refused: str = ""
    #: For a first token that taught the worker's rates: what they predicted for it (ms), just
    #: before it taught them, and how far off, as a fraction of its true time (> 0: predicted
    #: too long). None otherwise.
    predicted_ttft_ms: float | None = None
    ttft_error: float | None = None


class RouteDecision(msgspec.Struct, frozen=True, kw_only=True):
    """One decision as published to `kvtier.decisions.<model>`: enough to re-score it later
    (the request's page hashes per page size, the weights, every candidate's inputs, and the
    random draw that broke ties or sampled)."""

    v: int = DECISION_SCHEMA_VERSION
    request_id: str
    model: str
    router_id: str
    ts: float
    weights: ScoringWeights
    random_draw: float
    #: page size -> the request's page hashes (signed int64 BlockHash values) at that size
    page_hashes: dict[int, list[int]]
    request_pages: int
    chosen: str
    candidates: list[CandidateScore]
    degraded: list[str] = []
    latency_ms: float = 0.0
    shared_pool_queried: bool = False
    #: RouteResponse.predicted_ttft_ms of the decision.
    predicted_ttft_ms: float | None = None


class GenerateSamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of SGLang's native `/generate` body a proxying router reads; the body is
    forwarded unchanged, so every other field reaches the worker as the client sent it."""

    input_ids: list[int]  # each a uint32: check_token_ids in __post_init__
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    rid: RequestId | None = None
    stream: bool = False
    sampling_params: GenerateSamplingParams = GenerateSamplingParams()

    def __post_init__(self) -> None:
        check_token_ids(self.input_ids, "input_ids")


class ErrorBody(msgspec.Struct, frozen=True):
    error: str


class _RequestIdOnly(msgspec.Struct):
    """A decision-log message read for its request id alone (a search reads thousands)."""

    request_id: str = ""


_route_response = msgspec.json.Decoder(RouteResponse)
_decision_encoder = msgspec.msgpack.Encoder()
_decision = msgspec.msgpack.Decoder(RouteDecision)
_decision_request_id = msgspec.msgpack.Decoder(_RequestIdOnly)


def encode_decision(decision: RouteDecision) -> bytes:
    """A decision as published to `kvtier.decisions.<model>` (msgpack)."""
    return _decision_encoder.encode(decision)


def decode_decision(data: bytes) -> RouteDecision:
    """A decision-log message. Raises msgspec.DecodeError/ValidationError, and
    events.UnsupportedVersion for a newer major `v`."""
    decision = guarded(_decision.decode, data)
    if decision.v > DECISION_SCHEMA_VERSION:
        raise UnsupportedVersion(f"decision schema v{decision.v}")
    return decision


def decision_request_id(data: bytes) -> str:
    """Only the request id of a decision-log message ("" when it has none). Raises
    msgspec.DecodeError/ValidationError."""
    return guarded(_decision_request_id.decode, data).request_id


def decode_route_response(body: bytes | str) -> RouteResponse:
    """A router's `/v1/route` answer (200), as kvtier's benchmark clients read it. Raises
    msgspec.DecodeError/ValidationError."""
    return _route_response.decode(body)
