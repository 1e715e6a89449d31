"""MemoryTier: exact LRU order by bytes; contains is side-effect-free; oversize entries are not stored."""

from __future__ import annotations

import threading

import pytest
from keyed import K, Ks, ns_prefix

from kvfuse.tiers import MemoryTier


def _v(n: int, fill: int = 1) -> bytes:
    return bytes([fill]) * n


def test_capacity_is_counted_in_bytes_and_eviction_is_lru():
    t = MemoryTier(100)
    t.put(K("a"), _v(40))
    t.put(K("b"), _v(40))
    t.put(K("c"), _v(20))
    assert t.used_bytes() == 100 and t.keys_lru() == Ks("a", "b", "c")
    assert t.keys() == Ks("c", "b", "a") and t.keys(limit=2) == Ks("c", "b")  # most recent first
    t.put(K("d"), _v(30))  # needs 30 bytes: "a" (40) goes
    assert t.keys_lru() == Ks("b", "c", "d") and t.used_bytes() == 90
    t.put(K("e"), _v(60))  # needs 50 more: "b" then "c" go
    assert t.keys_lru() == Ks("d", "e") and t.used_bytes() == 90
    assert t.stats.snapshot()["evictions"] == 3


def test_get_refreshes_recency_and_contains_does_not():
    t = MemoryTier(30)
    for k in "abc":
        t.put(K(k), _v(10))
    assert t.contains(K("a"))  # must not save "a"
    assert t.get(K("b")) == _v(10)  # saves "b"
    t.put(K("d"), _v(10))
    assert t.keys_lru() == Ks("c", "b", "d")
    t.put(K("e"), _v(10))
    assert not t.contains(K("c")) and t.keys_lru() == Ks("b", "d", "e")


def test_overwrite_replaces_size_and_recency():
    t = MemoryTier(100)
    t.put(K("a"), _v(10))
    t.put(K("b"), _v(10))
    t.put(K("a"), _v(50, 2))
    assert t.used_bytes() == 60 and t.keys_lru() == Ks("b", "a") and t.get(K("a")) == _v(50, 2)
    assert t.entries() == 2


def test_oversize_entry_is_not_stored_and_counted():
    t = MemoryTier(100)
    t.put(K("a"), _v(10))
    t.put(K("big"), _v(101))
    assert not t.contains(K("big")) and t.get(K("big")) is None and t.contains(K("a"))
    t.put(K("a"), _v(101))  # an oversize overwrite also drops the stale value
    assert not t.contains(K("a")) and t.used_bytes() == 0
    assert t.stats.snapshot()["dropped_writes"] == 2
    t.put(K("exact"), _v(100))
    assert t.contains(K("exact"))


def test_put_keeps_the_value_itself_and_counts_its_bytes():
    import numpy as np

    t = MemoryTier(100)
    buf = bytearray(b"hello")
    t.put(K("a"), buf)
    assert t.get(K("a")) is buf  # no copy: an encoded entry decodes zero-copy from memory
    floats = memoryview(np.zeros(4, dtype=np.float32))  # 4 elements, 16 bytes
    t.put(K("b"), floats)
    assert t.get(K("b")) is floats and t.used_bytes() == 5 + 16


def test_stats_delete_prefix_clear():
    t = MemoryTier(1000)
    t.put(K("a", "ns1"), _v(10))
    t.put(K("b", "ns1"), _v(10))
    t.put(K("a", "ns2"), _v(5))
    assert t.get(K("a", "ns1")) and t.get(K("zzz")) is None
    s = t.stats.snapshot()
    assert (s["hits"], s["misses"], s["bytes_out"], s["puts"], s["bytes_in"]) == (1, 1, 10, 3, 25)
    assert (
        t.delete_prefix(ns_prefix("ns1")) == 2
        and t.keys_lru() == [K("a", "ns2")]
        and t.used_bytes() == 5
    )
    assert t.delete(K("a", "ns2")) and not t.delete(K("a", "ns2"))
    t.put(K("x"), _v(1))
    assert t.clear() == 1 and t.entries() == 0 and t.used_bytes() == 0


def test_batched_forms():
    t = MemoryTier(1000)
    t.put_many([(K("a"), b"1"), (K("b"), b"2")])
    assert t.contains_many(Ks("a", "x", "b")) == [True, False, True]
    assert t.get_many(Ks("b", "x", "a")) == [b"2", None, b"1"]


def test_concurrent_use_keeps_the_books_exact():
    t = MemoryTier(10_000)

    def worker(w: int) -> None:
        for i in range(2000):
            t.put(K(f"{w}:{i % 50}"), _v(1 + (i % 37)))
            t.get(K(f"{(w + 1) % 4}:{i % 50}"))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.used_bytes() == sum(len(t.get(k)) for k in t.keys_lru()) <= 10_000


def test_bad_capacity_and_untyped_keys():
    with pytest.raises(ValueError):
        MemoryTier(-1)
    with pytest.raises(TypeError, match="ChunkKey"):
        MemoryTier(10).put("a", b"1")


def test_read_with_serves_a_held_value_as_a_stream():
    """The default ``read_with`` (tiers that do not stream their reads): the value read whole, then
    handed to the reader in the pieces it asks for; an ``Entry`` as its serialized bytes."""
    import torch

    from kvfuse.codecs import get_codec
    from kvfuse.kv.chunk import KVChunk
    from kvfuse.kv.format import encode_entry, read_entry

    t = MemoryTier(10**6)
    entry = encode_entry(
        KVChunk(torch.randn((2, 2, 3, 2, 8)).half(), torch.arange(3)), K("a"), get_codec("raw")
    )
    t.put(K("a"), entry)
    t.put(K("b"), b"0123456789")
    got = t.read_with(K("a"), lambda readinto, size: read_entry(readinto, size, K("a")))
    assert torch.equal(got.chunk().kv, entry.chunk().kv) and got.header == entry.header

    def in_threes(readinto, size):
        out = bytearray()
        while (n := readinto(view := memoryview(bytearray(3)))) > 0:
            out += view[:n]
        return size, bytes(out)

    assert t.read_with(K("b"), in_threes) == (10, b"0123456789")
    assert t.read_with(K("zz"), in_threes) is None
