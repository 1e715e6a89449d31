"""The tier interface: a byte store keyed by storage-key strings, with per-tier counters.

A tier never raises for an operational failure (disk full, server down, a vanished file): it logs,
counts the error and answers as for a miss (``get`` -> None, ``contains`` -> False, writes dropped).
Bad arguments (a key a tier cannot represent) are ValueErrors.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Iterable

from kvfuse.kv.format import Blob, Entry  # noqa: F401  (re-exported for the tiers)

# Tiers take ``bytes``, ``bytearray``, ``memoryview`` or an ``Entry`` (header + payload, unjoined)
# and hand back what they hold: the very object (memory), ``bytes`` (Redis) or a fresh, private,
# writable ``memoryview`` (disk: the raw codec decodes it without a copy). All compare equal (==)
# to the bytes of what was put.


def nbytes(value: Blob) -> int:
    """The size of a value in bytes, whatever its kind."""
    return len(value) if isinstance(value, Entry) else memoryview(value).nbytes


@dataclass
class TierStats:
    """Thread-safe counters of one tier. ``bytes_in`` = bytes written, ``bytes_out`` = bytes read."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    evictions: int = 0
    errors: int = 0
    dropped_writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to several counters at once, e.g. ``stats.add(hits=1, bytes_out=n)``."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of all counters."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class Tier(ABC):
    """One storage tier. Keys are opaque strings (``str(ChunkKey)`` in practice)."""

    name: str = "tier"
    # True when ``get`` itself rejects corrupt entries (the store then skips its own check).
    validates_on_get: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored. Side-effect-free: no recency update, no hit/miss counting."""

    @abstractmethod
    def get(self, key: str) -> Blob | None:
        """The stored bytes, or None on a miss (including any failure)."""

    @abstractmethod
    def put(self, key: str, value: Blob) -> None:
        """Store ``value`` under ``key`` (replacing any previous value); failures drop the write."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if something was removed."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` (e.g. a namespace's short id); the count removed."""

    def clear(self) -> int:
        """Remove everything this tier stores; the count removed."""
        return self.delete_prefix("")

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Iterable[str]) -> list[Blob | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, Blob]]) -> None:
        for key, value in items:
            self.put(key, value)

    def entries(self) -> int | None:
        """Number of entries, or None where the tier does not track it cheaply."""
        return None

    def used_bytes(self) -> int | None:
        """Bytes of stored values, or None where the tier does not track it cheaply."""
        return None

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
