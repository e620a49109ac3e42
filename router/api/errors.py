"""Client-facing errors, shaped the way each client API shapes them.

One `APIError` carries an error *kind* (Anthropic's vocabulary, which names categories), an HTTP
status, a message that says what to fix, and optionally the offending field. `body()` renders it
for the API the client spoke:

- OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`):
  `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`
- Anthropic (`/v1/messages`): `{"type": "error", "error": {"type": ..., "message": ...}}`

Kinds and how they render:

| kind                  | status | OpenAI `type`           | OpenAI `code` (default)  |
|-----------------------|--------|-------------------------|--------------------------|
| invalid_request_error | 400    | invalid_request_error   | null                     |
| authentication_error  | 401    | invalid_request_error   | invalid_api_key          |
| permission_error      | 403    | invalid_request_error   | permission_denied        |
| not_found_error       | 404    | invalid_request_error   | not_found                |
| request_too_large     | 413    | invalid_request_error   | request_too_large        |
| rate_limit_error      | 429    | requests                | rate_limit_exceeded      |
| api_error             | 502    | server_error            | null                     |
| overloaded_error      | 503 (OpenAI) / 529 (Anthropic) | server_error | null             |

(OpenAI itself reports request-rate limits with type `requests` and an overloaded model as a 503
`server_error`; Anthropic reports overload as 529 `overloaded_error`.) `headers()` adds
`retry-after` (whole seconds, rounded up) and `retry-after-ms` — both SDKs honour them — when a
retry delay is known, plus `x-should-retry` for retryable kinds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

ErrorDialect = Literal["openai", "anthropic"]
ErrorKind = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]

_OPENAI_TYPE: dict[str, tuple[str, str | None]] = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "permission_error": ("invalid_request_error", "permission_denied"),
    "not_found_error": ("invalid_request_error", "not_found"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("requests", "rate_limit_exceeded"),
    "api_error": ("server_error", None),
    "overloaded_error": ("server_error", None),
}
_RETRYABLE = frozenset({"rate_limit_error", "api_error", "overloaded_error"})
OVERLOADED_STATUS: dict[ErrorDialect, int] = {"openai": 503, "anthropic": 529}


@dataclass(eq=False)
class APIError(Exception):
    """An error to return to the client, in `api`'s own shape.

    `status`: HTTP status. `type`: the error kind (table in the module docstring). `param`: the
    offending request field as a dotted path (`messages.0.role`), or None. `code`: OpenAI's
    machine-readable code; None picks the kind's default. `retry_after_s`: when the client may
    retry (429/503/529), or None.
    """

    status: int
    message: str
    type: ErrorKind = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    api: ErrorDialect = "openai"
    retry_after_s: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        """The JSON body in `api`'s error shape."""
        if self.api == "anthropic":
            return {"type": "error", "error": {"type": self.type, "message": self.message}}
        openai_type, default_code = _OPENAI_TYPE[self.type]
        return {
            "error": {
                "message": self.message,
                "type": openai_type,
                "param": self.param,
                "code": self.code if self.code is not None else default_code,
            }
        }

    def body_bytes(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()

    def headers(self) -> dict[str, str]:
        """Response headers: retry hints for retryable kinds (lower-case names)."""
        out: dict[str, str] = {}
        if self.type in _RETRYABLE:
            out["x-should-retry"] = "true"
        if self.retry_after_s is not None:
            delay = max(0.0, self.retry_after_s)
            out["retry-after"] = str(math.ceil(delay))
            out["retry-after-ms"] = str(math.ceil(delay * 1000))
        return out

    def for_api(self, api: ErrorDialect) -> APIError:
        """The same error for another dialect (an overload's status follows the dialect)."""
        if api == self.api:
            return self
        status = self.status
        if self.type == "overloaded_error" and status == OVERLOADED_STATUS[self.api]:
            status = OVERLOADED_STATUS[api]
        return dataclasses.replace(self, api=api, status=status)


def invalid_request(field: str | None, fix: str, api: ErrorDialect = "openai") -> APIError:
    """400: `field` (dotted path, or None for the whole body) is wrong; `fix` says how."""
    message = f"{field}: {fix}" if field else fix
    return APIError(400, message, "invalid_request_error", param=field, api=api)


def too_large(
    limit_bytes: int, size_bytes: int | None = None, api: ErrorDialect = "openai"
) -> APIError:
    """413: the request body exceeds the router's limit."""
    got = f"{size_bytes} bytes" if size_bytes is not None else "too large"
    message = (
        f"request body is {got}; the limit is {limit_bytes} bytes: shorten the request "
        "or raise the router's max request size"
    )
    return APIError(413, message, "request_too_large", api=api)


def unauthorized(
    message: str = "missing or invalid API key: send it as 'Authorization: Bearer <key>' "
    "or 'x-api-key: <key>'",
    api: ErrorDialect = "openai",
) -> APIError:
    """401: no or a wrong credential."""
    return APIError(401, message, "authentication_error", api=api)


def rate_limited(retry_after_s: float | None, api: ErrorDialect = "openai") -> APIError:
    """429: the router shed this request (its band's queue is full); retry later."""
    when = f" in {math.ceil(retry_after_s)} s" if retry_after_s is not None else " later"
    message = f"too many requests queued for this deployment: retry{when}"
    return APIError(429, message, "rate_limit_error", api=api, retry_after_s=retry_after_s)


def overloaded(retry_after_s: float | None, api: ErrorDialect = "openai") -> APIError:
    """503 (OpenAI) / 529 (Anthropic): no worker can take the request now; retry later."""
    when = f" in {math.ceil(retry_after_s)} s" if retry_after_s is not None else " later"
    message = f"the deployment is overloaded (no worker can take the request): retry{when}"
    return APIError(
        OVERLOADED_STATUS[api], message, "overloaded_error", api=api, retry_after_s=retry_after_s
    )


def not_found(
    what: str, fix: str = "", api: ErrorDialect = "openai", code: str | None = None
) -> APIError:
    """404: `what` (e.g. "model 'x'") does not exist here; `fix` names what does."""
    message = f"{what} not found" + (f": {fix}" if fix else "")
    return APIError(404, message, "not_found_error", api=api, code=code)


def upstream_failed(detail: str, api: ErrorDialect = "openai") -> APIError:
    """502: the worker failed or broke the protocol; the client may retry."""
    return APIError(502, f"upstream worker failed: {detail}", "api_error", api=api)
