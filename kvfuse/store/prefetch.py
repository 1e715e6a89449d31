"""Prefetching the KV of queued requests into memory before they run (CachedAttention's
scheduler-aware placement).

The engine's queue knows which keys each waiting request will load, in run order
(``TieredStore.upcoming``). A ``Prefetcher`` thread wakes whenever the queue changes (and a few
times a second), looks those keys up, and reads the ones held only below memory (disk, Redis)
through ``TieredStore.fetch``, which checks them and promotes them into the memory tier. With
``protect_upcoming`` the memory tier does not evict them while their requests wait. It stops
short of filling memory with the queue's entries alone (``fill``): prefetching more than fits
would only evict what it fetched a moment ago.

Counted in the store's statistics: ``prefetched`` (entries brought up), ``prefetch_hits`` (a
request found a prefetched entry in memory) and ``prefetch_misses`` (a request still had to read
an entry from a lower tier). The store keeps that count through a ``PrefetchTally``
(``prefetch_tally.py``).
"""

from __future__ import annotations

import logging
import threading

from kvfuse.store.core import TieredStore
from kvfuse.threads import helper_thread

log = logging.getLogger(__name__)


class Prefetcher:
    """A thread promoting queued requests' lower-tier entries into the memory tier."""

    def __init__(
        self, store: TieredStore, fill: float = 0.8, batch: int = 8, interval_s: float = 0.25
    ) -> None:
        if not 0 < fill <= 1:
            raise ValueError("fill must be in (0, 1]")
        self.store = store
        self.fill = fill
        self.batch = batch
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = helper_thread(self._loop, "kvfuse-prefetch")
        store.prefetching = True
        self._thread.start()

    def wake(self) -> None:
        """The queue changed: look again now."""
        self._wake.set()

    def run_once(self, stop: threading.Event | None = None) -> int:
        """Promote what the queue will need next (in run order, up to the fill limit, until
        ``stop`` is set); the number of entries promoted."""
        store = self.store
        memory = store.memory
        keys = store.upcoming()
        if not keys or not store.lower:
            return 0
        where = store.lookup(keys, count=False).where
        below = [k for k, w in zip(keys, where) if w is not None and w != memory.name]
        done = 0
        for i in range(0, len(below), self.batch):
            if stop is not None and stop.is_set():
                break
            if memory.bytes_of(keys) >= self.fill * memory.capacity_bytes:
                break
            got = store.fetch(below[i : i + self.batch], prefetch=True)
            done += sum(f.entry is not None for f in got)
        return done

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.run_once(self._stop)
            except Exception:  # never let a prefetch failure stop prefetching
                log.exception("prefetch failed")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)
        self.store.prefetching = False
