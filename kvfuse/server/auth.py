"""API keys -> tenants. ``Authorization: Bearer KEY``; each configured key names its tenant.

With no keys configured (``server.api_keys`` empty) every request belongs to the anonymous tenant
``""`` and the header is ignored. With keys, a missing or unknown key is a 401 with an OpenAI-style
body (code ``invalid_api_key``), which the ``openai`` client raises as ``AuthenticationError``.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import APIError
from .records import record_of

ANONYMOUS = ""


class Authenticator:
    """Maps an API key to its tenant name."""

    def __init__(self, keys: dict[str, str]):
        self._keys = [(k.encode(), tenant) for k, tenant in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; APIError(401) when keys are configured and it is not one of them."""
        if not self.enabled:
            return ANONYMOUS
        if not api_key:
            raise APIError(401, "missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key")
        given = api_key.encode()
        found = None
        for key, tenant in self._keys:  # compare with every key, in constant time per key
            if hmac.compare_digest(key, given):
                found = tenant
        if found is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return found


_bearer = HTTPBearer(
    auto_error=False,
    description="An API key configured with `--api-key KEY:TENANT` (server.api_keys). Only required when the "
                "server has API keys; each key's tenant gets its own KV cache namespace.",
)


async def current_tenant(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str:
    """FastAPI dependency: the caller's tenant (also noted in the request's log record)."""
    from .state import get_state  # the state module imports this one

    tenant = get_state(request).auth.tenant(credentials.credentials if credentials else None)
    if (record := record_of(request)) is not None:
        record.tenant = tenant
    return tenant
