"""The memory tier: an LRU dictionary bounded by the bytes of its values, with per-entry expiry
beside the LRU (see ``tiers/base.py``). Which entry it evicts is the eviction policy's
(``tiers/eviction.py``): least recently used first, optionally queue-aware (``set_protect``: the
entries queued requests will load are evicted last) and with per-tenant byte quotas (``quotas``,
``kvfuse.store.tenant_quota``: a tenant over its quota loses its own oldest entries). The keys,
sizes and LRU order live in a compact ``KeyIndex`` (about 70 bytes per entry with the value's
pointer, instead of ~265 in an ``OrderedDict`` of key objects)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Expiries, IndexedTier, check_key, nbytes
from kvfuse.tiers.eviction import Quotas


class MemoryTier(IndexedTier):
    """LRU by bytes (only the values' lengths are counted, not Python's per-object overhead).

    ``get`` and ``put`` make an entry most recent; ``contains`` does not (lookups are
    side-effect-free, apart from removing an expired entry). An entry larger than the whole
    capacity is not stored (``dropped_writes``). Expiries live in a map beside the LRU; eviction
    ignores them (an expired entry goes at its next read or sweep, ``expire``).
    ``put`` keeps the value it is given, without a copy: an ``Entry`` from ``encode_entry`` (whose
    payload is the chunk tensor's memory) is stored and later decoded with no copy of the KV at
    all. The tier takes ownership: a caller must not modify a value after putting it.
    """

    holds_entries = True
    reports_puts = True  # its put and _remove tell the observer (events)

    def __init__(
        self, capacity_bytes: int, name: str = "memory", quotas: Quotas | None = None
    ) -> None:
        super().__init__(capacity_bytes, quotas, with_values=True)  # the index, within capacity
        self.name = name
        self._protect: Callable[[], Collection[ChunkKey]] | None = None
        self._expiry = Expiries()  # key -> expires_at of the entries that have one

    def _live_locked(self, key: ChunkKey) -> tuple[bool, int]:
        """``(held, expired)``: whether ``key`` is held and not expired, and 1 if it was held but
        expired (now removed)."""
        if key not in self._index:
            return False, 0
        if self._expiry:
            rec = self._expiry.get(key)
            if rec is not None and self._expired_at(rec[0]):
                self._remove(key)
                return False, 1
        return True, 0

    def set_protect(self, protect: Callable[[], Collection[ChunkKey]] | None) -> None:
        """Queue-aware eviction: ``protect()`` names the keys not to evict while others can go (the
        keys queued requests will load). When only protected entries are left to make room, the
        least recently used of them goes after all (``protected_evictions``): the budget holds."""
        self._protect = protect

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            held, expired = self._live_locked(key)
        if expired:
            self.stats.add(expired=expired)
        return held

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        # One lock for the batch (a prompt's chain): lookups are most of what the index does.
        keys = list(keys)
        with self._lock:
            if not self._expiry:
                return self._index.contains_many(keys)
            found = [self._live_locked(k) for k in keys]
        expired = sum(e for _, e in found)
        if expired:
            self.stats.add(expired=expired)
        return [held for held, _ in found]

    def get(self, key: ChunkKey) -> Blob | None:
        with self._lock:
            held, expired = (
                self._live_locked(key) if self._expiry else (True, 0)
            )  # one probe, not two
            found = self._index.use(key) if held else None
            value = None if found is None else found[1]
        if value is None:
            self.stats.add(misses=1, expired=expired)
        else:
            self.stats.add(hits=1, bytes_out=nbytes(value))
        return value

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        check_key(key)
        if self._expired_at(expires_at):
            with self._lock:
                self._remove(key)
            return
        size = nbytes(value)
        # The protected set is asked for outside the lock (it comes from the engine's queue), and
        # only when this put has to evict something.
        protected = (
            self._protect() if self._protect is not None and self._must_evict(key, size) else ()
        )
        with self._lock:
            if size > self._room_locked(key):
                self._remove(key)
                self.stats.add(dropped_writes=1)
                return
            self._remove(key, gone=False)  # replaced, not lost
            self._index.put(key, size, value)
            self._used += size
            if expires_at is not None:
                self._expiry.set(key, expires_at)
            evicted, forced = self._evict_locked(key, set(protected) if protected else ())
        self._stored(key)
        self.stats.add(puts=1, bytes_in=size, evictions=evicted, protected_evictions=forced)

    def _must_evict(self, key: ChunkKey, size: int) -> bool:
        """Whether putting ``size`` bytes under ``key`` is to evict something (over the capacity,
        or over the quota of ``key``'s tenant)."""
        with self._lock:
            return self._eviction.must_evict(
                self._index, key, size, self._used, self.capacity_bytes
            )

    def _evict_locked(self, key: ChunkKey, protected: Collection[ChunkKey]) -> tuple[int, int]:
        """Evict what the eviction policy names after ``key`` was put (never it: a tenant over its
        quota loses its own oldest entries, then the tier goes within its capacity; queued
        requests' entries, ``protected``, last). The counts (evicted, protected ones among
        them)."""
        evicted = forced = 0
        for victim in self._victims_locked(key, protected):
            self._remove(victim.key)
            evicted, forced = evicted + 1, forced + victim.protected
        return evicted, forced

    def bytes_of(self, keys: Collection[ChunkKey]) -> int:
        """The bytes the entries of ``keys`` take here (those held)."""
        with self._lock:
            return sum(size for size in map(self._index.size, keys) if size is not None)

    def _remove(self, key: ChunkKey, gone: bool = True) -> bool:
        """Drop ``key``'s entry; ``gone``: it leaves the tier (told to the observer), rather than
        being replaced by a put."""
        self._expiry.pop(key)
        old = self._index.pop(key)
        if old is None:
            return False
        self._used -= old[0]
        if gone:
            self._gone(key)
        return True

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._remove(key)

    def expiry(self, key: ChunkKey) -> float | None:
        with self._lock:
            held, expired = self._live_locked(key)
            rec = self._expiry.get(key) if held else None
        if expired:
            self.stats.add(expired=expired)
        return None if rec is None else rec[0]

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        with self._lock:
            held, expired = self._live_locked(key)
            rec = self._expiry.get(key) if held else None
            if rec is not None and rec[0] < expires_at:
                self._expiry.set(key, expires_at)
        if expired:
            self.stats.add(expired=expired)
        return held

    def expire(self) -> int:
        now = self.clock()
        with self._lock:
            removed = sum(self._remove(key) for key, _ in self._expiry.due(now))
        if removed:
            self.stats.add(expired=removed)
        return removed

    def delete_prefix(self, prefix: str) -> int:
        """No scan of the entries: the index keeps keys by namespace group, a tenant's or a
        salt's prefix picks whole groups (``KeyIndex.keys_with_prefix``)."""
        with self._lock:
            doomed = self._index.keys_with_prefix(prefix)
            for k in doomed:
                self._remove(k)
        return len(doomed)
