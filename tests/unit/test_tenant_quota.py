"""Per-tenant byte quotas in the tiers: the eviction rule (table), the KeyIndex's per-owner lists
(against a model), and the memory and disk tiers keeping one tenant's flood off another's entries."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvfuse.kv.keys import ChunkKey, ChunkKind, tenant_tag
from kvfuse.store.tenant_quota import TenantQuotas
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.eviction import OTHERS, OwnerUse, capacity_owner, over_quota
from kvfuse.tiers.key_index import KeyIndex
from kvfuse.tiers.memory import MemoryTier

TAGS = {name: tenant_tag(name) for name in ("alice", "bob", "carol", "dave")}


def key(tenant: str, i: int, salt: str = "0" * 32) -> ChunkKey:
    return ChunkKey(TAGS[tenant] + salt, i.to_bytes(4, "little") * 8, ChunkKind.PREFIX)


# ------------------------------------------------------------------------------ the rule (pure)

U = OwnerUse


@pytest.mark.parametrize(
    "uses, putter, expected",
    [
        ({}, None, None),
        ({OTHERS: U(10, 2, None), 1: U(90, 9, 100)}, 1, OTHERS),  # no quota, no share: first to go
        (
            {OTHERS: U(10, 1, None), 1: U(90, 9, 100)},
            OTHERS,
            1,
        ),  # the putter's only entry is never evicted
        ({1: U(50, 5, 100), 2: U(60, 6, 100)}, None, 2),  # the larger fraction of its quota
        ({1: U(50, 5, 50), 2: U(60, 6, 100)}, None, 1),  # fractions, not bytes
        ({1: U(60, 6, 100), 2: U(30, 3, 50)}, None, 1),  # equal fractions: the one holding more
        ({1: U(30, 3, 50), 2: U(30, 3, 50)}, None, 1),  # all equal: the lower id
        ({1: U(100, 1, 100), 2: U(50, 5, 100)}, 1, 2),  # the putter's just-put entry stays
        ({1: U(100, 1, 100)}, 1, None),  # nothing evictable by owner: plain LRU decides
        ({OTHERS: U(0, 0, None), 1: U(10, 2, 100)}, None, 1),
    ],
)
def test_capacity_owner(uses, putter, expected):
    assert capacity_owner(uses, putter) == expected


@pytest.mark.parametrize(
    "use, over", [(U(10, 1, None), False), (U(10, 1, 10), False), (U(11, 2, 10), True)]
)
def test_over_quota(use, over):
    assert over_quota(use) == over


def test_quotas_give_owner_ids_to_tenants_with_a_quota_only():
    q = TenantQuotas({TAGS["alice"]: 100}, default=None)
    assert q.owner_of(TAGS["bob"] + "0" * 32) == OTHERS
    a = q.owner_of(TAGS["alice"] + "0" * 32)
    assert a != OTHERS and q.owner_of(TAGS["alice"] + "f" * 16) == a and q.limit(a) == 100
    every = TenantQuotas({TAGS["alice"]: 100}, default=7)
    ids = {every.owner_of(TAGS[t] + "0" * 32) for t in TAGS}
    assert OTHERS not in ids and len(ids) == 4
    with pytest.raises(ValueError):
        TenantQuotas({"short": 1})
    with pytest.raises(ValueError):
        TenantQuotas({}, default=0)


# ------------------------------------------------------------------------- KeyIndex's owner lists


def test_owner_lists_match_a_model_under_random_operations():
    rng = random.Random(3)
    owner_of = {TAGS["alice"]: 1, TAGS["bob"]: 2}
    index = KeyIndex(with_values=True, rows=4, owner_of=lambda ns: owner_of.get(ns[:16], OTHERS))
    pool = [key(rng.choice(list(TAGS)), i, rng.choice(["0" * 32, "1" * 32])) for i in range(300)]
    model: OrderedDict[ChunkKey, int] = OrderedDict()

    def owner(k):
        return owner_of.get(k.namespace_id[:16], OTHERS)

    for step in range(5000):
        k, op = rng.choice(pool), rng.random()
        if op < 0.5:
            size = rng.randrange(1, 1000)
            index.put(k, size, None)
            model[k] = size
            model.move_to_end(k)
        elif op < 0.65:
            assert (index.pop(k) is not None) == (model.pop(k, None) is not None)
        elif op < 0.8:
            if index.touch(k):
                model.move_to_end(k)
        elif op < 0.9 and model:
            o = rng.choice([OTHERS, 1, 2])
            mine = [m for m in model if owner(m) == o]
            if mine:
                assert index.pop_oldest(o)[0] == mine[0]
                del model[mine[0]]
            else:
                with pytest.raises(KeyError):
                    index.pop_oldest(o)
        if step % 250 == 0 or step == 4999:
            for o in (OTHERS, 1, 2):
                mine = [m for m in model if owner(m) == o]
                assert [k2 for k2, _, _ in index.items(o)] == mine
                assert index.owner_bytes(o) == sum(model[m] for m in mine)
                assert index.owner_entries(o) == len(mine)
            assert index.keys() == list(model)


def test_a_loaded_index_has_its_owner_lists():
    import numpy as np

    owners = {TAGS["alice"]: 1}
    groups = [
        (TAGS["alice"] + "0" * 32, ChunkKind.PREFIX, ""),
        (TAGS["bob"] + "0" * 32, ChunkKind.PREFIX, ""),
    ]
    group_of = np.array([0, 1, 0, 1, 0])
    digests = b"".join(bytes([i]) * 32 for i in range(5))
    index = KeyIndex(owner_of=lambda ns: owners.get(ns[:16], OTHERS))
    index.load(groups, group_of, digests, np.array([1, 2, 3, 4, 5], dtype=np.int64))
    assert [k.digest[0] for k, _, _ in index.items(1)] == [0, 2, 4]
    assert [k.digest[0] for k, _, _ in index.items(OTHERS)] == [1, 3]
    assert (
        index.owner_bytes(1) == 9
        and index.owner_entries(OTHERS) == 2
        and index.owners() == [OTHERS, 1]
    )
    assert index.nbytes() / len(index) < 1000  # the per-owner arrays are counted


# -------------------------------------------------------------------------------- the tiers

MB = 1000


def fill(tier, tenant: str, start: int, n: int, size: int = MB) -> list[ChunkKey]:
    keys = [key(tenant, i) for i in range(start, start + n)]
    for k in keys:
        tier.put(k, bytes(size))
    return keys


def test_a_flood_evicts_the_flooders_own_oldest_entries_only():
    quotas = TenantQuotas({TAGS["alice"]: 4 * MB, TAGS["bob"]: 4 * MB})
    tier = MemoryTier(10 * MB, quotas=quotas)
    bob = fill(tier, "bob", 0, 3)
    alice = fill(tier, "alice", 100, 50)  # a flood: 50 entries into a quota of 4
    assert all(tier.contains(k) for k in bob)
    assert [tier.contains(k) for k in alice] == [False] * 46 + [True] * 4  # its newest 4 stay
    usage = tier.tenant_usage()
    assert usage[TAGS["alice"]] == {
        "used_bytes": 4 * MB,
        "entries": 4,
        "quota_bytes": 4 * MB,
        "quota_evictions": 46,
    }
    assert usage[TAGS["bob"]]["quota_evictions"] == 0 and usage[TAGS["bob"]]["used_bytes"] == 3 * MB
    assert tier.stats.snapshot()["evictions"] == 46


def test_tenants_without_a_quota_go_first_when_the_tier_is_full():
    tier = MemoryTier(10 * MB, quotas=TenantQuotas({TAGS["bob"]: 5 * MB}))
    bob = fill(tier, "bob", 0, 5)  # oldest of all
    carol = fill(tier, "carol", 100, 5)  # no quota
    dave = fill(tier, "dave", 200, 3)  # no quota: pushes the tier over capacity
    assert all(tier.contains(k) for k in bob)  # bob is within his reserved share: untouched
    assert [tier.contains(k) for k in carol + dave] == [False] * 3 + [True] * 5
    assert tier.used_bytes() == 10 * MB


def test_oversubscribed_quotas_push_every_tenant_towards_the_same_fraction():
    tier = MemoryTier(10 * MB, quotas=TenantQuotas({}, default=8 * MB))  # "*": 8 each, 16 > 10
    alice = fill(tier, "alice", 0, 8)
    bob = fill(tier, "bob", 100, 8)
    usage = tier.tenant_usage()
    assert usage[TAGS["alice"]]["used_bytes"] == usage[TAGS["bob"]]["used_bytes"] == 5 * MB
    # alice's oldest went for bob
    assert [tier.contains(k) for k in alice] == [False] * 3 + [True] * 5
    assert [tier.contains(k) for k in bob] == [False] * 3 + [True] * 5


def test_an_entry_larger_than_its_tenants_quota_is_not_stored():
    tier = MemoryTier(10 * MB, quotas=TenantQuotas({TAGS["alice"]: 2 * MB}))
    keep = fill(tier, "alice", 0, 1)
    tier.put(key("alice", 9), bytes(3 * MB))
    assert not tier.contains(key("alice", 9)) and tier.contains(keep[0])
    assert tier.stats.snapshot()["dropped_writes"] == 1
    tier.put(key("bob", 9), bytes(3 * MB))  # bob has no quota
    assert tier.contains(key("bob", 9))


def test_queued_requests_entries_of_the_tenant_go_last():
    tier = MemoryTier(10 * MB, quotas=TenantQuotas({TAGS["alice"]: 3 * MB}))
    alice = fill(tier, "alice", 0, 3)
    tier.set_protect(lambda: {alice[0]})
    tier.put(key("alice", 3), bytes(MB))
    assert tier.contains(alice[0]) and not tier.contains(alice[1])


def test_replacing_an_entry_and_deleting_keep_the_tenants_bytes():
    tier = MemoryTier(10 * MB, quotas=TenantQuotas({TAGS["alice"]: 5 * MB}))
    a = fill(tier, "alice", 0, 3)
    tier.put(a[0], bytes(2 * MB))
    assert tier.tenant_usage()[TAGS["alice"]]["used_bytes"] == 4 * MB
    tier.delete(a[1])
    tier.delete_prefix(TAGS["alice"])
    assert tier.tenant_usage()[TAGS["alice"]]["used_bytes"] == 0 and tier.used_bytes() == 0


def test_a_memory_tier_without_quotas_is_plain_lru():
    tier = MemoryTier(3 * MB)
    a = fill(tier, "alice", 0, 2)
    b = fill(tier, "bob", 0, 2)
    assert [tier.contains(k) for k in a + b] == [False, True, True, True]
    assert tier.tenant_usage() == {}


def test_the_disk_tier_keeps_quotas_and_trims_after_a_restart_with_a_lower_quota(tmp_path):
    quotas = TenantQuotas({TAGS["alice"]: 4 * MB, TAGS["bob"]: 4 * MB})
    disk = DiskTier(tmp_path, 10 * MB, quotas=quotas, io_threads=1)
    bob = fill(disk, "bob", 0, 3)
    alice = fill(disk, "alice", 100, 20)
    assert all(disk.contains(k) for k in bob)
    assert [disk.contains(k) for k in alice] == [False] * 16 + [True] * 4
    assert disk.tenant_usage()[TAGS["alice"]]["quota_evictions"] == 16
    assert disk.entries() == 7 and disk.used_bytes() == 7 * MB
    disk.close()
    # restarted with bob's quota lowered: the scan finds his 3 entries, his oldest goes
    again = DiskTier(
        tmp_path, 10 * MB, quotas=TenantQuotas({TAGS["alice"]: 4 * MB, TAGS["bob"]: 2 * MB})
    )
    assert [again.contains(k) for k in bob] == [False, True, True]
    assert [again.contains(k) for k in alice[-4:]] == [True] * 4
    assert again.tenant_usage()[TAGS["bob"]] == {
        "used_bytes": 2 * MB,
        "entries": 2,
        "quota_bytes": 2 * MB,
        "quota_evictions": 1,
    }
    # a disk write larger than the tenant's quota is dropped, and never leaves an older value
    again.put(bob[-1], bytes(3 * MB))
    assert not again.contains(bob[-1]) and again.stats.snapshot()["dropped_writes"] == 1
    again.close()


def test_the_disk_tier_capacity_goes_to_tenants_without_a_quota_first(tmp_path):
    disk = DiskTier(tmp_path, 6 * MB, quotas=TenantQuotas({TAGS["alice"]: 3 * MB}), io_threads=1)
    alice = fill(disk, "alice", 0, 3)
    carol = fill(disk, "carol", 100, 5)
    assert all(disk.contains(k) for k in alice)
    assert [disk.contains(k) for k in carol] == [False, False, True, True, True]
    disk.close()
