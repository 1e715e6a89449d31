"""FastAPI dependencies: the app's state and the caller's tenant (from ``Authorization: Bearer``,
or on the Messages API from Anthropic's ``x-api-key`` header or the same bearer token)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from .auth_middleware import TENANT_KEY
from .errors import APIError
from .request_log import record_of

if TYPE_CHECKING:
    from .state import ServerState


def get_state(request: Request) -> ServerState:
    """The state of the app serving ``request``."""
    return request.app.state.kvfuse


_bearer = HTTPBearer(
    auto_error=False,
    description="An API key configured with `--api-key KEY:TENANT` (server.api_keys). Only required when the "
    "server has API keys; each key's tenant gets its own KV cache namespace.",
)


async def current_tenant(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> str:
    """The caller's tenant (also noted in the request's log record): the one ``AuthMiddleware``
    found before the body was read, or (outside it) the key's."""
    tenant = request.scope.get(TENANT_KEY)
    if tenant is None:
        tenant = get_state(request).auth.tenant(credentials.credentials if credentials else None)
    if (record := record_of(request)) is not None:
        record.tenant = tenant
    return tenant


async def limited_tenant(request: Request, tenant: str = Depends(current_tenant)) -> str:
    """The caller's tenant, after counting the request against its rate limit (429 beyond it:
    ``tenants.<name>.quota.requests_per_minute``)."""
    get_state(request).admit(tenant)
    return tenant


_x_api_key = APIKeyHeader(
    name="x-api-key",
    auto_error=False,
    description="Anthropic's API key header (the Messages API; Authorization: Bearer works too): "
    "a key configured with `--api-key KEY:TENANT`, only required when the server has API keys.",
)


async def anthropic_tenant(
    request: Request,
    api_key: str | None = Depends(_x_api_key),
    credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),
) -> str:
    """The caller's tenant on the Messages API: the key of ``x-api-key``, else the bearer token,
    mapped exactly as the OpenAI routes map theirs; the 401 says which header to send."""
    key = api_key or (credentials.credentials if credentials else None)
    try:
        tenant = get_state(request).auth.tenant(key)
    except APIError as e:
        what = (
            "missing API key: send it in the x-api-key header" if not key else "invalid x-api-key"
        )
        raise APIError(e.status, what, code=e.code, headers=e.headers) from None
    if (record := record_of(request)) is not None:
        record.tenant = tenant
    return tenant


async def anthropic_limited_tenant(
    request: Request, tenant: str = Depends(anthropic_tenant)
) -> str:
    """``anthropic_tenant``, after counting the request against the tenant's rate limit."""
    get_state(request).admit(tenant)
    return tenant


async def metrics_access(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    """401 unless ``/metrics`` is open or the request carries the metrics token (``server.metrics_token``)."""
    get_state(request).metrics_token.check(credentials.credentials if credentials else None)
