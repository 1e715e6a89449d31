"""The disk tier: one file per entry, atomic writes, LRU by bytes, shareable between processes.

Its pieces: ``files.py`` (where an entry's file lives, staged writes renamed into place,
reads, stale temp files, listings), ``scan.py`` (the start-up scan that rebuilds the LRU
index), ``expiry.py`` with ``journal.py`` (per-entry expiries and their journal,
``<root>/expiry.log``). This module is the tier itself: its index, capacity and evictions (which
entries go is the eviction policy's, ``tiers/eviction.py``), and the ``Tier`` operations over those
pieces.

A file's mtime is its recency (set on every put and hit), so a restart rebuilds the LRU order by
scanning. The tier does not check what it reads: the tiered store validates every entry and
discards a damaged one through ``delete``. ``read_with`` hands a file to the store's check as it is
read (a few layers at a time, each checked while still in the CPU cache: ``kv.format.read_entry``).
A fan-out folder (or file) it may not read is an operational failure like any other: the start-up
scan and ``delete_prefix`` log it, count an error and go on with the other folders (its entries
are misses until its permissions are fixed).

Several processes may share one directory. Each keeps its own index (for LRU and capacity); the
file system is the truth: ``contains``/``get`` consult it directly, a file another process wrote
is found, a file another process evicted is a plain miss. The capacity is enforced by each process
over the files it knows, so a shared directory can briefly exceed it. Expiries follow the rules of
``expiry.py`` (each process enforces the expiries it knows).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from kvfuse.kv.keys import ChunkKey
from kvfuse.private import make_dirs
from kvfuse.threads import helper_pool
from kvfuse.tiers.base import Blob, Clock, Entry, IndexedTier, T, nbytes
from kvfuse.tiers.disk import files
from kvfuse.tiers.disk.expiry import DiskExpiries
from kvfuse.tiers.disk.scan import Scan, scan
from kvfuse.tiers.eviction import Quotas

log = logging.getLogger(__name__)


class DiskTier(IndexedTier):
    """Entries as files under ``path``; see the module docstring for layout and sharing rules.

    ``fsync=True`` makes each put durable before it returns (slower). Temp files left by dead
    processes, or older than ``stale_temp_s``, are removed at start-up, and so are the entries
    whose expiry passed on ``clock`` (the journal, see ``expiry.py``; ``clock`` defaults to
    ``time.time`` and can be replaced later, as ``TieredStore`` does, but the start-up sweep has
    run by then). ``io_threads``: how many files of one ``put_many`` (the store's background
    writes) are written at once (default: one per core, at most 4; 1: one by one). ``quotas``:
    per-tenant byte quotas (``kvfuse.store.tenant_quota``), enforced by each process over the files
    it knows, like the capacity.
    """

    streams_reads = True  # read_with reads the file as the store's check asks for it
    reports_puts = True  # _commit and _forget_locked tell the observer (events)

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        fsync: bool = False,
        name: str = "disk",
        stale_temp_s: float = 600.0,
        clock: Clock | None = None,
        io_threads: int | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        super().__init__(capacity_bytes, quotas)  # the index of what it holds, within capacity
        if clock is not None:
            self.clock = clock  # given here, it is the start-up sweep's time too
        self.name = name
        self.root = Path(path)
        self.fsync = fsync
        self._last_ns = 0
        self._expiry = DiskExpiries(
            self.root,
            fsync,
            self._lock,
            self.stats,
            self._path,
            lambda: self.clock(),
            self._forget_locked,
        )
        # Threads writing the files of one put_many (None: one per core, <= 4).
        self.io_threads = min(4, os.cpu_count() or 1) if io_threads is None else int(io_threads)
        self._pool: ThreadPoolExecutor | None = None
        make_dirs(self.root)  # 0700 where made (kvfuse.private)
        self._load(scan(self.root, stale_temp_s, time.time()))

    @property
    def journal_compact_min(self) -> int:
        """Compact the expiry journal once it has at least this many stale lines."""
        return self._expiry.compact_min

    @journal_compact_min.setter
    def journal_compact_min(self, n: int) -> None:
        self._expiry.compact_min = n

    # -- paths and bookkeeping ------------------------------------------------------------------

    def _path(self, key: ChunkKey) -> str:
        return files.entry_path(self.root, key)

    def _now_ns(self) -> int:
        # Strictly increasing within the process: coarse file-system clocks would otherwise give
        # equal mtimes to quick successive writes and lose their order at the next restart.
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _load(self, found: Scan) -> None:
        """Fill the index from the start-up scan, least recent first; the journal's expiries are
        learnt (and the files whose expiry passed deleted) first."""
        self.stats.add(errors=found.unreadable)
        keep = found.lru_order()
        with self._lock:
            if self._expiry.journal.exists():
                gone = self._expiry.compact_locked(found.inodes())
                if gone:
                    keep = np.array(
                        [i for i in keep.tolist() if found.key(i) not in gone], dtype=np.intp
                    )
            sizes = found.sizes[keep]
            self._index.load(
                found.groups, found.group_of[keep], found.digests[keep].tobytes(), sizes
            )
            self._used = int(sizes.sum())
            evicted = self._evict_locked()
        self.stats.add(evictions=evicted)

    def _forget_locked(self, key: ChunkKey) -> None:
        old = self._index.pop(key)
        if old is not None:
            self._used -= old[0]
            self._gone(key)

    def _record_locked(self, key: ChunkKey, size: int) -> None:
        old = self._index.put(key, size)
        self._used += size - (old or 0)

    def _evict_locked(self, key: ChunkKey | None = None) -> int:
        """Remove the entries the eviction policy names, least recent first, each with its file:
        after ``key`` was written or used (never it), or after the start-up scan (``key`` None:
        every tenant over its quota, then the capacity). The count removed."""
        evicted, lines = 0, []
        for victim in self._victims_locked(key):
            self._evict_one_locked(victim.key, lines)
            evicted += 1
        self._expiry.settle_locked(lines)
        return evicted

    def _evict_one_locked(self, key: ChunkKey, lines: list) -> None:
        """Remove ``key``'s entry and its file."""
        size, _ = self._index.pop(key)
        self._used -= size
        self._gone(key)
        line = self._expiry.drop_locked(key)
        if line is not None:
            lines.append(line)
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass  # another process evicted it first
        except OSError as e:
            log.warning("disk tier %s: cannot evict %s: %s", self.root, key, e)
            self.stats.add(errors=1)

    def _touch(self, path: str, key: ChunkKey, size: int) -> None:
        """Make ``key`` the most recent entry, in the index and in the file's mtime."""
        t = self._now_ns()
        try:
            os.utime(path, ns=(t, t))  # the file's mtime is its recency across restarts
        except OSError:
            pass  # replaced or evicted meanwhile: the data we read is still valid
        with self._lock:
            self._record_locked(key, size)
            evicted = self._evict_locked(key)
        self.stats.add(evictions=evicted)

    def _missing(self, key: ChunkKey) -> None:
        with self._lock:
            self._forget_locked(key)
        self.stats.add(misses=1)

    # -- reads ----------------------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        # Always ask the file system (one stat): another process may have added or evicted it.
        st = self._stat(key)
        if st is None:
            return False
        if self._expiry and self._expiry.expired(key, st.st_ino):
            self._expiry.drop_expired(key, st.st_ino)
            return False
        return True

    def _stat(self, key: ChunkKey) -> os.stat_result | None:
        """The entry file's stat, or None: a missing file is forgotten from the index, another
        failure logged and counted as an error."""
        try:
            return os.stat(self._path(key))
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            return None
        except OSError as e:
            log.warning("disk tier %s: stat %s failed: %s", self.root, key, e)
            self.stats.add(errors=1)
            return None

    def _read_file(
        self, key: ChunkKey, read: Callable[[int, int], T], touch: bool = True
    ) -> T | None:
        """``read(fd, size)`` over ``key``'s open file, counted as a hit and, with ``touch``, as the
        entry's use (its recency); None for a missing or expired entry or an I/O error (each
        counted). Anything else ``read`` raises propagates, the entry's recency left as it was
        (the store un-counts the hit of an entry it rejects)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._missing(key)
            return None
        except OSError as e:
            log.warning("disk tier %s: open %s failed: %s", self.root, key, e)
            self.stats.add(misses=1, errors=1)
            return None
        counted = expired_ino = None
        try:
            st = os.fstat(fd)
            if self._expiry and self._expiry.expired(key, st.st_ino):
                expired_ino = st.st_ino  # nothing to read
            else:
                self.stats.add(hits=1)
                counted = True
                result = read(fd, st.st_size)
        except OSError as e:
            log.warning("disk tier %s: read %s failed: %s", self.root, key, e)
            self.stats.add(hits=-1 if counted else 0, misses=1, errors=1)
            return None
        finally:
            os.close(fd)
        if expired_ino is not None:
            self._expiry.drop_expired(key, expired_ino)
            self.stats.add(misses=1)
            return None
        if touch:
            self._touch(path, key, st.st_size)
        return result

    def get(self, key: ChunkKey) -> Blob | None:
        def read(fd: int, size: int) -> memoryview:
            buf = files.read_all(fd, size)  # writable: the raw codec decodes it without a copy
            self.stats.add(bytes_out=len(buf))
            return buf

        return self._read_file(key, read)

    def read_with(self, key: ChunkKey, reader):
        # The file is read as the reader asks (the store checks each piece while it is in cache).
        def read(fd: int, size: int):
            self.stats.add(bytes_out=size)
            return reader(lambda view: os.readv(fd, [view]), size)

        return self._read_file(key, read)

    def read_range(self, key: ChunkKey, start: int, stop: int) -> memoryview | None:
        def read(fd: int, size: int) -> memoryview:
            buf = files.read_at(fd, start, stop, size)
            self.stats.add(bytes_out=len(buf))
            return buf

        return self._read_file(key, read, touch=start == 0)  # the first read of an entry is its use

    # -- writes ---------------------------------------------------------------------------------

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        staged = self._stage(key, value, expires_at)
        if staged is not None:
            self._commit(*staged)

    def put_many(self, items, expires_at: float | None = None) -> None:
        # The files of a batch are written by a few threads at once (writes release the GIL), then
        # renamed into place and recorded in the batch's order (their recency, a duplicate key's
        # last value), as one-by-one puts would.
        items = list(items)
        if len(items) < 2 or self.io_threads < 2:
            for key, value in items:
                self.put(key, value, expires_at)
            return
        staged = list(self._io_pool().map(lambda kv: self._stage(kv[0], kv[1], expires_at), items))
        for s in staged:
            if s is not None:
                self._commit(*s)

    def _io_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = helper_pool(self.io_threads, f"kvfuse-{self.name}-io")
            return self._pool

    def _stage(self, key: ChunkKey, value: Blob, expires_at: float | None):
        """Write ``value`` into a new temp file beside ``key``'s path: (key, path, temp path, size,
        inode, expires_at) for ``_commit``, or None when nothing is to be stored (counted)."""
        path = self._path(key)
        if self._expired_at(expires_at):
            self.delete(key)  # stores nothing, and no older value stays behind
            return None
        size = nbytes(value)
        with self._lock:
            room = self._room_locked(key)
        if size > room:  # larger than the tier, or than its tenant's quota
            self.delete(key)  # never leave an older value behind a dropped write
            self.stats.add(dropped_writes=1)
            return None
        tmp = files.temp_path(os.path.dirname(path))
        try:
            # the inode is kept by the rename: the one the journal line names
            ino = files.stage_file(
                tmp, value.parts() if isinstance(value, Entry) else (value,), self.fsync
            )
        except OSError as e:
            self._write_failed(key, tmp, e)
            return None
        return key, path, tmp, size, ino, expires_at

    def _commit(
        self, key: ChunkKey, path: str, tmp: str, size: int, ino: int, expires_at: float | None
    ) -> None:
        """Make a staged temp file ``key``'s entry: its recency, the rename, the index, the expiry."""
        try:
            t = self._now_ns()
            os.utime(tmp, ns=(t, t))  # the mtime is the recency, given in commit order
            with self._lock:
                self._expiry.commit_locked(key, expires_at, ino, lambda: os.replace(tmp, path))
                self._record_locked(key, size)
                evicted = self._evict_locked(key)
            if self.fsync:
                files.fsync_dir(os.path.dirname(path))
        except OSError as e:
            self._write_failed(key, tmp, e)
            return
        self._stored(key)
        self.stats.add(puts=1, bytes_in=size, evictions=evicted)

    def _write_failed(self, key: ChunkKey, tmp: str, e: OSError) -> None:
        log.warning("disk tier %s: write %s failed: %s", self.root, key, e)
        self.stats.add(errors=1, dropped_writes=1)
        files.remove_quietly(tmp)

    # -- removals and expiry --------------------------------------------------------------------

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys) -> int:
        removed, lines = 0, []
        with self._lock:
            for key in keys:
                path = self._path(key)
                self._forget_locked(key)
                line = self._expiry.drop_locked(key)
                if line is not None:
                    lines.append(line)
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("disk tier %s: delete %s failed: %s", self.root, key, e)
                    self.stats.add(errors=1)
            self._expiry.settle_locked(lines)
        return removed

    def delete_prefix(self, prefix: str) -> int:
        """Lists every fan-out folder: the folder may be shared, and another process's files of
        the prefix are not in this process's index, yet must go too (an erasure). A scan of
        names only, run on the server's maintenance threads (``server/maintenance.py``)."""
        # A folder that cannot be listed is skipped (counted), not the end of the whole deletion.
        removed = 0
        for entries in files.fan_out(self.root):
            if entries is None:
                self.stats.add(errors=1)
                continue
            doomed = [
                key
                for key in map(files.filename_to_key, (e.name for e in entries))
                if key is not None and str(key).startswith(prefix)
            ]
            removed += self.delete_many(doomed)
        return removed

    def expiry(self, key: ChunkKey) -> float | None:
        return self._expiry.expiry(key)

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        st = self._stat(key)
        return st is not None and self._expiry.extend(key, st.st_ino, expires_at)

    def expire(self) -> int:
        return self._expiry.expire()

    def close(self) -> None:
        with self._lock:
            self._expiry.close()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
