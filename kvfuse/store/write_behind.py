"""The store's background writes to the lower tiers: one bounded queue and one writer thread per
lower tier, batch writes, expiry extensions of queued writes, and ``flush``.

``submit`` queues entries already in the memory tier for each lower tier (disk, Redis, S3). Each
tier has a lane of its own (``_Lane``): a queue of at most ``queue_size`` entries and a thread
writing them, so a slow tier (a throttled Redis, a far S3) fills and drops only its own queue
while the faster ones keep up. When a tier's queue is full, its writes are dropped and counted
(that tier's ``dropped_writes``, the store's ``queue_full_drops``); the caller is never blocked
(the entry is in memory), unless it asks to wait for room (``block``; the engine's saver never
does). A lane's writer takes up to ``batch`` entries at a time, re-encodes them for its tier
(``Transcoder``: the tier's codec and the CacheGen variants) and writes them with one
``put_many`` per expiry.

An ``extend`` of a key whose write is still queued is remembered: the writer gives the write the
later of its own expiry and any extension asked while it waited, and an extension that arrives
while the batch is being written (so it found the entries not there yet) is applied right after.
The caller of ``extend`` never waits for the queue.

``wait_written(keys)`` waits per key, not for the whole queue: until some lower tier has written
the key or none has it queued any more (dropped: a miss). It is what makes an entry the memory
tier could not keep findable without flushing everything.

A seam of its own because it holds the only threads the store starts and the only state a caller
shares with them (per lane: the queue, the in-flight count, the queued keys and their
extensions, under one condition): keeping it here keeps the store's reads free of that locking.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

from kvfuse.kv.keys import ChunkKey
from kvfuse.store.results import StoreCounters
from kvfuse.store.transcode import Transcoder
from kvfuse.threads import helper_thread
from kvfuse.tiers.base import Blob, Tier, guarded, put_many_expiring

_STOP = object()

Queued = tuple[ChunkKey, Blob, float | None]  # key, value, expires_at


class WriteBehind:
    """Background writes of entries to ``lower``, in their order per tier; see the module docstring.

    Side effects, stated: ``submit`` adds to ``counters`` (``queued_writes`` and
    ``queue_full_drops``, counted per tier write) and to a lower tier's ``dropped_writes`` when its
    queue is full; each lane's thread calls its tier's ``put_many`` and ``extend_many``."""

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
        self._lanes = tuple(_Lane(t, transcoder, queue_size, batch) for t in self._lower)
        # One condition for every lane's bookkeeping: ``wait_written`` looks across lanes.
        self._idle = threading.Condition()
        for lane in self._lanes:
            lane.start(self._idle)

    @property
    def running(self) -> bool:
        """Whether writer threads run (there are lower tiers to write to)."""
        return bool(self._lanes)

    def depth(self) -> int:
        """Entries waiting in the queues (not those being written), all tiers together."""
        return sum(lane.queue.qsize() for lane in self._lanes)

    def submit(
        self, items: list[tuple[ChunkKey, Blob]], expires_at: float | None, block: bool
    ) -> None:
        """Queue ``items`` for each lower tier with ``expires_at``; where a tier's queue is full,
        the rest are dropped for that tier and counted, unless ``block`` (then this waits)."""
        for lane in self._lanes:
            queued = lane.submit(items, expires_at, block)
            dropped = len(items) - queued
            if dropped:
                lane.tier.stats.add(dropped_writes=dropped)
            self._counters.add(queued_writes=queued, queue_full_drops=dropped)

    def note_extension(self, keys: Sequence[ChunkKey], expires_at: float) -> None:
        """Remember ``extend(keys, expires_at)`` for the writes of ``keys`` still queued."""
        with self._idle:
            for lane in self._lanes:
                lane.note_extension_locked(keys, expires_at)

    def extend_lower(self, keys: list[ChunkKey], expires_at: float) -> None:
        """``extend_many`` of ``keys`` and their variants in every lower tier."""
        with_variants = self._transcoder.with_variants(keys)
        for tier in self._lower:
            guarded(tier, "extend_many", tier.extend_many, None, with_variants, expires_at)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write of every tier is done; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: all(not x.inflight for x in self._lanes), timeout)

    def writing(self, keys: Sequence[ChunkKey]) -> bool:
        """Whether a write of any of ``keys`` is queued or being written, in any tier."""
        with self._idle:
            return any(k in lane.queued for lane in self._lanes for k in keys)

    def wait_written(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> bool:
        """Wait until each of ``keys`` is written by some lower tier or queued in none (see the
        module docstring); False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: settled(keys, self._lanes), timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, then stop the writer threads; at most ``timeout`` for all (None:
        as long as it takes). False when the writes did not end in time: the threads (daemons)
        are left to end with the process, and what they had not written is lost."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([lane.close(deadline) for lane in self._lanes])


def settled(keys: Sequence[ChunkKey], lanes: Sequence[_Lane]) -> bool:
    """Whether every key in ``keys`` is written by a tier that had it queued, or queued nowhere:
    the lanes' ``written``/``queued`` (under their shared lock)."""
    return all(
        any(k in lane.written for lane in lanes) or not any(k in lane.queued for lane in lanes)
        for k in keys
    )


class _Lane:
    """One lower tier's queue and writer thread; its bookkeeping (``inflight``, ``queued``,
    ``extended``, ``written``) is under the ``WriteBehind``'s shared condition ``idle``."""

    WRITTEN_KEPT = 4096  # recent keys written, for ``settled`` (a bounded memory of them)

    def __init__(self, tier: Tier, transcoder: Transcoder, queue_size: int, batch: int) -> None:
        self.tier, self._transcoder, self._batch = tier, transcoder, batch
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.inflight = 0
        # Keys with writes in the queue (how many), the extensions asked while they wait, and the
        # keys written while some other tier still had them queued (``settled``).
        self.queued: dict[ChunkKey, int] = {}
        self.extended: dict[ChunkKey, float] = {}
        self.written: dict[ChunkKey, None] = {}
        self._thread = helper_thread(self._loop, f"kvfuse-store-writer-{tier.name}")

    def start(self, idle: threading.Condition) -> None:
        self._idle = idle
        self._thread.start()

    def submit(
        self,
        items: list[tuple[ChunkKey, Blob]],
        expires_at: float | None,
        block: bool,
    ) -> int:
        """Queue ``items`` in order until the queue is full (``block``: wait for room); how many."""
        idle = self._idle
        for n, (key, value) in enumerate(items):
            with idle:
                self.inflight += 1
                self.queued[key] = self.queued.get(key, 0) + 1
                self.written.pop(key, None)
            try:
                if block:
                    self.queue.put((key, value, expires_at))
                else:
                    self.queue.put_nowait((key, value, expires_at))
            except queue.Full:
                with idle:
                    self.inflight -= 1
                    self._unqueue_locked(key)
                    idle.notify_all()
                return n
        return len(items)

    def note_extension_locked(self, keys: Sequence[ChunkKey], expires_at: float) -> None:
        for k in keys:
            if k in self.queued:
                self.extended[k] = max(self.extended.get(k, expires_at), expires_at)

    def close(self, deadline: float | None) -> bool:
        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            self.queue.put(_STOP, timeout=left())
        except queue.Full:
            return False
        self._thread.join(left())
        return not self._thread.is_alive()

    # -- the writer thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = []
            item = self.queue.get()
            while True:
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
                if len(batch) >= self._batch:
                    break
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write(batch)

    def _write(self, batch: list[Queued]) -> None:
        """Write one batch of queued entries to the tier, one ``put_many`` per expiry."""
        tier = self.tier
        with self._idle:  # an extension asked while the entry waited: the later time
            timed = [(k, v, self._effective_locked(k, x)) for k, v, x in batch]
        groups: dict[float | None, list[tuple[ChunkKey, Blob]]] = {}
        for key, value, expires_at in timed:
            groups.setdefault(expires_at, []).append((key, value))
        memo: dict = {}
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
            variants = self._transcoder.with_variants(keys)
            guarded(tier, "extend_many", tier.extend_many, None, variants, expires_at)
        with self._idle:
            for key, _, _ in batch:
                self._unqueue_locked(key)
                self._remember_written_locked(key)
            self.inflight -= len(batch)
            self._idle.notify_all()

    def _remember_written_locked(self, key: ChunkKey) -> None:
        self.written[key] = None
        if len(self.written) > self.WRITTEN_KEPT:
            del self.written[next(iter(self.written))]

    def _effective_locked(self, key: ChunkKey, expires_at: float | None) -> float | None:
        """A queued write's expiry: its own, or a later one ``extend`` asked meanwhile."""
        if expires_at is None:
            return None  # no expiry: extending leaves it alone
        ext = self.extended.get(key)
        return expires_at if ext is None else max(expires_at, ext)

    def _unqueue_locked(self, key: ChunkKey) -> None:
        n = self.queued.get(key, 0) - 1
        if n > 0:
            self.queued[key] = n
        else:
            self.queued.pop(key, None)
            self.extended.pop(key, None)
