"""The tiered store: the memory tier, then the lower tiers (disk, Redis, S3, in that order); reads
from the fastest tier that has a chunk.

The store takes its tiers by role: ``memory`` (a ``MemoryTier``: read first, promoted into, the
tier queue-aware eviction and prefetching act on) and ``lower``, the tiers below it, fastest
first. It does lookup, fetch, promotion, put, extension, expiry and deletion over them; the rest
is in pieces of their own: ``lookups.py`` (the walks down the tiers that lookup, fetch and
promotion make), ``checked_reads.py`` (the one validation path), ``write_behind.py`` (background
writes), ``transcode.py`` (per-tier codecs, CacheGen variants), ``prefetch.py``.

Semantics in brief:

- ``lookup(keys)`` is side-effect-free (no recency update, no promotion, no tier hit/miss counts):
  it reports, for every key, the fastest tier holding it, and how many leading keys are held.
- ``fetch(keys, specs)`` reads every key from the fastest tier holding it and validates it, in
  the one place where anything read back from storage is checked (``kv.format.open_entry``:
  integrity, the key, and the caller's ``EntrySpec``; for a tier that streams its reads, the
  disk's, the same checks as the bytes arrive: ``read_entry``). An unusable entry is deleted from its
  tier, counted (``unusable_entries``, and as an error of that tier) and the next tier is
  tried. Lower-tier hits are promoted into the memory tier as ``Entry`` objects, so later memory
  hits are neither re-checked nor copied. Entries can vanish between ``lookup`` and ``fetch``
  (evicted, expired, another process): the planner replans around what ``fetch`` could not give.
- ``fetch_layers(key, first, last)`` reads and checks only the bytes of a layer range (the
  entry's layer table says where they are), for loading layer by layer.
- ``put(items)`` writes the memory tier synchronously and queues the writes to the lower tiers for
  background threads (``write_behind.py``: a bounded queue and a thread per lower tier, which
  drop and count rather than block a caller, unless asked to wait; ``wait_written`` waits for
  some keys' writes only). Each tier may have its own codec (``codecs``), and the
  extra ``stream_levels`` of CacheGen are written under the chunk's variant keys for the
  streaming loader (``fetch_encoded``; see ``transcode.py``). ``flush()`` waits for the queued
  writes.
- Signing (``signer``, from ``cache.signing_key``): every entry written to a lower tier is signed
  (``transcode.py``, on the background writer) and every entry read back from one is checked
  before use (``checked_reads.py``); an unsigned or wrongly signed one is an unusable entry. The
  key reaches only those two seams: the tiers store bytes and never see it, and the memory tier,
  whose entries never leave the process, is neither signed nor checked.
- A tier that raises (it should not: tiers count their own failures) is logged, counted, and
  treated as a miss.
- ``upcoming()`` is what the engine's queue will ask for next (``set_lookahead``), in order.
  ``protect_upcoming`` makes the memory tier evict those entries last (queue-aware eviction), and
  a ``Prefetcher`` (``prefetch.py``) reads them into memory before their requests run;
  ``fetch(..., prefetch=True)`` counts its reads, and later request reads are counted as
  ``prefetch_hits`` / ``prefetch_misses``.
- Expiry (retention; the tiers' rules are in ``tiers/base.py``): ``put(..., expires_at=t)`` gives
  the entries an expiry in every tier they are written to (the lower-tier writes, and the CacheGen
  variants, carry it); ``memory_only`` writes the memory tier only. A promotion keeps the expiry
  the entry has in the tier it came from. ``extend(keys, t)`` keeps entries (and their variants)
  at least until ``t`` in every tier, a write still queued included: the writer gives it the later
  of its own expiry and any extension made while it waited (no flush, so the caller never waits
  for the queue). ``expire()`` sweeps every tier; ``lookup`` does it by itself at most once per
  ``expire_interval_s``. ``delete(keys)`` removes entries and their variants everywhere. All
  times are on one clock (``clock``, wall-clock seconds; ``time.time`` unless given), which the
  store sets on every tier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from kvfuse.codecs.base import Codec
from kvfuse.config import CacheConfig
from kvfuse.kv.format import Entry, EntrySpec
from kvfuse.kv.keys import ChunkKey
from kvfuse.kv.signing import EntrySigner
from kvfuse.store.checked_reads import CheckedReads
from kvfuse.store.lookups import Promotion, expiries_below, first_copies, holders
from kvfuse.store.prefetch_tally import PrefetchTally
from kvfuse.store.results import Encoded, Fetched, LayerRange, LookupResult, StoreCounters
from kvfuse.store.transcode import Transcoder
from kvfuse.store.write_behind import WriteBehind
from kvfuse.tiers.base import Blob, Clock, Tier, guarded, put_many_expiring
from kvfuse.tiers.memory import MemoryTier

__all__ = ["Encoded", "Fetched", "LayerRange", "LookupResult", "StoreCounters", "TieredStore"]

log = logging.getLogger(__name__)

_STORE = "store"  # the name of the store's own counters in stats()


class TieredStore:
    """The memory tier, then the ``lower`` tiers fastest first; see the module docstring.

    ``codecs``: a lower tier's write codec by tier name (absent: entries as put);
    ``stream_levels``: the CacheGen levels written as variants to the lower tiers;
    ``write_queue_size`` / ``write_batch``: the background write queue's bound and batch;
    ``clock``: the wall clock of expiries, set on every tier (None: ``time.time``, the tiers' own);
    ``expire_interval_s``: the least time between two sweeps ``lookup`` makes;
    ``signer``: sign the lower tiers' entries and check them when read (None: no signing)."""

    def __init__(
        self,
        memory: MemoryTier,
        lower: Sequence[Tier] = (),
        *,
        write_queue_size: int = CacheConfig.write_queue,
        write_batch: int = 16,
        codecs: Mapping[str, Codec] | None = None,
        stream_levels: Sequence[int] = CacheConfig.stream_levels,
        clock: Clock | None = None,
        expire_interval_s: float = 1.0,
        signer: EntrySigner | None = None,
    ) -> None:
        self._memory, self._lower = self._roles(memory, lower)
        self._tiers: tuple[Tier, ...] = (self._memory, *self._lower)
        names = [t.name for t in self._tiers]
        if len(set(names)) != len(names) or _STORE in names:
            raise ValueError(
                f"tier names must be unique and not {_STORE!r}, got {names}; pass name=... to the tiers"
            )
        if not expire_interval_s >= 0:
            raise ValueError(f"expire_interval_s must be >= 0, got {expire_interval_s}")
        unknown = set(codecs or {}) - set(names)
        if unknown:
            raise ValueError(f"codecs for unknown tiers {sorted(unknown)}; tiers are {names}")
        if clock is not None:
            for t in self._tiers:
                t.clock = clock
        self._clock: Clock = clock if clock is not None else time.time
        self.expire_interval_s = expire_interval_s
        self._next_sweep = self._clock() + expire_interval_s
        self._sweep_lock = threading.Lock()
        self._counters = StoreCounters()
        self._reads = CheckedReads(self._counters, signer)
        self._transcoder = Transcoder(codecs or {}, stream_levels, self._counters, signer)
        self._signer = signer
        self._writer = WriteBehind(
            self._lower, self._transcoder, self._counters, write_queue_size, write_batch
        )
        self._prefetch = PrefetchTally(self._counters, self._memory.name)
        self._lookahead: Callable[[], list[ChunkKey]] | None = None
        self._closed = False

    @staticmethod
    def _roles(memory: MemoryTier, lower: Sequence[Tier]) -> tuple[MemoryTier, tuple[Tier, ...]]:
        if not isinstance(memory, MemoryTier):
            raise TypeError(
                f"TieredStore's memory tier must be a MemoryTier, got {type(memory).__name__}; "
                f"disk, Redis and S3 tiers go below it: TieredStore(MemoryTier(...), lower=[...])"
            )
        if isinstance(lower, Tier):
            raise TypeError(
                "TieredStore's lower tiers are a sequence: TieredStore(memory, [disk, ...])"
            )
        lower = tuple(lower)
        if not all(isinstance(t, Tier) for t in lower):
            raise TypeError(
                f"TieredStore's lower tiers must be Tiers, got {[type(t).__name__ for t in lower]}"
            )
        return memory, lower

    # -- the tiers ------------------------------------------------------------------------------

    @property
    def memory(self) -> MemoryTier:
        """The memory tier: reads come from it first, promotions go into it."""
        return self._memory

    @property
    def lower(self) -> tuple[Tier, ...]:
        """The tiers below memory, fastest first (disk, Redis, S3)."""
        return self._lower

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """Every tier, fastest first: the memory tier, then the lower tiers."""
        return self._tiers

    def tier(self, name: str) -> Tier:
        """The tier named ``name``; ValueError if there is none."""
        for t in self._tiers:
            if t.name == name:
                return t
        raise ValueError(f"no tier named {name!r}")

    @property
    def clock(self) -> Clock:
        """The wall clock expiries are on (``store.clock()`` is now), the same on every tier."""
        return self._clock

    @property
    def codecs(self) -> dict[str, Codec]:
        """A lower tier's write codec by tier name (absent: entries as put)."""
        return self._transcoder.codecs

    def use_model(
        self, layer_types: Sequence[str], level: int = 0, k_cap: float | None = None
    ) -> None:
        """Encode lower tiers' entries for a model whose layers are ``layer_types`` and whose
        calibrated CacheGen level and K cap are ``level`` (0: none) and ``k_cap``
        (``Transcoder.use_model``)."""
        self._transcoder.use_model(layer_types, level, k_cap)

    @property
    def signer(self) -> EntrySigner | None:
        """What the lower tiers' entries are signed and checked with (None: signing is off)."""
        return self._signer

    @property
    def stream_levels(self) -> tuple[int, ...]:
        """The CacheGen levels written as variants to the lower tiers."""
        return self._transcoder.stream_levels

    @property
    def prefetching(self) -> bool:
        """Whether a ``Prefetcher`` runs (a request's lower-tier read then counts as its miss)."""
        return self._prefetch.active

    @prefetching.setter
    def prefetching(self, on: bool) -> None:
        self._prefetch.active = on

    # -- reads ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey], count: bool = True) -> LookupResult:
        """Where each key is stored; touches no recency and moves no data. ``count=False``: a
        look of the store's own (prefetch, saving), kept out of the lookup statistics. Expired
        entries are misses (and every tier is swept now and then, see ``expire``)."""
        self._maybe_sweep()
        result = LookupResult(tuple(holders(self._tiers, keys)))
        if count:
            self._counters.add(lookups=1, lookup_keys=len(keys), lookup_hits=result.hits)
        return result

    def get(self, keys: Sequence[ChunkKey]) -> list[Entry | None]:
        """One checked entry or None per key (see ``fetch``)."""
        return [f.entry for f in self.fetch(keys)]

    def fetch(
        self,
        keys: Sequence[ChunkKey],
        specs: Sequence[EntrySpec | None] | None = None,
        prefetch: bool = False,
    ) -> list[Fetched]:
        """Per key, the checked entry and the tier that served it, which can differ from what
        ``lookup`` said: a damaged copy in a faster tier is removed and a slower one serves.
        ``prefetch``: a read ahead of the request (``Prefetcher``), counted as such."""
        specs = [None] * len(keys) if specs is None else list(specs)
        if len(specs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(specs)} specs")
        fetched, promote = first_copies(self._tiers, self._memory, self._reads, keys, specs)
        if promote:
            self._promote(promote)
        self._prefetch.count(keys, [f.tier for f in fetched], prefetch)
        return fetched

    def fetch_encoded(
        self, key: ChunkKey, tier: str, variant: str = "", spec: EntrySpec | None = None
    ) -> Encoded | None:
        """``key``'s copy ``variant`` ("cachegen.1", or "" for the primary) from the tier named
        ``tier`` only, falling back to the primary copy there; checked like ``fetch``; None if
        the tier has no usable copy. Nothing is promoted (the streaming loader reads a chunk at
        the level its bandwidth allows, not a copy to keep)."""
        return self._reads.encoded(self.tier(tier), key, variant, spec)

    def fetch_layers(
        self, key: ChunkKey, first: int, last: int, spec: EntrySpec | None = None
    ) -> LayerRange | None:
        """The KV of layers ``[first, last)`` of ``key`` from the fastest tier holding a usable
        copy, reading (from disk or Redis) only the header and those layers' bytes; None if no
        tier has one. Nothing is promoted: a layer range is not a whole entry."""
        for tier in self._tiers:
            got = self._reads.layers(tier, key, first, last, spec)
            if got is not None:
                return got
        return None

    def discard(self, key: ChunkKey) -> None:
        """Remove ``key`` from every tier and count it unusable: an entry found intact but that its
        codec could not decode (``fetch`` checks bytes, not a codec's whole decode)."""
        self._reads.discard(self._tiers, key)

    def encodings(self, tier: str) -> list[str]:
        """The variants a chunk has in ``tier`` besides its primary copy ("cachegen.1", ...)."""
        return [] if tier == self._memory.name else self._transcoder.encodings()

    # -- writes ---------------------------------------------------------------------------------

    def put(
        self,
        items: Iterable[tuple[ChunkKey, Blob]],
        block: bool = False,
        expires_at: float | None = None,
        memory_only: bool = False,
    ) -> None:
        """Save entries: the memory tier now, the lower tiers from the write queue. The queue never
        blocks a caller: where a tier's queue is full its writes are dropped and counted, unless
        ``block`` (a caller that would rather wait for room; the engine's saver never does: a
        slow tier must not throttle it).
        ``expires_at``: the entries' expiry (on ``clock``) in every tier, their variants' too (None:
        none). ``memory_only``: the memory tier only (no lower-tier writes, no variants).

        The store takes ownership of the values, without copying them (an ``Entry`` of a chunk is
        kept by the memory tier and written later by the lower tiers): do not modify them."""
        if self._closed:
            raise RuntimeError("TieredStore.put after close()")
        items = list(items)
        memory = self._memory
        guarded(memory, "put_many", put_many_expiring, None, memory, items, expires_at)
        if self._writer.running and not memory_only:
            self._writer.submit(items, expires_at, block)

    def promote(self, items: Iterable[tuple[ChunkKey, Entry]]) -> None:
        """Put entries read from a lower tier into the memory tier only (they are stored below
        already), each with the expiry it has in the first lower tier holding it (or one of its
        variants). An entry no lower tier holds any more is not promoted: it expired or was
        evicted since it was read, and a memory copy must not outlive its retention. (With no
        lower tiers, every entry is put as it is.)"""
        items = list(items)
        if not items:
            return
        if not self._lower:
            self._promote([(k, e, None) for k, e in items])
            return
        expiries, held = expiries_below(
            self._lower, [k for k, _ in items], self._transcoder.variants
        )
        self._promote([(k, e, x) for (k, e), x, h in zip(items, expiries, held) if h])

    def _promote(self, items: list[Promotion]) -> None:
        """Put ``(key, entry, expires_at)`` into the memory tier, one ``put_many`` per expiry."""
        groups: dict[float | None, list[tuple[ChunkKey, Entry]]] = {}
        for key, entry, expires_at in items:
            groups.setdefault(expires_at, []).append((key, entry))
        memory = self._memory
        for expires_at, group in groups.items():
            guarded(memory, "put_many", put_many_expiring, None, memory, group, expires_at)
        if items:
            self._counters.add(promotions=len(items))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write is done; False if ``timeout`` passed first."""
        return self._writer.flush(timeout)

    def writing(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether a lower-tier write of any of ``keys`` is still queued (or being written)."""
        return self._writer.writing(keys)

    def wait_written(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> bool:
        """Wait until the queued lower-tier writes of ``keys`` are done, not the others' (a key
        the memory tier could not keep is findable once they are); False on time-out."""
        return self._writer.wait_written(keys, timeout)

    # -- look-ahead -----------------------------------------------------------------------------

    def set_lookahead(self, provider: Callable[[], list[ChunkKey]] | None) -> None:
        """Tell the store where to learn which keys queued requests will ask for next."""
        self._lookahead = provider

    def upcoming(self) -> list[ChunkKey]:
        """The keys queued requests will ask for, in the order they will run ([] if unknown)."""
        return list(self._lookahead()) if self._lookahead is not None else []

    def protect_upcoming(self, on: bool = True) -> None:
        """Queue-aware eviction: the memory tier keeps the entries of queued requests (``upcoming``)
        while anything else can be evicted instead; off: plain LRU."""
        self._memory.set_protect(self.upcoming if on else None)

    # -- expiry ---------------------------------------------------------------------------------

    def extend(self, keys: Iterable[ChunkKey], expires_at: float, lower: bool = True) -> None:
        """Keep the entries of ``keys`` (and their variants) at least until ``expires_at`` in every
        tier: an earlier expiry is moved to it, an entry without expiry is left alone (see
        ``Tier.extend``). A write of one of them still in the queue gets it too (when it is
        written), so this never waits for the queue. ``lower=False``: the memory tier and the
        queued writes only, no call to a lower tier (a network round trip for Redis and S3):
        the caller makes it later, off its thread (``extend_below``)."""
        keys = list(keys)
        if not keys:
            return
        self._writer.note_extension(keys, expires_at)
        memory = self._memory
        guarded(memory, "extend_many", memory.extend_many, None, keys, expires_at)
        if lower:
            self.extend_below(keys, expires_at)

    def extend_below(self, keys: Sequence[ChunkKey], expires_at: float) -> None:
        """``extend``'s calls to the lower tiers (the entries they hold now, and their variants)."""
        if keys:
            self._writer.extend_lower(list(keys), expires_at)

    def expire(self) -> dict[str, int]:
        """Remove every expired entry from every tier now; the count removed per tier (Redis
        expires keys by itself: 0 there)."""
        self._next_sweep = self._clock() + self.expire_interval_s
        return {t.name: guarded(t, "expire", t.expire, 0) for t in self._tiers}

    def _maybe_sweep(self) -> None:
        """``expire()`` if ``expire_interval_s`` has passed since the last sweep (one thread sweeps;
        the others go on)."""
        if self._clock() < self._next_sweep or not self._sweep_lock.acquire(blocking=False):
            return
        try:
            if self._clock() >= self._next_sweep:
                self.expire()
        finally:
            self._sweep_lock.release()

    # -- maintenance ----------------------------------------------------------------------------

    def delete(self, keys: Iterable[ChunkKey], timeout: float | None = None) -> dict[str, int]:
        """Remove the entries of ``keys`` and their variants from every tier (after the queued
        writes, so none lands afterwards: waited for at most ``timeout``, None: until done); the
        count removed per tier."""
        keys = list(keys)
        self.flush(timeout)
        with_variants = self._transcoder.with_variants(keys)
        self._prefetch.forget(keys)
        return {
            t.name: guarded(t, "delete_many", t.delete_many, 0, with_variants) for t in self._tiers
        }

    def delete_prefix(self, prefix: str, timeout: float | None = None) -> dict[str, int]:
        """Remove every key starting with ``prefix`` from every tier (after the queued writes, so
        none lands afterwards: waited for at most ``timeout``, None: until done); the count removed
        per tier. How each tier finds the keys: its ``delete_prefix``."""
        self.flush(timeout)
        return {
            t.name: guarded(t, "delete_prefix", t.delete_prefix, 0, prefix) for t in self._tiers
        }

    def clear(self) -> dict[str, int]:
        """Remove everything from every tier; the count removed per tier."""
        self.flush()
        return {t.name: guarded(t, "clear", t.clear, 0) for t in self._tiers}

    def stats(self) -> dict[str, dict]:
        """Counters per tier name (plus ``entries``/``used_bytes`` where tracked and the tier's
        ``capacity_bytes`` where it has one), and the store's own under ``"store"`` (lookups,
        promotions, unusable entries, queue drops, queue depth)."""
        out: dict[str, dict] = {}
        for t in self._tiers:
            out[t.name] = {
                **t.stats.snapshot(),
                "entries": t.entries(),
                "used_bytes": t.used_bytes(),
                "capacity_bytes": t.capacity_bytes,
            }
        out[_STORE] = {**self._counters.snapshot(), "queue_depth": self._writer.depth()}
        return out

    def tenant_usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier name, per tenant tag with a byte quota there: bytes and entries held, the
        quota, the evictions it caused (``Tier.tenant_usage``; tiers without quotas are left out).
        Apart from ``stats()`` on purpose: it names tenants, and ``stats()`` is shown to every
        tenant (``GET /v1/kv/stats``)."""
        out = {}
        for t in self._tiers:
            usage = guarded(t, "tenant_usage", t.tenant_usage, {})
            if usage:
                out[t.name] = usage
        return out

    def close(self, timeout: float | None = None) -> None:
        """Flush the queued writes (at most ``timeout``: a slow tier must not hold a shutdown
        forever; what is left is lost and logged), stop the writer thread, close the tiers.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._writer.close(timeout):
            log.warning(
                "the lower tiers' queued writes did not finish within %.0f s; the rest is lost",
                timeout,
            )
        for t in self._tiers:
            guarded(t, "close", t.close, None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
