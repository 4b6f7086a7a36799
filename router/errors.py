"""Why a routing decision gave no worker, each with the HTTP status the service answers with."""

from __future__ import annotations


class RoutingError(Exception):
    status = 400


class UnknownModel(RoutingError):
    status = 404


class NoWorkers(RoutingError):
    status = 503


class DuplicateRequest(RoutingError):
    status = 409


class Busy(RoutingError):
    """Every candidate is at or over a busy threshold: the request should wait (the service's
    queue) or be refused with Retry-After."""

    status = 503


class NotOwner(RoutingError):
    """A release that does not give the secret of the booking it names (the /v1/route answer's
    `owner`): only the client that booked may give its load back, or teach by its first token."""

    status = 403
