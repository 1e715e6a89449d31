"""The memory tier: an LRU dictionary bounded by the bytes of its values."""

from __future__ import annotations

import threading
from collections import OrderedDict

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
        evicted = 0
        with self._lock:
            self._remove(key)
            if size > self.capacity_bytes:
                self.stats.add(dropped_writes=1)
                return
            self._data[key] = value
            self._used += size
            while self._used > self.capacity_bytes:
                _, old = self._data.popitem(last=False)
                self._used -= nbytes(old)
                evicted += 1
        self.stats.add(puts=1, bytes_in=size, evictions=evicted)

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
