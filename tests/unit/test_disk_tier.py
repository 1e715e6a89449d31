"""DiskTier: restarts, exact LRU order, corrupt files are removed misses, temp files, several processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import time

import pytest
import torch
import xxhash

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import Entry, decode_chunk, encode_chunk
from kvfuse.tiers import DiskTier
from kvfuse.tiers.disk import filename_to_key, key_to_filename

CAP = 10**9


def blob(key: str, tokens: int = 4, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, tokens, 2, 8), generator=g).half()
    return encode_chunk(KVChunk(kv, torch.arange(seed, seed + tokens)), key, get_codec("raw"))


def test_round_trip_and_file_layout(tmp_path):
    t = DiskTier(tmp_path, CAP)
    b = blob("ns:p:01")
    t.put("ns:p:01", b)
    got = t.get("ns:p:01")
    # a checked Entry over the fresh, writable read buffer: raw decode is zero-copy
    assert got == b and isinstance(got, Entry) and not got.payload.readonly
    assert torch.equal(decode_chunk(got, "ns:p:01").kv, decode_chunk(b).kv)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["ns_3Ap_3A01.kvf"] and len(files[0].parent.name) == 2
    assert t.contains("ns:p:01") and not t.contains("ns:p:02") and t.get("ns:p:02") is None
    s = t.stats.snapshot()
    assert (s["hits"], s["misses"], s["puts"], s["bytes_in"], s["bytes_out"]) == (1, 1, 1, len(b), len(b))


@pytest.mark.parametrize("key", ["a", "a:b", "a_3Ab", "x/y\\z", "ü€", ".hidden", "..", "A-Z.0-9", "sp ace%"])
def test_file_names_are_reversible_and_distinct(key):
    name = key_to_filename(key)
    assert filename_to_key(name) == key and "/" not in name and not name.startswith(".tmp")
    assert all(c.isascii() for c in name)


def test_file_name_mapping_is_injective_and_bounded():
    assert key_to_filename("a:") != key_to_filename("a_3A")
    for bad in ["x.tmp", "a_zz.kvf", "a_3a.kvf", "plain", ".kvf", "a b.kvf"]:
        assert filename_to_key(bad) is None, bad
    with pytest.raises(ValueError, match="too long"):
        key_to_filename("k" * 300)
    with pytest.raises(ValueError):
        key_to_filename("")


def test_exact_eviction_order_by_bytes(tmp_path):
    sizes = {k: len(blob(k, tokens=n)) for k, n in [("a", 4), ("b", 8), ("c", 4), ("d", 6)]}
    t = DiskTier(tmp_path, sizes["a"] + sizes["b"] + sizes["c"])
    for k, n in [("a", 4), ("b", 8), ("c", 4)]:
        t.put(k, blob(k, tokens=n))
    assert t.keys_lru() == ["a", "b", "c"] and t.used_bytes() == sum(sizes[k] for k in "abc")
    assert t.contains("a")  # no recency change
    assert t.get("b") is not None  # recency change
    t.put("d", blob("d", tokens=6))  # needs room: "a" goes, then "c" (b was used)
    assert t.keys_lru() == ["b", "d"]
    assert not t.contains("a") and not t.contains("c") and t.stats.snapshot()["evictions"] == 2
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == ["b.kvf", "d.kvf"]


def test_restart_keeps_entries_and_lru_order(tmp_path):
    t = DiskTier(tmp_path, CAP)
    for k in "abcd":
        t.put(k, blob(k))
    t.get("a")
    t.get("c")
    t2 = DiskTier(tmp_path, CAP)
    assert t2.keys_lru() == ["b", "d", "a", "c"] and t2.entries() == 4
    assert t2.used_bytes() == t.used_bytes() and t2.get("d") == blob("d")
    # That get made "d" the most recent; a smaller capacity at restart evicts the least recent.
    t3 = DiskTier(tmp_path, 2 * len(blob("a")))
    assert t3.keys_lru() == ["c", "d"] and t3.stats.snapshot()["evictions"] == 2
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == ["c.kvf", "d.kvf"]


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
        lambda b: _reseal_version(b, 2),  # a file of another format version
        lambda b: blob("other-key"),  # a misplaced (renamed) file
        lambda b: b"",  # an empty file
    ],
)
def test_damaged_files_are_removed_misses(tmp_path, damage):
    t = DiskTier(tmp_path, CAP)
    t.put("k", blob("k"))
    (path,) = tmp_path.rglob("k.kvf")
    path.write_bytes(damage(path.read_bytes()))
    assert t.contains("k")  # contains only stats the file; get is where it is checked
    assert t.get("k") is None
    assert not path.exists() and not t.contains("k") and t.entries() == 0 and t.used_bytes() == 0
    s = t.stats.snapshot()
    assert (s["errors"], s["misses"], s["hits"]) == (1, 1, 0)


def test_leftover_temp_files_are_cleaned(tmp_path):
    t = DiskTier(tmp_path, CAP)
    t.put("k", blob("k"))
    (path,) = tmp_path.rglob("k.kvf")
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
    assert t2.keys_lru() == ["k"]


def test_files_of_another_process_are_found_and_its_evictions_are_misses(tmp_path):
    a, b = DiskTier(tmp_path, CAP), DiskTier(tmp_path, CAP)
    b.put("x", blob("x"))
    assert "x" not in a.keys_lru() and a.contains("x") and a.get("x") == blob("x")
    assert a.keys_lru() == ["x"]
    a.put("y", blob("y"))
    b.delete("y")  # b removes a file a's index lists
    assert not a.contains("y") and a.get("y") is None
    assert a.stats.snapshot()["errors"] == 0 and a.keys_lru() == ["x"]


def test_oversize_put_is_dropped_and_delete_prefix(tmp_path):
    t = DiskTier(tmp_path, len(blob("ns1:a")) * 3)
    t.put("ns1:a", blob("ns1:a"))
    t.put("ns1:b", blob("ns1:b"))
    t.put("ns2:a", blob("ns2:a"))
    t.put("ns1:big", blob("ns1:big", tokens=64))
    assert not t.contains("ns1:big") and t.stats.snapshot()["dropped_writes"] == 1
    other = DiskTier(tmp_path, CAP)  # delete_prefix also finds files its index never saw
    other.put("ns1:c", blob("ns1:c"))
    assert t.delete_prefix("ns1:") == 3
    assert sorted(p.name for p in tmp_path.rglob("*.kvf")) == ["ns2_3Aa.kvf"]
    assert t.clear() == 1 and t.entries() == 0


def test_failed_write_is_dropped_counted_and_leaves_no_temp(tmp_path, monkeypatch):
    t = DiskTier(tmp_path, CAP)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)  # a full disk cannot be produced portably
    t.put("k", blob("k"))
    monkeypatch.undo()
    s = t.stats.snapshot()
    assert (s["errors"], s["dropped_writes"], s["puts"]) == (1, 1, 0)
    assert not t.contains("k") and list(p for p in tmp_path.rglob("*") if p.is_file()) == []


def test_fsync_mode_writes_the_same_files(tmp_path):
    t = DiskTier(tmp_path, CAP, fsync=True)
    t.put("k", blob("k"))
    assert DiskTier(tmp_path, CAP).get("k") == blob("k")


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
    while time.monotonic() < deadline:
        k = rng.randrange(N_KEYS)
        if rng.random() < 0.4:
            version += 1
            tier.put(f"key{k}", encode_chunk(_versioned(k, writer, version), f"key{k}", get_codec("raw")))
            continue
        got = tier.get(f"key{k}")
        if got is None:
            continue
        chunk = decode_chunk(got, f"key{k}")
        w, rest = divmod(int(chunk.positions[0]), 1_000_000_000)
        v, key_i = divmod(rest, 1000)
        expected = _versioned(key_i, w, v)
        ok = key_i == k and torch.equal(chunk.kv, expected.kv) and torch.equal(chunk.positions, expected.positions)
        checked += 1
        foreign += w != writer
        bad += not ok
    out.put((writer, checked, foreign, bad, tier.stats.snapshot()))


def test_two_processes_never_read_a_torn_entry(tmp_path):
    entry = len(encode_chunk(_versioned(0, 0, 0), "key0", get_codec("raw")))
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(2)
    # A capacity of 6 entries for 12 keys: the processes also evict each other's files.
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), w, 1.5, 6 * entry, start, out)) for w in (1, 2)]
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
    entry = encode_entry(chunk, "k:p:1", get_codec("raw"))
    t.put("k:p:1", entry)
    got = t.get("k:p:1")
    assert got == encode_chunk(chunk, "k:p:1", get_codec("raw")) and t.used_bytes() == len(entry)
    assert torch.equal(decode_chunk(got, "k:p:1").kv, chunk.kv)
