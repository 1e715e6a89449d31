"""TieredStore: contiguous partial hits, which tier holds what, promotion, the async write queue, corruption."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from keyed import K, ns_prefix

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import decode_chunk, encode_chunk
from kvfuse.store import LookupResult, TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

KEYS = [K(f"{i:02d}") for i in range(6)]


def blob(key, seed: int = 0) -> bytes:
    kv = torch.randn((2, 2, 4, 2, 8), generator=torch.Generator().manual_seed(seed)).half()
    return encode_chunk(KVChunk(kv, torch.arange(4)), key, get_codec("raw"))


class GatedTier(MemoryTier):
    """A lower tier whose writes wait for a gate: stands in for a slow disk or network."""

    def __init__(self, name: str) -> None:
        super().__init__(10**9, name=name)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        self.gate.wait(timeout=10)
        super().put_many(items)


class BrokenTier(MemoryTier):
    """A tier with a bug: every call raises (faults a real tier should never produce)."""

    def contains_many(self, keys):
        raise RuntimeError("boom")

    def get(self, key):
        raise RuntimeError("boom")

    def get_many(self, keys):
        raise RuntimeError("boom")


@pytest.fixture
def three(tmp_path):
    mem, disk, remote = (
        MemoryTier(10**6),
        DiskTier(tmp_path, 10**6),
        MemoryTier(10**6, name="remote"),
    )
    store = TieredStore(mem, [disk, remote])
    yield store, mem, disk, remote
    store.close()


def test_lookup_reports_the_contiguous_prefix_and_the_tier_of_each(three):
    store, mem, disk, remote = three
    mem.put(KEYS[0], blob(KEYS[0]))
    disk.put(KEYS[1], blob(KEYS[1]))
    remote.put(KEYS[2], blob(KEYS[2]))
    disk.put(KEYS[3], blob(KEYS[3]))
    remote.put(KEYS[3], blob(KEYS[3]))  # in two tiers: the faster one is reported
    mem.put(KEYS[5], blob(KEYS[5]))  # after the gap at 4: not part of the hit
    found = store.lookup(KEYS)
    assert (found.hits, found.tiers) == (4, ("memory", "disk", "remote", "disk"))
    # every key's holder
    assert found == LookupResult(("memory", "disk", "remote", "disk", None, "memory"))
    assert (store.lookup(KEYS[1:]).hits, store.lookup(KEYS[1:]).tiers) == (
        3,
        ("disk", "remote", "disk"),
    )
    assert (store.lookup(KEYS[4:]).hits, store.lookup(KEYS[4:]).tiers) == (0, ())
    assert store.lookup([]) == LookupResult(())


def test_lookup_is_side_effect_free(three):
    store, mem, disk, remote = three
    mem.put(K("a"), blob(K("a")))
    mem.put(K("b"), blob(K("b")))
    disk.put(KEYS[0], blob(KEYS[0]))
    before = {name: s for name, s in store.stats().items() if name != "store"}
    assert store.lookup([K("a"), KEYS[0]]).hits == 2
    # no recency, no promotion
    assert mem.keys_lru() == [K("a"), K("b")] and not mem.contains(KEYS[0])
    assert {name: s for name, s in store.stats().items() if name != "store"} == before
    assert store.stats()["store"]["lookups"] == 1


def test_get_reads_the_fastest_tier_and_promotes_lower_hits(three):
    store, mem, disk, remote = three
    mem.put(KEYS[0], blob(KEYS[0], seed=1))
    disk.put(KEYS[0], blob(KEYS[0], seed=2))  # a stale lower copy must not be read
    disk.put(KEYS[1], blob(KEYS[1]))
    remote.put(KEYS[2], blob(KEYS[2]))
    out = store.get(KEYS[:4])
    assert out[:3] == [blob(KEYS[0], seed=1), blob(KEYS[1]), blob(KEYS[2])] and out[3] is None
    assert mem.contains(KEYS[1]) and mem.contains(KEYS[2]) and not disk.contains(KEYS[2])
    assert store.lookup(KEYS[:3]).tiers == ("memory",) * 3
    assert store.stats()["store"]["promotions"] == 2
    assert remote.stats.snapshot()["hits"] == 1 and disk.stats.snapshot()["hits"] == 1
    assert torch.equal(decode_chunk(out[1], KEYS[1]).kv, decode_chunk(blob(KEYS[1])).kv)


def test_a_chunk_vanishing_between_lookup_and_get_is_a_none(three):
    store, mem, disk, _ = three
    for k in KEYS[:3]:
        disk.put(k, blob(k))
    assert store.lookup(KEYS[:3]).hits == 3
    disk.delete(KEYS[1])  # evicted meanwhile (e.g. by another process)
    out = store.get(KEYS[:3])
    assert out[0] is not None and out[1] is None and out[2] is not None  # callers use the prefix: 1


def test_put_writes_memory_now_and_lower_tiers_after_flush(tmp_path):
    mem, slow = MemoryTier(10**6), GatedTier("slow")
    with TieredStore(mem, [slow]) as store:
        store.put([(k, blob(k)) for k in KEYS[:2]])
        assert mem.contains(KEYS[0]) and mem.contains(KEYS[1])
        assert slow.entered.wait(5) and not slow.contains(KEYS[0])
        assert store.flush(timeout=0.1) is False  # still held at the gate
        slow.gate.set()
        assert store.flush(timeout=5) is True
        assert slow.contains(KEYS[0]) and slow.contains(KEYS[1])
        assert store.stats()["store"]["queued_writes"] == 2


def test_a_full_queue_drops_lower_tier_writes_without_blocking():
    mem, slow = MemoryTier(10**6), GatedTier("slow")
    store = TieredStore(mem, [slow], write_queue_size=2, write_batch=1)
    store.put([(KEYS[0], blob(KEYS[0]))])
    assert slow.entered.wait(5)  # the writer holds KEYS[0]; the queue is empty again
    t0 = time.monotonic()
    store.put([(k, blob(k)) for k in KEYS[1:6]])  # 2 fit in the queue, 3 are dropped
    assert time.monotonic() - t0 < 0.5
    assert all(mem.contains(k) for k in KEYS[:6])
    s = store.stats()
    assert s["store"]["queue_full_drops"] == 3 and s["slow"]["dropped_writes"] == 3
    slow.gate.set()
    assert store.flush(timeout=5)
    assert [slow.contains(k) for k in KEYS[:6]] == [True, True, True, False, False, False]
    store.close()


def test_corrupt_entry_in_a_lower_tier_is_removed_and_the_next_tier_tried():
    mem, mid, low = MemoryTier(10**6), MemoryTier(10**6, name="mid"), MemoryTier(10**6, name="low")
    with TieredStore(mem, [mid, low]) as store:
        good = blob(KEYS[0])
        mid.put(KEYS[0], good[:-1] + bytes([good[-1] ^ 1]))
        low.put(KEYS[0], good)
        mid.put(KEYS[1], blob(KEYS[2]))  # a valid entry of another key: also not this key's
        assert store.get(KEYS[:2]) == [good, None]
        assert not mid.contains(KEYS[0]) and not mid.contains(KEYS[1]) and mem.get(KEYS[0]) == good
        s = store.stats()["mid"]
        assert (s["errors"], s["hits"], s["misses"]) == (2, 0, 2)


def test_corrupt_file_in_the_disk_tier_is_a_removed_miss(tmp_path):
    mem, disk = MemoryTier(10**6), DiskTier(tmp_path, 10**6)
    with TieredStore(mem, [disk]) as store:
        disk.put(KEYS[0], blob(KEYS[0]))
        (path,) = tmp_path.rglob("*.kvf")
        path.write_bytes(path.read_bytes()[:-5])
        assert store.lookup(KEYS[:1]).hits == 1  # lookup does not read files
        assert store.get(KEYS[:1]) == [None] and not path.exists() and not mem.contains(KEYS[0])
        assert store.stats()["disk"]["errors"] == 1


def test_a_raising_tier_is_a_counted_miss():
    mem, broken = MemoryTier(10**6), BrokenTier(10**6, name="broken")
    with TieredStore(mem, [broken]) as store:
        mem.put(KEYS[0], blob(KEYS[0]))
        assert store.lookup(KEYS[:2]) == LookupResult(("memory", None))
        assert store.get(KEYS[:2]) == [blob(KEYS[0]), None]
        assert broken.stats.snapshot()["errors"] == 2


def test_delete_prefix_and_clear_reach_every_tier_after_queued_writes(tmp_path):
    mem, disk = MemoryTier(10**6), DiskTier(tmp_path, 10**6)
    store = TieredStore(mem, [disk])
    a1, a2, b1 = K("1", "a"), K("2", "a"), K("1", "b")
    store.put([(a1, blob(a1)), (a2, blob(a2)), (b1, blob(b1))])
    assert store.delete_prefix(ns_prefix("a")) == {"memory": 2, "disk": 2}
    assert store.lookup([a1]).hits == 0 and store.lookup([b1]).tiers == ("memory",)
    assert store.clear() == {"memory": 1, "disk": 1}
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError):
        store.put([(K("c"), b"x")])


def test_close_flushes_pending_writes(tmp_path):
    mem, disk = MemoryTier(10**6), DiskTier(tmp_path, 10**6)
    store = TieredStore(mem, [disk])
    store.put([(k, blob(k)) for k in KEYS])
    store.close()
    assert DiskTier(tmp_path, 10**6).entries() == len(KEYS)


def test_stats_shape_and_bad_configuration(tmp_path):
    with TieredStore(MemoryTier(100)) as store:
        s = store.stats()
        assert (
            set(s) == {"memory", "store"}
            and s["memory"]["entries"] == 0
            and s["memory"]["used_bytes"] == 0
        )
    with pytest.raises(ValueError, match="unique"):
        TieredStore(MemoryTier(1), [MemoryTier(1)])
    # the memory role: a MemoryTier, nothing else
    with pytest.raises(TypeError, match="must be a MemoryTier"):
        TieredStore([])
    with pytest.raises(TypeError, match="must be a MemoryTier"):
        TieredStore(DiskTier(tmp_path, 10**6))
    with pytest.raises(TypeError, match="sequence"):
        TieredStore(MemoryTier(1), DiskTier(tmp_path, 10**6))


def test_the_store_takes_its_tiers_by_role(tmp_path):
    mem, disk, remote = (
        MemoryTier(10**6),
        DiskTier(tmp_path, 10**6),
        MemoryTier(10**6, name="remote"),
    )
    clock = lambda: 1234.5  # noqa: E731
    with TieredStore(mem, [disk, remote], clock=clock) as store:
        assert (
            store.memory is mem
            and store.lower == (disk, remote)
            and store.tiers == (mem, disk, remote)
        )
        assert (
            store.tier("disk") is disk and store.tier("memory") is mem and store.clock() == 1234.5
        )
        with pytest.raises(ValueError, match="no tier named 'nvme'"):
            store.tier("nvme")
        with pytest.raises(ValueError, match="no tier named 'nvme'"):
            store.fetch_encoded(KEYS[0], "nvme")
    with TieredStore(MemoryTier(10)) as alone:
        assert alone.lower == () and alone.tiers == (alone.memory,)
        # no writer thread to wait for
        assert alone.protect_upcoming() is None and alone.flush(0) is True


def test_entries_are_trusted_blobs_verified_and_promotions_become_entries(tmp_path, monkeypatch):
    import kvfuse.store.checked_reads as checked_reads
    from kvfuse.kv.format import Entry, encode_entry, open_entry, read_entry

    checked: list = []

    def counting_open(value, key=None, spec=None, signer=None):
        if not isinstance(value, Entry):
            checked.append(key)
        return open_entry(value, key, spec, signer)

    def counting_read(readinto, size, key=None, spec=None, signer=None):
        checked.append(key)
        return read_entry(readinto, size, key, spec, signer)

    # the one validation path, in both its forms (a blob; a stream of bytes, as the disk tier's), counted
    monkeypatch.setattr(checked_reads, "open_entry", counting_open)
    monkeypatch.setattr(checked_reads, "read_entry", counting_read)
    chunk = KVChunk(torch.randn((2, 2, 4, 2, 8)).half(), torch.arange(4))
    disk = DiskTier(tmp_path, 10**9)
    with TieredStore(MemoryTier(10**9), [disk]) as store:
        store.put([(KEYS[0], encode_entry(chunk, KEYS[0], get_codec("raw")))])
        store.flush()
        assert isinstance(store.get([KEYS[0]])[0], Entry) and checked == []  # in-process: trusted
        store.memory.clear()
        (promoted,) = store.get([KEYS[0]])  # from disk: verified once, then kept as an Entry
        assert checked == [KEYS[0]] and isinstance(promoted, Entry)
        assert isinstance(store.memory.get(KEYS[0]), Entry)
        assert torch.equal(
            decode_chunk(store.get([KEYS[0]])[0], KEYS[0]).kv, chunk.kv
        ) and checked == [KEYS[0]]
        # an Entry stored under another key is never served for this one
        store.memory.put(KEYS[1], encode_entry(chunk, KEYS[0], get_codec("raw")))
        assert store.get([KEYS[1]]) == [None]
        assert store.stats()["store"]["unusable_entries"] == 1


def test_fetch_checks_the_callers_spec_and_reports_what_it_rejected(tmp_path):
    from kvfuse.kv.format import EntrySpec

    mem, disk = MemoryTier(10**6), DiskTier(tmp_path, 10**6)
    with TieredStore(mem, [disk]) as store:
        disk.put(KEYS[0], blob(KEYS[0]))
        mem.put(
            KEYS[0],
            encode_chunk(
                KVChunk(torch.zeros((2, 2, 4, 2, 8)).float(), torch.arange(4)),
                KEYS[0],
                get_codec("raw"),
            ),
        )  # intact, but fp32: not what the reader expects
        spec = EntrySpec(
            torch.float16, num_layers=2, kv_heads=2, head_dim=8, tokens=4, first_position=0
        )
        (f,) = store.fetch([KEYS[0]], [spec])
        assert f.tier == "disk" and f.rejected == 1 and f.entry.dtype == torch.float16
        assert (
            store.stats()["store"]["unusable_entries"] == 1
            and store.stats()["memory"]["errors"] == 1
        )
        (g,) = store.fetch(
            [KEYS[0]], [EntrySpec(torch.float16, 2, 2, 8, tokens=4, first_position=7)]
        )
        assert (g.entry, g.tier, g.rejected) == (
            None,
            None,
            2,
        )  # the promoted copy and the disk copy
        with pytest.raises(ValueError, match="specs"):
            store.fetch(KEYS[:2], [spec])


@pytest.mark.parametrize("where", ["memory", "disk", "redis"])
def test_a_layer_range_is_read_without_the_rest_of_the_entry(tmp_path, where, request):
    from kvfuse.kv.format import EntrySpec
    from kvfuse.tiers import RedisTier

    chunk = KVChunk(
        torch.randn((6, 2, 64, 2, 32), generator=torch.Generator().manual_seed(2)).half(),
        torch.arange(8, 72),
    )
    data = encode_chunk(chunk, KEYS[0], get_codec("int8"))
    full = decode_chunk(data, KEYS[0]).kv
    if where == "redis":
        tier = RedisTier(request.getfixturevalue("redis_server").url, timeout_s=2.0)
    else:
        tier = MemoryTier(10**6) if where == "memory" else DiskTier(tmp_path, 10**6)
    with (
        TieredStore(tier) if where == "memory" else TieredStore(MemoryTier(10**6), [tier]) as store
    ):
        tier.put(KEYS[0], data)
        read = tier.stats.snapshot()["bytes_out"]
        got = store.fetch_layers(
            KEYS[0], 2, 4, EntrySpec(torch.float16, 6, 2, 32, tokens=64, first_position=8)
        )
        assert got.tier == where and (got.first, got.last) == (2, 4)
        assert torch.equal(got.kv, full[2:4]) and torch.equal(got.positions, torch.arange(8, 72))
        if where != "memory":
            # the header and two layers of six
            assert tier.stats.snapshot()["bytes_out"] - read < len(data) / 2
            assert not store.memory.contains(KEYS[0])  # a layer range is not promoted
        assert store.fetch_layers(KEYS[1], 0, 1) is None
        # not as expected
        assert store.fetch_layers(KEYS[0], 0, 1, EntrySpec(torch.float32, 6, 2, 32)) is None
        assert not tier.contains(KEYS[0]) and store.stats()["store"]["unusable_entries"] == 1
