"""Per-entry expiry (retention) in the memory and disk tiers, behind a ThrottledTier, and in the
tiered store: put / expiry / extend / expire, reads of expired entries, the disk tier's journal
(restart, damage, compaction, several processes), and the store's memory-only writes, expiries
carried to lower tiers and variants, promotion, extension of queued writes, the sweep in lookup and
delete. Time is a fake clock; Redis's expiry runs on its own clock and is tested in
``tests/integration/test_redis_tier.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch
from keyed import K, Ks

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_chunk, encode_entry, read_header
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.disk.files import key_to_filename
from kvfuse.tiers.disk.journal import JOURNAL, journal_line, parse_journal
from kvfuse_testkit.throttled import ThrottledTier

T0 = 1_000_000.0  # the fake clock's start


class Clock:
    """A fake wall clock: ``clock()`` is ``t``; tests move it by hand."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_tier(kind: str, path, clock: Clock, capacity: int = 10**6):
    if kind == "memory":
        tier = MemoryTier(capacity)
    elif kind == "disk":
        tier = DiskTier(path, capacity, clock=clock)
    elif kind.startswith("throttled-"):
        inner = make_tier(kind.removeprefix("throttled-"), path, clock, capacity)
        tier = ThrottledTier(inner, [1000.0], clock=lambda: 0.0, sleep=lambda s: None)
    else:
        raise ValueError(kind)
    tier.clock = clock
    return tier


KINDS = ["memory", "disk", "throttled-memory", "throttled-disk"]


@pytest.fixture(params=KINDS)
def tc(request, tmp_path):
    clock = Clock()
    return make_tier(request.param, tmp_path / "disk", clock), clock


def stat(tier, name):
    return tier.stats.snapshot()[name]


# -- the tier semantics (memory, disk, throttled) ------------------------------------------------


def test_an_entry_lives_until_its_expiry_then_every_read_is_a_miss(tc):
    tier, clock = tc
    a, b, c = Ks("a", "b", "c")
    tier.put(a, b"va", expires_at=T0 + 10)
    tier.put(b, b"vb")  # no expiry
    tier.put_many([(c, b"vc")], expires_at=T0 + 20)
    assert tier.expiries([a, b, c, K("none")]) == [T0 + 10, None, T0 + 20, None]
    clock.advance(9.5)
    assert tier.contains(a) and tier.get(a) == b"va" and stat(tier, "expired") == 0
    clock.advance(0.5)  # exactly the expiry: expired (expires_at <= now)
    assert not tier.contains(a) and stat(tier, "expired") == 1
    # removed once
    assert tier.get(a) is None and tier.expiry(a) is None and stat(tier, "expired") == 1
    clock.advance(100)
    # every read path: a miss, counted as expired, not as an error
    assert tier.get_many([c, b]) == [None, b"vb"]
    assert tier.contains_many([b, c]) == [True, False]
    s = tier.stats.snapshot()
    assert (s["expired"], s["errors"]) == (2, 0)
    assert tier.contains(b) and tier.expiry(b) is None  # no expiry: lives on


@pytest.mark.parametrize("read", ["contains", "get", "get_many", "read_range", "expiry", "extend"])
def test_each_read_of_an_expired_entry_removes_it_and_counts_it(tc, read):
    tier, clock = tc
    k = K("k")
    tier.put(k, b"0123456789", expires_at=T0 + 5)
    assert tier.read_range(k, 2, 5) == b"234"
    clock.advance(5)
    misses = stat(tier, "misses")
    got = {
        "contains": lambda: tier.contains(k),
        "get": lambda: tier.get(k),
        "get_many": lambda: tier.get_many([k])[0],
        "read_range": lambda: tier.read_range(k, 2, 5),
        "expiry": lambda: tier.expiry(k),
        "extend": lambda: tier.extend(k, T0 + 100),
    }[read]()
    assert got in (None, False)
    s = tier.stats.snapshot()
    assert (s["expired"], s["errors"]) == (1, 0)
    assert s["misses"] - misses == (1 if read in ("get", "get_many", "read_range") else 0)
    assert tier.entries() == 0 and tier.expire() == 0  # gone, and nothing left to sweep


@pytest.mark.parametrize(
    "first, second, alive_at_20, expiry_after",
    [
        (T0 + 10, None, True, None),  # a put without expiry replaces the expiry too
        (T0 + 10, T0 + 30, True, T0 + 30),  # a later one
        (T0 + 30, T0 + 10, False, T0 + 10),  # an earlier one (a put replaces, it does not extend)
        (None, T0 + 10, False, T0 + 10),
    ],
)
def test_a_put_replaces_the_value_and_its_expiry(tc, first, second, alive_at_20, expiry_after):
    tier, clock = tc
    k = K("k")
    tier.put(k, b"old", expires_at=first)
    tier.put(k, b"new", expires_at=second)
    assert tier.get(k) == b"new" and tier.expiry(k) == expiry_after
    clock.advance(20)
    assert tier.contains(k) is alive_at_20


@pytest.mark.parametrize("expires_at", [T0, T0 - 1])
def test_a_put_already_expired_stores_nothing_and_removes_the_older_value(tc, expires_at):
    tier, _ = tc
    k, other = K("k"), K("other")
    tier.put(k, b"old")
    tier.put(other, b"x", expires_at=T0 + 1)
    tier.put(k, b"new", expires_at=expires_at)
    tier.put_many([(other, b"y")], expires_at=expires_at)
    assert not tier.contains(k) and tier.get(k) is None and not tier.contains(other)
    assert tier.entries() == 0 and stat(tier, "puts") == 2


@pytest.mark.parametrize(
    "initial, to, result, expiry_after",
    [
        (T0 + 10, T0 + 50, True, T0 + 50),  # an earlier expiry moves to the later time
        (T0 + 50, T0 + 10, True, T0 + 50),  # never shortened
        (T0 + 10, T0 + 10, True, T0 + 10),
        (None, T0 + 50, True, None),  # no expiry: left as it is (it lives longer already)
        ("absent", T0 + 50, False, None),  # not held
    ],
)
def test_extend_keeps_an_entry_at_least_until(tc, initial, to, result, expiry_after):
    tier, clock = tc
    k = K("k")
    if initial != "absent":
        tier.put(k, b"v", expires_at=initial)
    assert tier.extend(k, to) is result
    assert tier.expiry(k) == expiry_after
    assert tier.extend_many([k, K("none")], to) == [result, False]
    clock.advance(30)
    assert tier.contains(k) is (result and (expiry_after is None or expiry_after > T0 + 30))


def test_expire_sweeps_what_is_due_and_counts_it(tc):
    tier, clock = tc
    keys = Ks("a", "b", "c", "d")
    for k, t in zip(keys, [T0 + 1, T0 + 2, T0 + 3, None]):
        tier.put(k, b"v", expires_at=t)
    assert tier.expire() == 0
    clock.advance(2)
    assert tier.expire() == 2 and tier.entries() == 2 and stat(tier, "expired") == 2
    assert tier.expire() == 0 and tier.contains(keys[2])
    clock.advance(100)
    assert tier.expire() == 1 and tier.entries() == 1 and tier.contains(keys[3])
    assert stat(tier, "expired") == 3 and stat(tier, "errors") == 0


def test_delete_drops_the_expiry_with_the_entry(tc):
    tier, clock = tc
    k = K("k")
    tier.put(k, b"v", expires_at=T0 + 10)
    assert tier.delete(k)
    tier.put(k, b"again")  # no expiry now
    clock.advance(20)
    assert tier.expire() == 0 and tier.get(k) == b"again" and stat(tier, "expired") == 0
    tier.put(k, b"v", expires_at=T0 + 30)
    assert tier.delete_many([k, K("none")]) == 1 and tier.expiry(k) is None


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_eviction_drops_the_expiry_bookkeeping(tmp_path, kind):
    clock = Clock()
    tier = make_tier(kind, tmp_path / "disk", clock, capacity=10)
    a, b = Ks("a", "b")
    tier.put(a, b"12345678", expires_at=T0 + 10)
    ino_a = os.stat(file_of(tmp_path / "disk", a)).st_ino if kind == "disk" else None
    tier.put(b, b"12345678")  # evicts a
    assert not tier.contains(a) and stat(tier, "evictions") == 1
    assert len(tier._expiry) == 0  # white box: no record of a left behind
    # and its journal record is cancelled (were the inode reused by a later file)
    if kind == "disk":
        assert parse_journal((tmp_path / "disk" / JOURNAL).read_bytes())[(a, ino_a)] is None
    clock.advance(20)
    assert tier.expire() == 0 and stat(tier, "expired") == 0  # nothing of a is left to sweep
    tier.put(b, b"1234")  # replace b smaller, then a again without expiry
    tier.put(a, b"1234")
    clock.advance(20)
    assert tier.expire() == 0 and tier.contains(a) and stat(tier, "expired") == 0


def test_memory_lru_eviction_ignores_expiries():
    clock = Clock()
    tier = make_tier("memory", None, clock, capacity=12)
    a, b, c = Ks("a", "b", "c")
    tier.put(a, b"1234", expires_at=T0 + 100)
    tier.put(b, b"1234", expires_at=T0 + 1)
    tier.get(a)
    tier.put(c, b"12345")  # evicts the least recently used (b), whatever the expiries
    assert tier.keys_lru() == [a, c]


def test_a_throttled_tier_forwards_the_clock_and_expiries_to_its_inner_tier():
    inner = MemoryTier(10**6)
    clock = Clock()
    inner.clock = clock
    t = ThrottledTier(inner, [1.0], clock=lambda: 0.0, sleep=lambda s: None)
    assert t.clock is clock  # built on a tier with its own clock: kept
    other = Clock(T0 + 500)
    t.clock = other
    assert inner.clock is other
    t.put(K("a"), b"v", expires_at=T0 + 501)
    assert inner.expiry(K("a")) == T0 + 501 and t.expiries([K("a")]) == [T0 + 501]
    other.advance(1)
    assert (
        t.expire() == 1
        and inner.stats.snapshot()["expired"] == 1
        and t.stats.snapshot()["expired"] == 1
    )


# -- the disk tier's journal ---------------------------------------------------------------------


def file_of(root, key):
    found = list(root.rglob(key_to_filename(key)))
    return found[0] if found else None


def journal_lines(root) -> list[str]:
    path = root / JOURNAL
    return path.read_text().splitlines() if path.exists() else []


def test_disk_expiries_survive_a_restart_and_what_expired_meanwhile_is_removed(tmp_path):
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    a, b, c, e, f = Ks("a", "b", "c", "e", "f")
    d.put(a, b"a", expires_at=T0 + 10)
    d.put(b, b"b", expires_at=T0 + 100)
    d.put(c, b"c")  # no expiry
    d.put(e, b"e", expires_at=T0 + 10)
    assert d.extend(e, T0 + 200)
    d.put(f, b"f", expires_at=T0 + 10)
    ino_f = os.stat(file_of(tmp_path, f)).st_ino
    d.put(f, b"f2")  # replaced without expiry: the old one must not come back
    # cancelled (were the inode reused)
    assert parse_journal((tmp_path / JOURNAL).read_bytes())[(f, ino_f)] is None
    clock.advance(50)  # "down" while a expires
    d2 = DiskTier(tmp_path, 10**6, clock=clock)
    assert (
        d2.stats.snapshot()["expired"] == 1
        and file_of(tmp_path, a) is None
        and file_of(tmp_path, b) is not None
    )
    assert [d2.contains(k) for k in (a, b, c, e, f)] == [False, True, True, True, True]
    assert d2.expiries([a, b, c, e, f]) == [None, T0 + 100, None, T0 + 200, None]
    # removed at start-up, not at the read
    assert d2.entries() == 4 and d2.stats.snapshot()["expired"] == 1
    # the journal was rewritten compacted: one line per live expiry
    assert sorted(parse_journal((tmp_path / JOURNAL).read_bytes()).values()) == [T0 + 100, T0 + 200]
    assert len(journal_lines(tmp_path)) == 2
    clock.advance(100)
    d3 = DiskTier(tmp_path, 10**6, clock=clock)
    assert [d3.contains(k) for k in (b, c, e, f)] == [False, True, True, True] and d3.entries() == 3


@pytest.mark.parametrize(
    "remove", ["delete", "delete_many", "delete_prefix", "clear", "expire", "get", "put_over"]
)
def test_every_removal_cancels_the_journal_record_of_that_file(tmp_path, remove):
    """A record left behind could apply to a later file of the key that got the same inode."""
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    k, other = Ks("k", "other")
    d.put(k, b"v", expires_at=T0 + 10)
    d.put(other, b"o", expires_at=T0 + 50)
    ino = os.stat(file_of(tmp_path, k)).st_ino
    if remove in ("expire", "get"):
        clock.advance(10)
    {
        "delete": lambda: d.delete(k),
        "delete_many": lambda: d.delete_many([k]),
        "delete_prefix": lambda: d.delete_prefix(str(k)),
        "clear": d.clear,
        "expire": d.expire,
        "get": lambda: d.get(k),
        "put_over": lambda: d.put(k, b"new"),
    }[remove]()
    records = parse_journal((tmp_path / JOURNAL).read_bytes())
    assert records[(k, ino)] is None
    assert d.expiry(k) is None and (remove == "put_over") == d.contains(k)


def test_a_disk_tier_without_expiries_writes_no_journal(tmp_path):
    d = DiskTier(tmp_path, 10**6)
    d.put(K("a"), b"v")
    d.delete(K("a"))
    d.put(K("b"), b"v")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == []
    DiskTier(tmp_path, 10**6)
    assert not (tmp_path / JOURNAL).exists()


def test_damaged_journal_lines_are_ignored(tmp_path):
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    a, b, c = Ks("a", "b", "c")
    d.put(a, b"a", expires_at=T0 + 10)
    d.put(b, b"b", expires_at=T0 + 10)
    d.put(c, b"c")  # no expiry: each damaged line below would give it one that has passed
    ino_c = os.stat(file_of(tmp_path, c)).st_ino
    good_c = journal_line(c, T0 + 5, ino_c)
    body = f"{c} -inf {ino_c}"
    with open(tmp_path / JOURNAL, "ab") as f:
        f.write(b"garbage\n" + b"x" * 5000 + b"\n" + b"\xff\xfe binary\n" + b"1 2 3 4\n")
        f.write(good_c.replace(str(T0 + 5), str(T0 + 6)).encode())  # the checksum no longer matches
        # well-formed, but not a finite time
        f.write(f"{body} {zlib.crc32(body.encode()):08x}\n".encode())
        f.write(f"v2 {good_c}".encode())  # an unknown (future) form
        f.write(good_c[:-1].encode())  # a torn last line: no newline
    clock.advance(20)
    d2 = DiskTier(tmp_path, 10**6, clock=clock)
    assert [d2.contains(k) for k in (a, b, c)] == [False, False, True]
    assert (
        d2.stats.snapshot()["expired"] == 2
        and d2.expiry(c) is None
        and d2.stats.snapshot()["errors"] == 0
    )
    assert journal_lines(tmp_path) == []  # compacted: nothing live, the damage gone


def test_the_parser_takes_the_last_line_of_each_file_and_rejects_damage():
    a = K("a")
    lines = (
        journal_line(a, 5.0, 7)
        + journal_line(a, 9.0, 7)
        + journal_line(a, None, 8)
        + journal_line(a, 3.0, 8)
    )
    assert parse_journal(lines.encode()) == {(a, 7): 9.0, (a, 8): 3.0}
    assert parse_journal((journal_line(a, 5.0, 7) + journal_line(a, None, 7)).encode()) == {
        (a, 7): None
    }
    torn = journal_line(a, 5.0, 7)[:-1]
    assert parse_journal(torn.encode()) == {}  # no newline: not trusted
    flipped = journal_line(a, 5.0, 7).replace("5.0", "6.0")
    assert parse_journal(flipped.encode()) == {}


def test_the_journal_is_compacted_when_stale_lines_exceed_twice_the_live_ones(tmp_path):
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    d.journal_compact_min = 4
    a, b = Ks("a", "b")
    d.put(a, b"a", expires_at=T0 + 1)
    d.put(b, b"b", expires_at=T0 + 1)
    counts = []
    for i in range(2, 40):
        assert d.extend(a, T0 + i)
        counts.append(len(journal_lines(tmp_path)))
    assert max(counts) <= 2 + 4 + 2  # 2 live, compacted past max(4, 2 * live) stale lines
    assert counts[-1] < 39 and min(counts) == 2
    assert (
        parse_journal((tmp_path / JOURNAL).read_bytes())[(a, os.stat(file_of(tmp_path, a)).st_ino)]
        == T0 + 39
    )
    # compaction keeps every live record: a restart knows both
    d2 = DiskTier(tmp_path, 10**6, clock=clock)
    assert d2.expiries([a, b]) == [T0 + 39, T0 + 1]
    # deletes, evictions and expiries write removal lines, compacted too
    for i in range(30):
        d.put(K(f"x{i}"), b"x", expires_at=T0 + 100)
        d.delete(K(f"x{i}"))
    assert len(journal_lines(tmp_path)) < 20
    assert d.expiries([a, b]) == [T0 + 39, T0 + 1]


def test_a_put_whose_expiry_cannot_be_recorded_is_dropped(tmp_path):
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    d.put(K("a"), b"old")
    (tmp_path / JOURNAL).mkdir()  # the journal cannot be opened for appending
    d.put(K("a"), b"new", expires_at=T0 + 10)
    s = d.stats.snapshot()
    assert (s["errors"], s["dropped_writes"]) == (1, 1)
    assert d.get(K("a")) == b"old" and d.expiry(K("a")) is None  # the write failed as a whole
    assert not list(tmp_path.rglob("*.tmp"))
    d.put(K("b"), b"fine")  # writes without expiry need no journal
    assert d.get(K("b")) == b"fine"


def test_several_tiers_on_one_folder_follow_the_multi_process_rule(tmp_path):
    """Two DiskTiers on one folder stand for two processes (each its own map and lock descriptor)."""
    clock = Clock()
    early = DiskTier(tmp_path, 10**6, clock=clock)  # started before anything had an expiry
    writer = DiskTier(tmp_path, 10**6, clock=clock)
    a, b = Ks("a", "b")
    writer.put(a, b"a", expires_at=T0 + 10)
    writer.put(b, b"b", expires_at=T0 + 10)
    assert early.expiry(a) is None  # it learns other processes' expiries at its start-up
    late = DiskTier(tmp_path, 10**6, clock=clock)
    assert late.expiry(a) == T0 + 10
    clock.advance(10)
    assert early.contains(a)  # not known there: not enforced
    assert not writer.contains(a) and not early.contains(a)  # the writer enforces it, for everyone
    # another process puts b again without expiry: the old expiry (of the old file) no longer applies
    early.put(b, b"b2")
    assert writer.get(b) == b"b2" and late.get(b) == b"b2" and writer.expiry(b) is None
    assert writer.expire() == 0 and late.expire() == 0 and early.get(b) == b"b2"
    assert DiskTier(tmp_path, 10**6, clock=clock).get(b) == b"b2"


def test_journal_appends_from_threads_and_tiers_are_not_lost(tmp_path):
    clock = Clock()
    tiers = [DiskTier(tmp_path, 10**8, clock=clock) for _ in range(3)]
    for t in tiers:
        t.journal_compact_min = 8  # compactions interleave with the others' appends

    def work(t, n):
        for i in range(40):
            k = K(f"{n}-{i}")
            t.put(k, b"v", expires_at=T0 + 1000 + i)
            t.extend(k, T0 + 2000 + i)
            if i % 3 == 0:
                t.delete(k)

    threads = [threading.Thread(target=work, args=(t, n)) for n, t in enumerate(tiers * 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    fresh = DiskTier(tmp_path, 10**8, clock=clock)
    for n in range(6):
        for i in range(40):
            want = None if i % 3 == 0 else T0 + 2000 + i
            assert fresh.expiry(K(f"{n}-{i}")) == want, (n, i)


_CHILD = """
import sys
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers import DiskTier
d = DiskTier(sys.argv[1], 10**6, clock=lambda: float(sys.argv[2]))
d.put(ChunkKey.parse(sys.argv[3]), b"child", expires_at=float(sys.argv[2]) + 10)
d.put(ChunkKey.parse(sys.argv[4]), b"child, no expiry")
"""


def test_another_process_appends_to_the_same_journal(tmp_path):
    clock = Clock()
    d = DiskTier(tmp_path, 10**6, clock=clock)
    mine, theirs, replaced = Ks("mine", "theirs", "replaced")
    d.put(mine, b"m", expires_at=T0 + 10)
    d.put(replaced, b"r", expires_at=T0 + 10)
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), repr(T0), str(theirs), str(replaced)],
        env={**os.environ, "PYTHONPATH": str(root)},
        check=True,
        timeout=120,
    )
    assert d.expiries([mine, theirs, replaced]) == [
        T0 + 10,
        None,
        None,
    ]  # theirs: not known here until...
    fresh = DiskTier(tmp_path, 10**6, clock=clock)  # ... a start-up
    assert fresh.expiries([mine, theirs, replaced]) == [T0 + 10, T0 + 10, None]
    clock.advance(10)
    fresh2 = DiskTier(tmp_path, 10**6, clock=clock)
    assert [fresh2.contains(k) for k in (mine, theirs, replaced)] == [False, False, True]
    assert fresh2.get(replaced) == b"child, no expiry" and fresh2.stats.snapshot()["expired"] == 2


# -- the store ------------------------------------------------------------------------------------

KEYS = [K(f"{i:02d}") for i in range(6)]


def blob(key, seed: int = 0) -> bytes:
    kv = torch.randn((2, 2, 4, 2, 8), generator=torch.Generator().manual_seed(seed)).half()
    return encode_chunk(KVChunk(kv, torch.arange(4)), key, get_codec("raw"))


def entry(key, seed: int = 0):
    kv = torch.randn((2, 2, 16, 2, 8), generator=torch.Generator().manual_seed(seed)).half()
    return encode_entry(KVChunk(kv, torch.arange(16)), key, get_codec("raw"))


class Recording(MemoryTier):
    """A lower tier recording each ``put_many`` (keys, expiry), optionally held at a gate or running
    a hook first."""

    def __init__(self, name: str) -> None:
        super().__init__(10**9, name=name)
        self.calls: list[tuple[list, float | None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.hook = None

    def put_many(self, items, expires_at=None):
        items = list(items)
        self.calls.append(([k for k, _ in items], expires_at))
        self.entered.set()
        self.gate.wait(timeout=10)
        if self.hook is not None:
            self.hook()
        super().put_many(items, expires_at)


@pytest.fixture
def three(tmp_path):
    clock = Clock()
    mem, disk, remote = (
        MemoryTier(10**6),
        DiskTier(tmp_path, 10**6),
        MemoryTier(10**6, name="remote"),
    )
    store = TieredStore(mem, [disk, remote], clock=clock)
    yield store, mem, disk, remote, clock
    store.close()


def test_the_store_sets_its_clock_on_every_tier(tmp_path):
    clock = Clock()
    inner = MemoryTier(10, name="slow")
    slow = ThrottledTier(inner, [1.0], clock=lambda: 0.0, sleep=lambda s: None)
    mem, disk = MemoryTier(10), DiskTier(tmp_path, 10)
    with TieredStore(mem, [disk, slow], clock=clock) as store:
        assert (
            mem.clock is clock
            and disk.clock is clock
            and inner.clock is clock
            and store.clock is clock
        )
    plain = MemoryTier(10)
    with TieredStore(plain) as store:
        # time.time by default
        assert abs(plain.clock() - store.clock()) < 5 and plain.clock() > 1e9
    with pytest.raises(ValueError, match="expire_interval_s"):
        TieredStore(MemoryTier(1), expire_interval_s=-1)


def test_a_put_with_an_expiry_reaches_every_tier(three):
    store, mem, disk, remote, clock = three
    store.put([(k, blob(k)) for k in KEYS[:2]], expires_at=T0 + 10)
    store.put([(KEYS[2], blob(KEYS[2]))])
    store.flush()
    for t in (mem, disk, remote):
        assert t.expiries(KEYS[:3]) == [T0 + 10, T0 + 10, None], t.name
    clock.advance(10)
    assert store.lookup(KEYS[:3]).where == (None, None, "memory")
    assert store.get(KEYS[:3])[:2] == [None, None]


def test_memory_only_writes_the_first_tier_only(three):
    store, mem, disk, remote, clock = three
    store.put([(KEYS[0], blob(KEYS[0]))], memory_only=True, expires_at=T0 + 10)
    store.put([(KEYS[1], blob(KEYS[1]))], memory_only=True)
    store.flush()
    assert mem.expiries(KEYS[:2]) == [T0 + 10, None]
    assert (
        not disk.contains(KEYS[0]) and not remote.contains(KEYS[0]) and not disk.contains(KEYS[1])
    )
    assert store.stats()["store"]["queued_writes"] == 0 and disk.stats.snapshot()["puts"] == 0


def test_the_writer_groups_a_batch_by_expiry():
    clock = Clock()
    mem, low = MemoryTier(10**6), Recording("low")
    with TieredStore(mem, [low], clock=clock, write_batch=16) as store:
        low.gate.clear()
        store.put([(KEYS[5], blob(KEYS[5]))])  # the writer takes it and waits at the gate
        assert low.entered.wait(5)
        store.put([(KEYS[0], blob(KEYS[0]))], expires_at=T0 + 10)
        store.put([(KEYS[1], blob(KEYS[1]))], expires_at=T0 + 20)
        store.put([(KEYS[2], blob(KEYS[2])), (KEYS[3], blob(KEYS[3]))], expires_at=T0 + 10)
        store.put([(KEYS[4], blob(KEYS[4]))])
        low.gate.set()
        assert store.flush(5)
        assert low.calls[0] == ([KEYS[5]], None)
        assert sorted(low.calls[1:], key=lambda c: c[1] or 0) == [
            ([KEYS[4]], None),
            ([KEYS[0], KEYS[2], KEYS[3]], T0 + 10),
            ([KEYS[1]], T0 + 20),
        ]
        assert low.expiries(KEYS[:5]) == [T0 + 10, T0 + 20, T0 + 10, T0 + 10, None]


def test_variants_get_the_expiry_of_their_chunk(tmp_path):
    clock = Clock()
    disk = DiskTier(tmp_path, 1 << 30)
    with TieredStore(
        MemoryTier(1 << 30),
        [disk],
        codecs={"disk": get_codec("cachegen", 2)},
        stream_levels=(1, 2),
        clock=clock,
    ) as store:
        k = KEYS[0]
        v1 = k.encoded_as("cachegen", 1)
        store.put([(k, entry(k))], expires_at=T0 + 10)
        store.flush()
        assert read_header(disk.get(k)).level == 2 and disk.contains(v1)
        assert disk.expiries([k, v1]) == [T0 + 10, T0 + 10]
        store.extend([k], T0 + 40)
        assert disk.expiries([k, v1]) == [T0 + 40, T0 + 40] and store.memory.expiry(k) == T0 + 40
        clock.advance(40)
        assert store.expire() == {"memory": 1, "disk": 2} and disk.entries() == 0


def test_a_promotion_keeps_the_expiry_of_the_tier_it_came_from(three):
    store, mem, disk, remote, clock = three
    disk.put(KEYS[0], blob(KEYS[0]), expires_at=T0 + 10)
    remote.put(KEYS[1], blob(KEYS[1]), expires_at=T0 + 20)
    disk.put(KEYS[2], blob(KEYS[2]))
    disk.put(KEYS[3], blob(KEYS[3]), expires_at=T0 + 1)
    clock.advance(1)  # KEYS[3] expired below: neither served nor promoted
    got = store.fetch(KEYS[:4])
    assert [f.tier for f in got] == ["disk", "remote", "disk", None]
    assert mem.expiries(KEYS[:4]) == [T0 + 10, T0 + 20, None, None] and not mem.contains(KEYS[3])
    assert store.stats()["store"]["promotions"] == 3
    clock.advance(10)
    assert store.lookup(KEYS[:3]).where == (None, "memory", "memory")


def test_promote_looks_the_expiry_up_below_and_skips_what_is_gone(tmp_path):
    clock = Clock()
    mem, disk, remote = (
        MemoryTier(10**6),
        DiskTier(tmp_path, 10**6),
        MemoryTier(10**6, name="remote"),
    )
    with TieredStore(mem, [disk, remote], clock=clock, stream_levels=(1,)) as store:
        a, b, c, d, e = KEYS[:5]
        disk.put(a, blob(a), expires_at=T0 + 10)
        remote.put(a, blob(a), expires_at=T0 + 99)  # the first tier holding it rules
        remote.put(b, blob(b), expires_at=T0 + 20)
        disk.put(c, blob(c))
        # primary evicted
        remote.put(d.encoded_as("cachegen", 1), b"variant only", expires_at=T0 + 30)
        store.promote([(k, entry(k)) for k in (a, b, c, d, e)])  # e: gone from every lower tier
        assert mem.expiries([a, b, c, d]) == [T0 + 10, T0 + 20, None, T0 + 30]
        assert [mem.contains(k) for k in (a, b, c, d, e)] == [True, True, True, True, False]
        assert store.stats()["store"]["promotions"] == 4
    with TieredStore(MemoryTier(10**6), clock=clock) as single:
        single.promote([(a, entry(a))])  # no lower tier to ask: put as it is
        assert single.memory.contains(a) and single.memory.expiry(a) is None


def test_extend_reaches_every_tier_and_never_shortens(three):
    store, mem, disk, remote, clock = three
    store.put([(k, blob(k)) for k in KEYS[:2]], expires_at=T0 + 10)
    store.put([(KEYS[2], blob(KEYS[2]))])
    store.flush()
    store.extend(KEYS[:3], T0 + 50)
    store.extend(KEYS[:1], T0 + 20)
    for t in (mem, disk, remote):
        assert t.expiries(KEYS[:3]) == [T0 + 50, T0 + 50, None], t.name
    clock.advance(30)
    assert store.lookup(KEYS[:3]).hits == 3


def test_a_queued_write_gets_an_extension_asked_while_it_waits():
    clock = Clock()
    mem, low = MemoryTier(10**6), Recording("low")
    with TieredStore(mem, [low], clock=clock) as store:
        low.gate.clear()
        store.put([(KEYS[0], blob(KEYS[0]))], expires_at=T0 + 10)
        assert low.entered.wait(5)  # being written: the time is taken, the write not done yet
        store.put([(KEYS[1], blob(KEYS[1]))], expires_at=T0 + 10)  # still in the queue
        store.put([(KEYS[2], blob(KEYS[2]))])  # no expiry: an extension leaves it alone
        store.extend(KEYS[:3], T0 + 60)
        low.gate.set()
        assert store.flush(5)
        assert low.expiries(KEYS[:3]) == [T0 + 60, T0 + 60, None] and mem.expiries(KEYS[:3]) == [
            T0 + 60
        ] * 2 + [None]
        # the queued write was made with the later time (KEYS[0] was past that point: extended after)
        assert sorted(low.calls[1:], key=lambda c: c[1] or 0) == [
            ([KEYS[2]], None),
            ([KEYS[1]], T0 + 60),
        ]
        # bookkeeping gone with the writes
        lane = store._writer._lanes[0]
        assert not lane.queued and not lane.extended and not store.writing(KEYS[:3])


def test_an_extension_racing_the_write_is_applied_after_it():
    clock = Clock()
    mem, low = MemoryTier(10**6), Recording("low")
    with TieredStore(mem, [low], clock=clock) as store:
        low.hook = lambda: (store.extend([KEYS[0]], T0 + 60), low.hook_done.set())
        low.hook_done = threading.Event()
        store.put([(KEYS[0], blob(KEYS[0]))], expires_at=T0 + 10)
        assert store.flush(5) and low.hook_done.is_set()
        # written with its own time, the extension came later
        assert low.calls == [([KEYS[0]], T0 + 10)]
        assert low.expiry(KEYS[0]) == T0 + 60 and mem.expiry(KEYS[0]) == T0 + 60


def test_lookup_sweeps_every_tier_at_most_once_per_interval(tmp_path):
    clock = Clock()
    mem, disk = MemoryTier(10**6), DiskTier(tmp_path, 10**6)
    with TieredStore(mem, [disk], clock=clock, expire_interval_s=1.0) as store:
        a, b, c = KEYS[:3]
        store.put([(a, blob(a))], expires_at=T0 + 0.5)
        store.put([(b, blob(b))])
        store.flush()
        clock.advance(0.75)
        store.lookup([b])  # within the first interval: no sweep (and a is not looked at)
        assert mem.entries() == 2 and disk.entries() == 2
        clock.advance(0.25)
        store.lookup([b])  # T0 + 1: a sweep
        assert mem.entries() == 1 and disk.entries() == 1
        s = store.stats()
        assert (s["memory"]["expired"], s["disk"]["expired"]) == (1, 1)
        store.put([(c, blob(c))], expires_at=T0 + 1.25)
        store.flush()
        clock.advance(0.5)
        store.lookup([b])  # T0 + 1.5: c has expired, but the next sweep is at T0 + 2
        assert mem.entries() == 2 and disk.entries() == 2
        clock.advance(0.5)
        assert store.lookup([b]).hits == 1
        assert mem.entries() == 1 and disk.entries() == 1
        assert store.stats()["memory"]["expired"] == 2 and store.stats()["disk"]["expired"] == 2


def test_expire_sweeps_every_tier_now(three):
    store, mem, disk, remote, clock = three
    store.put([(k, blob(k)) for k in KEYS[:3]], expires_at=T0 + 5)
    store.put([(KEYS[3], blob(KEYS[3]))])
    store.flush()
    assert store.expire() == {"memory": 0, "disk": 0, "remote": 0}
    clock.advance(5)
    assert store.expire() == {"memory": 3, "disk": 3, "remote": 3}
    assert {name: s["expired"] for name, s in store.stats().items() if name != "store"} == {
        "memory": 3,
        "disk": 3,
        "remote": 3,
    }
    assert store.lookup(KEYS[:4]).where == (None, None, None, "memory")


def test_delete_removes_keys_and_their_variants_everywhere(tmp_path):
    clock = Clock()
    mem, disk = MemoryTier(1 << 30), DiskTier(tmp_path, 1 << 30)
    remote = MemoryTier(1 << 30, name="remote")
    with TieredStore(mem, [disk, remote], clock=clock, stream_levels=(1, 3)) as store:
        keys = KEYS[:2]
        store.put([(k, entry(k)) for k in keys])
        store.put([(KEYS[2], entry(KEYS[2]))])
        # no flush: delete waits for the queued writes, so nothing lands after it
        assert store.delete(keys + [KEYS[4]]) == {"memory": 2, "disk": 6, "remote": 6}
        assert store.lookup(keys).where == (None, None)
        assert not any(
            t.contains(k.encoded_as("cachegen", lv))
            for t in (disk, remote)
            for k in keys
            for lv in (1, 3)
        )
        assert disk.entries() == 3 and remote.entries() == 3 and mem.contains(KEYS[2])
