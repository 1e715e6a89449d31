"""The disk tier: one file per entry, atomic writes, LRU by bytes, shareable between processes.

Files live at ``<root>/<xx>/<name>.kvf`` where ``xx`` is the low byte of ``xxh3_64(key)`` in hex
(256 fan-out directories keep directories small) and ``name`` is the key with every character
outside ``[A-Za-z0-9.-]`` written as ``_XX`` (the hex of its UTF-8 bytes), a reversible mapping:
``ab:p:cd`` -> ``ab_3Ap_3Acd.kvf``. Keys are case-sensitive, so the directory must be on a
case-sensitive file system.

Writes go to a unique ``.<pid>.<random>.tmp`` file in the target directory and are renamed into
place (``os.replace``): a reader sees the old file, the new file or none, never a torn one. A file's
mtime is its recency (set on every put and hit), so a restart rebuilds the LRU order by scanning.

Several processes may share one directory. Each keeps its own index (for LRU and capacity); the
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
from typing import Callable

import numpy as np
import xxhash

from kvfuse.kv.format import open_entry
from kvfuse.tiers.base import Blob, Entry, Tier, nbytes

log = logging.getLogger(__name__)

Validator = Callable[[Blob, str], "bool | Blob | None"]

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
_SUFFIX = ".kvf"
_MAX_NAME = 240  # file names are limited to 255 bytes on common file systems
_TMP_RE = re.compile(r"^\.(\d+)\.[0-9a-f]+\.tmp$")
_SUBDIR_RE = re.compile(r"^[0-9a-f]{2}$")
_CHUNK_KEY_CHARS = re.compile(r"[A-Za-z0-9.:-]+")


def key_to_filename(key: str) -> str:
    """The file name of ``key`` (reversible, see the module docstring); ValueError if too long."""
    if not key:
        raise ValueError("DiskTier keys must be non-empty strings")
    if _CHUNK_KEY_CHARS.fullmatch(key):  # every chunk key: only its ':' separators need escaping
        name = key.replace(":", "_3A") + _SUFFIX
    else:
        name = "".join(c if c in _SAFE else "".join(f"_{b:02X}" for b in c.encode("utf-8")) for c in key) + _SUFFIX
    if len(name) > _MAX_NAME:
        raise ValueError(f"key too long for a file name ({len(name)} > {_MAX_NAME} chars): {key[:40]!r}...")
    return name


def filename_to_key(name: str) -> str | None:
    """Inverse of :func:`key_to_filename`; None for a name it did not produce."""
    if not name.endswith(_SUFFIX) or len(name) == len(_SUFFIX):
        return None
    out, stem, i = bytearray(), name[: -len(_SUFFIX)], 0
    while i < len(stem):
        c = stem[i]
        if c == "_":
            try:
                out.append(int(stem[i + 1 : i + 3], 16))
            except ValueError:
                return None
            i += 3
        elif c in _SAFE:
            out += c.encode("ascii")
            i += 1
        else:
            return None
    try:
        key = out.decode("utf-8")
    except UnicodeDecodeError:
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

    ``validator(blob, key)`` (default: ``open_entry``, the entry format's full check) runs on
    every ``get``: a truncated or corrupt file (a falsy result) is a miss, counted as an error,
    and removed. A validator may return the value to hand out instead of True: ``open_entry``
    returns the checked ``Entry``, so the header is parsed once for the check and every later use. ``fsync=True`` makes
    each put durable before it returns (slower). Temp files left by dead processes, or older than
    ``stale_temp_s``, are removed at start-up.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        validator: Validator | None = open_entry,
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
        self.validator = validator
        self.validates_on_get = validator is not None
        self.fsync = fsync
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._lock = threading.Lock()
        self._last_ns = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan(stale_temp_s)

    # -- paths and bookkeeping ------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        sub = f"{xxhash.xxh3_64_intdigest(key.encode('utf-8')) & 0xFF:02x}"
        return self.root / sub / key_to_filename(key)

    def _now_ns(self) -> int:
        # Strictly increasing within the process: coarse file-system clocks would otherwise give
        # equal mtimes to quick successive writes and lose their order at the next restart.
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _scan(self, stale_temp_s: float) -> None:
        found: list[tuple[int, str, int]] = []
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
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
            evicted = self._evict_locked()
        self.stats.add(evictions=evicted)

    def _forget_locked(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _record_locked(self, key: str, size: int) -> None:
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

    # -- the Tier interface ---------------------------------------------------------------------

    def contains(self, key: str) -> bool:
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

    def get(self, key: str) -> Blob | None:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                # One read into an uninitialised buffer (a bytearray would be zero-filled first):
                # the returned view is writable, so the raw codec decodes it without a copy.
                buf = memoryview(np.empty(st.st_size, dtype=np.uint8))
                n = 0
                while n < len(buf):
                    got = f.readinto(buf[n:])
                    if not got:
                        break
                    n += got
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            self.stats.add(misses=1)
            return None
        except OSError as e:
            log.warning("disk tier %s: read %s failed: %s", self.root, key, e)
            self.stats.add(misses=1, errors=1)
            return None
        checked = True if self.validator is None or n != len(buf) else self.validator(buf, key)
        if n != len(buf) or not checked:
            log.warning("disk tier %s: corrupt entry %s removed", self.root, key)
            self._remove_if_same(path, key, st.st_ino)
            self.stats.add(misses=1, errors=1)
            return None
        t = self._now_ns()
        try:
            os.utime(path, ns=(t, t))  # the file's mtime is its recency across restarts
        except OSError:
            pass  # replaced or evicted meanwhile: the data we read is still valid
        with self._lock:
            self._record_locked(key, len(buf))
            evicted = self._evict_locked()
        self.stats.add(hits=1, bytes_out=len(buf), evictions=evicted)
        return buf if checked is True else checked

    def _remove_if_same(self, path: Path, key: str, ino: int) -> None:
        # Only unlink the very file we found corrupt: another process may have replaced it since.
        with self._lock:
            self._forget_locked(key)
            try:
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
            except OSError:
                pass

    def put(self, key: str, value: Blob) -> None:
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

    def delete(self, key: str) -> bool:
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
                if key is not None and key.startswith(prefix):
                    removed += self.delete(key)
        return removed

    def keys_lru(self) -> list[str]:
        """Keys this process knows, from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._index)

    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used
