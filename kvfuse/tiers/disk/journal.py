"""The disk tier's expiry journal: ``<root>/expiry.log``, its line format, its lock, appends and rewrites.

Expiries must survive a restart, and several processes may share one folder, so each records its
expiries in an append-only journal. One line per put with an expiry, per extend, and per removal of
an entry that had one (delete, eviction, expiry, a put without expiry over it)::

    <key> <expires_at | -> <inode of the file> <crc32 of the rest, 8 hex>

A line applies to the file of that inode only: a later put of the key (a new file, a new inode)
sheds the older expiry whichever process wrote it, and a removal line cancels only that file's
expiry. Lines are appended with ``O_APPEND`` (one ``write`` each batch) while holding a shared
``flock`` on ``<root>/expiry.lock``; they are in the kernel before ``put`` returns (and fsynced
with ``fsync=True``). Reading it back, damaged, torn or unknown lines are ignored and the last
line of each (key, inode) wins (``parse_journal``). A compaction rewrites it (temp file +
``os.replace``) under the exclusive lock, so no process's appends are lost. The journal and its
lock file are only created once some entry has an expiry.

This module is the file and its format only; what the lines mean for the tier's entries (which
expiries apply, what a compaction keeps) is ``expiry.py``'s.
"""

from __future__ import annotations

import fcntl
import math
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from kvfuse.kv.keys import ChunkKey
from kvfuse.private import FILE_MODE
from kvfuse.tiers.disk.files import write_all

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


class ExpiryJournal:
    """The journal file of one process's disk tier under ``root``.

    Not thread-safe: the owning tier calls it under its own lock, so one thread at a time uses
    the lock file's descriptor. Every method raises OSError on an I/O failure; the caller decides
    what a failure means (a put whose expiry cannot be recorded is dropped; a removal line that
    cannot be written is logged and counted)."""

    def __init__(self, root: Path, fsync: bool) -> None:
        self.root = root
        self.path = root / JOURNAL
        self.fsync = fsync
        self.lines = 0  # lines in the journal, as far as this process knows
        self._lock_fd: int | None = None

    def exists(self) -> bool:
        return self.path.exists()

    @contextmanager
    def locked(self, how: int) -> Iterator[None]:
        """Hold ``flock(how)`` on the journal's lock file (``fcntl.LOCK_SH``: appending, and
        renaming a file whose line was just appended; ``fcntl.LOCK_EX``: rewriting)."""
        if self._lock_fd is None:
            self._lock_fd = os.open(self.root / _JOURNAL_LOCK, os.O_RDWR | os.O_CREAT, FILE_MODE)
        fcntl.flock(self._lock_fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def write(self, lines: list[str]) -> None:
        """Append ``lines`` in one write; the caller holds the shared lock (``locked``)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            write_all(fd, ("".join(lines).encode("ascii"),))
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.lines += len(lines)

    def append(self, lines: list[str]) -> None:
        """Append ``lines`` under the shared lock (nothing to do for none)."""
        if lines:
            with self.locked(fcntl.LOCK_SH):
                self.write(lines)

    def read(self) -> bytes:
        """The journal's bytes (empty when there is none); the caller holds the exclusive lock."""
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def rewrite(self, records: Iterable[tuple[ChunkKey, float, int]]) -> None:
        """Replace the journal with one line per ``(key, expires_at, inode)`` (temp file +
        ``os.replace``); the caller holds the exclusive lock."""
        records = list(records)
        tmp = self.root / _JOURNAL_TMP
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            write_all(
                fd, ("".join(journal_line(k, t, ino) for k, t, ino in records).encode("ascii"),)
            )
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self.lines = len(records)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
