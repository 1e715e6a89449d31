"""The disk tier's files: where an entry lives, atomic staged writes, reads, stale temp files, listings.

Files live at ``<root>/<xx>/<name>.kvf`` where ``xx`` is the low byte of ``xxh3_64(key)`` in hex
(256 fan-out directories keep directories small) and ``name`` is the chunk key with its ``:``
separators written as ``_3A``: ``<ns>:p:<digest>`` -> ``<ns>_3Ap_3A<digest>.kvf`` (the mapping of
earlier versions, so their files are still indexed, counted and evicted by LRU, while their old
namespaces make them misses). Keys are case-sensitive, so the directory must be on a
case-sensitive file system.

Writes go to a unique ``.<pid>.<random>.tmp`` file in the target directory and are renamed into
place (``os.replace``, by the tier), created 0600 in folders created 0700 (``kvfuse.private``): a reader sees the old file, the new file or none, never a
torn one. A temp file whose writer is gone (``stale_temp``) is removed at start-up.

These are plain functions over paths and descriptors, without the tier's index, lock or counters:
the rules of the on-disk layout in one place, shared by the tier, its start-up scan and the
history records' folder (``stale_temp``), and testable alone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from typing import Iterator

import numpy as np
import xxhash

from kvfuse.kv.keys import ChunkKey
from kvfuse.private import FILE_MODE, make_dirs
from kvfuse.tiers.base import check_key

log = logging.getLogger(__name__)

_SUFFIX = ".kvf"
_SEP = "_3A"  # ":" in file names
_TMP_RE = re.compile(r"^\.(\d+)\.[0-9a-f]+\.tmp$")
SUBDIR_RE = re.compile(r"^[0-9a-f]{2}$")
# The names key_to_filename writes (a key's text with ":" as "_3A"): namespace, kind, digest, variant.
NAME_RE = re.compile(r"^([0-9a-f]{48})_3A([dptc])_3A([0-9a-f]{64})(?:@([a-z0-9]+\.[0-9]+))?\.kvf$")
# The names of key version 2 (a 24-hex namespace: a 32-bit tenant tag), never a hit since key
# version 3: the start-up scan removes them, since no index would ever count or evict them.
LEGACY_NAME_RE = re.compile(r"^[0-9a-f]{24}_3A[dptc]_3A[0-9a-f]{64}(?:@[a-z0-9]+\.[0-9]+)?\.kvf$")


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


def entry_path(root: str | os.PathLike, key: ChunkKey) -> str:
    """The path of ``key``'s file under ``root``: ``<root>/<xx>/<name>.kvf``.

    A str, not a Path: it is built for every read and write, and pathlib's joins cost more than
    the rest of a small entry's read."""
    name = key_to_filename(key)
    sub = f"{xxhash.xxh3_64_intdigest(str(key).encode('utf-8')) & 0xFF:02x}"
    return f"{root}{os.sep}{sub}{os.sep}{name}"


# -- writes -------------------------------------------------------------------------------------


def write_all(fd: int, parts) -> None:
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


def temp_path(folder: str) -> str:
    """A new temp file name in ``folder`` (``.<pid>.<random hex>.tmp``)."""
    return os.path.join(folder, f".{os.getpid()}.{secrets.token_hex(8)}.tmp")


def stage_file(tmp: str, parts, fsync: bool) -> int:
    """Write ``parts`` into the new file ``tmp`` (its folder made if missing), fsynced with
    ``fsync``; the file's inode (a rename keeps it). Raises OSError (``tmp`` may be left: the
    caller removes it, ``remove_quietly``)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileNotFoundError:
        make_dirs(os.path.dirname(tmp))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        write_all(fd, parts)
        if fsync:
            os.fsync(fd)
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Remove ``path`` if it can be (a failed write's temp file); errors are ignored."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(directory: str) -> None:
    """fsync a folder (a rename in it is then durable)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reads --------------------------------------------------------------------------------------


def read_all(fd: int, size: int) -> memoryview:
    """The ``size`` bytes of the open file ``fd`` from its current offset, fewer if it is shorter
    (truncated under us: the store rejects it). One read into an uninitialised buffer (a
    bytearray would be zero-filled first): the view is writable, so the raw codec decodes it
    without a copy."""
    buf = memoryview(np.empty(size, dtype=np.uint8))
    n = 0
    while n < size:
        got = os.readv(fd, [buf[n:]])
        if not got:
            break
        n += got
    return buf[:n]


def read_at(fd: int, start: int, stop: int, size: int) -> memoryview:
    """Bytes ``[start, stop)`` of the open file ``fd`` of ``size`` bytes (fewer past its end)."""
    buf = memoryview(np.empty(max(0, min(stop, size) - start), dtype=np.uint8))
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [buf[n:]], start + n)
        if not got:
            break
        n += got
    return buf[:n]


# -- temp files and listings --------------------------------------------------------------------


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


def listing(path, what: str) -> list[os.DirEntry] | None:
    """``os.scandir(path)`` as a list, or None (logged) when it cannot be read (permissions, I/O)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("disk tier: cannot list %s %s (%s); its entries are skipped", what, path, e)
        return None


def fan_out(root) -> Iterator[list[os.DirEntry] | None]:
    """The listing of each fan-out folder under ``root``, None for one that cannot be read (and a
    single None when ``root`` itself cannot be): the caller counts those and goes on."""
    subs = listing(root, "folder")
    if subs is None:
        yield None
        return
    for sub in subs:
        if sub.is_dir() and SUBDIR_RE.match(sub.name):
            yield listing(sub.path, "fan-out folder")
