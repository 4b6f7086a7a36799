"""The Mooncake master's HTTP existence query, as the router reads it:
GET /batch_query_keys?keys=k1,k2 -> {"success": true, "data": {"k1": {"ok": true, ...},
"k2": {"ok": false, "error": "OBJECT_NOT_FOUND"}}}. Other fields are ignored."""

from __future__ import annotations

import msgspec


class KeyStatus(msgspec.Struct, frozen=True):
    ok: bool = False
    error: str = ""


class BatchQueryReply(msgspec.Struct, frozen=True):
    success: bool = False
    data: dict[str, KeyStatus] = {}
    error: str = ""
