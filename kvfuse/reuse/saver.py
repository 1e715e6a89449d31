"""Saving a sequence's new KV off the request path (CachedAttention's asynchronous save).

When a prefill ends and when a turn ends, the engine hands the live KV cache and the spans to
save to the ``Saver`` and goes on at once: the first token, the next decode step and the answer
do not wait for any store write, not even the memory tier's. A thread of its own copies each
span out of the cache (the spans are never written again: decoding only appends after them),
encodes it and puts it in the store; the lower tiers' writes it queues wait for room instead of
being dropped, since nobody waits on this thread. The cache object stays alive until its spans
are saved.

``SyncSaver`` is the same interface doing that work on the caller's thread (``save_now``), for
``cache.async_save: false``: the rest of the cache engine never asks which one it has.

A prefill that needs keys still being saved (the next turn, sent the moment the answer arrived)
waits for exactly those keys (``wait``), at most ``wait_s``; what is not saved by then is a
miss, planned around like any other. A key stays pending until some tier can be asked for it:
when the memory tier could not keep an entry (a small budget), until the lower tiers have it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvfuse.codecs.base import Codec
from kvfuse.counters import Counters
from kvfuse.kv.format import Entry, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.store import TieredStore

from .planner import Save

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class SaveStats(Counters):
    """``save_jobs``: hand-offs; ``saved_entries``/``saved_bytes``: what reached the store;
    ``save_s``: the saver thread's time (off the request path); ``handoff_s``: the request
    path's time handing jobs over; ``save_waits``/``save_wait_s``: prefills that waited for a
    key still being saved."""

    save_jobs: int = 0
    saved_entries: int = 0
    skipped_entries: int = 0
    saved_bytes: int = 0
    save_s: float = 0.0
    save_max_s: float = 0.0
    handoff_s: float = 0.0
    save_waits: int = 0
    save_wait_s: float = 0.0
    save_errors: int = 0


class Saver:
    """One background thread saving spans of live KV caches into a ``TieredStore``."""

    def __init__(self, store: TieredStore, wait_s: float = 5.0) -> None:
        self.store = store
        self.wait_s = wait_s
        self.stats = SaveStats()
        self._queue: queue.Queue = queue.Queue()
        self._pending: Counter[ChunkKey] = Counter()
        self._cond = threading.Condition()
        self.epoch = (
            0  # jobs finished so far: a lookup made at the same epoch would answer the same
        )
        self._thread = threading.Thread(target=self._loop, name="kvfuse-saver", daemon=True)
        self._thread.start()

    def save(
        self,
        kv: KVCache,
        codec: Codec,
        spans: Sequence[Save],
        ids: Sequence[int],
        skip_held: bool = False,
        expires_at: float | None = None,
        memory_only: bool = False,
    ) -> int:
        """Queue ``spans`` of ``kv`` to be stored under their keys; returns how many (the slots of
        each must be final: nothing may write them again). ``ids``: the token id of every slot of
        ``kv`` (at least up to the spans' end; recorded in the entries). With ``skip_held``, keys some tier
        already holds are not written again. ``expires_at`` / ``memory_only``: how long and where
        the entries stay (``TieredStore.put``)."""
        t0 = time.perf_counter()
        spans = [s for s in spans if s.end <= kv.length]
        if spans:
            with self._cond:
                self._pending.update(s.key for s in spans)
            self._queue.put(
                (
                    kv,
                    codec,
                    spans,
                    list(ids[: max(s.end for s in spans)]),
                    skip_held,
                    expires_at,
                    memory_only,
                )
            )
        self.stats.add(save_jobs=int(bool(spans)), handoff_s=time.perf_counter() - t0)
        return len(spans)

    def wait(self, keys: Iterable[ChunkKey]) -> bool:
        """Block until none of ``keys`` is still being saved (at most ``wait_s``); False on time-out."""
        keys = list(keys)
        with self._cond:
            if not any(self._pending[k] for k in keys if k in self._pending):
                return True
            t0 = time.perf_counter()
            done = self._cond.wait_for(
                lambda: not any(self._pending[k] for k in keys if k in self._pending), self.wait_s
            )
        self.stats.add(save_waits=1, save_wait_s=time.perf_counter() - t0)
        return done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is saved; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not +self._pending, timeout)

    def flush_prefix(self, prefix: str, timeout: float | None = None) -> bool:
        """Wait until no key starting with ``prefix`` is still to be saved; False if ``timeout``
        passed first. Unlike ``flush``, other tenants' saves queued meanwhile do not make it wait:
        a delete waits for what it deletes, not for the whole queue to run dry."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not any(n and str(k).startswith(prefix) for k, n in self._pending.items()),
                timeout,
            )

    def pending(self) -> int:
        with self._cond:
            return sum(self._pending.values())

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            kv, codec, spans, ids, skip_held, expires_at, memory_only = job
            t0 = time.perf_counter()
            try:
                todo = unheld(self.store, spans) if skip_held else spans
                items = encode_spans(kv, codec, todo, ids)
                if items:
                    self.store.put(
                        items, block=True, expires_at=expires_at, memory_only=memory_only
                    )
                    if not memory_only and not all(self.store.memory.contains(k) for k, _ in items):
                        # The memory tier did not keep them all (a small budget): they are not
                        # findable until the lower tiers have them, so they stay pending till then.
                        self.store.flush()
                dt = time.perf_counter() - t0
                self.stats.add(
                    saved_entries=len(items),
                    skipped_entries=len(spans) - len(todo),
                    saved_bytes=sum(len(e) for _, e in items),
                    save_s=dt,
                )
                self.stats.max(save_max_s=dt)
            except Exception:
                log.exception(
                    "saving %d spans failed; they are misses for later requests", len(spans)
                )
                self.stats.add(save_errors=1)
            finally:
                # let the live KV go now (its bytes go back to the KV budget), not at the next job
                job = kv = None
                with self._cond:
                    self.epoch += 1
                    self._pending.subtract(s.key for s in spans)
                    self._pending = +self._pending
                    self._cond.notify_all()

    def close(self, timeout: float | None = 30.0) -> None:
        """Save what is queued, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)


def unheld(store: TieredStore, spans: Iterable[Save]) -> list[Save]:
    """The spans whose keys no tier holds yet (the others need not be written again)."""
    spans = list(spans)
    held = store.lookup([s.key for s in spans], count=False).where
    return [s for s, w in zip(spans, held) if w is None]


def encode_spans(
    kv: KVCache, codec: Codec, spans: Iterable[Save], ids: Sequence[int]
) -> list[tuple[ChunkKey, Entry]]:
    """An entry per span of ``kv`` (its slots copied out), keyed by the span's key, recording the
    span's token ids (``ids``: the token id of every slot of ``kv``)."""
    return [
        (
            s.key,
            encode_entry(kv.chunk(s.start, s.end), s.key, codec, token_ids=ids[s.start : s.end]),
        )
        for s in spans
        if s.end <= kv.length
    ]


def save_now(
    store: TieredStore,
    kv: KVCache,
    codec: Codec,
    spans: Sequence[Save],
    ids: Sequence[int],
    skip_held: bool = False,
    expires_at: float | None = None,
    memory_only: bool = False,
) -> int:
    """``Saver.save`` on the caller's thread: the entries go into memory now (the lower tiers from the
    store's write queue); returns how many were written."""
    todo = unheld(store, spans) if skip_held else spans
    items = encode_spans(kv, codec, todo, ids)
    if items:
        store.put(items, expires_at=expires_at, memory_only=memory_only)
    return len(items)


class SyncSaver:
    """``Saver``'s interface without a thread (``cache.async_save: false``): each save is written
    on the caller's thread, so nothing is ever pending."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.stats = SaveStats()
        self.epoch = 0  # saves made so far (see ``Saver.epoch``)

    def save(
        self,
        kv: KVCache,
        codec: Codec,
        spans: Sequence[Save],
        ids: Sequence[int],
        skip_held: bool = False,
        expires_at: float | None = None,
        memory_only: bool = False,
    ) -> int:
        self.epoch += 1
        return save_now(self.store, kv, codec, spans, ids, skip_held, expires_at, memory_only)

    def wait(self, keys: Iterable[ChunkKey]) -> bool:
        return True

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def flush_prefix(self, prefix: str, timeout: float | None = None) -> bool:
        return True

    def pending(self) -> int:
        return 0

    def close(self, timeout: float | None = 30.0) -> None:
        pass
