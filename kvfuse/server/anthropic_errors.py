"""Anthropic's error shape, for the Messages API routes (``/v1/messages``, ``/v1/messages/*``).

The official ``anthropic`` clients parse::

    {"type": "error", "error": {"type": "<error type>", "message": str}, "request_id": str}

and raise an exception per HTTP status (400 ``BadRequestError``, 401 ``AuthenticationError``,
404 ``NotFoundError``, 413, 429 ``RateLimitError``, 529 ``OverloadedError``, ...). The error
type follows the status as Anthropic's API documents it. ``errors.error_response`` renders every
error of these routes through here, so a route raises the same ``APIError`` on both APIs; the
OpenAI routes keep OpenAI's shape. Nothing here imports ``errors`` (which imports this).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

MESSAGES_ROUTE = "/v1/messages"

# Anthropic's error type for each status it documents; other 4xx are invalid requests and other
# 5xx API errors.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # kvfuse: shutting down, or the request was cancelled: retry
    504: "timeout_error",
    529: "overloaded_error",
}

# The status Anthropic answers when the service (here: the engine's queue) is overloaded.
OVERLOADED = 529


def is_messages_route(path: str) -> bool:
    """Whether ``path`` belongs to the Messages API (answered in Anthropic's shape)."""
    return path == MESSAGES_ROUTE or path.startswith(MESSAGES_ROUTE + "/")


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """The body of an error answered with ``status``."""
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": error_type(status), "message": message},
    }
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_headers(
    headers: dict[str, str], request_id: str | None, now: float | None = None
) -> dict[str, str]:
    """``headers`` with Anthropic's: ``request-id`` (which the clients expose as
    ``_request_id``) and, for a rate limit, ``anthropic-ratelimit-requests-*`` (limit, remaining,
    and the reset time in RFC 3339) beside the OpenAI-style ``x-ratelimit-*`` ones."""
    out = dict(headers)
    if request_id is not None:
        out["request-id"] = request_id
    limit = headers.get("x-ratelimit-limit-requests")
    if limit is not None:
        out["anthropic-ratelimit-requests-limit"] = limit
        out["anthropic-ratelimit-requests-remaining"] = headers.get(
            "x-ratelimit-remaining-requests", "0"
        )
        wait = float(headers.get("retry-after", "1"))
        reset = datetime.fromtimestamp((time.time() if now is None else now) + wait, timezone.utc)
        out["anthropic-ratelimit-requests-reset"] = reset.isoformat(timespec="seconds").replace(
            "+00:00", "Z"
        )
    return out
