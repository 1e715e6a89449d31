"""The tiered store: memory, then disk, then Redis; reads from the fastest tier that has a chunk.

Semantics in brief:

- ``lookup(keys)`` is side-effect-free (no recency update, no promotion, no tier hit/miss counts):
  it reports how many leading keys some tier holds, and which tier holds each.
- ``get(keys)`` fetches every key from the fastest tier holding it, validates it (an invalid entry
  is deleted from that tier, counted as an error there, and the next tier is tried), and promotes
  lower-tier hits into the first tier. It returns one entry or None per key. Entries can vanish
  between ``lookup`` and ``get`` (evicted, expired, another process): callers use the contiguous
  prefix of non-None results, so ``get(keys[:lookup(keys).hits])`` may still come back shorter.
- ``put(items)`` writes the first tier synchronously and queues the writes to the lower tiers for a
  background thread. The queue holds at most ``write_queue_size`` entries; when it is full, the
  lower-tier write is dropped and counted (the caller is never blocked: the entry is in memory).
  ``flush()`` waits for the queued writes.
- A tier that raises (it should not: tiers count their own failures) is logged, counted, and
  treated as a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvfuse.kv.format import Entry, FormatError, verify
from kvfuse.tiers.base import Blob, Tier

log = logging.getLogger(__name__)


def _as_entry(blob: Blob) -> Blob:
    """A verified blob promoted to memory, as an Entry (later hits skip verification and decode
    zero-copy); read-only bytes (from Redis) are copied once into writable memory for that."""
    if isinstance(blob, Entry):
        return blob
    try:
        return Entry.from_blob(blob if not memoryview(blob).readonly else bytearray(blob))
    except FormatError:  # not a kvfuse entry (a store used for other bytes): keep it as it is
        return blob

Validator = Callable[[Blob, str], bool]

_STOP = object()
_STORE = "store"  # the name of the store's own counters in stats()


@dataclass(frozen=True)
class LookupResult:
    """``hits`` = the length of the longest prefix of keys held by some tier;
    ``tiers[i]`` = the name of the fastest tier holding chunk ``i`` (``len(tiers) == hits``)."""

    hits: int
    tiers: tuple[str, ...]


class TieredStore:
    """Tiers ordered fastest first; see the module docstring for the semantics."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        write_queue_size: int = 64,
        validator: Validator | None = verify,
        write_batch: int = 16,
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier (e.g. a MemoryTier)")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or _STORE in names:
            raise ValueError(f"tier names must be unique and not {_STORE!r}, got {names}; pass name=... to the tiers")
        if write_queue_size < 1 or write_batch < 1:
            raise ValueError("write_queue_size and write_batch must be >= 1")
        self.tiers = list(tiers)
        self.validator = validator
        self._write_batch = write_batch
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue_size)
        self._idle = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._counts = {
            "lookups": 0,
            "lookup_keys": 0,
            "lookup_hits": 0,
            "promotions": 0,
            "queued_writes": 0,
            "queue_full_drops": 0,
        }
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

    def lookup(self, keys: Sequence[str]) -> LookupResult:
        """Which leading keys are stored, and where; touches no recency and moves no data."""
        holder: list[str | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            asked = [keys[i] for i in pending]
            found = self._safe(tier, "contains_many", tier.contains_many, [False] * len(pending), asked)
            still = []
            for i, ok in zip(pending, found):
                if ok:
                    holder[i] = tier.name
                else:
                    still.append(i)
            pending = still
        hits = next((i for i, h in enumerate(holder) if h is None), len(keys))
        self._count(lookups=1, lookup_keys=len(keys), lookup_hits=hits)
        return LookupResult(hits=hits, tiers=tuple(holder[:hits]))  # type: ignore[arg-type]

    def get(self, keys: Sequence[str]) -> list[Blob | None]:
        """One validated entry or None per key (see the module docstring); promotes lower-tier hits."""
        return [blob for blob, _ in self.get_with_tiers(keys)]

    def get_with_tiers(self, keys: Sequence[str]) -> list[tuple[Blob | None, str | None]]:
        """Like ``get``, with the name of the tier each entry was actually served from.

        That can differ from ``lookup``'s answer: a corrupt copy in a faster tier is skipped and the
        entry is served from a slower one."""
        out: list[tuple[Blob | None, str | None]] = [(None, None)] * len(keys)
        pending = list(range(len(keys)))
        promote: list[tuple[str, Blob]] = []
        for level, tier in enumerate(self.tiers):
            if not pending:
                break
            values = self._safe(tier, "get_many", tier.get_many, [None] * len(pending), [keys[i] for i in pending])
            still = []
            for i, value in zip(pending, values):
                if value is not None and not self._valid(tier, keys[i], value):
                    value = None
                if value is None:
                    still.append(i)
                    continue
                if level > 0:
                    value = _as_entry(value)
                    promote.append((keys[i], value))
                out[i] = (value, tier.name)
            pending = still
        if promote:
            first = self.tiers[0]
            self._safe(first, "put_many", first.put_many, None, promote)
            self._count(promotions=len(promote))
        return out

    def _valid(self, tier: Tier, key: str, value: Blob) -> bool:
        # An Entry never left this process (built by encode_entry, or promoted after verification):
        # only its key is checked. Serialized blobs are verified, wherever they come from.
        if isinstance(value, Entry):
            ok = value.key == key
        else:
            ok = self.validator is None or tier.validates_on_get or self.validator(value, key)
        if ok:
            return True
        log.warning("tier %s: corrupt entry %s removed", tier.name, key)
        tier.stats.add(hits=-1, misses=1, errors=1)  # the tier counted a hit; it was not one
        self._safe(tier, "delete", tier.delete, False, key)
        return False

    # -- writes ---------------------------------------------------------------------------------

    def put(self, items: Iterable[tuple[str, Blob]]) -> None:
        """Store entries: the first tier now, the lower tiers from the write queue (never blocks).

        The store takes ownership of the values, without copying them (an ``Entry`` of a chunk is
        kept by the memory tier and written later by the lower tiers): do not modify them."""
        if self._closed:
            raise RuntimeError("TieredStore.put after close()")
        items = list(items)
        first = self.tiers[0]
        self._safe(first, "put_many", first.put_many, None, items)
        if self._worker is None:
            return
        for n, item in enumerate(items):
            with self._idle:
                self._inflight += 1
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                with self._idle:
                    self._inflight -= 1
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
            for tier in self.tiers[1:]:
                self._safe(tier, "put_many", tier.put_many, None, batch)
            with self._idle:
                self._inflight -= len(batch)
                self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued lower-tier write is done; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    # -- maintenance ----------------------------------------------------------------------------

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
        """Counters per tier name (plus ``entries``/``used_bytes`` where tracked), and the store's
        own under ``"store"`` (lookups, promotions, queue drops, queue depth)."""
        out: dict[str, dict] = {}
        for t in self.tiers:
            out[t.name] = {**t.stats.snapshot(), "entries": t.entries(), "used_bytes": t.used_bytes()}
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
