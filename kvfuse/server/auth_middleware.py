"""Authentication before the body: ASGI middleware that answers a missing or wrong API key with
its 401 from the headers alone, before the request body is read or parsed.

A route's dependencies run only once FastAPI has read and parsed the whole body (up to
``server.max_body_bytes``, on the event loop), so checking the key there let anyone without a key
make the server read and parse 4 MiB per request. Here the key is checked first; the tenant it
names is left in the scope for ``deps.current_tenant``. Every ``/v1/`` route is authenticated
(``/health``, ``/metrics`` with its own token and the API docs are not).

Failed attempts are counted per client address (``server.auth_failures_per_minute``, the
sliding window of ``rate_limit``): beyond the limit a wrong key gets a 429 with ``Retry-After``
instead of another 401, so guessing keys or flooding bad ones is throttled too. A valid key is
never refused for its address's failures (tenants behind one proxy share an address).

On Anthropic's Messages API (``/v1/messages...``) the key is read from ``x-api-key`` first (then
the bearer token), and the refusal has Anthropic's error shape, as ``deps.anthropic_tenant``
gives it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from . import anthropic_errors
from .auth import Authenticator
from .errors import APIError, error_response
from .rate_limit import RateLimiter, rate_limited
from .request_log import RECORD_KEY

TENANT_KEY = "kvfuse.tenant"  # the scope key of the authenticated tenant
AUTHENTICATED_PREFIX = "/v1/"


def bearer_token(scope: Scope) -> str | None:
    """The credentials of an ``Authorization: Bearer ...`` header (scheme case-insensitive, as
    FastAPI's ``HTTPBearer``); None without one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, credentials = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and credentials:
                return credentials.strip()
            return None
    return None


def header(scope: Scope, name: bytes) -> str | None:
    """The value of the first ``name`` header (lower case), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip() or None
    return None


def api_key(scope: Scope) -> str | None:
    """The request's key: the bearer token, or on the Messages API ``x-api-key`` first."""
    if anthropic_errors.is_messages_route(scope["path"]):
        return header(scope, b"x-api-key") or bearer_token(scope)
    return bearer_token(scope)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""


class AuthMiddleware:
    """See the module docstring. ``failures``: per client address, the failed attempts allowed
    per minute (None: no limit)."""

    def __init__(self, app: ASGIApp, auth: Authenticator, failures_per_minute: int | None):
        self.app, self.auth = app, auth
        limit = failures_per_minute or None
        self.failures = RateLimiter(lambda _address: limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.auth.enabled
            or not scope["path"].startswith(AUTHENTICATED_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        try:
            scope[TENANT_KEY] = self.auth.tenant(api_key(scope))
        except APIError as refused:
            if anthropic_errors.is_messages_route(scope["path"]):
                what = (
                    "invalid x-api-key"
                    if api_key(scope)
                    else "missing API key: send it in the x-api-key header"
                )
                refused = APIError(refused.status, what, code=refused.code, headers=refused.headers)
            await self._refuse(scope, receive, send, refused)
            return
        if (record := scope.get(RECORD_KEY)) is not None:
            record.tenant = scope[TENANT_KEY]
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, e: APIError) -> None:
        """The 401, or the 429 once the address spent its failed attempts; the connection is
        closed (its unread body is not waited for)."""
        address = client_address(scope)
        got = self.failures.admit(address)
        if got is not None and not got[0].allowed:
            e = rate_limited(f"unauthenticated {address}", "server.auth_failures_per_minute", *got)
            if (record := scope.get(RECORD_KEY)) is not None:
                record.error = "auth_rate_limited"
        record = scope.get(RECORD_KEY)
        response = error_response(e, scope["path"], getattr(record, "request_id", None))
        response.headers["connection"] = "close"
        await response(scope, receive, send)
