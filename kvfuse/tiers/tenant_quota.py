"""Per-tenant byte quotas of a tier (memory, disk): who gives up room, and in what order.

**What a quota means.** ``tenants.<name>.quota.<tier>_bytes`` is both a cap and a reserved share of
that tier for the tenant (``"*"``: the same for every tenant without its own):

1. *Cap.* After a put, a tenant holding more than its quota loses its **own** least recently used
   entries until it is within it (``quota_evictions``). Its flood never costs another tenant an
   entry. An entry larger than the whole quota is not stored (a dropped write).
2. *Share.* When the tier as a whole is over capacity, entries go in this order: first the oldest
   entries of tenants without a quota (they reserved nothing), then the oldest entry of the tenant
   holding the largest fraction of its quota. While the quotas add up to no more than the capacity,
   the capacity rule therefore never takes a tenant below its quota; when they add up to more
   (oversubscribed), every tenant is pushed down towards the same fraction of its quota, never one
   tenant's share to make room for another's flood.

Without quotas (``TenantQuotas`` not given) a tier is plain LRU, exactly as before.

**How it is held.** A tenant is read off every key: the first 8 hex characters of a storage key are
its tenant's tag (``kv.keys.tenant_tag``), so the tiers need no request context. The tier's
``KeyIndex`` keeps, beside its global LRU list, one LRU list per *owner* (``owner_of``): one per
tenant with a quota, and one (``OTHERS``) shared by every tenant without one, with each list's bytes
and entries. So a tenant's oldest entry is found in O(1) without walking other tenants' entries,
and the capacity rule compares a handful of owners, not entries (``capacity_owner``, pure and
table-tested). Not thread-safe: the owning tier's lock guards it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

OTHERS = 0  # the owner of every entry whose tenant has no quota in this tier


@dataclass(frozen=True)
class OwnerUse:
    """What one owner holds in a tier: bytes and entries, and its quota (None: no quota)."""

    bytes: int
    entries: int
    limit: int | None


def over_quota(use: OwnerUse) -> bool:
    """Whether an owner holds more than its quota (never, without one)."""
    return use.limit is not None and use.bytes > use.limit


def capacity_owner(uses: Mapping[int, OwnerUse], putter: int | None = None) -> int | None:
    """The owner whose oldest entry goes next when the tier is over capacity (see the module
    docstring): ``OTHERS`` while tenants without a quota hold anything, then the owner using the
    largest fraction of its quota (ties: more bytes, then the lower id). ``putter``: the owner of the
    entry just put, which is never evicted: an owner holding only that entry is no candidate.
    None: no owner qualifies (evict by plain LRU)."""

    def evictable(owner: int, use: OwnerUse) -> bool:
        return use.entries > (1 if owner == putter else 0)

    others = uses.get(OTHERS)
    if others is not None and others.limit is None and evictable(OTHERS, others):
        return OTHERS
    candidates = [
        (use.bytes / use.limit, use.bytes, -owner, owner)
        for owner, use in uses.items()
        if use.limit and evictable(owner, use)
    ]
    return max(candidates)[3] if candidates else None


class TenantQuotas:
    """One tier's quotas by tenant tag (``limits``) and the quota of every other tenant (``default``;
    None: no quota). Gives each quota'd tenant an owner id (1, 2, ...) for the tier's ``KeyIndex``
    (``owner_of``) and counts the evictions each owner's quota caused."""

    def __init__(self, limits: Mapping[str, int], default: int | None = None) -> None:
        for tag, limit in limits.items():
            if len(tag) != 8 or not isinstance(limit, int) or limit <= 0:
                raise ValueError(
                    f"a quota is a tenant tag (8 hex chars) and a size > 0, got {tag!r}: {limit!r}"
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
        """The owner of the entries of a namespace (a storage key's first 24 hex chars)."""
        tag = namespace_id[:8]
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

    def usage(self, index) -> dict[str, dict[str, int]]:
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

    def uses(self, index) -> dict[int, OwnerUse]:
        """``OwnerUse`` of every owner holding something in ``index``."""
        return {
            owner: OwnerUse(
                index.owner_bytes(owner), index.owner_entries(owner), self._owner_limits[owner]
            )
            for owner in index.owners()
        }

    def use(self, index, owner: int) -> OwnerUse:
        return OwnerUse(
            index.owner_bytes(owner), index.owner_entries(owner), self._owner_limits[owner]
        )
