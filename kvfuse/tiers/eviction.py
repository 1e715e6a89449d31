"""Which entry a memory or disk tier evicts next: the tiers' one eviction policy.

A tier asks after every put (the disk tier also after a read, which makes an entry the most recent,
and after its start-up scan) and carries out what it is told: it removes the entry (and its file),
counts it, and asks again until nothing more is to go. The rules, in order:

1. *Quota.* A tenant holding more than its quota in the tier (``kvfuse.store.tenant_quota``: a
   cap, and a share of the tier reserved for it) loses its **own** least recently used entries
   until it is within it (``quota_evictions``): its flood never costs another tenant an entry.
   After the disk tier's start-up scan, every tenant over its quota is trimmed so, lowest owner
   first.
2. *Capacity.* While the tier holds more than its capacity, entries go from the tenants without a
   quota first (they reserved nothing), then from the tenant holding the largest fraction of its
   quota (``capacity_owner``); without quotas, from all entries. While the quotas add up to no
   more than the capacity, this never takes a tenant below its quota; when they add up to more
   (oversubscribed), every tenant is pushed down towards the same fraction of its quota. The last
   entry a tier holds stays.
3. *Order.* Among the entries chosen so, the least recently used goes first (``lru_victim``), never
   the entry just put or used, and the entries queued requests will load (the *protected* keys,
   ``MemoryTier.set_protect``) only when nothing else is left: the budget holds, and such an
   eviction is counted (``protected_evictions``).

An entry larger than its room (``Eviction.room``: the capacity, or its tenant's quota if smaller)
is never stored (a dropped write), so these rules always bring a tier within its limits.

``over_quota``, ``capacity_owner`` and ``lru_victim`` are pure and table-tested; ``Eviction``
applies them to a tier's ``KeyIndex``, whose per-owner LRU lists give a tenant's oldest entry
without walking the others' (``tiers/key_index``).

Why in ``tiers/`` and not beside the store (issue 37 asked for ``store/eviction.py``): a tier
enforces its capacity by itself, with or without a store over it (a bare ``MemoryTier`` in tools
and tests, a ``DiskTier`` opened alone), and ``kvfuse.store`` imports ``kvfuse.tiers``, never the
reverse. A policy in ``store/`` would have to be handed to every tier, and a tier handed none
would still need a rule of its own: eviction decided in two places again. So the rules live here,
and what only the configuration and the store know comes in as arguments: each tenant's quota
(``TenantQuotas`` from ``kvfuse.store.tenant_quota``, given to the tier as ``quotas``) and the
protected keys (``TieredStore.protect_upcoming``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.key_index import KeyIndex

OTHERS = 0  # the owner of every entry whose tenant has no quota in the tier


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
    """The owner whose oldest entry goes next when the tier is over capacity (rule 2):
    ``OTHERS`` while tenants without a quota hold anything, then the owner using the largest
    fraction of its quota (ties: more bytes, then the lower id). ``putter``: the owner of the
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


def lru_victim(
    lru: Iterable[ChunkKey], keep: ChunkKey | None, protected: Collection[ChunkKey]
) -> tuple[ChunkKey | None, bool]:
    """The entry to evict among ``lru`` (least recent first), rule 3: the first that is not
    ``keep`` (the entry just put) and not ``protected``; failing that, the first protected one.
    With it, whether it is protected; (None, False) when ``lru`` holds nothing but ``keep``."""
    fallback = None
    for k in lru:
        if k == keep:
            continue
        if k not in protected:
            return k, False
        if fallback is None:
            fallback = k
    return fallback, fallback is not None


class Quotas(Protocol):
    """What the policy reads of a tier's per-tenant quotas (``kvfuse.store.tenant_quota``)."""

    def owner_of(self, namespace_id: str) -> int: ...

    def limit(self, owner: int) -> int | None: ...

    def counted_eviction(self, owner: int) -> None: ...

    def usage(self, index: KeyIndex) -> dict[str, dict[str, int]]: ...


class Victim(NamedTuple):
    """An entry to evict: its key, whether it is one of the protected keys, and the owner whose
    quota it goes for (None: it goes for the capacity)."""

    key: ChunkKey
    protected: bool
    quota_owner: int | None


class Eviction:
    """One tier's eviction policy over its ``KeyIndex`` (see the module docstring). ``quotas``:
    the tier's per-tenant quotas (None: plain LRU). Not thread-safe: the tier asks under its
    lock, and carries out each ``next_victim`` before asking again."""

    def __init__(self, quotas: Quotas | None = None) -> None:
        self.quotas = quotas

    @property
    def owner_of(self) -> Callable[[str], int] | None:
        """Who owns a namespace's entries, for the tier's ``KeyIndex`` to keep an LRU list per
        owner (None without quotas: no per-owner lists)."""
        return None if self.quotas is None else self.quotas.owner_of

    def use(self, index: KeyIndex, owner: int) -> OwnerUse:
        """What ``owner`` holds in ``index``, with its quota."""
        return OwnerUse(
            index.owner_bytes(owner), index.owner_entries(owner), self.quotas.limit(owner)
        )

    def uses(self, index: KeyIndex) -> dict[int, OwnerUse]:
        """``OwnerUse`` of every owner holding something in ``index``."""
        return {owner: self.use(index, owner) for owner in index.owners()}

    def room(self, index: KeyIndex, key: ChunkKey, capacity: int) -> int:
        """The largest entry ``key`` may have: the capacity, or less, its tenant's quota."""
        if self.quotas is None:
            return capacity
        limit = self.quotas.limit(index.owner_of(key))
        return capacity if limit is None else min(limit, capacity)

    def must_evict(
        self, index: KeyIndex, key: ChunkKey, size: int, used: int, capacity: int
    ) -> bool:
        """Whether putting ``size`` bytes under ``key`` into a tier holding ``used`` bytes is to
        evict something: over the capacity, or over the quota of ``key``'s tenant."""
        if used + size > capacity:
            return True
        if self.quotas is None:
            return False
        use = self.use(index, index.owner_of(key))
        return use.limit is not None and use.bytes + size > use.limit

    def next_victim(
        self,
        index: KeyIndex,
        key: ChunkKey | None,
        used: int,
        capacity: int,
        protected: Collection[ChunkKey] = (),
    ) -> Victim | None:
        """The entry a tier holding ``used`` bytes of its ``capacity`` in ``index`` evicts next,
        after ``key`` was put or used (None: after the disk tier's start-up scan); None when
        nothing more is to go. Rule 1 for ``key``'s tenant (every tenant after the scan), then
        rule 2, each ordered by rule 3."""
        putter = None
        if self.quotas is not None:
            putter = None if key is None else index.owner_of(key)
            for owner in index.owners() if key is None else [putter]:
                if over_quota(self.use(index, owner)):
                    victim, was_protected = lru_victim(_lru(index, owner), key, protected)
                    if victim is not None:
                        return Victim(victim, was_protected, owner)
        if used <= capacity or len(index) <= 1:
            return None
        group = None if self.quotas is None else capacity_owner(self.uses(index), putter)
        victim, was_protected = lru_victim(_lru(index, group), key, protected)
        return None if victim is None else Victim(victim, was_protected, None)

    def evicted(self, victim: Victim) -> None:
        """``victim`` is gone: count it against the quota it went for, if any."""
        if victim.quota_owner is not None:
            self.quotas.counted_eviction(victim.quota_owner)

    def usage(self, index: KeyIndex) -> dict[str, dict[str, int]]:
        """Per tenant tag with a quota: bytes and entries held, the quota, its evictions."""
        return {} if self.quotas is None else self.quotas.usage(index)


def _lru(index: KeyIndex, owner: int | None) -> Iterator[ChunkKey]:
    """The keys of ``owner``'s entries (None: of all), least recent first."""
    return (k for k, _, _ in index.items(owner))
