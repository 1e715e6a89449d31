"""API keys -> tenants, and the ``/metrics`` token. ``Authorization: Bearer KEY``; each configured key
names its tenant.

With no keys configured (``server.api_keys`` empty) every request belongs to the anonymous tenant
``""`` and the header is ignored. With keys, a missing or unknown key is a 401 with an OpenAI-style
body (code ``invalid_api_key``), which the ``openai`` client raises as ``AuthenticationError``.
The FastAPI dependency that applies it to a request is ``deps.current_tenant``.

Keys are held as SHA-256 digests only: a configured ``sha256:<hex>`` entry as written, a plain key
hashed once here (``kvfuse.config.api_keys``). A presented key is hashed and its digest compared
with every configured one by ``hmac.compare_digest``: the time taken depends on neither the keys'
contents nor where a match is (every digest is compared, all of the same length), so it tells a
caller nothing about how close a guess was.
"""

from __future__ import annotations

import hashlib
import hmac

from kvfuse.config.api_keys import digest_bytes

from .errors import APIError

ANONYMOUS = ""


def _match(given: str, digests: list[tuple[bytes, str]]) -> str | None:
    """The value paired with the digest ``given`` hashes to, comparing with every digest in constant time."""
    presented = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    found = None
    for digest, value in digests:
        if hmac.compare_digest(digest, presented):
            found = value
    return found


class Authenticator:
    """Maps an API key to its tenant name. ``keys``: key or ``sha256:<hex>`` digest -> tenant."""

    def __init__(self, keys: dict[str, str]):
        self._digests = [(digest_bytes(k), tenant) for k, tenant in keys.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> set[str]:
        """The tenants the configured keys name."""
        return {tenant for _, tenant in self._digests}

    def tenant(self, api_key: str | None) -> str:
        """The tenant of ``api_key``; APIError(401) when keys are configured and it is not one of them."""
        if not self.enabled:
            return ANONYMOUS
        if not api_key:
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        found = _match(api_key, self._digests)
        if found is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return found


class MetricsToken:
    """The bearer token ``/metrics`` asks for (``server.metrics_token``, a token or its digest);
    ``None``: ``/metrics`` is open."""

    def __init__(self, token: str | None):
        self._digests = [] if token is None else [(digest_bytes(token), "ok")]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, token: str | None) -> None:
        """APIError(401) unless no token is configured or ``token`` is the configured one."""
        if not self.enabled:
            return
        if not token or _match(token, self._digests) is None:
            what = "missing" if not token else "incorrect"
            raise APIError(
                401,
                f"{what} metrics token: /metrics needs 'Authorization: Bearer TOKEN' with the token "
                "of server.metrics_token (or server.metrics_token_file)",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
