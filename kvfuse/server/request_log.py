"""The per-request record behind the JSON request log line; handlers fill in what they learn."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

RECORD_KEY = "kvfuse.record"  # where a request's RequestRecord lives in the ASGI scope


@dataclass
class RequestRecord:
    """What the request log line says about one request."""

    request_id: str
    method: str
    path: str
    status: int = 0
    tenant: str | None = None
    model: str | None = None
    stream: bool | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    queue_ms: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    duration_ms: float = 0.0


def record_of(request: Request) -> RequestRecord | None:
    """The record of ``request`` (None outside the request-context middleware, e.g. in unit tests)."""
    return request.scope.get(RECORD_KEY)
