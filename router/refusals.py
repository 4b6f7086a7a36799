"""Refusing a request, for every path of the HTTP edge (router/service.py, router/proxy.py): the
error bodies (the router's `{"error": ...}`, or OpenAI's shape on the OpenAI paths), the
`Refused` exception handlers raise, decoding a body, and the bounds more than one path checks."""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvtier.schemas.limits import guarded
from kvtier.schemas.openai import ChatCompletionRequest, CompletionRequest, OpenAIError, OpenAIErrorBody
from kvtier.schemas.routing import ErrorBody, GenerateRequest, ReleaseRequest, RouteRequest

from .service_settings import ServiceSettings

json_encoder = msgspec.json.Encoder()

#: Paths whose refusals take OpenAI's error shape.
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
_OPENAI_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                       429: "rate_limit_error"}


def error_response(status: int, message: str, metrics=None, openai: bool = False) -> web.Response:
    """A JSON error answer; a 4xx counts in router_bad_requests when `metrics` is given."""
    if metrics is not None and 400 <= status < 500:
        metrics.bad_requests.labels(str(status)).inc()
    if openai:
        kind = _OPENAI_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        body: msgspec.Struct = OpenAIErrorBody(error=OpenAIError(message=message, type=kind, code=status))
    else:
        body = ErrorBody(message)
    return web.Response(status=status, body=json_encoder.encode(body), content_type="application/json")


class Refused(Exception):
    """A request this router will not serve, with the status and the reason to send back."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


#: One decoder per request type, built once (msgspec.json.decode(data, type=...) looks the type up on
#: every call, and a lambda per request wrapped it).
_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (RouteRequest, ReleaseRequest, GenerateRequest,
                                                            CompletionRequest, ChatCompletionRequest)}


def decode_body(body: bytes, kind):
    """Decode a request body straight into its struct; errors name the offending path."""
    if not body:
        raise Refused(400, "empty body: send a JSON object")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return guarded(decoder.decode, body)


def check_tokens(count: int, field: str, settings: ServiceSettings) -> None:
    if count == 0:
        raise Refused(400, f"{field} is empty: there is nothing to route")
    if count > settings.max_request_tokens:
        raise Refused(413, f"{field} has {count} tokens; this router accepts at most "
                           f"{settings.max_request_tokens} (--max-request-tokens)")


def check_budget(budget: int, field: str, settings: ServiceSettings) -> None:
    if budget > settings.max_new_tokens:
        raise Refused(400, f"{field} is {budget}; this router accepts at most {settings.max_new_tokens} "
                           "(--max-new-tokens)")
