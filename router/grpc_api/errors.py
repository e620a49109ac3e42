"""Typed refusals shared by the gRPC services.

A routing callable (the ext_proc picker or the native `Route`) refuses a request by raising
`RouteRejected`; each service turns it into its own wire form: an Envoy `ImmediateResponse` with
the HTTP status (ext_proc) or a gRPC status with a `retry-after` trailer (native `Route`).

| status | meaning | gRPC code |
|---|---|---|
| 503 | no endpoint fits (none ready, none in the data plane's subset) | UNAVAILABLE |
| 429 | shed by flow control (band over capacity) | RESOURCE_EXHAUSTED |
| 400 | the request cannot be routed as sent (bad JSON, unknown model) | INVALID_ARGUMENT |
| 404 | unknown model | NOT_FOUND |
| 413 | request body over the configured limit | RESOURCE_EXHAUSTED |
"""

from __future__ import annotations

import grpc

GRPC_CODE_FOR_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class RouteRejected(Exception):
    """A request the router will not place: `status` is the HTTP status the client gets.

    `retry_after_s` (None: no hint) becomes a `Retry-After` header (whole seconds, rounded up)
    or a `retry-after` gRPC trailer.
    """

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"RouteRejected status must be an HTTP error status 400-599: {status}")
        if retry_after_s is not None and retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return GRPC_CODE_FOR_STATUS.get(
            self.status,
            grpc.StatusCode.INTERNAL if self.status >= 500 else grpc.StatusCode.FAILED_PRECONDITION,
        )


def retry_after_header(retry_after_s: float | None) -> str | None:
    """`Retry-After` value in whole seconds (RFC 9110 delay-seconds), rounded up; None: no hint."""
    if retry_after_s is None:
        return None
    whole = int(retry_after_s)
    return str(whole if whole == retry_after_s else whole + 1)
