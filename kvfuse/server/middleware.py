"""ASGI middleware: request ids, one JSON log line and the request metrics per request, body limit.

Both are plain ASGI middleware (not ``BaseHTTPMiddleware``), so streaming responses and client
disconnects pass through them untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict

from fastapi import HTTPException
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, error_response, internal_error
from .metrics import ServerMetrics
from .request_log import RECORD_KEY, RequestRecord

log = logging.getLogger(__name__)
request_log = logging.getLogger("kvfuse.server.requests")

# Label values of kvfuse_http_requests_total: the routes, and "other" (bounded cardinality).
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/v1/kv",
    "/v1/kv/stats",
    "/health",
    "/metrics",
)


def endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class RequestContextMiddleware:
    """Gives every request an id (``x-request-id`` response header), counts it in the metrics, logs
    it as one JSON line, and turns an unhandled exception into an OpenAI-style 500."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(
            request_id=f"req_{uuid.uuid4().hex}", method=scope["method"], path=scope["path"]
        )
        scope[RECORD_KEY] = record
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                MutableHeaders(scope=message).append("x-request-id", record.request_id)
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "request %s (%s %s) failed", record.request_id, record.method, record.path
            )
            record.error = record.error or "internal_error"
            if started:
                record.status = 500  # the response was cut short
            else:
                response = error_response(internal_error(), record.path, record.request_id)
                await response(scope, receive, send_with_id)
        finally:
            record.duration_ms = round((time.perf_counter() - t0) * 1000, 1)
            self.metrics.requests.labels(
                endpoint=endpoint_label(record.path), status=str(record.status)
            ).inc()
            if request_log.isEnabledFor(logging.INFO):
                fields = {k: v for k, v in asdict(record).items() if v is not None}
                request_log.info(json.dumps({"event": "request", **fields}, ensure_ascii=False))


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(
            413, f"the request body is larger than {limit} bytes (server.max_body_bytes)"
        )


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float):
        super().__init__(
            408, f"the request body was not received within {timeout_s:g} s (server.body_timeout_s)"
        )


class BodyLimitMiddleware:
    """413 for request bodies above ``max_body_bytes``: at once from Content-Length, and while reading
    for bodies without one (chunked), before the whole body is in memory. 408 for a body not
    received within ``body_timeout_s`` of its first read (0: no limit): a client trickling a body
    would otherwise hold its connection, and a place under uvicorn's ``limit_concurrency``, for
    ever."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = 0.0):
        self.app = app
        self.limit = max_body_bytes
        self.timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _reply(
                    scope,
                    receive,
                    send,
                    400,
                    "the Content-Length header is not a number",
                    "invalid_request",
                )
                return
            if int(length) > self.limit:
                await _reply(
                    scope,
                    receive,
                    send,
                    413,
                    f"the request body ({int(length)} bytes) is larger than {self.limit} bytes "
                    "(server.max_body_bytes)",
                    "request_too_large",
                )
                return
        received, deadline, complete = 0, None, False

        async def limited_receive() -> Message:
            nonlocal received, deadline, complete
            if complete or not self.timeout_s:  # after the body: e.g. waiting for a disconnect
                message = await receive()
            else:
                deadline = deadline or time.monotonic() + self.timeout_s
                try:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except TimeoutError:
                    raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.limit:
                    # FastAPI re-raises HTTPExceptions from body reads
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)


async def _reply(
    scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str
) -> None:
    err = APIError(status, message, code=code, headers={"connection": "close"})
    record = scope.get(RECORD_KEY)
    response = error_response(err, scope["path"], record.request_id if record else None)
    await response(scope, receive, send)
