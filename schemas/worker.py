"""Worker metadata: what a router needs to hash requests and to find a worker's pages in
the shared Mooncake pool. Announced by the bridge, stored by the processor."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from .limits import Name, guarded

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
#: TP/PP/DP sizes: at most 1024 (GPUs of one engine; far above any deployment).
MAX_PARALLEL_SIZE = 1024
ParallelSize = Annotated[int, msgspec.Meta(gt=0, le=MAX_PARALLEL_SIZE)]
#: Objects a router checks per page in the shared pool (2 x TP x PP with MHA, PP with MLA):
#: at most this many, so one announcement cannot make every routing decision enumerate
#: millions of keys.
MAX_OBJECTS_PER_PAGE = 4096


class AttentionKind(str, enum.Enum):
    MHA = "mha"  # keys "{digest}_{tp_rank}_k" and "_v" per TP rank
    MLA = "mla"  # one key "{digest}__k" shared by all ranks


class MooncakeLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How SGLang HiCache names a page's objects in Mooncake."""

    attention: AttentionKind = AttentionKind.MHA
    tp_size: ParallelSize = 1
    pp_size: ParallelSize = 1
    key_prefix: str = ""

    def __post_init__(self) -> None:
        if self.objects_per_page > MAX_OBJECTS_PER_PAGE:
            raise ValueError(f"a {self.attention.value.upper()} layout with tp_size {self.tp_size} and pp_size "
                             f"{self.pp_size} has {self.objects_per_page} objects per page; at most "
                             f"{MAX_OBJECTS_PER_PAGE} are supported")

    @property
    def objects_per_page(self) -> int:
        return self.pp_size if self.attention == AttentionKind.MLA else 2 * self.tp_size * self.pp_size


class WorkerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    #: Schema version; decoders accept newer minor additions (unknown fields are ignored).
    v: int = 1
    worker_id: Name
    model: Name
    #: The engine process this state unit belongs to; for DP>1 each attention-DP rank is its own
    #: kvtier worker ("<engine_worker_id>-dp<rank>") because each rank has its own radix cache.
    engine_worker_id: str = ""
    dp_rank: NonNegativeInt = 0
    dp_size: ParallelSize = 1
    page_size: PositiveInt
    tp_size: ParallelSize = 1
    pp_size: ParallelSize = 1
    mooncake: MooncakeLayout | None = None
    kv_events_endpoint: str = ""
    #: The engine's HTTP base URL (e.g. http://10.0.0.5:30000), where a proxying router sends
    #: the requests it routes to this worker.
    http_endpoint: str = ""
    replay_endpoint: str = ""
    #: Whether the engine runs HiCache (a host-RAM tier, SGLang --enable-hierarchical-cache);
    #: None when the bridge was not told. With HiCache on, host stores must appear in the
    #: events (`kvtier doctor` checks it), and the write policy says when.
    hicache_enabled: bool | None = None
    hicache_write_policy: str = ""
    engine: str = "sglang"
    engine_version: str = ""


_decoder = msgspec.json.Decoder(WorkerMetadata)


def encode_worker_metadata(meta: WorkerMetadata) -> bytes:
    """The JSON stored at `kvt:{m}:w:<worker>:meta` (schemas/state_keys.py)."""
    return msgspec.json.encode(meta)


def decode_worker_metadata(data: bytes | str) -> WorkerMetadata:
    """Raises msgspec.DecodeError/ValidationError."""
    return guarded(_decoder.decode, data)


#: A worker whose flags leave its layout out, as the declarations above say: TP and PP of one
#: and MHA attention (MooncakeLayout), one attention-DP rank (WorkerMetadata).
UNSPLIT = MooncakeLayout()
ONE_RANK: int = next(f.default for f in msgspec.structs.fields(WorkerMetadata) if f.name == "dp_size")
