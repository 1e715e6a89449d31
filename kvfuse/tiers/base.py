"""The tier interface: a byte store keyed by ``ChunkKey``, with per-tier counters; and
``IndexedTier``, what the memory and disk tiers share: an index of what they hold, kept within
their capacity by the eviction policy.

A tier stores and returns bytes; it does not judge them. Whether what comes back is an intact
entry, the one asked for, is checked in one place above the tiers (``TieredStore`` through
``kv.format.open_entry``), which also tells the tier to drop an entry found unusable.

A tier never raises for an operational failure (disk full, server down, a vanished file): it logs,
counts the error and answers as for a miss (``get`` -> None, ``contains`` -> False, writes dropped).
Bad arguments (something that is not a ``ChunkKey``) are TypeErrors. The store calls tiers through
``guarded``, so that a tier which raises anyway (a bug) is a counted miss, not a failed request.

Expiry (retention): a put may give an entry an ``expires_at``, an absolute time on the tier's
``clock`` (wall-clock seconds since the epoch, ``time.time`` unless the store sets another); None
is no expiry (the entry lives until evicted or deleted). A put replaces the value *and* its
expiry; a put whose ``expires_at`` has passed stores nothing (and removes an older value). Reads
(``contains``, ``get``, ``read_range`` and their batches) treat an expired entry as absent and
remove it, counted in ``expired`` (not as an error); ``expire()`` removes every expired entry
now. ``extend`` only ever lengthens a life: an entry without expiry is left alone.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, TypeVar

from kvfuse.counters import Counters
from kvfuse.kv.format import Blob, Entry  # noqa: F401  (re-exported for the tiers)
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.eviction import Eviction, Quotas, Victim
from kvfuse.tiers.key_index import KeyIndex

log = logging.getLogger(__name__)

T = TypeVar("T")
Clock = Callable[
    [], float
]  # wall-clock seconds since the epoch (``time.time``); injectable for tests

# Tiers take ``bytes``, ``bytearray``, ``memoryview`` or an ``Entry`` (header + payload, unjoined)
# and hand back what they hold: the very object (memory), ``bytes`` (Redis) or a fresh, private,
# writable ``memoryview`` (disk: the raw codec decodes it without a copy). All compare equal (==)
# to the bytes of what was put.


def nbytes(value: Blob) -> int:
    """The size of a value in bytes, whatever its kind."""
    return len(value) if isinstance(value, Entry) else memoryview(value).nbytes


def check_key(key: ChunkKey) -> ChunkKey:
    if not isinstance(key, ChunkKey):
        raise TypeError(f"tiers take ChunkKey keys, got {type(key).__name__} {key!r}")
    return key


@dataclass
class TierStats(Counters):
    """Counters of one tier. ``bytes_in`` = bytes written, ``bytes_out`` = bytes read."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    evictions: int = 0
    errors: int = 0
    dropped_writes: int = 0
    protected_evictions: int = 0  # memory: entries of queued requests evicted for want of room
    expired: int = 0  # entries removed because their expiry passed
    decrypt_failures: int = 0  # encrypted tiers: values that did not open (read as misses)


class Expiries:
    """``key -> (expires_at, tag)`` with a heap of the times, so a sweep costs the entries due, not
    all of them. Not thread-safe: the owning tier's lock guards it. ``tag`` is the tier's own
    (the disk tier keeps the file's inode there)."""

    def __init__(self) -> None:
        self._at: dict[ChunkKey, tuple[float, Any]] = {}
        self._heap: list[tuple[float, int, ChunkKey]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._at

    def get(self, key: ChunkKey) -> tuple[float, Any] | None:
        return self._at.get(key)

    def set(self, key: ChunkKey, expires_at: float, tag: Any = None) -> None:
        self._at[key] = (expires_at, tag)
        heapq.heappush(self._heap, (expires_at, next(self._seq), key))
        if len(self._heap) > 2 * len(self._at) + 1024:  # superseded times pile up: rebuild
            self._heap = [(t, next(self._seq), k) for k, (t, _) in self._at.items()]
            heapq.heapify(self._heap)

    def pop(self, key: ChunkKey) -> tuple[float, Any] | None:
        return self._at.pop(key, None)

    def due(self, now: float) -> list[tuple[ChunkKey, tuple[float, Any]]]:
        """Remove and return every record whose time is ``<= now``."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            t, _, key = heapq.heappop(self._heap)
            rec = self._at.get(key)
            if rec is not None and rec[0] == t:
                del self._at[key]
                out.append((key, rec))
        return out


def guarded(tier: "Tier", what: str, fn: Callable, default, *args):
    """``fn(*args)``, or ``default`` when it raises: the error is logged and counted as an error of
    ``tier``. Tiers answer their own failures as misses; this is the store's guard against a tier
    bug, which must not take a request down."""
    try:
        return fn(*args)
    except Exception as e:
        log.exception("tier %s: %s raised %s", tier.name, what, e)
        tier.stats.add(errors=1)
        return default


def put_many_expiring(tier: "Tier", items: list, expires_at: float | None) -> None:
    """``tier.put_many(items, expires_at)``, without the argument when it is None (so a tier
    subclass written before expiry existed keeps working for entries without one)."""
    if expires_at is None:
        tier.put_many(items)
    else:
        tier.put_many(items, expires_at=expires_at)
    if tier.observer is not None and not tier.reports_puts:
        for key, _ in items:
            tier.observer.stored(key)


class TierObserver(Protocol):
    """Told what a tier stored and lost (``kvfuse/events``: KV events for routers). Called on
    the tier's own threads, some under its lock: an observer only hands the key on (a deque
    append), never blocks and never calls back into the tier."""

    def stored(self, key: ChunkKey) -> None: ...

    def removed(self, key: ChunkKey) -> None: ...


class Tier(ABC):
    """One storage tier."""

    name: str = "tier"
    # True when ``get`` hands back the very objects that were put (in-process ``Entry`` objects):
    # reading a layer range is then a decode of those layers, not a byte read.
    holds_entries: bool = False
    # True when ``get_many`` is one round trip (Redis's MGET): the store reads a batch in one call.
    # Otherwise it reads key by key and checks each entry as soon as it is read.
    batch_reads: bool = False
    # True when ``read_with`` reads the stored bytes piece by piece as its reader asks for them
    # (disk: from the file): the store then checks each piece of an entry as it arrives
    # (``kv.format.read_entry``) instead of reading the whole entry and checking it afterwards.
    streams_reads: bool = False
    # The most bytes the tier keeps, where it has such a bound (memory, disk); None otherwise.
    capacity_bytes: int | None = None
    # Told of every entry stored and removed (evicted, expired, deleted by key), when set; a
    # deletion by prefix is reported by whoever asked for it (``TierObserver``). A tier that
    # does not report its own puts (``reports_puts`` False: Redis, S3, which cannot see their
    # evictions either) is reported by ``put_many_expiring`` after a put that did not raise.
    observer: TierObserver | None = None
    reports_puts: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()
        self.clock: Clock = time.time  # the time expiries are on (the store may set its own)

    def _stored(self, key: ChunkKey) -> None:
        if self.observer is not None:
            self.observer.stored(key)

    def _gone(self, key: ChunkKey) -> None:
        if self.observer is not None:
            self.observer.removed(key)

    def _expired_at(self, expires_at: float | None) -> bool:
        """Whether an entry expiring at ``expires_at`` is expired now."""
        return expires_at is not None and expires_at <= self.clock()

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether ``key`` is stored (and not expired). Side-effect-free: no recency update, no
        hit/miss counting; only an expired entry found is removed (and counted in ``expired``)."""

    @abstractmethod
    def get(self, key: ChunkKey) -> Blob | None:
        """The stored bytes, or None on a miss (including any failure)."""

    @abstractmethod
    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        """Save ``value`` under ``key`` until ``expires_at`` (None: no expiry), replacing any previous
        value and its expiry; failures drop the write. An ``expires_at`` that has passed stores
        nothing and removes an older value."""

    @abstractmethod
    def expiry(self, key: ChunkKey) -> float | None:
        """When the entry of ``key`` expires (None: no expiry, or not held)."""

    @abstractmethod
    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        """Keep ``key`` at least until ``expires_at``: an entry expiring earlier gets ``expires_at``,
        one without expiry is left as it is (it lives longer already); True if ``key`` is held."""

    @abstractmethod
    def expire(self) -> int:
        """Remove every entry whose expiry has passed; the count removed (added to ``expired``)."""

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; True if something was removed."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every key whose string form starts with ``prefix`` (e.g. a tenant tag or a
        namespace's short id); the count removed."""

    def read_range(self, key: ChunkKey, start: int, stop: int) -> bytes | memoryview | None:
        """Bytes ``[start, stop)`` of the stored value (fewer if it is shorter), or None on a miss:
        one layer range of an entry without reading the rest. The default reads the whole value."""
        value = self.get(key)
        if value is None:
            return None
        return memoryview(value.join() if isinstance(value, Entry) else value)[start:stop]

    def read_with(
        self, key: ChunkKey, reader: Callable[[Callable[[memoryview], int], int], T]
    ) -> T | None:
        """``reader(readinto, size)`` over the stored value of ``key``, or None on a miss: the
        reader pulls the value's ``size`` bytes in order through ``readinto(view)`` (the count
        written into ``view``, 0 at the end). The read counts as a hit; what the reader raises (a
        FormatError for a damaged entry) propagates. The default reads the whole value with
        ``get`` first; the disk tier reads its file as the reader goes (``streams_reads``)."""
        value = self.get(key)
        if value is None:
            return None
        data = memoryview(value.join() if isinstance(value, Entry) else value).cast("B")
        pos = 0

        def readinto(view: memoryview) -> int:
            nonlocal pos
            n = min(len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            pos += n
            return n

        return reader(readinto, len(data))

    def clear(self) -> int:
        """Remove everything this tier stores; the count removed."""
        return self.delete_prefix("")

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        return [self.get(k) for k in keys]

    def put_many(
        self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None
    ) -> None:
        """``put`` of every item; all of them share ``expires_at``."""
        for key, value in items:
            if expires_at is None:
                self.put(key, value)
            else:
                self.put(key, value, expires_at)

    def expiries(self, keys: Iterable[ChunkKey]) -> list[float | None]:
        """``expiry`` of every key."""
        return [self.expiry(k) for k in keys]

    def extend_many(self, keys: Iterable[ChunkKey], expires_at: float) -> list[bool]:
        """``extend`` of every key (one round trip where the tier can)."""
        return [self.extend(k, expires_at) for k in keys]

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        """``delete`` of every key; the count removed."""
        return sum(bool(self.delete(k)) for k in keys)

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        """Up to ``limit`` stored keys (None: all): most recently used first where the tier knows
        recency (memory, disk), else in the tier's own order (Redis: SCAN's). The default raises
        NotImplementedError: a tier that cannot list what it holds cheaply (S3: a whole bucket
        listing) says so rather than answering with a partial list."""
        raise NotImplementedError(
            f"the {self.name} tier ({type(self).__name__}) cannot list its keys"
        )

    def entries(self) -> int | None:
        """Number of entries, or None where the tier does not track it cheaply."""
        return None

    def used_bytes(self) -> int | None:
        """Bytes of stored values, or None where the tier does not track it cheaply."""
        return None

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Per tenant tag with a byte quota in this tier: ``used_bytes``, ``entries``,
        ``quota_bytes``, ``quota_evictions`` (``store/tenant_quota.py``); {} where the tier has no
        quotas (the default; only the memory and disk tiers account bytes per tenant)."""
        return {}

    def close(self) -> None:
        """Release resources; the tier must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class IndexedTier(Tier):
    """A tier that knows what it holds, the memory and disk tiers (the disk tier: what this
    process knows): its keys and their sizes in a ``KeyIndex``, least recent first (~70 bytes an
    entry), and their bytes (``_used``), kept within ``capacity_bytes`` and the tenants'
    ``quotas`` (``kvfuse.store.tenant_quota``; None: none) by the eviction policy
    (``tiers/eviction.py``). ``_lock`` guards them all. ``with_values``: the index keeps each
    entry's value too (the memory tier's)."""

    def __init__(
        self, capacity_bytes: int, quotas: Quotas | None = None, with_values: bool = False
    ) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(
                f"{type(self).__name__} capacity_bytes must be a non-negative int, "
                f"got {capacity_bytes!r}"
            )
        self.capacity_bytes = capacity_bytes
        self._quotas = quotas
        self._eviction = Eviction(quotas)
        # key -> (size, value), least recent first, and per owner with quotas
        self._index = KeyIndex(with_values=with_values, owner_of=self._eviction.owner_of)
        self._used = 0
        self._lock = threading.Lock()

    def _victims_locked(
        self, key: ChunkKey | None, protected: Collection[ChunkKey] = ()
    ) -> Iterator[Victim]:
        """The entries to evict after ``key`` was put or used (None: after a start-up scan), as
        the eviction policy names them, one at a time: the tier removes each before it asks for
        the next (the policy reads the index and ``_used`` again)."""
        policy = self._eviction
        while True:
            victim = policy.next_victim(
                self._index, key, self._used, self.capacity_bytes, protected
            )
            if victim is None:
                return
            yield victim
            policy.evicted(victim)

    def _room_locked(self, key: ChunkKey) -> int:
        """The largest entry ``key`` may have: the capacity, or less, its tenant's quota."""
        return self._eviction.room(self._index, key, self.capacity_bytes)

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Per tenant tag with a quota here: bytes and entries held, the quota, its evictions."""
        if self._quotas is None:
            return {}
        with self._lock:
            return self._eviction.usage(self._index)

    def keys_lru(self) -> list[ChunkKey]:
        """Keys from least to most recently used (the eviction order)."""
        with self._lock:
            return self._index.keys()

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        """Up to ``limit`` keys (None: all), most recently used first."""
        return self.keys_lru()[::-1][:limit]

    def entries(self) -> int:
        with self._lock:
            return len(self._index)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used
