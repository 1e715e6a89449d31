"""API keys -> tenants. ``Authorization: Bearer KEY``; each configured key names its tenant.

With no keys configured (``server.api_keys`` empty) every request belongs to the anonymous tenant
``""`` and the header is ignored. With keys, a missing or unknown key is a 401 with an OpenAI-style
body (code ``invalid_api_key``), which the ``openai`` client raises as ``AuthenticationError``.
The FastAPI dependency that applies it to a request is ``deps.current_tenant``.
"""

from __future__ import annotations

import hmac

from .errors import APIError

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
