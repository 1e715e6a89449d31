"""MemoryTier: exact LRU order by bytes; contains is side-effect-free; oversize entries are not stored."""

from __future__ import annotations

import threading

import pytest

from kvfuse.tiers import MemoryTier


def _v(n: int, fill: int = 1) -> bytes:
    return bytes([fill]) * n


def test_capacity_is_counted_in_bytes_and_eviction_is_lru():
    t = MemoryTier(100)
    t.put("a", _v(40))
    t.put("b", _v(40))
    t.put("c", _v(20))
    assert t.used_bytes() == 100 and t.keys_lru() == ["a", "b", "c"]
    t.put("d", _v(30))  # needs 30 bytes: "a" (40) goes
    assert t.keys_lru() == ["b", "c", "d"] and t.used_bytes() == 90
    t.put("e", _v(60))  # needs 50 more: "b" then "c" go
    assert t.keys_lru() == ["d", "e"] and t.used_bytes() == 90
    assert t.stats.snapshot()["evictions"] == 3


def test_get_refreshes_recency_and_contains_does_not():
    t = MemoryTier(30)
    for k in "abc":
        t.put(k, _v(10))
    assert t.contains("a")  # must not save "a"
    assert t.get("b") == _v(10)  # saves "b"
    t.put("d", _v(10))
    assert t.keys_lru() == ["c", "b", "d"]
    t.put("e", _v(10))
    assert not t.contains("c") and t.keys_lru() == ["b", "d", "e"]


def test_overwrite_replaces_size_and_recency():
    t = MemoryTier(100)
    t.put("a", _v(10))
    t.put("b", _v(10))
    t.put("a", _v(50, 2))
    assert t.used_bytes() == 60 and t.keys_lru() == ["b", "a"] and t.get("a") == _v(50, 2)
    assert t.entries() == 2


def test_oversize_entry_is_not_stored_and_counted():
    t = MemoryTier(100)
    t.put("a", _v(10))
    t.put("big", _v(101))
    assert not t.contains("big") and t.get("big") is None and t.contains("a")
    t.put("a", _v(101))  # an oversize overwrite also drops the stale value
    assert not t.contains("a") and t.used_bytes() == 0
    assert t.stats.snapshot()["dropped_writes"] == 2
    t.put("exact", _v(100))
    assert t.contains("exact")


def test_put_keeps_the_value_itself_and_counts_its_bytes():
    import numpy as np

    t = MemoryTier(100)
    buf = bytearray(b"hello")
    t.put("a", buf)
    assert t.get("a") is buf  # no copy: an encoded entry decodes zero-copy from memory
    floats = memoryview(np.zeros(4, dtype=np.float32))  # 4 elements, 16 bytes
    t.put("b", floats)
    assert t.get("b") is floats and t.used_bytes() == 5 + 16


def test_stats_delete_prefix_clear():
    t = MemoryTier(1000)
    t.put("ns1:a", _v(10))
    t.put("ns1:b", _v(10))
    t.put("ns2:a", _v(5))
    assert t.get("ns1:a") and t.get("zzz") is None
    s = t.stats.snapshot()
    assert (s["hits"], s["misses"], s["bytes_out"], s["puts"], s["bytes_in"]) == (1, 1, 10, 3, 25)
    assert t.delete_prefix("ns1:") == 2 and t.keys_lru() == ["ns2:a"] and t.used_bytes() == 5
    assert t.delete("ns2:a") and not t.delete("ns2:a")
    t.put("x", _v(1))
    assert t.clear() == 1 and t.entries() == 0 and t.used_bytes() == 0


def test_batched_forms():
    t = MemoryTier(1000)
    t.put_many([("a", b"1"), ("b", b"2")])
    assert t.contains_many(["a", "x", "b"]) == [True, False, True]
    assert t.get_many(["b", "x", "a"]) == [b"2", None, b"1"]


def test_concurrent_use_keeps_the_books_exact():
    t = MemoryTier(10_000)

    def worker(w: int) -> None:
        for i in range(2000):
            t.put(f"{w}:{i % 50}", _v(1 + (i % 37)))
            t.get(f"{(w + 1) % 4}:{i % 50}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.used_bytes() == sum(len(t.get(k)) for k in t.keys_lru()) <= 10_000


def test_bad_capacity():
    with pytest.raises(ValueError):
        MemoryTier(-1)
