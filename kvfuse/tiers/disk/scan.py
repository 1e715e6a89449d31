"""The disk tier's start-up scan: every entry file under the root, as columns, and stale temp files removed.

A restart rebuilds the tier's LRU index from the files themselves: a file's mtime is its recency
(set on every put and hit). A million files take seconds, so names are parsed by one regex into
columns (no key object per file) and the index is filled from them at once (``KeyIndex.load``).

A folder or file that cannot be read (EACCES, EIO) is skipped and counted (``unreadable``): a tier
never fails its process for an operational failure (an unreadable fan-out folder used to stop
the server from starting); its entries are misses until its permissions are fixed. Temp files
whose writer is gone (``files.stale_temp``) are removed on the way.

A seam of its own because it is the one bulk, columnar pass over the folder, unlike the tier's
per-key work, and the only part of start-up that does not need the tier's index or lock.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.tiers.disk.files import LEGACY_NAME_RE, NAME_RE, fan_out, stale_temp

log = logging.getLogger(__name__)


@dataclass
class Scan:
    """The entry files found: row ``i`` is the file of key ``key(i)`` (its namespace, kind and
    variant in ``groups[group_of[i]]``, its digest in ``digests[i]``), with its mtime (ns), size
    and inode; ``unreadable``: the folders and files that could not be read."""

    groups: list[tuple[str, ChunkKind, str]]
    group_of: np.ndarray
    digests: np.ndarray
    mtimes: np.ndarray
    sizes: np.ndarray
    inos: list[int]
    unreadable: int

    def __len__(self) -> int:
        return len(self.inos)

    def key(self, i: int) -> ChunkKey:
        ns, kind, variant = self.groups[self.group_of[i]]
        return ChunkKey(ns, self.digests[i].tobytes(), kind, variant)

    def lru_order(self) -> np.ndarray:
        """The rows from least to most recently used (by mtime)."""
        return np.argsort(self.mtimes, kind="stable")

    def inodes(self) -> dict[ChunkKey, int]:
        """Each file's inode by key."""
        return {self.key(i): self.inos[i] for i in range(len(self))}


class _Columns:
    """The columns being filled by ``scan``."""

    def __init__(self) -> None:
        self.groups: dict[tuple[str, str, str], int] = {}
        self.group_of: list[int] = []
        self.hexes: list[str] = []
        self.mtimes: list[int] = []
        self.sizes: list[int] = []
        self.inos: list[int] = []

    def add(self, m, st: os.stat_result) -> None:
        group = (m.group(1), m.group(2), m.group(4) or "")
        gid = self.groups.get(group)
        if gid is None:
            gid = self.groups[group] = len(self.groups)
        self.group_of.append(gid)
        self.hexes.append(m.group(3))
        self.mtimes.append(st.st_mtime_ns)
        self.sizes.append(st.st_size)
        self.inos.append(st.st_ino)

    def done(self, unreadable: int) -> Scan:
        return Scan(
            groups=[(ns, ChunkKind(kind), variant) for ns, kind, variant in self.groups],
            group_of=np.array(self.group_of, dtype=np.intp),
            digests=np.frombuffer(bytes.fromhex("".join(self.hexes)), dtype="<u8").reshape(-1, 4),
            mtimes=np.array(self.mtimes, dtype=np.int64),
            sizes=np.array(self.sizes, dtype=np.int64),
            inos=self.inos,
            unreadable=unreadable,
        )


def scan(root, stale_temp_s: float, now: float) -> Scan:
    """Every entry file under ``root``'s fan-out folders; temp files stale at ``now`` (wall clock)
    are removed. Never raises for a folder or file it cannot read: counts it (``unreadable``)."""
    columns, unreadable = _Columns(), 0
    for entries in fan_out(root):
        if entries is None:
            unreadable += 1
            continue
        for entry in entries:
            m = NAME_RE.fullmatch(entry.name)
            if m is None:
                if entry.name.endswith(".tmp"):
                    unreadable += not _remove_if_stale(root, entry, now, stale_temp_s)
                elif LEGACY_NAME_RE.fullmatch(entry.name):
                    unreadable += not _remove_legacy(root, entry)
                continue
            try:
                if not entry.is_file():
                    continue
                st = entry.stat()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("disk tier %s: cannot stat %s (%s)", root, entry.path, e)
                unreadable += 1
                continue
            columns.add(m, st)
    return columns.done(unreadable)


def _remove_legacy(root, entry: os.DirEntry) -> bool:
    """Remove an entry file of key version 2 (``files.LEGACY_NAME_RE``): it can never be a hit,
    and no index would count or evict it; False if it could not be removed."""
    try:
        os.unlink(entry.path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning(
            "disk tier %s: cannot remove the old-version entry %s (%s)", root, entry.path, e
        )
        return False
    return True


def _remove_if_stale(root, entry: os.DirEntry, now: float, stale_temp_s: float) -> bool:
    """Remove the temp file ``entry`` if it is stale; False if it could not be looked at or removed."""
    try:
        if stale_temp(entry.name, entry.stat().st_mtime, now, stale_temp_s):
            os.unlink(entry.path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("disk tier %s: cannot stat or remove %s (%s)", root, entry.path, e)
        return False
    return True
