"""What prefetching achieved, counted by the store at every ``fetch``: entries brought into memory
ahead of their request (``prefetched``), requests that found them there (``prefetch_hits``), and
requests that still read an entry from a lower tier while a ``Prefetcher`` ran
(``prefetch_misses``). A module of its own because the store counts through it and the
``Prefetcher`` (``prefetch.py``) uses the store: it is the one piece of the store's reads that
remembers keys between calls.
"""

from __future__ import annotations

import threading
from typing import Sequence

from kvfuse.kv.keys import ChunkKey
from kvfuse.store.results import StoreCounters

_FORGET_AFTER = (
    65536  # prefetched keys remembered at most (the rest: never asked for, e.g. cancelled)
)


class PrefetchTally:
    """The store's count of what prefetching achieved; see the module docstring.

    ``count`` is told every ``fetch``: a prefetching read (``prefetch``) adds its entries to
    ``prefetched`` and remembers their keys; a request's read counts ``prefetch_hits`` (a
    remembered key served by the memory tier) and, while a ``Prefetcher`` runs (``active``),
    ``prefetch_misses`` (an entry served by a lower tier). Side effects: only ``counters``."""

    def __init__(self, counters: StoreCounters, memory: str) -> None:
        self.active = False  # a Prefetcher runs (lower-tier reads at run time are then its misses)
        self._counters = counters
        self._memory = memory  # the memory tier's name
        self._keys: set[ChunkKey] = set()  # brought into memory ahead of the request needing them
        self._lock = threading.Lock()

    def count(self, keys: Sequence[ChunkKey], served: Sequence[str | None], prefetch: bool) -> None:
        """Count one ``fetch`` of ``keys``, served by the tiers named in ``served`` (None: missed)."""
        if prefetch:
            got = [k for k, t in zip(keys, served) if t is not None]
            with self._lock:
                self._keys.update(got)
            self._counters.add(prefetched=len(got))
            return
        hits = misses = 0
        with self._lock:
            for k, t in zip(keys, served):
                if t == self._memory and k in self._keys:
                    self._keys.discard(k)
                    hits += 1
                elif t is not None and t != self._memory and self.active:
                    misses += 1
            if len(self._keys) > _FORGET_AFTER:
                self._keys.clear()
        if hits or misses:
            self._counters.add(prefetch_hits=hits, prefetch_misses=misses)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Keys deleted from the store: no longer prefetched."""
        with self._lock:
            self._keys.difference_update(keys)
