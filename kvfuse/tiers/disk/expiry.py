"""The disk tier's expiries: what one process knows of them, and the rules that tie them to files.

Each process keeps a map key -> (expires_at, inode) and records it in the expiry journal
(``journal.py``), so that expiries survive a restart. An expiry applies to the file of that
inode only: a later put of the key (a new file) sheds it, whichever process made that put. A put
whose expiry cannot be recorded is dropped (an entry is never kept with a retention it cannot
enforce). At start-up the journal is read, entries already expired are deleted (counted in
``expired``), lines of files that are gone or were replaced are dropped, and the journal is
rewritten compacted; the same compaction runs whenever the journal's stale lines exceed about
twice the live ones (``compact_min`` at least).

Several processes on one directory: a process learns the expiries other processes wrote at its
start-up (and whenever it compacts the journal); each process enforces what it knows: its reads
treat the expired entries it knows of as misses and remove them, and its ``expire`` sweeps them.
The process that put an entry with an expiry removes its file on time (at its sweeps), which every
process then sees as a miss; an entry whose writer stopped before its expiry is removed by the
next process that starts (or compacts) after it. A read in a process that does not know an
expiry serves the entry until then.

A seam of its own because these rules (inodes, the journal, compaction, several processes) are
independent of how entries are stored, read and evicted; the tier tells this object what happened
to its files, and this object tells the tier which entries to forget (``forget_locked``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Clock, Expiries, TierStats
from kvfuse.tiers.disk.journal import ExpiryJournal, journal_line, parse_journal

log = logging.getLogger(__name__)


class DiskExpiries:
    """The expiries of one disk tier's files; see the module docstring.

    It shares the tier's ``lock`` (methods named ``*_locked`` are called under it; the others take
    it) and tells the tier to drop an entry from its index through ``forget_locked(key)`` (under
    the lock). Side effects, stated: it removes expired files, appends to and rewrites the journal,
    and counts ``expired`` and ``errors`` in the tier's ``stats``."""

    compact_min = 64  # compact the journal once it has at least this many stale lines

    def __init__(
        self,
        root: Path,
        fsync: bool,
        lock: threading.Lock,
        stats: TierStats,
        path_of: Callable[[ChunkKey], str],
        clock: Clock,
        forget_locked: Callable[[ChunkKey], None],
    ) -> None:
        self.journal = ExpiryJournal(root, fsync)
        self._map = Expiries()  # key -> (expires_at, inode of the file it applies to)
        self._root, self._lock, self._stats = root, lock, stats
        self._path_of, self._clock, self._forget_locked = path_of, clock, forget_locked

    def __len__(self) -> int:
        return len(self._map)

    def _passed(self, expires_at: float | None) -> bool:
        return expires_at is not None and expires_at <= self._clock()

    def expired(self, key: ChunkKey, ino: int) -> bool:
        """Whether the file of inode ``ino`` holding ``key`` has an expiry that passed."""
        rec = self._map.get(key)
        return rec is not None and rec[1] == ino and self._passed(rec[0])

    # -- what happens to the tier's files -------------------------------------------------------

    def commit_locked(
        self, key: ChunkKey, expires_at: float | None, ino: int, rename: Callable[[], None]
    ) -> None:
        """Make the staged file of inode ``ino`` the entry of ``key`` (``rename()`` puts it in
        place) with ``expires_at``; an older expiry of ``key`` is cancelled. Raises OSError (the
        write is then dropped: the file was not renamed)."""
        if expires_at is None:
            rename()
        else:
            # Recorded before the file is visible, and under the shared lock until it is (a
            # compaction meanwhile would drop a line whose file is not in place yet). A
            # failure drops the write: no entry is kept with an expiry it cannot keep.
            with self.journal.locked(fcntl.LOCK_SH):
                self.journal.write([journal_line(key, expires_at, ino)])
                rename()
        old = self._map.pop(key)
        if expires_at is not None:
            self._map.set(key, expires_at, ino)
        elif old is not None:
            self._append_locked([journal_line(key, None, old[1])])

    def drop_locked(self, key: ChunkKey) -> str | None:
        """Forget ``key``'s expiry (its file is being removed): the journal line recording the
        removal (for ``settle_locked``), or None if it had none."""
        rec = self._map.pop(key)
        return None if rec is None else journal_line(key, None, rec[1])

    def settle_locked(self, lines: list[str]) -> None:
        """Append removal ``lines`` (from ``drop_locked``), then compact the journal if due."""
        self._append_locked(lines)
        self._maybe_compact_locked()

    def drop_expired(self, key: ChunkKey, ino: int) -> None:
        """Remove the expired file of ``key`` (inode ``ino``), counted in ``expired``."""
        with self._lock:
            rec = self._map.get(key)
            if rec is None or rec[1] != ino:
                return  # put again meanwhile
            self._map.pop(key)
            self._forget_locked(key)
            gone = self._unlink_if(key, ino)
            self.settle_locked([journal_line(key, None, ino)])
        if gone:
            self._stats.add(expired=1)

    # -- the Tier operations on expiries --------------------------------------------------------

    def expiry(self, key: ChunkKey) -> float | None:
        """``Tier.expiry``: None for no expiry known here, or not held (no need to look then)."""
        rec = self._map.get(key)
        if rec is None:
            return None
        try:
            ino = os.stat(self._path_of(key)).st_ino
        except OSError:
            return None
        if ino != rec[1]:
            return None  # put again since (by another process): its expiry is not known here
        if self._passed(rec[0]):
            self.drop_expired(key, ino)
            return None
        return rec[0]

    def extend(self, key: ChunkKey, ino: int, expires_at: float) -> bool:
        """``Tier.extend`` of the file of inode ``ino`` holding ``key``; True if it is held."""
        with self._lock:
            rec = self._map.get(key)
            if rec is None or rec[1] != ino:
                return True  # no expiry (known here): it lives longer already
            if not self._passed(rec[0]):
                if rec[0] < expires_at:
                    self._append_locked([journal_line(key, expires_at, ino)])
                    self._map.set(key, expires_at, ino)
                    self._maybe_compact_locked()
                return True
        self.drop_expired(key, ino)
        return False

    def expire(self) -> int:
        """``Tier.expire``: remove every file whose expiry passed; the count removed."""
        now = self._clock()
        removed = 0
        with self._lock:
            lines = []
            for key, (_, ino) in self._map.due(now):
                if self._unlink_if(key, ino):
                    self._forget_locked(key)
                    removed += 1
                lines.append(journal_line(key, None, ino))
            self.settle_locked(lines)
        if removed:
            self._stats.add(expired=removed)
        return removed

    # -- the journal ----------------------------------------------------------------------------

    def _append_locked(self, lines: list[str]) -> None:
        """Append ``lines`` to the journal; a failure is logged and counted."""
        try:
            self.journal.append(lines)
        except OSError as e:
            log.warning("disk tier %s: cannot append to the expiry journal: %s", self._root, e)
            self._stats.add(errors=1)

    def _maybe_compact_locked(self) -> None:
        """Compact the journal when its stale lines exceed about twice the live ones."""
        live = len(self._map)
        stale = self.journal.lines - live
        if stale >= self.compact_min and stale > 2 * live:
            self.compact_locked(None)

    def compact_locked(self, inodes: dict[ChunkKey, int] | None) -> set[ChunkKey]:
        """Rewrite the journal from what it holds now (every process's lines): the live record of
        each file only; delete the files whose expiry passed; learn the rest. ``inodes``: the
        files' inodes when the caller just scanned them (saves a stat per key).
        Returns the keys whose files were deleted."""
        removed: set[ChunkKey] = set()
        try:
            with self.journal.locked(fcntl.LOCK_EX):
                live = self._live_records(parse_journal(self.journal.read()), inodes, removed)
                self.journal.rewrite((k, t, ino) for k, (t, ino) in live.items())
        except OSError as e:
            log.warning("disk tier %s: cannot compact the expiry journal: %s", self._root, e)
            self._stats.add(errors=1)
        else:
            self._map = Expiries()
            for key, (t, ino) in live.items():
                self._map.set(key, t, ino)
        for key in removed:
            self._forget_locked(key)
            self._map.pop(key)
        if removed:
            self._stats.add(expired=len(removed))
        return removed

    def _live_records(
        self, records: dict, inodes: dict[ChunkKey, int] | None, removed: set[ChunkKey]
    ) -> dict[ChunkKey, tuple[float, int]]:
        """The journal's records that apply to a file still in place and not expired; the files
        of expired ones are deleted (their keys added to ``removed``)."""
        now = self._clock()
        live: dict[ChunkKey, tuple[float, int]] = {}
        for (key, ino), expires_at in records.items():
            if expires_at is None:
                continue
            current = None if inodes is None else inodes.get(key)
            if (
                current != ino
            ):  # not scanned as this file: look (another process may have just put it)
                try:
                    current = os.stat(self._path_of(key)).st_ino
                except OSError:
                    current = None
            if current != ino:
                continue  # gone, or replaced by a later put (whose own line, if any, rules)
            if expires_at <= now:
                if self._unlink_if(key, ino):
                    removed.add(key)
                continue
            live[key] = (expires_at, ino)
        return live

    def _unlink_if(self, key: ChunkKey, ino: int) -> bool:
        """Remove ``key``'s file if it is still the file of inode ``ino`` (not one put since)."""
        path = self._path_of(key)
        try:
            if os.stat(path).st_ino != ino:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("disk tier %s: cannot remove expired %s: %s", self._root, key, e)
            self._stats.add(errors=1)
            return False

    def close(self) -> None:
        self.journal.close()
