"""Tenant isolation in the KV cache: the salt of a (tenant, cache_salt) namespace, and the salts seen.

Chunk keys are hashes that include the namespace salt, so two tenants can never share an entry as
long as their salts differ. The composition is unambiguous for any strings: a JSON array
``["tenant", "cache_salt"]``, except that the anonymous tenant without a cache_salt uses the
engine's plain namespace (salt ``""``), the one ``kvfuse generate`` uses too.

Because a namespace's storage-key prefix is a digest, "everything of tenant T" cannot be found by
a key prefix: the server remembers which cache_salts each tenant has used (``SaltRegistry``) so that
``DELETE /v1/kv`` can clear all of them. Salts used before the server (re)started are not known;
a client can still clear one by naming it (``DELETE /v1/kv?cache_salt=...``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict


def namespace_salt(tenant: str, cache_salt: str | None) -> str:
    """The engine salt (``CacheOptions.salt``) of ``tenant``'s namespace ``cache_salt``."""
    cache_salt = cache_salt or ""
    if not tenant and not cache_salt:
        return ""
    return json.dumps([tenant, cache_salt], ensure_ascii=False)


class SaltRegistry:
    """The cache_salts each tenant has used since start-up (at most ``per_tenant`` most recent each)."""

    def __init__(self, per_tenant: int = 10_000):
        self.per_tenant = per_tenant
        self._salts: dict[str, OrderedDict[str, None]] = {}
        self._lock = threading.Lock()

    def record(self, tenant: str, cache_salt: str | None) -> None:
        if not cache_salt:
            return  # the default namespace is always cleared
        with self._lock:
            salts = self._salts.setdefault(tenant, OrderedDict())
            salts[cache_salt] = None
            salts.move_to_end(cache_salt)
            while len(salts) > self.per_tenant:
                salts.popitem(last=False)

    def salts(self, tenant: str) -> list[str]:
        """``""`` (the tenant's default namespace) and every cache_salt recorded for ``tenant``."""
        with self._lock:
            return [""] + list(self._salts.get(tenant, ()))

    def forget(self, tenant: str, cache_salt: str | None = None) -> None:
        with self._lock:
            if cache_salt is None:
                self._salts.pop(tenant, None)
            elif tenant in self._salts:
                self._salts[tenant].pop(cache_salt, None)
