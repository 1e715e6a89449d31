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
damaged one through ``delete``. Several processes may share one directory. Each keeps its own index (for LRU and capacity); the
file system is the truth: ``contains``/``get`` consult it directly, a file another process wrote
is found, a file another process evicted is a plain miss. The capacity is enforced by each process
over the files it knows, so a shared directory can briefly exceed it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import xxhash

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Entry, Tier, check_key, nbytes

log = logging.getLogger(__name__)

_SUFFIX = ".kvf"
_SEP = "_3A"  # ":" in file names
_TMP_RE = re.compile(r"^\.(\d+)\.[0-9a-f]+\.tmp$")
_SUBDIR_RE = re.compile(r"^[0-9a-f]{2}$")


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


class DiskTier(Tier):
    """Entries as files under ``path``; see the module docstring for layout and sharing rules.

    ``fsync=True`` makes each put durable before it returns (slower). Temp files left by dead
    processes, or older than ``stale_temp_s``, are removed at start-up.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        fsync: bool = False,
        name: str = "disk",
        stale_temp_s: float = 600.0,
    ) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"DiskTier capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.name = name
        self.root = Path(path)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._lock = threading.Lock()
        self._last_ns = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan(stale_temp_s)

    # -- paths and bookkeeping ------------------------------------------------------------------

    def _path(self, key: ChunkKey) -> Path:
        name = key_to_filename(key)
        sub = f"{xxhash.xxh3_64_intdigest(str(key).encode('utf-8')) & 0xFF:02x}"
        return self.root / sub / name

    def _now_ns(self) -> int:
        # Strictly increasing within the process: coarse file-system clocks would otherwise give
        # equal mtimes to quick successive writes and lose their order at the next restart.
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _scan(self, stale_temp_s: float) -> None:
        found: list[tuple[int, ChunkKey, int]] = []
        now = time.time()
        for sub in os.scandir(self.root):
            if not (sub.is_dir() and _SUBDIR_RE.match(sub.name)):
                continue
            for entry in os.scandir(sub.path):
                m = _TMP_RE.match(entry.name)
                try:
                    st = entry.stat()
                    if m and (not _pid_alive(int(m.group(1))) or now - st.st_mtime > stale_temp_s):
                        os.unlink(entry.path)
                        continue
                except FileNotFoundError:
                    continue
                key = filename_to_key(entry.name)
                if key is not None and entry.is_file():
                    found.append((st.st_mtime_ns, key, st.st_size))
        found.sort(key=lambda f: f[0])
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
            evicted = self._evict_locked()
        self.stats.add(evictions=evicted)

    def _forget_locked(self, key: ChunkKey) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _record_locked(self, key: ChunkKey, size: int) -> None:
        self._forget_locked(key)
        self._index[key] = size
        self._used += size

    def _evict_locked(self) -> int:
        """Remove least-recent files until within capacity (never the most recent entry)."""
        evicted = 0
        while self._used > self.capacity_bytes and len(self._index) > 1:
            key, size = self._index.popitem(last=False)
            self._used -= size
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError as e:
                log.warning("disk tier %s: cannot evict %s: %s", self.root, key, e)
                self.stats.add(errors=1)
            evicted += 1
        return evicted

    def _touch(self, path: Path, key: ChunkKey, size: int) -> None:
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
            os.stat(self._path(key))
            return True
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            return False
        except OSError as e:
            log.warning("disk tier %s: stat %s failed: %s", self.root, key, e)
            self.stats.add(errors=1)
            return False

    def get(self, key: ChunkKey) -> Blob | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                # One read into an uninitialised buffer (a bytearray would be zero-filled first):
                # the returned view is writable, so the raw codec decodes it without a copy.
                buf = memoryview(np.empty(size, dtype=np.uint8))
                n = 0
                while n < size:
                    got = os.readv(fd, [buf[n:]])
                    if not got:
                        break
                    n += got
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._missing(key)
            return None
        except OSError as e:
            log.warning("disk tier %s: read %s failed: %s", self.root, key, e)
            self.stats.add(misses=1, errors=1)
            return None
        self._touch(path, key, size)
        self.stats.add(hits=1, bytes_out=n)
        return buf[:n]  # shorter than the file only if it was truncated under us: the store rejects it

    def read_range(self, key: ChunkKey, start: int, stop: int) -> memoryview | None:
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
        try:
            size = os.fstat(fd).st_size
            buf = memoryview(np.empty(max(0, min(stop, size) - start), dtype=np.uint8))
            n = 0
            while n < len(buf):
                got = os.preadv(fd, [buf[n:]], start + n)
                if not got:
                    break
                n += got
        except OSError as e:
            log.warning("disk tier %s: read %s failed: %s", self.root, key, e)
            self.stats.add(misses=1, errors=1)
            return None
        finally:
            os.close(fd)
        if start == 0:  # the first read of an entry counts as its use
            self._touch(path, key, size)
        self.stats.add(hits=1, bytes_out=n)
        return buf[:n]

    def put(self, key: ChunkKey, value: Blob) -> None:
        path = self._path(key)
        size = nbytes(value)
        if size > self.capacity_bytes:
            self.delete(key)  # never leave an older value behind a dropped write
            self.stats.add(dropped_writes=1)
            return
        tmp = path.parent / f".{os.getpid()}.{secrets.token_hex(8)}.tmp"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, value.parts() if isinstance(value, Entry) else (value,))
                t = self._now_ns()
                os.utime(fd, ns=(t, t))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, path)
                self._record_locked(key, size)
                evicted = self._evict_locked()
            if self.fsync:
                self._fsync_dir(path.parent)
        except OSError as e:
            log.warning("disk tier %s: write %s failed: %s", self.root, key, e)
            self.stats.add(errors=1, dropped_writes=1)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self.stats.add(puts=1, bytes_in=size, evictions=evicted)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: ChunkKey) -> bool:
        path = self._path(key)
        with self._lock:
            self._forget_locked(key)
            try:
                os.unlink(path)
                return True
            except FileNotFoundError:
                return False
            except OSError as e:
                log.warning("disk tier %s: delete %s failed: %s", self.root, key, e)
                self.stats.add(errors=1)
                return False

    def delete_prefix(self, prefix: str) -> int:
        removed = 0
        for sub in os.scandir(self.root):
            if not (sub.is_dir() and _SUBDIR_RE.match(sub.name)):
                continue
            for entry in os.scandir(sub.path):
                key = filename_to_key(entry.name)
                if key is not None and str(key).startswith(prefix):
                    removed += self.delete(key)
        return removed

    def keys_lru(self) -> list[ChunkKey]:
        """Keys this process knows, from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._index)

    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used
