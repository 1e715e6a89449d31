"""Per-tenant byte quotas of a tier (memory, disk): each tenant's quota, who owns which entries.

**What a quota means.** ``tenants.<name>.quota.<tier>_bytes`` is both a cap and a reserved share of
that tier for the tenant (``"*"``: the same for every tenant without its own): a tenant over its
quota loses its own oldest entries, never another tenant's, and a full tier takes room from the
tenants without a quota first, then from the one furthest into its quota. Those rules are the
tiers' eviction policy (``kvfuse/tiers/eviction.py``); this module is what they are applied to.
Built from the configuration (``runtime.tenant_quotas``) and given to a tier as its ``quotas``.
Without quotas (``TenantQuotas`` not given) a tier is plain LRU.

**How it is held.** A tenant is read off every key: the first 16 hex characters (64 bits: no two
tenants' tags collide in practice) of a storage key are its tenant's tag (``kv.keys.tenant_tag``), so the tiers need no request context. The tier's
``KeyIndex`` keeps, beside its global LRU list, one LRU list per *owner* (``owner_of``): one per
tenant with a quota, and one (``OTHERS``) shared by every tenant without one, with each list's bytes
and entries. So a tenant's oldest entry is found in O(1) without walking other tenants' entries,
and the capacity rule compares a handful of owners, not entries. Not thread-safe: the owning
tier's lock guards it.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfuse.kv.keys import TAG_LEN
from kvfuse.tiers.eviction import OTHERS
from kvfuse.tiers.key_index import KeyIndex


class TenantQuotas:
    """One tier's quotas by tenant tag (``limits``) and the quota of every other tenant (``default``;
    None: no quota). Gives each quota'd tenant an owner id (1, 2, ...) for the tier's ``KeyIndex``
    (``owner_of``) and counts the evictions each owner's quota caused."""

    def __init__(self, limits: Mapping[str, int], default: int | None = None) -> None:
        for tag, limit in limits.items():
            if len(tag) != TAG_LEN or not isinstance(limit, int) or limit <= 0:
                raise ValueError(
                    f"a quota is a tenant tag ({TAG_LEN} hex chars) and a size > 0, "
                    f"got {tag!r}: {limit!r}"
                )
        if default is not None and (not isinstance(default, int) or default <= 0):
            raise ValueError(f"the default quota must be a size > 0 or None, got {default!r}")
        self._limits = dict(limits)
        self.default = default
        self._owners: dict[str, int] = {}  # tag -> owner id, given at first sight
        self._tags: list[str] = [""]  # owner id -> tag (OTHERS has none)
        self._owner_limits: list[int | None] = [None]
        self._evictions: list[int] = [0]

    def limit_of_tag(self, tag: str) -> int | None:
        return self._limits.get(tag, self.default)

    def owner_of(self, namespace_id: str) -> int:
        """The owner of the entries of a namespace (a storage key's first 48 hex chars)."""
        tag = namespace_id[:TAG_LEN]
        owner = self._owners.get(tag)
        if owner is None:
            limit = self.limit_of_tag(tag)
            if limit is None:
                return OTHERS
            owner = self._owners[tag] = len(self._tags)
            self._tags.append(tag)
            self._owner_limits.append(limit)
            self._evictions.append(0)
        return owner

    def limit(self, owner: int) -> int | None:
        return self._owner_limits[owner]

    def counted_eviction(self, owner: int) -> None:
        """One entry of ``owner`` evicted because ``owner`` was over its quota."""
        self._evictions[owner] += 1

    def usage(self, index: KeyIndex) -> dict[str, dict[str, int]]:
        """Per quota'd tenant tag: ``used_bytes``, ``entries``, ``quota_bytes``, ``quota_evictions``
        (``index``: the tier's ``KeyIndex``)."""
        return {
            tag: {
                "used_bytes": index.owner_bytes(owner),
                "entries": index.owner_entries(owner),
                "quota_bytes": self._owner_limits[owner],
                "quota_evictions": self._evictions[owner],
            }
            for owner, tag in enumerate(self._tags)
            if owner != OTHERS
        }
