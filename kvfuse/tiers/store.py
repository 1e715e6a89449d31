"""The tiered store: memory, then disk, then Redis; reads from the fastest tier that has a chunk.

Semantics in brief:

- ``lookup(keys)`` is side-effect-free (no recency update, no promotion, no tier hit/miss counts):
  it reports, for every key, the fastest tier holding it, and how many leading keys are held.
- ``fetch(keys, specs)`` reads every key from the fastest tier holding it and validates it, in
  the one place where anything read back from storage is checked (``kv.format.open_entry``:
  integrity, the key, and the caller's ``EntrySpec``; for a tier that streams its reads, the
  disk's, the same checks as the bytes arrive: ``read_entry``). An unusable entry is deleted from its
  tier, counted (``unusable_entries``, and as an error of that tier) and the next tier is
  tried. Lower-tier hits are promoted into the first tier as ``Entry`` objects, so later memory
  hits are neither re-checked nor copied. Entries can vanish between ``lookup`` and ``fetch``
  (evicted, expired, another process): the planner replans around what ``fetch`` could not give.
- ``fetch_layers(key, first, last)`` reads and checks only the bytes of a layer range (the
  entry's layer table says where they are), for loading layer by layer.
- ``put(items)`` writes the first tier synchronously and queues the writes to the lower tiers for a
  background thread. Each tier may have its own codec (``codecs``: e.g. raw in memory, CacheGen
  on disk and Redis): the background writer re-encodes an entry for a tier whose codec differs,
  and writes the extra ``stream_levels`` of CacheGen under the chunk's variant keys
  (``ChunkKey.encoded_as``) for the streaming loader (``fetch_encoded``). Readers accept any
  codec, so lookups and fetches are unchanged; entries written before a codec change stay usable. The queue holds at most ``write_queue_size`` entries; when it is full, the
  lower-tier write is dropped and counted (the caller is never blocked: the entry is in memory),
  unless the caller asks to wait for room (``block``: the engine's saver thread, which nobody
  waits on). ``flush()`` waits for the queued writes.
- A tier that raises (it should not: tiers count their own failures) is logged, counted, and
  treated as a miss.
- ``upcoming()`` is what the engine's queue will ask for next (``set_lookahead``), in order.
  ``protect_upcoming`` makes the memory tier evict those entries last (queue-aware eviction), and
  a ``Prefetcher`` (``tiers/prefetch.py``) reads them into memory before their requests run;
  ``fetch(..., prefetch=True)`` counts its reads, and later request reads are counted as
  ``prefetch_hits`` / ``prefetch_misses``.
- Expiry (retention; the tiers' rules are in ``tiers/base.py``): ``put(..., expires_at=t)`` gives
  the entries an expiry in every tier they are written to (the lower-tier writes, and the CacheGen
  variants, carry it); ``memory_only`` writes the first tier only. A promotion keeps the expiry
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
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from kvfuse.codecs import get_codec
from kvfuse.codecs.base import Codec
from kvfuse.kv.format import (MIN_READ, Entry, EntrySpec, FormatError, Header, encode_entry, header_length, open_entry,
                              parse_header, read_entry)
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Clock, Tier, nbytes, put_many_expiring

log = logging.getLogger(__name__)

_STOP = object()
_STORE = "store"  # the name of the store's own counters in stats()


@dataclass(frozen=True)
class LookupResult:
    """``where[i]`` = the name of the fastest tier holding key ``i`` (None: no tier has it)."""

    where: tuple[str | None, ...]

    @property
    def hits(self) -> int:
        """The length of the longest prefix of keys held by some tier."""
        return next((i for i, w in enumerate(self.where) if w is None), len(self.where))

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tier of each of the first ``hits`` keys."""
        return self.where[: self.hits]  # type: ignore[return-value]


@dataclass(frozen=True)
class Fetched:
    """What ``fetch`` got for one key: the checked entry and the tier that served it (None, None
    on a miss), and how many unusable copies were found (and removed) on the way."""

    entry: Entry | None
    tier: str | None
    rejected: int = 0


@dataclass(frozen=True)
class Encoded:
    """What ``fetch_encoded`` read: the checked entry, its size in the tier, and the variant it is
    ("" for the chunk's primary copy)."""

    entry: Entry
    nbytes: int
    variant: str


@dataclass(frozen=True)
class LayerRange:
    """The decoded KV of layers ``[first, last)`` of one entry, ``(n, 2, tokens, kv_heads,
    head_dim)``, with the entry's positions and the tier it came from."""

    kv: torch.Tensor
    positions: torch.Tensor
    first: int
    last: int
    tier: str


class TieredStore:
    """Tiers ordered fastest first; see the module docstring for the semantics."""

    def __init__(self, tiers: Sequence[Tier], write_queue_size: int = 64, write_batch: int = 16,
                 codecs: dict[str, Codec] | None = None, stream_levels: Sequence[int] = (),
                 clock: Clock | None = None, expire_interval_s: float = 1.0) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier (e.g. a MemoryTier)")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or _STORE in names:
            raise ValueError(f"tier names must be unique and not {_STORE!r}, got {names}; pass name=... to the tiers")
        if write_queue_size < 1 or write_batch < 1:
            raise ValueError("write_queue_size and write_batch must be >= 1")
        if not expire_interval_s >= 0:
            raise ValueError(f"expire_interval_s must be >= 0, got {expire_interval_s}")
        self.tiers = list(tiers)
        if clock is not None:
            for t in self.tiers:
                t.clock = clock
        self.clock: Clock = clock if clock is not None else time.time
        self.expire_interval_s = expire_interval_s
        self._next_sweep = self.clock() + expire_interval_s
        self._sweep_lock = threading.Lock()
        unknown = set(codecs or {}) - set(names)
        if unknown:
            raise ValueError(f"codecs for unknown tiers {sorted(unknown)}; tiers are {names}")
        self.codecs: dict[str, Codec] = dict(codecs or {})  # a tier's write codec (absent: as put)
        self.stream_levels = tuple(sorted(set(stream_levels)))
        self._stream_codecs = [get_codec("cachegen", level) for level in self.stream_levels]
        self._write_batch = write_batch
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue_size)
        self._idle = threading.Condition()
        self._inflight = 0
        # Keys with writes in the queue (how many), and the extensions asked while they wait; both
        # under ``_idle``'s lock.
        self._queued: dict[ChunkKey, int] = {}
        self._extended: dict[ChunkKey, float] = {}
        self._closed = False
        self._lookahead: Callable[[], list[ChunkKey]] | None = None
        self._counts = {
            "lookups": 0,
            "lookup_keys": 0,
            "lookup_hits": 0,
            "promotions": 0,
            "unusable_entries": 0,
            "queued_writes": 0,
            "queue_full_drops": 0,
            "prefetched": 0,
            "prefetch_hits": 0,
            "prefetch_misses": 0,
            "reencoded": 0,
            "reencode_errors": 0,
        }
        self._prefetched: set[ChunkKey] = set()  # brought into memory ahead of the request needing them
        self.prefetching = False  # a Prefetcher runs (lower-tier reads at run time are then its misses)
        self._counts_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        if len(self.tiers) > 1:
            self._worker = threading.Thread(target=self._write_loop, name="kvfuse-store-writer", daemon=True)
            self._worker.start()

    def _count(self, **counts: int) -> None:
        with self._counts_lock:
            for name, n in counts.items():
                self._counts[name] += n

    @staticmethod
    def _safe(tier: Tier, what: str, fn: Callable, default, *args):
        try:
            return fn(*args)
        except Exception as e:  # a tier bug must not take the request down: count it as a miss
            log.exception("tier %s: %s raised %s", tier.name, what, e)
            tier.stats.add(errors=1)
            return default

    # -- reads ----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey], count: bool = True) -> LookupResult:
        """Where each key is stored; touches no recency and moves no data. ``count=False``: a
        look of the store's own (prefetch, saving), kept out of the lookup statistics. Expired
        entries are misses (and every tier is swept now and then, see ``expire``)."""
        self._maybe_sweep()
        holder: list[str | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            asked = [keys[i] for i in pending]
            found = self._safe(tier, "contains_many", tier.contains_many, [False] * len(pending), asked)
            if all(found):  # the usual answer of the first tier to a prompt it holds
                for i in pending:
                    holder[i] = tier.name
                pending = []
                break
            still = []
            for i, ok in zip(pending, found):
                if ok:
                    holder[i] = tier.name
                else:
                    still.append(i)
            pending = still
        result = LookupResult(tuple(holder))
        if count:
            self._count(lookups=1, lookup_keys=len(keys), lookup_hits=result.hits)
        return result

    def get(self, keys: Sequence[ChunkKey]) -> list[Entry | None]:
        """One checked entry or None per key (see ``fetch``)."""
        return [f.entry for f in self.fetch(keys)]

    def fetch(self, keys: Sequence[ChunkKey], specs: Sequence[EntrySpec | None] | None = None,
              prefetch: bool = False) -> list[Fetched]:
        """Per key, the checked entry and the tier that served it, which can differ from what
        ``lookup`` said: a damaged copy in a faster tier is removed and a slower one serves.
        ``prefetch``: a read ahead of the request (``Prefetcher``), counted as such."""
        specs = [None] * len(keys) if specs is None else list(specs)
        if len(specs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(specs)} specs")
        entries: list[Entry | None] = [None] * len(keys)
        served: list[str | None] = [None] * len(keys)
        rejected = [0] * len(keys)
        pending = list(range(len(keys)))
        promote: list[tuple[ChunkKey, Entry, float | None]] = []
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            # A promoted copy keeps the expiry it has here, asked before the read: an entry that
            # expires in between is then promoted with a time passed, i.e. not at all.
            expiries = (self._safe(tier, "expiries", tier.expiries, [None] * len(pending), [keys[i] for i in pending])
                        if level > 0 else None)
            if tier.batch_reads:
                values = self._safe(tier, "get_many", tier.get_many, [None] * len(pending), [keys[i] for i in pending])
                opened = (self._checked(tier, keys[i], v, specs[i], level > 0) for i, v in zip(pending, values))
            else:  # key by key, each entry checked as it is read, while its bytes are in the CPU cache
                opened = (self._read_checked(tier, keys[i], specs[i], level > 0) for i in pending)
            still = []
            for j, (i, (entry, bad)) in enumerate(zip(pending, opened)):
                if entry is None:
                    rejected[i] += bad
                    still.append(i)
                    continue
                if level > 0:
                    promote.append((keys[i], entry, expiries[j]))
                entries[i], served[i] = entry, tier.name
            pending = still
        if promote:
            self._promote(promote)
        self._count_prefetch(keys, served, prefetch)
        return [Fetched(e, t, r) for e, t, r in zip(entries, served, rejected)]

    def _count_prefetch(self, keys: Sequence[ChunkKey], served: Sequence[str | None], prefetch: bool) -> None:
        first = self.tiers[0].name
        with self._counts_lock:
            if prefetch:
                got = [k for k, t in zip(keys, served) if t is not None]
                self._prefetched.update(got)
                self._counts["prefetched"] += len(got)
                return
            for k, t in zip(keys, served):
                if t == first and k in self._prefetched:
                    self._prefetched.discard(k)
                    self._counts["prefetch_hits"] += 1
                elif t is not None and t != first and self.prefetching:
                    self._counts["prefetch_misses"] += 1
            if len(self._prefetched) > 65536:  # prefetched, never asked for (cancelled requests)
                self._prefetched.clear()

    def _checked(self, tier: Tier, key: ChunkKey, value: Blob | None, spec: EntrySpec | None,
                 promoted: bool) -> tuple[Entry | None, bool]:
        """(the checked entry of ``value`` or None, whether a value was there but unusable)."""
        if value is None:
            return None, False
        entry = self._open(tier, key, value, spec, promoted)
        return entry, entry is None

    def _read_checked(self, tier: Tier, key: ChunkKey, spec: EntrySpec | None,
                      promoted: bool) -> tuple[Entry | None, bool]:
        """``key`` read from ``tier`` and checked, as ``_checked`` answers. A tier that streams
        its reads (disk) hands the bytes to ``read_entry`` piece by piece, which checks each piece
        as it arrives: one pass over memory instead of a read and then a check."""
        if not tier.streams_reads:
            return self._checked(tier, key, self._safe(tier, "get", tier.get, None, key), spec, promoted)
        return self._safe(tier, "read_with", self._streamed, (None, False), tier, key, spec)

    def _streamed(self, tier: Tier, key: ChunkKey, spec: EntrySpec | None) -> tuple[Entry | None, bool]:
        try:
            return tier.read_with(key, lambda readinto, size: read_entry(readinto, size, key, spec)), False
        except FormatError as e:
            self._reject(tier, key, e)
            return None, True

    def _open(self, tier: Tier, key: ChunkKey, value: Blob, spec: EntrySpec | None, promoted: bool) -> Entry | None:
        """The checked entry of ``value`` from ``tier``, or None after removing and counting it."""
        if promoted and not isinstance(value, Entry) and memoryview(value).readonly:
            # Read-only bytes (Redis) are copied once into writable memory: the entry kept in the
            # first tier then decodes without a copy at every later hit.
            value = bytearray(value)
        try:
            return open_entry(value, key, spec)
        except FormatError as e:
            self._reject(tier, key, e)
            return None

    def _reject(self, tier: Tier, key: ChunkKey, error: Exception) -> None:
        log.warning("tier %s: unusable entry %s removed (%s)", tier.name, key, error)
        tier.stats.add(hits=-1, misses=1, errors=1)  # the tier counted a hit; it was not one
        self._count(unusable_entries=1)
        self._safe(tier, "delete", tier.delete, False, key)

    def fetch_encoded(self, key: ChunkKey, tier: str, variant: str = "", spec: EntrySpec | None = None) -> Encoded | None:
        """``key``'s copy ``variant`` ("cachegen.1", or "" for the primary) from the tier named
        ``tier`` only, falling back to the primary copy there; checked like ``fetch``; None if
        the tier has no usable copy. Nothing is promoted (the streaming loader reads a chunk at
        the level its bandwidth allows, not a copy to keep)."""
        t = next((x for x in self.tiers if x.name == tier), None)
        if t is None:
            raise ValueError(f"no tier named {tier!r}")
        wanted = [key.encoded_as(*variant.rsplit(".", 1)), key] if variant else [key]
        for k in wanted:
            entry, _ = self._read_checked(t, k, spec, promoted=False)
            if entry is not None:
                return Encoded(entry, nbytes(entry), k.variant)
        return None

    def discard(self, key: ChunkKey) -> None:
        """Remove ``key`` from every tier and count it unusable: an entry found intact but that its
        codec could not decode (``fetch`` checks bytes, not a codec's whole decode)."""
        self._count(unusable_entries=1)
        for t in self.tiers:
            if self._safe(t, "delete", t.delete, False, key):
                t.stats.add(errors=1)

    def fetch_layers(self, key: ChunkKey, first: int, last: int, spec: EntrySpec | None = None) -> LayerRange | None:
        """The KV of layers ``[first, last)`` of ``key`` from the fastest tier holding a usable
        copy, reading (from disk or Redis) only the header and those layers' bytes; None if no
        tier has one. Nothing is promoted: a layer range is not a whole entry."""
        for tier in self.tiers:
            got = self._safe(tier, "read layers", self._read_layers, None, tier, key, first, last, spec)
            if got is not None:
                return got
        return None

    def _read_layers(self, tier: Tier, key: ChunkKey, first: int, last: int, spec: EntrySpec | None):
        try:
            if tier.holds_entries:  # in-process entries: no bytes to read, decode the layers
                value = tier.get(key)
                if value is None:
                    return None
                entry = open_entry(value, key, spec)
                return LayerRange(entry.decode(first, last), entry.positions, first, last, tier.name)
            head = tier.read_range(key, 0, MIN_READ)
            if head is None:
                return None
            need = header_length(head)
            if need > len(head):
                head = bytes(head) + bytes(tier.read_range(key, len(head), need) or b"")
            h: Header = parse_header(head)
            if h.key != str(key):
                raise FormatError(f"entry holds key {h.key!r}, expected {str(key)!r}")
            if spec is not None:
                spec.check(h)
            start, stop = h.layer_span(first, last)
            data = memoryview(head)[start:stop] if stop <= len(head) else tier.read_range(key, start, stop)
            if data is None:
                raise FormatError("the entry vanished while it was read")
            kv = h.decode_layers(memoryview(data), first, last)
        except FormatError as e:
            self._reject(tier, key, e)
            return None
        return LayerRange(kv, h.positions, first, last, tier.name)

    # -- writes ---------------------------------------------------------------------------------

    def promote(self, items: Iterable[tuple[ChunkKey, Entry]]) -> None:
        """Put entries read from a lower tier into the first tier only (they are stored below
        already), each with the expiry it has in the first lower tier holding it (or one of its
        variants). An entry no lower tier holds any more is not promoted: it expired or was
        evicted since it was read, and a memory copy must not outlive its retention. (With no
        lower tiers, every entry is put as it is.)"""
        items = list(items)
        if not items:
            return
        if len(self.tiers) == 1:
            self._promote([(k, e, None) for k, e in items])
            return
        expiries, held = self._lower_expiries([k for k, _ in items])
        self._promote([(k, e, x) for (k, e), x, h in zip(items, expiries, held) if h])

    def _promote(self, items: list[tuple[ChunkKey, Entry, float | None]]) -> None:
        """Put ``(key, entry, expires_at)`` into the first tier, one ``put_many`` per expiry."""
        groups: dict[float | None, list[tuple[ChunkKey, Entry]]] = {}
        for key, entry, expires_at in items:
            groups.setdefault(expires_at, []).append((key, entry))
        first = self.tiers[0]
        for expires_at, group in groups.items():
            self._safe(first, "put_many", put_many_expiring, None, first, group, expires_at)
        if items:
            self._count(promotions=len(items))

    def _variants(self, key: ChunkKey) -> list[ChunkKey]:
        """The keys of ``key``'s extra encodings (the store's ``stream_levels``)."""
        return [] if key.variant else [key.encoded_as(c.name, c.level) for c in self._stream_codecs]

    def _lower_expiries(self, keys: Sequence[ChunkKey]) -> tuple[list[float | None], list[bool]]:
        """Per key: its expiry in the first lower tier holding it, and whether one does. A key
        held by none is looked for again as its variants."""
        expiries: list[float | None] = [None] * len(keys)
        held = [False] * len(keys)
        for stage in (lambda k: [k], self._variants):
            pending = [(i, c) for i in range(len(keys)) if not held[i] for c in stage(keys[i])]
            for tier in self.tiers[1:]:
                if not pending:
                    break
                asked = [c for _, c in pending]
                times = self._safe(tier, "expiries", tier.expiries, [None] * len(asked), asked)
                for (i, _), t in zip(pending, times):
                    if t is not None and not held[i]:  # an expiry: held (when asked)
                        expiries[i], held[i] = t, True
                rest = [(i, c) for i, c in pending if not held[i]]
                found = (self._safe(tier, "contains_many", tier.contains_many, [False] * len(rest), [c for _, c in rest])
                         if rest else [])
                for (i, _), ok in zip(rest, found):
                    held[i] = held[i] or bool(ok)
                pending = [(i, c) for i, c in pending if not held[i]]
        return expiries, held

    def put(self, items: Iterable[tuple[ChunkKey, Blob]], block: bool = False, expires_at: float | None = None,
            memory_only: bool = False) -> None:
        """Store entries: the first tier now, the lower tiers from the write queue. The queue never
        blocks a caller: when it is full the lower-tier writes are dropped and counted, unless
        ``block`` (a background saver, which nobody waits on, waits for room instead).
        ``expires_at``: the entries' expiry (on ``clock``) in every tier, their variants' too (None:
        none). ``memory_only``: the first tier only (no lower-tier writes, no variants).

        The store takes ownership of the values, without copying them (an ``Entry`` of a chunk is
        kept by the memory tier and written later by the lower tiers): do not modify them."""
        if self._closed:
            raise RuntimeError("TieredStore.put after close()")
        items = list(items)
        first = self.tiers[0]
        self._safe(first, "put_many", put_many_expiring, None, first, items, expires_at)
        if self._worker is None or memory_only:
            return
        for n, (key, value) in enumerate(items):
            with self._idle:
                self._inflight += 1
                self._queued[key] = self._queued.get(key, 0) + 1
            try:
                if block:
                    self._queue.put((key, value, expires_at))
                else:
                    self._queue.put_nowait((key, value, expires_at))
            except queue.Full:
                with self._idle:
                    self._inflight -= 1
                    self._unqueue_locked(key)
                    self._idle.notify_all()
                dropped = len(items) - n
                for tier in self.tiers[1:]:
                    tier.stats.add(dropped_writes=dropped)
                self._count(queued_writes=n, queue_full_drops=dropped)
                return
        self._count(queued_writes=len(items))

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            batch = []
            item = self._queue.get()
            while True:
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
                if len(batch) >= self._write_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._write_batch_of(batch)

    def _write_batch_of(self, batch: list[tuple[ChunkKey, Blob, float | None]]) -> None:
        """Write one batch of queued entries to the lower tiers, one ``put_many`` per expiry."""
        with self._idle:  # an extension asked while the entry waited: the later time
            timed = [(k, v, self._effective_locked(k, x)) for k, v, x in batch]
        groups: dict[float | None, list[tuple[ChunkKey, Blob]]] = {}
        for key, value, expires_at in timed:
            groups.setdefault(expires_at, []).append((key, value))
        memo: dict = {}
        for tier in self.tiers[1:]:
            for expires_at, group in groups.items():
                items = self._encoded_for(tier, group, memo)
                self._safe(tier, "put_many", put_many_expiring, None, tier, items, expires_at)
        # An extension asked while these were written may have found them not there yet: apply it.
        with self._idle:
            late: dict[float, list[ChunkKey]] = {}
            for key, _, expires_at in timed:
                ext = self._effective_locked(key, expires_at)
                if expires_at is not None and ext > expires_at:
                    late.setdefault(ext, []).append(key)
        for expires_at, keys in late.items():
            self._extend_lower(keys, expires_at)
        with self._idle:
            for key, _, _ in batch:
                self._unqueue_locked(key)
            self._inflight -= len(batch)
            self._idle.notify_all()

    def _effective_locked(self, key: ChunkKey, expires_at: float | None) -> float | None:
        """A queued write's expiry: its own, or a later one ``extend`` asked meanwhile."""
        if expires_at is None:
            return None  # no expiry: extending leaves it alone
        ext = self._extended.get(key)
        return expires_at if ext is None else max(expires_at, ext)

    def _unqueue_locked(self, key: ChunkKey) -> None:
        n = self._queued.get(key, 0) - 1
        if n > 0:
            self._queued[key] = n
        else:
            self._queued.pop(key, None)
            self._extended.pop(key, None)

    def encodings(self, tier: str) -> list[str]:
        """The variants a chunk has in ``tier`` besides its primary copy ("cachegen.1", ...)."""
        if tier == self.tiers[0].name:
            return []
        return [f"{c.name}.{c.level}" for c in self._stream_codecs]

    def _encoded_for(self, tier: Tier, batch: list, memo: dict) -> list[tuple[ChunkKey, Blob]]:
        """The writes of ``batch`` for ``tier``: each entry in the tier's codec, plus its variants.
        ``memo`` shares the encodings between the tiers of one batch."""
        codec = self.codecs.get(tier.name)
        if codec is None and not self._stream_codecs:
            return batch
        out = []
        for key, value in batch:
            primary = value if codec is None else self._reencode(key, value, codec, memo)
            if primary is not None:
                out.append((key, primary))
            if key.variant:
                continue
            for c in self._stream_codecs:
                if codec is not None and (codec.name, codec.level) == (c.name, c.level):
                    continue  # the primary copy is this level already
                vkey = key.encoded_as(c.name, c.level)
                encoded = self._reencode(vkey, value, c, memo)
                if encoded is not None:
                    out.append((vkey, encoded))
        return out

    def _reencode(self, key: ChunkKey, value: Blob, codec: Codec, memo: dict) -> Entry | None:
        """``value`` as an entry of ``codec`` under ``key`` (itself when it is one already); None
        (counted, logged) when it cannot be (a damaged value, KV the codec refuses)."""
        memo_key = (str(key), codec.name, codec.level)
        if memo_key in memo:
            return memo[memo_key]
        try:
            entry = open_entry(value)
            if entry.key == str(key) and (entry.codec.name, entry.codec.level) == (codec.name, codec.level):
                out = entry
            else:
                out = encode_entry(entry.chunk(), key, codec)
                self._count(reencoded=1)
        except (FormatError, ValueError) as e:
            log.warning("cannot encode %s with %s level %d: %s", key, codec.name, codec.level, e)
            self._count(reencode_errors=1)
            out = None
        memo[memo_key] = out
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write is done; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

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
        first = self.tiers[0]
        if hasattr(first, "set_protect"):
            first.set_protect(self.upcoming if on else None)

    # -- expiry ---------------------------------------------------------------------------------

    def extend(self, keys: Iterable[ChunkKey], expires_at: float) -> None:
        """Keep the entries of ``keys`` (and their variants) at least until ``expires_at`` in every
        tier: an earlier expiry is moved to it, an entry without expiry is left alone (see
        ``Tier.extend``). A write of one of them still in the queue gets it too (when it is
        written), so this never waits for the queue."""
        keys = list(keys)
        if not keys:
            return
        with self._idle:
            for k in keys:
                if k in self._queued:
                    self._extended[k] = max(self._extended.get(k, expires_at), expires_at)
        first = self.tiers[0]
        self._safe(first, "extend_many", first.extend_many, None, keys, expires_at)
        self._extend_lower(keys, expires_at)

    def _extend_lower(self, keys: list[ChunkKey], expires_at: float) -> None:
        with_variants = keys + [v for k in keys for v in self._variants(k)]
        for tier in self.tiers[1:]:
            self._safe(tier, "extend_many", tier.extend_many, None, with_variants, expires_at)

    def expire(self) -> dict[str, int]:
        """Remove every expired entry from every tier now; the count removed per tier (Redis
        expires keys by itself: 0 there)."""
        self._next_sweep = self.clock() + self.expire_interval_s
        return {t.name: self._safe(t, "expire", t.expire, 0) for t in self.tiers}

    def _maybe_sweep(self) -> None:
        """``expire()`` if ``expire_interval_s`` has passed since the last sweep (one thread sweeps;
        the others go on)."""
        if self.clock() < self._next_sweep or not self._sweep_lock.acquire(blocking=False):
            return
        try:
            if self.clock() >= self._next_sweep:
                self.expire()
        finally:
            self._sweep_lock.release()

    # -- maintenance ----------------------------------------------------------------------------

    def delete(self, keys: Iterable[ChunkKey]) -> dict[str, int]:
        """Remove the entries of ``keys`` and their variants from every tier (after the queued
        writes, so none lands afterwards); the count removed per tier."""
        keys = list(keys)
        self.flush()
        with_variants = keys + [v for k in keys for v in self._variants(k)]
        with self._counts_lock:
            self._prefetched.difference_update(keys)
        return {t.name: self._safe(t, "delete_many", t.delete_many, 0, with_variants) for t in self.tiers}

    def delete_prefix(self, prefix: str) -> dict[str, int]:
        """Remove every key starting with ``prefix`` from every tier (after the queued writes, so
        none lands afterwards); the count removed per tier."""
        self.flush()
        return {t.name: self._safe(t, "delete_prefix", t.delete_prefix, 0, prefix) for t in self.tiers}

    def clear(self) -> dict[str, int]:
        """Remove everything from every tier; the count removed per tier."""
        self.flush()
        return {t.name: self._safe(t, "clear", t.clear, 0) for t in self.tiers}

    def stats(self) -> dict[str, dict]:
        """Counters per tier name (plus ``entries``/``used_bytes`` where tracked and the tier's
        ``capacity_bytes`` where it has one), and the store's own under ``"store"`` (lookups,
        promotions, unusable entries, queue drops, queue depth)."""
        out: dict[str, dict] = {}
        for t in self.tiers:
            out[t.name] = {**t.stats.snapshot(), "entries": t.entries(), "used_bytes": t.used_bytes(),
                           "capacity_bytes": getattr(t, "capacity_bytes", None)}
        with self._counts_lock:
            out[_STORE] = {**self._counts, "queue_depth": self._queue.qsize()}
        return out

    def close(self) -> None:
        """Flush the queued writes, stop the writer thread, close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(_STOP)
            self._worker.join()
        for t in self.tiers:
            self._safe(t, "close", t.close, None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
