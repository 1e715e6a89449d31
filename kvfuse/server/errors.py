"""OpenAI-style error bodies and the handlers that turn every failure into one.

Every error the server sends has the shape the official clients parse::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Bad input is a 4xx naming the field and the fix; an unexpected failure is a logged 500. FastAPI's
422 validation errors become 400s (OpenAI never answers 422), starlette's 404/405 keep their
status but get the same body. The Messages API routes (``/v1/messages*``) answer the same errors
in Anthropic's shape instead (``anthropic_errors``): ``error_response`` picks by path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import anthropic_errors
from .request_log import record_of

log = logging.getLogger(__name__)

# The error ``type`` OpenAI reports for each status (the clients map the status to an exception).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client as ``status`` with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(err: APIError, path: str, request_id: str | None = None) -> JSONResponse:
    """``err`` answered to a request for ``path``: in Anthropic's shape on the Messages API
    routes (with its ``request-id`` header), in OpenAI's elsewhere."""
    if not anthropic_errors.is_messages_route(path):
        return err.response()
    return JSONResponse(
        anthropic_errors.error_body(err.status, err.message, request_id),
        status_code=err.status,
        headers=anthropic_errors.error_headers(err.headers, request_id),
    )


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The ``{"error": {...}}`` body the OpenAI clients expect."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(
    message: str, param: str | None = None, code: str | None = "invalid_value"
) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """A 400 for pydantic/FastAPI validation errors, naming the first offending field.

    ``errors`` are ``RequestValidationError.errors()`` items: ``loc`` starts with where the value
    was (``body``, ``query``, ...) and continues with the field path; union members add their type
    name to the path, which is dropped so that the message names the field the client wrote.
    """
    if not errors:
        return bad_request("the request is invalid", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(
            f"the request body is not valid JSON ({detail}); send a JSON object",
            code="invalid_json",
        )
    loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "header", "path")]
    if not loc:
        if first.get("type") == "missing":
            return bad_request(
                "the request body is missing; send a JSON object", code="invalid_request"
            )
        return bad_request(
            f"the request body must be a JSON object: {first.get('msg', 'invalid')}",
            code="invalid_request",
        )
    param = str(loc[0])
    path = _path(loc)
    if first.get("type") == "extra_forbidden":
        return unsupported_field(path, param)
    # Several errors on the same field come from the members of a union: say so in one line.
    same_field = [e for e in errors if _field(e) == param]
    if len(same_field) > 1 and first.get("type") != "missing":
        message = f"{param}: invalid value or type ({'; '.join(sorted({_msg(e) for e in same_field})[:4])})"
    else:
        message = f"{path}: {_msg(first)}"
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    return bad_request(message, param=param, code=code)


def unsupported_field(path: str, param: str) -> APIError:
    """A 400 for a field kvfuse does not implement: never accepted and silently dropped, since
    the answer would then differ from what the client asked for (docs/api.md lists each
    endpoint's fields)."""
    return bad_request(
        f"{path}: this field is not supported by kvfuse; remove it "
        "(docs/api.md lists the supported fields of each endpoint)",
        param=param,
        code="unsupported_parameter",
    )


def _field(error: dict[str, Any]) -> str | None:
    loc = [p for p in error.get("loc", ()) if p not in ("body", "query", "header", "path")]
    return str(loc[0]) if loc else None


def _path(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_type_tag(str(part)):
            continue  # a union member's name, e.g. "list[int]" or "str"
        else:
            out += ("." if out else "") + str(part)
    return out


def _is_type_tag(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "none")
        or "[" in part
        or part[:1].isupper()
        or "-" in part
    )


def _msg(error: dict[str, Any]) -> str:
    if error.get("type") == "missing":
        return "this field is required"
    return str(error.get("msg", "invalid value"))


def install_error_handlers(app: FastAPI) -> None:
    """Route APIError, validation errors and HTTP exceptions to OpenAI-style responses."""

    def answer(request: Request, err: APIError) -> JSONResponse:
        record = record_of(request)
        if record is not None:
            record.error = err.code or err.type
        return error_response(
            err, request.url.path, record.request_id if record is not None else None
        )

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc.errors()))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (
                f"no such endpoint: {request.method} {request.url.path}; see /docs for the API"
            )
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        err = APIError(
            exc.status_code,
            message,
            code=codes.get(exc.status_code),
            headers=dict(exc.headers or {}),
        )
        return answer(request, err)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)


def internal_error() -> APIError:
    """The 500 sent for an unexpected failure (the traceback goes to the log, not the client)."""
    return APIError(
        500,
        "the server had an error while processing your request; it has been logged",
        code="internal_error",
    )
