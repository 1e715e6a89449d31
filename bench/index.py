"""The tiers' in-memory indexes at scale: bytes per entry, batched lookups per second, and the disk
tier's start-up index rebuild.

    python bench/index.py [--entries 1000000] [--files 100000] [--repeats 5]

- Memory per entry: the growth of Python's allocations (tracemalloc) when a MemoryTier / the disk
  tier's index (``DiskTier._index``, a ``KeyIndex``: key -> size, LRU order) holds ``--entries``
  keys, values excluded (one tiny shared value), divided by the entries; and the index of a real
  DiskTier after its start-up scan (``KeyIndex.nbytes``).
- Lookups: ``TieredStore.lookup`` of batches of 64 keys (a 16k-token prompt's chain), memory tier
  only (the disk tier asks the file system for every key: its rate is the file system's, measured
  separately with ``--files`` real files).
- Rebuild: a ``DiskTier`` opened on a folder of ``--files`` entry files (created once, 1 byte each).

Targets (issue 15): <= 100 bytes per entry, >= 1M key lookups per second in batches, a 1M-entry
disk rebuild in seconds. Writes docs/bench/index.json; prints a table.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.lib.cli import parser
from bench.lib.results import environment, print_table, write_json
from bench.lib.rounds import spread
from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.key_index import KeyIndex

NS = "0123456789abcdef01234567"


def keys(n: int, seed: int = 0) -> list[ChunkKey]:
    rng = __import__("random").Random(seed)
    return [ChunkKey(NS, rng.randbytes(32), ChunkKind.PREFIX) for _ in range(n)]


def bytes_per_entry(make, n: int) -> float:
    """Allocation growth per entry of making ``n`` keys and filling the index ``make(keys)``
    returns: the keys are counted, since an index has to hold them."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = make(keys(n, seed=7))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    return used / n


def memory_tier(ks):
    t = MemoryTier(1 << 62)
    value = b"x"
    for k in ks:
        t.put(k, value)
    return t


def disk_index(ks):
    index = KeyIndex()  # exactly DiskTier._index: key -> size, least recent first
    for i, k in enumerate(ks):
        index.put(k, 6 * 1024 * 1024 + i)
    return index


def lookups_per_s(ks: list[ChunkKey], batch: int = 64, seconds: float = 2.0) -> float:
    store = TieredStore(memory_tier(ks))
    n, t0 = 0, time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        store.lookup(ks[i : i + batch], count=False)
        n += batch
        i = (i + batch) % (len(ks) - batch)
    rate = n / (time.perf_counter() - t0)
    store.close()
    return rate


def disk_files(folder: Path, n: int) -> list[ChunkKey]:
    ks = keys(n, seed=1)
    tier = DiskTier(folder, 1 << 62)
    if tier.entries() < n:
        for k in ks:
            tier.put(k, b"x")
    tier.close()
    return ks


def rebuild_s(folder: Path) -> tuple[float, float]:
    """Seconds to open a DiskTier on ``folder`` (its scan), and its index's bytes per entry."""
    t0 = time.perf_counter()
    tier = DiskTier(folder, 1 << 62)
    dt = time.perf_counter() - t0
    per_entry = tier._index.nbytes() / max(1, tier.entries())
    tier.close()
    return dt, per_entry


def disk_contains_per_s(folder: Path, ks: list[ChunkKey], seconds: float = 2.0) -> float:
    tier = DiskTier(folder, 1 << 62)
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        tier.contains_many(ks[i : i + 64])
        n += 64
        i = (i + 64) % (len(ks) - 64)
    return n / (time.perf_counter() - t0)


def measure(args) -> dict:
    """Bytes per entry (memory tier, disk index, disk index after a scan), then ``--repeats``
    lookups/s, disk rebuilds and disk contains/s, each measure repeated back to back."""
    ks = keys(args.entries)
    m = {
        "mem": bytes_per_entry(memory_tier, args.entries),
        "disk": bytes_per_entry(disk_index, args.entries),
        "rates": [lookups_per_s(ks) for _ in range(args.repeats)],
    }
    tmp = None if args.folder else tempfile.TemporaryDirectory(prefix="kvfuse-index-")
    folder = Path(args.folder or tmp.name)
    fk = disk_files(folder, args.files)
    scans = [rebuild_s(folder) for _ in range(args.repeats)]
    m["rebuilds"] = [dt for dt, _ in scans]
    m["scanned"] = scans[-1][1]
    m["contains"] = [disk_contains_per_s(folder, fk) for _ in range(args.repeats)]
    if tmp is not None:
        tmp.cleanup()
    return m


def rows(args, m: dict) -> list[list]:
    files, rebuilds = args.files, m["rebuilds"]
    return [
        ["memory tier: bytes/entry", f"{m['mem']:.0f}", "", "", "<= 100"],
        ["disk index: bytes/entry", f"{m['disk']:.0f}", "", "", "<= 100"],
        [
            f"disk index after a scan of {files:,} files: bytes/entry",
            f"{m['scanned']:.0f}",
            "",
            "",
            "<= 100",
        ],
        [
            "lookups/s (memory, batches of 64)",
            *(f"{v:,.0f}" for v in spread(m["rates"]).values()),
            ">= 1,000,000",
        ],
        [
            "disk contains/s (batches of 64)",
            *(f"{v:,.0f}" for v in spread(m["contains"]).values()),
            "",
        ],
        [
            f"disk rebuild, {files:,} files (s)",
            *(f"{v:.2f}" for v in spread(rebuilds).values()),
            "",
        ],
        [
            "  = per 1M files (s)",
            *(f"{v * 1e6 / files:.1f}" for v in spread(rebuilds).values()),
            "seconds",
        ],
    ]


def main() -> None:
    ap = parser(__doc__.splitlines()[0], ("repeats", {"help": "repetitions of each measure"}))
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument(
        "--folder", help="where the disk tier's files go (default: a temp folder, removed)"
    )
    args = ap.parse_args()
    m = measure(args)
    result = {
        "environment": {**environment(), "load_average_1m": os.getloadavg()[0]},
        "entries": args.entries,
        "files": args.files,
        "repeats": args.repeats,
        "memory_tier_bytes_per_entry": m["mem"],
        "disk_index_bytes_per_entry": m["disk"],
        "disk_index_after_scan_bytes_per_entry": m["scanned"],
        "memory_lookups_per_s": spread(m["rates"]),
        "disk_contains_per_s": spread(m["contains"]),
        "disk_rebuild_s": spread(m["rebuilds"]),
        "disk_rebuild_s_per_million": spread([r * 1e6 / args.files for r in m["rebuilds"]]),
        "targets": {"bytes_per_entry": 100, "lookups_per_s": 1e6},
    }
    print_table(["measure", "median", "min", "max", "target"], rows(args, m))
    print(f"wrote {write_json('index', result)}")


if __name__ == "__main__":
    os.environ.setdefault(
        "KVFUSE_HOME", str(Path(__file__).resolve().parent.parent / ".kvfuse-home")
    )
    main()
