"""The store's background writes to the lower tiers: a bounded queue, one writer thread, batch
writes, expiry extensions of queued writes, and ``flush``.

``submit`` queues entries already in the memory tier for the lower tiers (disk, Redis, S3). The
queue holds at most ``queue_size`` entries; when it is full the lower-tier writes are dropped and
counted (the caller is never blocked: the entry is in memory), unless the caller asks to wait for
room (``block``: the engine's saver thread, which nobody waits on). The writer takes up to
``batch`` entries at a time, re-encodes them for each tier (``Transcoder``: the tier's codec and
the CacheGen variants) and writes them with one ``put_many`` per tier and expiry.

An ``extend`` of a key whose write is still queued is remembered: the writer gives the write the
later of its own expiry and any extension asked while it waited, and an extension that arrives
while the batch is being written (so it found the entries not there yet) is applied right after.
The caller of ``extend`` never waits for the queue.

A seam of its own because it is the only thread the store starts and the only state a caller
shares with that thread (the queue, the in-flight count, the queued keys and their extensions,
all under one condition): keeping it here keeps the store's reads free of that locking.
"""

from __future__ import annotations

import queue
import threading
from typing import Sequence

from kvfuse.kv.keys import ChunkKey
from kvfuse.store.results import StoreCounters
from kvfuse.store.transcode import Transcoder
from kvfuse.tiers.base import Blob, Tier, guarded, put_many_expiring

_STOP = object()

Queued = tuple[ChunkKey, Blob, float | None]  # key, value, expires_at


class WriteBehind:
    """Background writes of entries to ``lower``, in their order; see the module docstring.

    Side effects, stated: ``submit`` adds to ``counters`` (``queued_writes``, ``queue_full_drops``)
    and to every lower tier's ``dropped_writes`` when the queue is full; the writer thread (started
    only when there are lower tiers) calls the tiers' ``put_many`` and ``extend_many``."""

    def __init__(
        self,
        lower: Sequence[Tier],
        transcoder: Transcoder,
        counters: StoreCounters,
        queue_size: int,
        batch: int,
    ) -> None:
        if queue_size < 1 or batch < 1:
            raise ValueError("write_queue_size and write_batch must be >= 1")
        self._lower = tuple(lower)
        self._transcoder = transcoder
        self._counters = counters
        self._batch = batch
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._idle = threading.Condition()
        self._inflight = 0
        # Keys with writes in the queue (how many), and the extensions asked while they wait; both
        # under ``_idle``'s lock.
        self._queued: dict[ChunkKey, int] = {}
        self._extended: dict[ChunkKey, float] = {}
        self._thread: threading.Thread | None = None
        if self._lower:
            self._thread = threading.Thread(
                target=self._loop, name="kvfuse-store-writer", daemon=True
            )
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether a writer thread runs (there are lower tiers to write to)."""
        return self._thread is not None

    def depth(self) -> int:
        """Entries waiting in the queue (not those being written)."""
        return self._queue.qsize()

    def submit(
        self, items: list[tuple[ChunkKey, Blob]], expires_at: float | None, block: bool
    ) -> None:
        """Queue ``items`` for the lower tiers with ``expires_at``; when the queue is full, the
        rest are dropped and counted, unless ``block`` (then this waits for room)."""
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
                for tier in self._lower:
                    tier.stats.add(dropped_writes=dropped)
                self._counters.add(queued_writes=n, queue_full_drops=dropped)
                return
        self._counters.add(queued_writes=len(items))

    def note_extension(self, keys: Sequence[ChunkKey], expires_at: float) -> None:
        """Remember ``extend(keys, expires_at)`` for the writes of ``keys`` still queued."""
        with self._idle:
            for k in keys:
                if k in self._queued:
                    self._extended[k] = max(self._extended.get(k, expires_at), expires_at)

    def extend_lower(self, keys: list[ChunkKey], expires_at: float) -> None:
        """``extend_many`` of ``keys`` and their variants in every lower tier."""
        with_variants = self._transcoder.with_variants(keys)
        for tier in self._lower:
            guarded(tier, "extend_many", tier.extend_many, None, with_variants, expires_at)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()

    # -- the writer thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = []
            item = self._queue.get()
            while True:
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
                if len(batch) >= self._batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._write(batch)

    def _write(self, batch: list[Queued]) -> None:
        """Write one batch of queued entries to the lower tiers, one ``put_many`` per expiry."""
        with self._idle:  # an extension asked while the entry waited: the later time
            timed = [(k, v, self._effective_locked(k, x)) for k, v, x in batch]
        groups: dict[float | None, list[tuple[ChunkKey, Blob]]] = {}
        for key, value, expires_at in timed:
            groups.setdefault(expires_at, []).append((key, value))
        memo: dict = {}
        for tier in self._lower:
            for expires_at, group in groups.items():
                items = self._transcoder.encoded_for(tier, group, memo)
                guarded(tier, "put_many", put_many_expiring, None, tier, items, expires_at)
        # An extension asked while these were written may have found them not there yet: apply it.
        with self._idle:
            late: dict[float, list[ChunkKey]] = {}
            for key, _, expires_at in timed:
                ext = self._effective_locked(key, expires_at)
                if expires_at is not None and ext > expires_at:
                    late.setdefault(ext, []).append(key)
        for expires_at, keys in late.items():
            self.extend_lower(keys, expires_at)
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
