"""The tiers' eviction policy (tiers/eviction.py) as tables: the order within entries
(``lru_victim``), the next entry a tier evicts (``Eviction.next_victim``: quota, then capacity,
protected keys last), and the room and must-evict questions a tier asks before a put. The owner
rule (``capacity_owner``, ``over_quota``) is tabled in test_tenant_quota.py."""

from __future__ import annotations

import pytest

from kvfuse.kv.keys import ChunkKey, ChunkKind, tenant_tag
from kvfuse.store.tenant_quota import TenantQuotas
from kvfuse.tiers.eviction import Eviction, Victim, lru_victim
from kvfuse.tiers.key_index import KeyIndex

TAGS = {name: tenant_tag(name) for name in ("a", "b", "c")}


def key(name: str) -> ChunkKey:
    """``"a1"``: entry 1 of tenant a."""
    return ChunkKey(
        TAGS[name[0]] + "0" * 32, int(name[1:]).to_bytes(4, "little") * 8, ChunkKind.PREFIX
    )


def ks(names: str) -> list[ChunkKey]:
    return [key(n) for n in names.split()]


@pytest.mark.parametrize(
    "lru, keep, protected, expected",
    [
        ("", None, "", (None, False)),
        ("a1 a2 a3", None, "", ("a1", False)),  # least recent first
        ("a1 a2 a3", "a1", "", ("a2", False)),  # never the entry just put
        ("a1 a2 a3", None, "a1 a2", ("a3", False)),  # protected ones last
        ("a1 a2 a3", "a3", "a1 a2", ("a1", True)),  # only protected left: the oldest goes
        ("a1", "a1", "", (None, False)),  # nothing but the entry just put
    ],
)
def test_lru_victim(lru, keep, protected, expected):
    victim, was_protected = lru_victim(ks(lru), keep and key(keep), set(ks(protected)))
    assert (victim, was_protected) == (expected[0] and key(expected[0]), expected[1])


def tier_index(quotas: dict[str, int] | None, entries: str, size: int = 100):
    """A policy with ``quotas`` (tenant -> bytes; None: none) and the index of a tier holding
    ``entries`` (least recent first), ``size`` bytes each."""
    policy = Eviction(
        None if quotas is None else TenantQuotas({TAGS[t]: b for t, b in quotas.items()})
    )
    index = KeyIndex(owner_of=policy.owner_of)
    for k in ks(entries):
        index.put(k, size)
    return policy, index


QA = {"a": 300}  # a: 300 bytes; b and c: no quota
QAB = {"a": 300, "b": 300}


@pytest.mark.parametrize(
    "quotas, entries, put, capacity, protected, expected",
    [
        (None, "a1 b1 a2", "a2", 300, "", None),  # within capacity: nothing goes
        (None, "a1 b1 a2", "a2", 200, "", ("a1", False, None)),  # plain LRU
        (None, "a1 b1 a2", "a2", 200, "a1", ("b1", False, None)),  # queued entries last
        (None, "a1 b1 a2", "a2", 200, "a1 b1", ("a1", True, None)),  # the budget holds
        (None, "a1", "a1", 50, "", None),  # the entry just put stays
        (QA, "a1 b1 a2 a3 a4", "a4", 1000, "", ("a1", False, "a")),  # a over its quota: its own
        (QA, "a1 b1 a2 a3 a4", "a4", 1000, "a1", ("a2", False, "a")),
        (QA, "a1 b1 a2", "a2", 200, "", ("b1", False, None)),  # full: no-quota tenants first...
        (QA, "b1 a1 a2 c1", "c1", 300, "", ("b1", False, None)),
        (QA, "a1 a2 b1", "b1", 250, "", ("a1", False, None)),  # ...but never the entry just put
        (QAB, "a1 a2 b1", "b1", 200, "", ("a1", False, None)),  # a furthest into its quota
        (QAB, "b1 b2 a1", "a1", 200, "", ("b1", False, None)),
        (QAB, "a1 a2 a3 a4 b1", None, 10_000, "", ("a1", False, "a")),  # start-up: everyone
        (QAB, "b1 b2 b3 b4 a1", None, 10_000, "", ("b1", False, "b")),
        (QAB, "a1", None, 50, "", None),  # start-up: the last entry stays
    ],
)
def test_next_victim(quotas, entries, put, capacity, protected, expected):
    policy, index = tier_index(quotas, entries)
    victim = policy.next_victim(
        index, put and key(put), 100 * len(index), capacity, set(ks(protected))
    )
    if expected is None:
        assert victim is None
        return
    name, was_protected, quota = expected
    owner = None if quota is None else index.owner_of(key(quota + "0"))
    assert victim == Victim(key(name), was_protected, owner)


def test_a_quota_eviction_is_counted_against_its_tenant():
    policy, index = tier_index({"a": 100}, "a1 a2")
    victim = policy.next_victim(index, key("a2"), 200, 1000)
    index.pop(victim.key)
    policy.evicted(victim)
    policy.evicted(Victim(key("a2"), False, None))  # a capacity eviction: not the quota's
    assert policy.usage(index)[TAGS["a"]]["quota_evictions"] == 1


@pytest.mark.parametrize(
    "quotas, entries, put, size, capacity, room, must",
    [
        (None, "a1 b1", "a2", 100, 300, 300, False),
        (None, "a1 b1", "a2", 101, 300, 300, True),  # over the capacity
        (QA, "a1 a2", "a3", 100, 1000, 300, False),
        (QA, "a1 a2", "a3", 101, 1000, 300, True),  # over a's quota, not the capacity
        (QA, "a1 a2", "b1", 500, 1000, 1000, False),  # b has no quota
        (QA, "a1 a2", "a3", 100, 250, 250, True),  # the room is the smaller of the two
    ],
)
def test_room_and_must_evict(quotas, entries, put, size, capacity, room, must):
    policy, index = tier_index(quotas, entries)
    used = 100 * len(index)
    assert policy.room(index, key(put), capacity) == room
    assert policy.must_evict(index, key(put), size, used, capacity) == must
