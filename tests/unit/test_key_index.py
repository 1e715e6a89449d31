"""KeyIndex: the tiers' compact LRU index, checked against an OrderedDict model (random
operations, forced collisions, wrap-around at the table's end, bulk loading, prefixes)."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.tiers.key_index import KeyIndex

NS1 = "0123456789abcdef01234567" * 2
NS2 = "fedcba9876543210fedcba98" * 2


def key(
    digest: bytes, ns: str = NS1, kind: ChunkKind = ChunkKind.PREFIX, variant: str = ""
) -> ChunkKey:
    return ChunkKey(ns, digest, kind, variant)


def colliding(n: int, word: int = 7) -> list[ChunkKey]:
    """Keys whose first digest word is equal: one home slot for all (one probe run)."""
    return [key(word.to_bytes(8, "little") + i.to_bytes(24, "little")) for i in range(n)]


def check(index: KeyIndex, model: OrderedDict) -> None:
    assert len(index) == len(model)
    assert index.keys() == list(model)
    assert [(k, s, v) for k, s, v in index.items()] == [(k, s, v) for k, (s, v) in model.items()]
    for k, (s, v) in model.items():
        assert k in index and index.size(k) == s and index.value(k) == v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_an_ordered_dict(seed):
    rng = random.Random(seed)
    pool = [
        key(
            rng.randbytes(32),
            rng.choice([NS1, NS2]),
            rng.choice(list(ChunkKind)),
            rng.choice(["", "cachegen.1"]),
        )
        for _ in range(400)
    ]
    pool += colliding(40)  # long probe runs inside the random ones
    index, model = KeyIndex(with_values=True, rows=4), OrderedDict()
    for step in range(6000):
        k, op = rng.choice(pool), rng.random()
        if op < 0.45:
            size = rng.randrange(1 << 40)
            assert index.put(k, size, f"v{size}") == (model[k][0] if k in model else None)
            model[k] = (size, f"v{size}")
            model.move_to_end(k)
        elif op < 0.65:
            assert index.pop(k) == model.pop(k, None)
        elif op < 0.75:
            assert index.touch(k) == (k in model)
            if k in model:
                model.move_to_end(k)
        elif op < 0.8:
            got = index.use(k)
            assert got == model.get(k)
            if k in model:
                model.move_to_end(k)
        elif op < 0.85 and model:
            k2, (s2, v2) = model.popitem(last=False)
            assert index.pop_oldest() == (k2, s2, v2)
        else:
            batch = rng.sample(pool, rng.choice([1, 7, 8, 64, 200]))
            assert index.contains_many(batch) == [b in model for b in batch]
        if step % 500 == 0:
            check(index, model)
    check(index, model)


def test_removal_in_the_middle_of_a_probe_run_keeps_the_rest_reachable():
    keys = colliding(30)
    index = KeyIndex()
    for i, k in enumerate(keys):
        index.put(k, i)
    for k in keys[::3]:
        assert index.pop(k) == (keys.index(k), None)
    for i, k in enumerate(keys):
        assert (k in index) == (i % 3 != 0)
    assert index.contains_many(keys) == [i % 3 != 0 for i in range(len(keys))]


def test_probe_runs_wrap_around_the_end_of_the_table():
    index = KeyIndex(rows=4)
    mask = index._mask
    keys = colliding(3, word=mask)  # home slot = the last one (group 0 mixes in nothing)
    for k in keys:
        index.put(k, 1)
    assert all(k in index for k in keys)
    assert index.pop(keys[0]) is not None
    assert keys[1] in index and keys[2] in index and keys[0] not in index


def test_variants_kinds_and_namespaces_of_one_digest_are_distinct_keys():
    d = bytes(range(32))
    keys = [key(d), key(d, variant="cachegen.2"), key(d, kind=ChunkKind.DOCUMENT), key(d, ns=NS2)]
    index = KeyIndex()
    for i, k in enumerate(keys):
        index.put(k, i)
    assert [index.size(k) for k in keys] == [0, 1, 2, 3]
    index.pop(keys[1])
    assert index.contains_many(keys * 3) == [True, False, True, True] * 3


def test_pop_oldest_of_an_empty_index_is_a_key_error():
    with pytest.raises(KeyError):
        KeyIndex().pop_oldest()


def test_load_fills_an_empty_index_in_the_given_order():
    rng = random.Random(5)
    groups = [(NS1, ChunkKind.PREFIX, ""), (NS2, ChunkKind.TAIL, "cachegen.1")]
    digests = [rng.randbytes(32) for _ in range(1000)]
    group_of = np.array([rng.randrange(2) for _ in digests])
    sizes = np.arange(1000, dtype=np.int64) * 3
    index = KeyIndex()
    index.load(groups, group_of, b"".join(digests), sizes)
    expected = [
        ChunkKey(groups[g][0], d, groups[g][1], groups[g][2]) for g, d in zip(group_of, digests)
    ]
    assert index.keys() == expected and len(index) == 1000
    assert index.contains_many(expected) == [True] * 1000
    assert [index.size(k) for k in expected[:10]] == list(range(0, 30, 3))
    for k in expected[:500]:  # and it keeps working as an ordinary index afterwards
        index.pop(k)
    new = key(rng.randbytes(32))
    index.put(new, 7)
    assert index.keys() == expected[500:] + [new]
    with pytest.raises(ValueError, match="empty"):
        index.load(groups, group_of, b"".join(digests), sizes)


def test_load_of_nothing():
    index = KeyIndex()
    index.load([], np.zeros(0, dtype=np.intp), b"", np.zeros(0, dtype=np.int64))
    assert len(index) == 0 and index.keys() == []
    index.put(key(bytes(32)), 1)
    assert index.keys() == [key(bytes(32))]


@pytest.mark.parametrize(
    "prefix, expected",
    [
        (NS1[:8], {"a", "b", "c"}),  # a tenant tag: every namespace of the tenant
        (NS1 + ":", {"a", "b", "c"}),
        (NS1 + ":p:", {"a", "c"}),
        (NS1 + ":p:" + "aa", {"a"}),
        (NS2, {"d"}),
        ("ffff", set()),
    ],
)
def test_keys_with_prefix(prefix, expected):
    named = {
        "a": key(bytes([0xAA]) * 32),
        "b": key(bytes([0xAA]) * 32, kind=ChunkKind.DOCUMENT),
        "c": key(bytes([0xBB]) * 32),
        "d": key(bytes([0xAA]) * 32, ns=NS2),
    }
    index = KeyIndex()
    for k in named.values():
        index.put(k, 1)
    assert set(index.keys_with_prefix(prefix)) == {named[n] for n in expected}


def test_a_million_entries_take_under_100_bytes_each():
    rng = np.random.default_rng(0)
    n = 1_000_000
    index = KeyIndex()
    index.load(
        [(NS1, ChunkKind.PREFIX, "")],
        np.zeros(n, dtype=np.intp),
        rng.bytes(32 * n),
        np.full(n, 6 << 20, dtype=np.int64),
    )
    assert index.nbytes() / n <= 100
    probe = [key(rng.bytes(32)) for _ in range(64)]
    assert index.contains_many(probe) == [False] * 64
