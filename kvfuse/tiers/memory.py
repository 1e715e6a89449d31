"""The memory tier: an LRU dictionary bounded by the bytes of its values, optionally queue-aware
(``set_protect``: the entries queued requests will load are evicted last)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier, check_key, nbytes


class MemoryTier(Tier):
    """LRU by bytes (only the values' lengths are counted, not Python's per-object overhead).

    ``get`` and ``put`` make an entry most recent; ``contains`` does not (lookups are
    side-effect-free). An entry larger than the whole capacity is not stored (``dropped_writes``).
    ``put`` keeps the value it is given, without a copy: an ``Entry`` from ``encode_entry`` (whose
    payload is the chunk tensor's memory) is stored and later decoded with no copy of the KV at
    all. The tier takes ownership: a caller must not modify a value after putting it.
    """

    holds_entries = True

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"MemoryTier capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[ChunkKey, Blob] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._protect: Callable[[], Collection[ChunkKey]] | None = None

    def set_protect(self, protect: Callable[[], Collection[ChunkKey]] | None) -> None:
        """Queue-aware eviction: ``protect()`` names the keys not to evict while others can go (the
        keys queued requests will load). When only protected entries are left to make room, the
        least recently used of them goes after all (``protected_evictions``): the budget holds."""
        self._protect = protect

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._data

    def get(self, key: ChunkKey) -> Blob | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
        if value is None:
            self.stats.add(misses=1)
        else:
            self.stats.add(hits=1, bytes_out=nbytes(value))
        return value

    def put(self, key: ChunkKey, value: Blob) -> None:
        check_key(key)
        size = nbytes(value)
        evicted = forced = 0
        # The protected set is asked for outside the lock (it comes from the engine's queue), and
        # only when this put has to evict something.
        protected = self._protect() if self._protect is not None and self._used + size > self.capacity_bytes else ()
        with self._lock:
            self._remove(key)
            if size > self.capacity_bytes:
                self.stats.add(dropped_writes=1)
                return
            self._data[key] = value
            self._used += size
            if self._used > self.capacity_bytes and protected:
                protected = set(protected)
                for k in [k for k in self._data if k not in protected and k != key]:
                    if self._used <= self.capacity_bytes:
                        break
                    self._used -= nbytes(self._data.pop(k))
                    evicted += 1
            while self._used > self.capacity_bytes:
                k, old = self._data.popitem(last=False)
                self._used -= nbytes(old)
                evicted += 1
                forced += k in protected
        self.stats.add(puts=1, bytes_in=size, evictions=evicted, protected_evictions=forced)

    def bytes_of(self, keys: Collection[ChunkKey]) -> int:
        """The bytes the entries of ``keys`` take here (those held)."""
        with self._lock:
            return sum(nbytes(self._data[k]) for k in keys if k in self._data)

    def _remove(self, key: ChunkKey) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        self._used -= nbytes(old)
        return True

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._remove(key)

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            doomed = [k for k in self._data if str(k).startswith(prefix)]
            for k in doomed:
                self._remove(k)
        return len(doomed)

    def keys_lru(self) -> list[ChunkKey]:
        """Keys from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._data)

    def entries(self) -> int:
        with self._lock:
            return len(self._data)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used
