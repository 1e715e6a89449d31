"""The disk tier: one file per entry, atomic writes, LRU by bytes, shareable between processes.

Files live at ``<root>/<xx>/<name>.kvf`` where ``xx`` is the low byte of ``xxh3_64(key)`` in hex
(256 fan-out directories keep directories small) and ``name`` is the chunk key with its ``:``
separators written as ``_3A``: ``<ns>:p:<digest>`` -> ``<ns>_3Ap_3A<digest>.kvf`` (the mapping of
earlier versions, so their files are still indexed, counted and evicted by LRU, while their old
namespaces make them misses). Keys are case-sensitive, so the directory must be on a
case-sensitive file system.

Writes go to a unique ``.<pid>.<random>.tmp`` file in the target directory and are renamed into
place (``os.replace``): a reader sees the old file, the new file or none, never a torn one. A file's
mtime is its recency (set on every put and hit), so a restart rebuilds the LRU order by scanning.

The tier does not check what it reads: the tiered store validates every entry and discards a
damaged one through ``delete``. ``read_with`` hands a file to the store's check as it is read (a
few layers at a time, each checked while still in the CPU cache: ``kv.format.read_entry``).
A fan-out folder (or file) it may not read is an operational failure like any other: the
start-up scan and ``delete_prefix`` log it, count an error and go on with the other folders (its entries are misses until its permissions are fixed). Several processes may share one directory. Each keeps its own index (for LRU and capacity); the
file system is the truth: ``contains``/``get`` consult it directly, a file another process wrote
is found, a file another process evicted is a plain miss. The capacity is enforced by each process
over the files it knows, so a shared directory can briefly exceed it.

Expiry (``put(..., expires_at)``, see ``tiers/base.py``): each process keeps a map key ->
(expires_at, inode) and records it in an append-only journal, ``<root>/expiry.log``, so that
expiries survive a restart. One line per put with an expiry, per extend, and per removal of an
entry that had one (delete, eviction, expiry, a put without expiry over it)::

    <key> <expires_at | -> <inode of the file> <crc32 of the rest, 8 hex>

A line applies to the file of that inode only: a later put of the key (a new file, a new inode)
sheds the older expiry whichever process wrote it, and a removal line cancels only that file's
expiry. Lines are appended with ``O_APPEND`` (one ``write`` each batch) while holding a shared
``flock`` on ``<root>/expiry.lock``; they are in the kernel before ``put`` returns (and fsynced
with ``fsync=True``). A put whose expiry cannot be recorded is dropped (an entry is never kept
with a retention it cannot enforce). At start-up the journal is read (damaged, torn or unknown
lines are ignored; the last line of each (key, inode) wins), entries already expired are deleted
(counted in ``expired``), lines of files that are gone or were replaced are dropped, and the
journal is rewritten compacted (temp file + ``os.replace``, under the exclusive lock, so no
process's appends are lost); the same compaction runs whenever the journal's stale lines exceed
about twice the live ones (``journal_compact_min`` at least). The journal and its lock file are
only created once some entry has an expiry.

Several processes on one directory: a process learns the expiries other processes wrote at its
start-up (and whenever it compacts the journal); each process enforces what it knows: its reads
treat the expired entries it knows of as misses and remove them, and its ``expire`` sweeps them.
The process that put an entry with an expiry removes its file on time (at its sweeps), which every
process then sees as a miss; an entry whose writer stopped before its expiry is removed by the
next process that starts (or compacts) after it. A read in a process that does not know an
expiry serves the entry until then.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import secrets
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable
from pathlib import Path

import numpy as np
import xxhash

from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.tiers.base import Blob, Clock, Entry, Expiries, T, Tier, check_key, nbytes
from kvfuse.tiers.key_index import KeyIndex

log = logging.getLogger(__name__)

_SUFFIX = ".kvf"
_SEP = "_3A"  # ":" in file names
_TMP_RE = re.compile(r"^\.(\d+)\.[0-9a-f]+\.tmp$")
_SUBDIR_RE = re.compile(r"^[0-9a-f]{2}$")
# The names key_to_filename writes (a key's text with ":" as "_3A"): namespace, kind, digest, variant.
_NAME_RE = re.compile(r"^([0-9a-f]{24})_3A([dpt])_3A([0-9a-f]{64})(?:@([a-z0-9]+\.[0-9]+))?\.kvf$")
JOURNAL = "expiry.log"
_JOURNAL_LOCK = "expiry.lock"
_JOURNAL_TMP = "expiry.log.tmp"  # written under the exclusive lock only: one name is enough


def journal_line(key: ChunkKey, expires_at: float | None, ino: int) -> str:
    """One journal line (see the module docstring): ``expires_at`` None records a removal."""
    body = f"{key} {'-' if expires_at is None else repr(float(expires_at))} {int(ino)}"
    return f"{body} {zlib.crc32(body.encode('ascii')):08x}\n"


def parse_journal(data: bytes) -> dict[tuple[ChunkKey, int], float | None]:
    """The journal's records: ``(key, inode) -> expires_at`` (None: removed), the last line of each
    winning. A damaged line (checksum, torn write, unknown form, a non-finite time) is skipped, and
    so is a last line without its newline (a write cut short)."""
    out: dict[tuple[ChunkKey, int], float | None] = {}
    for raw in data.split(b"\n")[:-1]:
        parts = raw.split(b" ")
        if len(parts) != 4 or len(parts[3]) != 8:
            continue
        try:
            if int(parts[3], 16) != zlib.crc32(b" ".join(parts[:3])):
                continue
            key = ChunkKey.parse(parts[0].decode("ascii"))
            expires_at = None if parts[1] == b"-" else float(parts[1])
            ino = int(parts[2])
        except (ValueError, UnicodeDecodeError):
            continue
        if expires_at is not None and not math.isfinite(expires_at):
            continue
        out[(key, ino)] = expires_at
    return out


def key_to_filename(key: ChunkKey) -> str:
    """The file name of ``key`` (see the module docstring)."""
    return str(check_key(key)).replace(":", _SEP) + _SUFFIX


def filename_to_key(name: str) -> ChunkKey | None:
    """Inverse of :func:`key_to_filename`; None for a name it did not produce."""
    if not name.endswith(_SUFFIX):
        return None
    try:
        key = ChunkKey.parse(name[: -len(_SUFFIX)].replace(_SEP, ":"))
    except ValueError:
        return None
    return key if key_to_filename(key) == name else None


def _write_all(fd: int, parts) -> None:
    """Write every buffer in ``parts``, in order: one ``writev`` (an ``Entry``'s header and payload
    go out without being joined first), continuing after a partial write."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temp(name: str, mtime: float, now: float, stale_s: float) -> bool:
    """Whether ``name`` is a temporary file (``.<pid>.<random hex>.tmp``) whose writer is gone: its
    process is dead (killed in the middle of a write), or the file is older than ``stale_s`` (a
    pid reused since). Such files are never renamed into place and only take room: removed at
    start-up (the disk tier's folders, and the history records' folder)."""
    m = _TMP_RE.match(name)
    return bool(m) and (not _pid_alive(int(m.group(1))) or now - mtime > stale_s)


def _listing(path, what: str):
    """``os.scandir(path)`` as a list, or None (logged) when it cannot be read (permissions, I/O)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("disk tier: cannot list %s %s (%s); its entries are skipped", what, path, e)
        return None


class DiskTier(Tier):
    """Entries as files under ``path``; see the module docstring for layout and sharing rules.

    ``fsync=True`` makes each put durable before it returns (slower). Temp files left by dead
    processes, or older than ``stale_temp_s``, are removed at start-up, and so are the entries
    whose expiry passed on ``clock`` (the journal, see the module docstring; ``clock`` defaults to
    ``time.time`` and can be replaced later, as ``TieredStore`` does, but the start-up sweep has
    run by then). ``io_threads``: how many files of one ``put_many`` (the store's background
    writes) are written at once (default: one per core, at most 4; 1: one by one).
    """

    journal_compact_min = 64  # compact the journal once it has at least this many stale lines
    streams_reads = True  # read_with reads the file as the store's check asks for it

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        fsync: bool = False,
        name: str = "disk",
        stale_temp_s: float = 600.0,
        clock: Clock | None = None,
        io_threads: int | None = None,
    ) -> None:
        super().__init__()
        if clock is not None:
            self.clock = clock  # given here, it is the start-up sweep's time too
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"DiskTier capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.name = name
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._index = KeyIndex()  # key -> size, least recent first (compact: ~70 bytes an entry)
        self._used = 0
        self._lock = threading.Lock()
        self._last_ns = 0
        self._expiry = Expiries()  # key -> (expires_at, inode of the file it applies to)
        self._journal = self.root / JOURNAL
        self._journal_lines = 0  # lines in the journal, as far as this process knows
        self._lock_fd: int | None = None
        # Threads writing the files of one put_many (None: one per core, <= 4).
        self.io_threads = min(4, os.cpu_count() or 1) if io_threads is None else int(io_threads)
        self._pool: ThreadPoolExecutor | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan(stale_temp_s)

    # -- paths and bookkeeping ------------------------------------------------------------------

    def _path(self, key: ChunkKey) -> str:
        # A str, not a Path: it is built for every read and write, and pathlib's joins cost more
        # than the rest of a small entry's read.
        name = key_to_filename(key)
        sub = f"{xxhash.xxh3_64_intdigest(str(key).encode('utf-8')) & 0xFF:02x}"
        return f"{self.root}{os.sep}{sub}{os.sep}{name}"

    def _now_ns(self) -> int:
        # Strictly increasing within the process: coarse file-system clocks would otherwise give
        # equal mtimes to quick successive writes and lose their order at the next restart.
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _scan(self, stale_temp_s: float) -> None:
        # A folder or file that cannot be read (EACCES, EIO) is skipped and counted: a tier never
        # fails its process for an operational failure (an unreadable fan-out folder used to stop
        # the server from starting). A million files take seconds: names are parsed by one regex
        # into columns (no key object per file) and the index is filled at once (KeyIndex.load).
        now = time.time()
        unreadable = 0
        groups: dict[tuple[str, str, str], int] = {}
        group_of, hexes, mtimes, sizes, inos = [], [], [], [], []
        subs = _listing(self.root, "folder")
        if subs is None:
            subs, unreadable = [], 1
        for sub in subs:
            if not (sub.is_dir() and _SUBDIR_RE.match(sub.name)):
                continue
            entries = _listing(sub.path, "fan-out folder")
            if entries is None:
                unreadable += 1
                continue
            for entry in entries:
                name = entry.name
                m = _NAME_RE.fullmatch(name)
                if m is None:
                    if name.endswith(".tmp"):
                        try:
                            if stale_temp(name, entry.stat().st_mtime, now, stale_temp_s):
                                os.unlink(entry.path)
                        except FileNotFoundError:
                            pass
                        except OSError as e:
                            log.warning("disk tier %s: cannot stat or remove %s (%s)", self.root, entry.path, e)
                            unreadable += 1
                    continue
                try:
                    if not entry.is_file():
                        continue
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("disk tier %s: cannot stat %s (%s)", self.root, entry.path, e)
                    unreadable += 1
                    continue
                group = (m.group(1), m.group(2), m.group(4) or "")
                gid = groups.get(group)
                if gid is None:
                    gid = groups[group] = len(groups)
                group_of.append(gid)
                hexes.append(m.group(3))
                mtimes.append(st.st_mtime_ns)
                sizes.append(st.st_size)
                inos.append(st.st_ino)
        self.stats.add(errors=unreadable)
        order = np.argsort(np.array(mtimes, dtype=np.int64), kind="stable")
        digests = np.frombuffer(bytes.fromhex("".join(hexes)), dtype="<u8").reshape(-1, 4)
        group_list = [(ns, ChunkKind(kind), variant) for ns, kind, variant in groups]
        keep = order
        with self._lock:
            if self._journal.exists():
                def key_of(i: int) -> ChunkKey:
                    ns, kind, variant = group_list[group_of[i]]
                    return ChunkKey(ns, digests[i].tobytes(), kind, variant)

                gone = self._compact_locked({key_of(i): inos[i] for i in range(len(hexes))})
                if gone:
                    keep = np.array([i for i in order.tolist() if key_of(i) not in gone], dtype=np.intp)
            sizes_kept = np.array(sizes, dtype=np.int64)[keep]
            self._index.load(group_list, np.array(group_of, dtype=np.intp)[keep], digests[keep].tobytes(), sizes_kept)
            self._used = int(sizes_kept.sum())
            evicted = self._evict_locked()
        self.stats.add(evictions=evicted)

    # -- the expiry journal ---------------------------------------------------------------------

    @contextmanager
    def _journal_locked(self, how: int):
        """Hold ``flock(how)`` on the journal's lock file (shared: appending; exclusive: rewriting).
        Called under ``self._lock``, so one thread of this tier uses the lock's descriptor at a time."""
        if self._lock_fd is None:
            self._lock_fd = os.open(self.root / _JOURNAL_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write_journal(self, lines: list[str]) -> None:
        """Append ``lines`` to the journal in one write (the caller holds the shared lock); raises
        OSError."""
        fd = os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _write_all(fd, ("".join(lines).encode("ascii"),))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._journal_lines += len(lines)

    def _append_locked(self, lines: list[str]) -> None:
        """Append ``lines`` to the journal (under ``self._lock``); a failure is logged and counted."""
        if not lines:
            return
        try:
            with self._journal_locked(fcntl.LOCK_SH):
                self._write_journal(lines)
        except OSError as e:
            log.warning("disk tier %s: cannot append to the expiry journal: %s", self.root, e)
            self.stats.add(errors=1)

    def _maybe_compact_locked(self) -> None:
        """Compact the journal when its stale lines exceed about twice the live ones."""
        live = len(self._expiry)
        stale = self._journal_lines - live
        if stale >= self.journal_compact_min and stale > 2 * live:
            self._compact_locked(None)

    def _compact_locked(self, inodes: dict[ChunkKey, int] | None) -> set[ChunkKey]:
        """Rewrite the journal from what it holds now (every process's lines): the live record of
        each file only; delete the files whose expiry passed; learn the rest. ``inodes``: the
        files' inodes when the caller just scanned them (saves a stat per key).
        Returns the keys whose files were deleted. Under ``self._lock``."""
        removed: set[ChunkKey] = set()
        live: dict[ChunkKey, tuple[float, int]] = {}
        try:
            with self._journal_locked(fcntl.LOCK_EX):
                try:
                    data = self._journal.read_bytes()
                except FileNotFoundError:
                    data = b""
                now = self.clock()
                for (key, ino), expires_at in parse_journal(data).items():
                    if expires_at is None:
                        continue
                    current = None if inodes is None else inodes.get(key)
                    if current != ino:  # not scanned as this file: look (another process may have just put it)
                        try:
                            current = os.stat(self._path(key)).st_ino
                        except OSError:
                            current = None
                    if current != ino:
                        continue  # gone, or replaced by a later put (whose own line, if any, rules)
                    if expires_at <= now:
                        if self._unlink_if(key, ino):
                            removed.add(key)
                        continue
                    live[key] = (expires_at, ino)
                tmp = self.root / _JOURNAL_TMP
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _write_all(fd, ("".join(journal_line(k, t, ino) for k, (t, ino) in live.items()).encode("ascii"),))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self._journal)
        except OSError as e:
            log.warning("disk tier %s: cannot compact the expiry journal: %s", self.root, e)
            self.stats.add(errors=1)
        else:
            self._expiry = Expiries()
            for key, (t, ino) in live.items():
                self._expiry.set(key, t, ino)
            self._journal_lines = len(live)
        for key in removed:
            self._forget_locked(key)
            self._expiry.pop(key)
        if removed:
            self.stats.add(expired=len(removed))
        return removed

    def _unlink_if(self, key: ChunkKey, ino: int) -> bool:
        """Remove ``key``'s file if it is still the file of inode ``ino`` (not one put since)."""
        path = self._path(key)
        try:
            if os.stat(path).st_ino != ino:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk tier %s: cannot remove expired %s: %s", self.root, key, e)
            self.stats.add(errors=1)
            return False

    def _expired(self, key: ChunkKey, ino: int) -> bool:
        """Whether the file of inode ``ino`` holding ``key`` has an expiry that passed."""
        rec = self._expiry.get(key)
        return rec is not None and rec[1] == ino and self._expired_at(rec[0])

    def _drop_expired(self, key: ChunkKey, ino: int) -> None:
        """Remove the expired file of ``key`` (inode ``ino``), counted in ``expired``."""
        with self._lock:
            rec = self._expiry.get(key)
            if rec is None or rec[1] != ino:
                return  # put again meanwhile
            self._expiry.pop(key)
            self._forget_locked(key)
            gone = self._unlink_if(key, ino)
            self._append_locked([journal_line(key, None, ino)])
            self._maybe_compact_locked()
        if gone:
            self.stats.add(expired=1)

    def _forget_locked(self, key: ChunkKey) -> None:
        old = self._index.pop(key)
        if old is not None:
            self._used -= old[0]

    def _record_locked(self, key: ChunkKey, size: int) -> None:
        old = self._index.put(key, size)
        self._used += size - (old or 0)

    def _evict_locked(self) -> int:
        """Remove least-recent files until within capacity (never the most recent entry)."""
        evicted, lines = 0, []
        while self._used > self.capacity_bytes and len(self._index) > 1:
            key, size, _ = self._index.pop_oldest()
            self._used -= size
            rec = self._expiry.pop(key)
            if rec is not None:
                lines.append(journal_line(key, None, rec[1]))
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError as e:
                log.warning("disk tier %s: cannot evict %s: %s", self.root, key, e)
                self.stats.add(errors=1)
            evicted += 1
        self._append_locked(lines)
        self._maybe_compact_locked()
        return evicted

    def _touch(self, path: str, key: ChunkKey, size: int) -> None:
        """Make ``key`` the most recent entry, in the index and in the file's mtime."""
        t = self._now_ns()
        try:
            os.utime(path, ns=(t, t))  # the file's mtime is its recency across restarts
        except OSError:
            pass  # replaced or evicted meanwhile: the data we read is still valid
        with self._lock:
            self._record_locked(key, size)
            evicted = self._evict_locked()
        self.stats.add(evictions=evicted)

    def _missing(self, key: ChunkKey) -> None:
        with self._lock:
            self._forget_locked(key)
        self.stats.add(misses=1)

    # -- the Tier interface ---------------------------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        # Always ask the file system (one stat): another process may have added or evicted it.
        try:
            st = os.stat(self._path(key))
            if self._expiry and self._expired(key, st.st_ino):
                self._drop_expired(key, st.st_ino)
                return False
            return True
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            return False
        except OSError as e:
            log.warning("disk tier %s: stat %s failed: %s", self.root, key, e)
            self.stats.add(errors=1)
            return False

    def _read_file(self, key: ChunkKey, read: Callable[[int, int], T], touch: bool = True) -> T | None:
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
            if self._expiry and self._expired(key, st.st_ino):
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
            self._drop_expired(key, expired_ino)
            self.stats.add(misses=1)
            return None
        if touch:
            self._touch(path, key, st.st_size)
        return result

    def get(self, key: ChunkKey) -> Blob | None:
        def read(fd: int, size: int) -> memoryview:
            # One read into an uninitialised buffer (a bytearray would be zero-filled first):
            # the returned view is writable, so the raw codec decodes it without a copy.
            buf = memoryview(np.empty(size, dtype=np.uint8))
            n = 0
            while n < size:
                got = os.readv(fd, [buf[n:]])
                if not got:
                    break
                n += got
            self.stats.add(bytes_out=n)
            return buf[:n]  # shorter than the file only if it was truncated under us: the store rejects it

        return self._read_file(key, read)

    def read_with(self, key: ChunkKey, reader):
        # The file is read as the reader asks (the store checks each piece while it is in cache).
        def read(fd: int, size: int):
            self.stats.add(bytes_out=size)
            return reader(lambda view: os.readv(fd, [view]), size)

        return self._read_file(key, read)

    def read_range(self, key: ChunkKey, start: int, stop: int) -> memoryview | None:
        def read(fd: int, size: int) -> memoryview:
            buf = memoryview(np.empty(max(0, min(stop, size) - start), dtype=np.uint8))
            n = 0
            while n < len(buf):
                got = os.preadv(fd, [buf[n:]], start + n)
                if not got:
                    break
                n += got
            self.stats.add(bytes_out=n)
            return buf[:n]

        return self._read_file(key, read, touch=start == 0)  # the first read of an entry is its use

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
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvfuse-{self.name}-io")
            return self._pool

    def _stage(self, key: ChunkKey, value: Blob, expires_at: float | None):
        """Write ``value`` into a new temp file beside ``key``'s path: (key, path, temp path, size,
        inode, expires_at) for ``_commit``, or None when nothing is to be stored (counted)."""
        path = self._path(key)
        if self._expired_at(expires_at):
            self.delete(key)  # stores nothing, and no older value stays behind
            return None
        size = nbytes(value)
        if size > self.capacity_bytes:
            self.delete(key)  # never leave an older value behind a dropped write
            self.stats.add(dropped_writes=1)
            return None
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, value.parts() if isinstance(value, Entry) else (value,))
                if self.fsync:
                    os.fsync(fd)
                ino = os.fstat(fd).st_ino  # kept by the rename: the inode the journal line names
            finally:
                os.close(fd)
        except OSError as e:
            self._write_failed(key, tmp, e)
            return None
        return key, path, tmp, size, ino, expires_at

    def _commit(self, key: ChunkKey, path: str, tmp: str, size: int, ino: int, expires_at: float | None) -> None:
        """Make a staged temp file ``key``'s entry: its recency, the rename, the index, the expiry."""
        try:
            t = self._now_ns()
            os.utime(tmp, ns=(t, t))  # the mtime is the recency, given in commit order
            with self._lock:
                if expires_at is None:
                    os.replace(tmp, path)
                else:
                    # Recorded before the file is visible, and under the shared lock until it is (a
                    # compaction meanwhile would drop a line whose file is not in place yet). A
                    # failure drops the write: no entry is kept with an expiry it cannot keep.
                    with self._journal_locked(fcntl.LOCK_SH):
                        self._write_journal([journal_line(key, expires_at, ino)])
                        os.replace(tmp, path)
                self._record_locked(key, size)
                old = self._expiry.pop(key)
                if expires_at is not None:
                    self._expiry.set(key, expires_at, ino)
                elif old is not None:
                    self._append_locked([journal_line(key, None, old[1])])
                evicted = self._evict_locked()
            if self.fsync:
                self._fsync_dir(os.path.dirname(path))
        except OSError as e:
            self._write_failed(key, tmp, e)
            return
        self.stats.add(puts=1, bytes_in=size, evictions=evicted)

    def _write_failed(self, key: ChunkKey, tmp: str, e: OSError) -> None:
        log.warning("disk tier %s: write %s failed: %s", self.root, key, e)
        self.stats.add(errors=1, dropped_writes=1)
        try:
            os.unlink(tmp)
        except OSError:
            pass

    @staticmethod
    def _fsync_dir(directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys) -> int:
        removed, lines = 0, []
        with self._lock:
            for key in keys:
                path = self._path(key)
                self._forget_locked(key)
                rec = self._expiry.pop(key)
                if rec is not None:
                    lines.append(journal_line(key, None, rec[1]))
                try:
                    os.unlink(path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("disk tier %s: delete %s failed: %s", self.root, key, e)
                    self.stats.add(errors=1)
            self._append_locked(lines)
            self._maybe_compact_locked()
        return removed

    def delete_prefix(self, prefix: str) -> int:
        # A folder that cannot be listed is skipped (counted), not the end of the whole deletion.
        removed = 0
        subs = _listing(self.root, "folder")
        if subs is None:
            self.stats.add(errors=1)
            return 0
        for sub in subs:
            if not (sub.is_dir() and _SUBDIR_RE.match(sub.name)):
                continue
            entries = _listing(sub.path, "fan-out folder")
            if entries is None:
                self.stats.add(errors=1)
                continue
            doomed = [key for key in map(filename_to_key, (e.name for e in entries))
                      if key is not None and str(key).startswith(prefix)]
            removed += self.delete_many(doomed)
        return removed

    def expiry(self, key: ChunkKey) -> float | None:
        rec = self._expiry.get(key)
        if rec is None:
            return None  # no expiry known here, or not held: None either way, no need to look
        try:
            ino = os.stat(self._path(key)).st_ino
        except OSError:
            return None
        if ino != rec[1]:
            return None  # put again since (by another process): its expiry is not known here
        if self._expired_at(rec[0]):
            self._drop_expired(key, ino)
            return None
        return rec[0]

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        try:
            ino = os.stat(self._path(key)).st_ino
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            return False
        except OSError as e:
            log.warning("disk tier %s: stat %s failed: %s", self.root, key, e)
            self.stats.add(errors=1)
            return False
        with self._lock:
            rec = self._expiry.get(key)
            if rec is None or rec[1] != ino:
                return True  # no expiry (known here): it lives longer already
            if not self._expired_at(rec[0]):
                if rec[0] < expires_at:
                    self._append_locked([journal_line(key, expires_at, ino)])
                    self._expiry.set(key, expires_at, ino)
                    self._maybe_compact_locked()
                return True
        self._drop_expired(key, ino)
        return False

    def expire(self) -> int:
        now = self.clock()
        removed = 0
        with self._lock:
            due = self._expiry.due(now)
            lines = []
            for key, (_, ino) in due:
                if self._unlink_if(key, ino):
                    self._forget_locked(key)
                    removed += 1
                lines.append(journal_line(key, None, ino))
            self._append_locked(lines)
            self._maybe_compact_locked()
        if removed:
            self.stats.add(expired=removed)
        return removed

    def keys_lru(self) -> list[ChunkKey]:
        """Keys this process knows, from least to most recently used (the eviction order)."""
        with self._lock:
            return self._index.keys()

    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def close(self) -> None:
        with self._lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
