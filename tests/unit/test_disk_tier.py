"""DiskTier: restarts, exact LRU order, corrupt files are removed misses, temp files, several processes."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
from keyed import K, Ks, ns_prefix

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import Entry, FormatError, decode_chunk, encode_chunk
from kvfuse.kv.keys import ChunkKind
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.disk.files import filename_to_key, key_to_filename

CAP = 10**9


def names(*keys) -> list[str]:
    return sorted(key_to_filename(k) for k in keys)


def blob(key, tokens: int = 4, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, tokens, 2, 8), generator=g).half()
    return encode_chunk(KVChunk(kv, torch.arange(seed, seed + tokens)), key, get_codec("raw"))


def test_round_trip_and_file_layout(tmp_path):
    t = DiskTier(tmp_path, CAP)
    key = K("01")
    b = blob(key)
    t.put(key, b)
    got = t.get(key)
    # the fresh, writable read buffer: raw decode is zero-copy
    assert got == b and not isinstance(got, Entry) and not got.readonly
    assert torch.equal(decode_chunk(got, key).kv, decode_chunk(b).kv)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files] == [str(key).replace(":", "_3A") + ".kvf"] and len(
        files[0].parent.name
    ) == 2
    assert t.contains(key) and not t.contains(K("02")) and t.get(K("02")) is None
    s = t.stats.snapshot()
    assert (s["hits"], s["misses"], s["puts"], s["bytes_in"], s["bytes_out"]) == (
        1,
        1,
        1,
        len(b),
        len(b),
    )


@pytest.mark.parametrize("kind", list(ChunkKind))
def test_file_names_are_reversible_and_distinct(kind):
    key = K("x", kind=kind)
    name = key_to_filename(key)
    assert (
        filename_to_key(name) == key
        and "/" not in name
        and ":" not in name
        and not name.startswith(".")
    )
    assert all(c.isascii() for c in name) and len(name) < 255
    assert len({key_to_filename(K("x", kind=k)) for k in ChunkKind}) == len(ChunkKind)


def test_file_name_mapping_rejects_what_it_did_not_produce():
    good = key_to_filename(K("a"))
    for bad in [
        "x.tmp",
        "a_zz.kvf",
        good.replace("_3A", "_3a"),
        good[:-4],
        ".kvf",
        good.replace(".kvf", "0.kvf"),
        good.upper(),
        good.replace("_3Ap", "_3Ax"),
    ]:
        assert filename_to_key(bad) is None, bad
    with pytest.raises(TypeError):
        key_to_filename("a:p:b")


def test_exact_eviction_order_by_bytes(tmp_path):
    sizes = {k: len(blob(K(k), tokens=n)) for k, n in [("a", 4), ("b", 8), ("c", 4), ("d", 6)]}
    t = DiskTier(tmp_path, sizes["a"] + sizes["b"] + sizes["c"])
    for k, n in [("a", 4), ("b", 8), ("c", 4)]:
        t.put(K(k), blob(K(k), tokens=n))
    assert t.keys_lru() == Ks("a", "b", "c") and t.used_bytes() == sum(sizes[k] for k in "abc")
    assert t.contains(K("a"))  # no recency change
    assert t.get(K("b")) is not None  # recency change
    t.put(K("d"), blob(K("d"), tokens=6))  # needs room: "a" goes, then "c" (b was used)
    assert t.keys_lru() == Ks("b", "d") and t.keys() == Ks("d", "b") and t.keys(limit=1) == Ks("d")
    assert (
        not t.contains(K("a")) and not t.contains(K("c")) and t.stats.snapshot()["evictions"] == 2
    )
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == names(K("b"), K("d"))


def test_the_start_up_scan_indexes_every_kind_and_variant_and_nothing_else(tmp_path):
    t = DiskTier(tmp_path, CAP)
    keys = [
        K("a"),
        K("b", kind=ChunkKind.DOCUMENT),
        K("c", kind=ChunkKind.TAIL),
        K("a").encoded_as("cachegen", 2),
        K("d", "ns2"),
    ]
    for k in keys:
        t.put(k, blob(k))
    sub = Path(t._path(keys[0])).parent
    (sub / (key_to_filename(keys[0]) + "\n")).write_bytes(b"x")  # a look-alike name: never a key
    (sub / key_to_filename(keys[0]).upper()).write_bytes(b"x")
    (sub / "notes.txt").write_bytes(b"x")
    (tmp_path / "zz").mkdir()  # not a fan-out folder
    (tmp_path / "zz" / key_to_filename(K("e"))).write_bytes(b"x")
    t2 = DiskTier(tmp_path, CAP)
    assert t2.keys_lru() == keys and t2.used_bytes() == t.used_bytes()
    assert all(t2.get(k) == blob(k) for k in keys)


@pytest.mark.parametrize("threads", [1, 4])
def test_put_many_writes_in_parallel_and_records_in_order(tmp_path, threads):
    t = DiskTier(tmp_path, CAP, io_threads=threads)
    t.put(K("old"), blob(K("old")))
    batch = [(K(n), blob(K(n), seed=i)) for i, n in enumerate("dcbaxyz")] + [
        (K("a"), blob(K("a"), seed=99))
    ]
    t.put_many(batch)
    # the batch's order; "a" put twice
    assert t.keys_lru() == Ks("old", "d", "c", "b", "x", "y", "z", "a")
    assert t.get(K("a")) == blob(K("a"), seed=99) and t.get(K("x")) == blob(K("x"), seed=4)
    assert not list(tmp_path.rglob("*.tmp")) and t.stats.snapshot()["puts"] == 9
    # mtimes too
    assert DiskTier(tmp_path, CAP).keys_lru() == Ks("old", "d", "c", "b", "y", "z", "a", "x")
    t.close()


def test_restart_keeps_entries_and_lru_order(tmp_path):
    t = DiskTier(tmp_path, CAP)
    for k in "abcd":
        t.put(K(k), blob(K(k)))
    t.get(K("a"))
    t.get(K("c"))
    t2 = DiskTier(tmp_path, CAP)
    assert t2.keys_lru() == Ks("b", "d", "a", "c") and t2.entries() == 4
    assert t2.used_bytes() == t.used_bytes() and t2.get(K("d")) == blob(K("d"))
    # That get made "d" the most recent; a smaller capacity at restart evicts the least recent.
    t3 = DiskTier(tmp_path, 2 * len(blob(K("a"))))
    assert t3.keys_lru() == Ks("c", "d") and t3.stats.snapshot()["evictions"] == 2
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == names(K("c"), K("d"))


def _reseal_version(b: bytes, version: int) -> bytes:
    x = bytearray(b)
    struct.pack_into("<H", x, 4, version)
    hl = struct.unpack_from("<I", x, 6)[0]
    struct.pack_into("<Q", x, hl - 8, xxhash.xxh3_64_intdigest(bytes(x[: hl - 8])))
    return bytes(x)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # a partial write
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # bit rot in the payload
        lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],  # bit rot in the header
        lambda b: _reseal_version(b, 1),  # a file of another format version
        lambda b: blob(K("other-key")),  # a misplaced (renamed) file
        lambda b: b"",  # an empty file
    ],
)
def test_damaged_files_are_removed_misses(tmp_path, damage):
    """The tier hands back bytes; the store's one validation path rejects them and removes the file."""
    t = DiskTier(tmp_path, CAP)
    store = TieredStore(MemoryTier(CAP), [t])  # memory misses: the disk copy is read and checked
    t.put(K("k"), blob(K("k")))
    (path,) = tmp_path.rglob(key_to_filename(K("k")))
    path.write_bytes(damage(path.read_bytes()))
    assert t.contains(K("k"))  # contains only stats the file; reading is where it is checked
    assert store.get([K("k")]) == [None]
    assert not path.exists() and not t.contains(K("k")) and t.entries() == 0 and t.used_bytes() == 0
    s = t.stats.snapshot()
    assert (s["errors"], s["misses"], s["hits"]) == (1, 1, 0)
    assert store.stats()["store"]["unusable_entries"] == 1


def test_read_with_streams_the_file_and_a_failing_reader_is_no_use_of_the_entry(
    tmp_path, monkeypatch
):
    """``read_with`` hands the file to the reader piece by piece; a read the reader rejects does not
    make the entry recent (in the index or in the file's mtime); an I/O error is a counted miss."""
    t = DiskTier(tmp_path, CAP)
    for name in "abc":
        t.put(K(name), blob(K(name)))
    pieces: list[int] = []

    def reader(readinto, size):
        buf = bytearray(size)
        pos = 0
        while pos < size:
            n = readinto(memoryview(buf)[pos : pos + 64])
            assert n > 0
            pieces.append(n)
            pos += n
        assert readinto(memoryview(bytearray(8))) == 0  # the end of the file
        return bytes(buf)

    def rejecting(readinto, size):
        readinto(memoryview(bytearray(16)))
        raise FormatError("damaged")

    assert t.read_with(K("a"), reader) == blob(K("a")) and len(pieces) > 1 and max(pieces) == 64
    assert t.keys_lru() == [K("b"), K("c"), K("a")]
    with pytest.raises(FormatError):
        t.read_with(K("b"), rejecting)
    assert t.keys_lru() == [K("b"), K("c"), K("a")]
    assert DiskTier(tmp_path, CAP).keys_lru() == [K("b"), K("c"), K("a")]  # the mtimes say so too
    assert t.read_with(K("zz"), reader) is None
    assert (t.stats.hits, t.stats.misses, t.stats.errors) == (
        2,
        1,
        0,
    )  # the store un-counts a rejected hit

    def failing_readv(fd, buffers):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "readv", failing_readv)
    assert t.read_with(K("c"), reader) is None
    assert (t.stats.hits, t.stats.misses, t.stats.errors) == (2, 2, 1) and t.contains(K("c"))


def test_leftover_temp_files_are_cleaned(tmp_path):
    t = DiskTier(tmp_path, CAP)
    t.put(K("k"), blob(K("k")))
    (path,) = tmp_path.rglob(key_to_filename(K("k")))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_tmp = path.parent / f".{dead.pid}.0123abcd.tmp"
    old_tmp = path.parent / f".{os.getpid()}.89abcdef.tmp"
    live_tmp = path.parent / f".{os.getpid()}.feedbeef.tmp"
    for p in (dead_tmp, old_tmp, live_tmp):
        p.write_bytes(b"partial")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    t2 = DiskTier(tmp_path, CAP)
    assert not dead_tmp.exists() and not old_tmp.exists()
    assert live_tmp.exists()  # a live writer's fresh temp file is left alone
    assert t2.keys_lru() == Ks("k")


def test_files_of_another_process_are_found_and_its_evictions_are_misses(tmp_path):
    a, b = DiskTier(tmp_path, CAP), DiskTier(tmp_path, CAP)
    b.put(K("x"), blob(K("x")))
    assert "x" not in a.keys_lru() and a.contains(K("x")) and a.get(K("x")) == blob(K("x"))
    assert a.keys_lru() == Ks("x")
    a.put(K("y"), blob(K("y")))
    b.delete(K("y"))  # b removes a file a's index lists
    assert not a.contains(K("y")) and a.get(K("y")) is None
    assert a.stats.snapshot()["errors"] == 0 and a.keys_lru() == Ks("x")


def test_oversize_put_is_dropped_and_delete_prefix(tmp_path):
    t = DiskTier(tmp_path, len(blob(K("a", "ns1"))) * 3)
    for ns, name in [("ns1", "a"), ("ns1", "b"), ("ns2", "a")]:
        t.put(K(name, ns), blob(K(name, ns)))
    t.put(K("big", "ns1"), blob(K("big", "ns1"), tokens=64))
    assert not t.contains(K("big", "ns1")) and t.stats.snapshot()["dropped_writes"] == 1
    other = DiskTier(tmp_path, CAP)  # delete_prefix also finds files its index never saw
    other.put(K("c", "ns1"), blob(K("c", "ns1")))
    assert t.delete_prefix(ns_prefix("ns1")) == 3
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == names(K("a", "ns2"))
    assert t.clear() == 1 and t.entries() == 0


def test_failed_write_is_dropped_counted_and_leaves_no_temp(tmp_path, monkeypatch):
    t = DiskTier(tmp_path, CAP)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)  # a full disk cannot be produced portably
    t.put(K("k"), blob(K("k")))
    monkeypatch.undo()
    s = t.stats.snapshot()
    assert (s["errors"], s["dropped_writes"], s["puts"]) == (1, 1, 0)
    assert not t.contains(K("k")) and list(p for p in tmp_path.rglob("*") if p.is_file()) == []


def test_fsync_mode_writes_the_same_files(tmp_path):
    t = DiskTier(tmp_path, CAP, fsync=True)
    t.put(K("k"), blob(K("k")))
    assert DiskTier(tmp_path, CAP).get(K("k")) == blob(K("k"))


# -- several processes sharing one directory ------------------------------------------------------

N_KEYS = 12


def _versioned(key_i: int, writer: int, version: int) -> KVChunk:
    seed = key_i * 1_000_003 + writer * 1009 + version
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((4, 2, 64, 4, 32), generator=g).half()  # 128 KiB: writes take a while
    start = (writer * 1_000_000 + version) * 1000 + key_i
    return KVChunk(kv, torch.arange(start, start + 64))


def _worker(path: str, writer: int, seconds: float, capacity: int, start, out) -> None:
    tier = DiskTier(path, capacity)
    start.wait(timeout=60)  # both processes run the loop at the same time, after their imports
    rng = random.Random(writer)
    version, checked, foreign, bad = 0, 0, 0, 0
    deadline = time.monotonic() + seconds
    hard = deadline + 30  # on a busy machine, run on until enough reads were checked
    while time.monotonic() < deadline or (checked < 40 and time.monotonic() < hard):
        k = rng.randrange(N_KEYS)
        if rng.random() < 0.4:
            version += 1
            tier.put(
                K(f"key{k}"),
                encode_chunk(_versioned(k, writer, version), K(f"key{k}"), get_codec("raw")),
            )
            continue
        got = tier.get(K(f"key{k}"))
        if got is None:
            continue
        chunk = decode_chunk(got, K(f"key{k}"))
        w, rest = divmod(int(chunk.positions[0]), 1_000_000_000)
        v, key_i = divmod(rest, 1000)
        expected = _versioned(key_i, w, v)
        ok = (
            key_i == k
            and torch.equal(chunk.kv, expected.kv)
            and torch.equal(chunk.positions, expected.positions)
        )
        checked += 1
        foreign += w != writer
        bad += not ok
    out.put((writer, checked, foreign, bad, tier.stats.snapshot()))


def test_two_processes_never_read_a_torn_entry(tmp_path):
    entry = len(encode_chunk(_versioned(0, 0, 0), K("key0"), get_codec("raw")))
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(2)
    # A capacity of 6 entries for 12 keys: the processes also evict each other's files.
    procs = [
        ctx.Process(target=_worker, args=(str(tmp_path), w, 1.5, 6 * entry, start, out))
        for w in (1, 2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for writer, checked, foreign, bad, stats in results:
        assert bad == 0, f"writer {writer} read {bad} wrong entries"
        assert stats["errors"] == 0, f"writer {writer} saw corrupt files: {stats}"
        assert checked > 20 and foreign > 0, (writer, checked, foreign)
        assert stats["evictions"] > 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_an_entry_is_written_from_its_two_parts_as_the_same_bytes(tmp_path):
    from kvfuse.kv.format import encode_entry

    chunk = KVChunk(kv=torch.randn(3, 2, 64, 2, 32).half(), positions=torch.arange(64))
    t = DiskTier(tmp_path, 1 << 30)
    entry = encode_entry(chunk, K("1"), get_codec("raw"))
    t.put(K("1"), entry)
    got = t.get(K("1"))
    assert got == encode_chunk(chunk, K("1"), get_codec("raw")) and t.used_bytes() == len(entry)
    assert torch.equal(decode_chunk(got, K("1")).kv, chunk.kv)


def test_start_up_scan_removes_entries_of_key_version_2(tmp_path):
    """Key version 2's files (a 24-hex namespace: the 32-bit tenant tag) can never be a hit under
    version 3, and no index would count or evict them: the start-up scan removes them, and keeps
    this version's files and whatever is not an entry."""
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(K("kept"), b"x" * 10)
    tier.close()
    old = tmp_path / "ab" / ("0" * 24 + "_3Ap_3A" + "1" * 64 + ".kvf")
    other = tmp_path / "ab" / "notes.txt"
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(b"old")
    other.write_bytes(b"mine")
    again = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert not old.exists() and other.exists()
    assert again.contains(K("kept")) and again.entries() == 1
    again.close()
