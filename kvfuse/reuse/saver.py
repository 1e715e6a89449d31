"""Saving a sequence's new KV off the request path (CachedAttention's asynchronous save).

When a prefill ends and when a turn ends, the engine hands the live KV cache and the spans to
save to the ``Saver`` and goes on at once: the first token, the next decode step and the answer
do not wait for any store write, not even the memory tier's. A thread of its own copies each
span out of the cache (the spans are never written again: decoding only appends after them),
encodes it and puts it in the store. The cache object stays alive until its spans are saved.

Nothing here waits for a lower tier, so a slow disk, Redis or S3 never throttles the engine:

- the store's lower-tier writes are queued without blocking (``TieredStore.put``): past the
  store's bounded write queue they are dropped and counted per tier, the memory copy kept;
- the saver's own queue is bounded (``max_jobs``): a job handed over when it is full is not
  queued at all (``skipped_jobs`` / ``skipped_spans``): its spans are not stored (later requests
  compute them again) and the live KV is not held, so its bytes go back to the KV budget as soon
  as the sequence ends. The saver thus never holds more than ``max_jobs`` sequences' KV;
- the store is never flushed here. When the memory tier could not keep an entry (a small
  budget), the key is findable only once a lower tier has it: ``wait`` waits for exactly those
  keys' queued lower-tier writes (``TieredStore.wait_written``), per key; a write that was
  dropped makes the key a miss.

``later(task)`` runs other store work of the request path on the same thread, in order with the
saves (promotions and expiry extensions, which ask the lower tiers: a network round trip each
for Redis and S3); it is skipped and counted (``skipped_tasks``) when the queue is full: a
promotion not made or a lower-tier extension not applied is a later read from below, or an entry
expiring at its own time, never a wrong answer.

``SyncSaver`` is the same interface doing that work on the caller's thread (``save_now``), for
``cache.async_save: false``: the rest of the cache engine never asks which one it has.

A prefill that needs keys still being saved (the next turn, sent the moment the answer arrived)
waits for exactly those keys (``wait``), at most ``wait_s``; what is not saved by then is a
miss, planned around like any other.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvfuse.codecs.base import Codec
from kvfuse.counters import Counters
from kvfuse.kv.format import Entry, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache
from kvfuse.store import TieredStore
from kvfuse.threads import helper_thread

from .planner import Save

log = logging.getLogger(__name__)

_STOP = object()
_TASK = object()  # a ``later`` job: (_TASK, task)

# The saver's queue bound (``cache.save_queue``): jobs waiting, each holding one sequence's KV.
SAVE_QUEUE = 16


@dataclass
class SaveStats(Counters):
    """``save_jobs``: hand-offs; ``saved_entries``/``saved_bytes``: what reached the store;
    ``save_s``: the saver thread's time (off the request path); ``handoff_s``: the request
    path's time handing jobs over; ``save_waits``/``save_wait_s``: prefills that waited for a
    key still being saved; ``skipped_jobs``/``skipped_spans``: saves not queued because the
    queue was full (their spans are not stored); ``skipped_tasks``: ``later`` tasks likewise."""

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
    skipped_jobs: int = 0
    skipped_spans: int = 0
    skipped_tasks: int = 0


class Saver:
    """One background thread saving spans of live KV caches into a ``TieredStore``; at most
    ``max_jobs`` jobs wait (see the module docstring)."""

    def __init__(self, store: TieredStore, wait_s: float = 5.0, max_jobs: int = SAVE_QUEUE) -> None:
        if max_jobs < 1:
            raise ValueError(f"the saver's queue needs room for a job, got max_jobs={max_jobs}")
        self.store = store
        self.wait_s = wait_s
        self.stats = SaveStats()
        self._queue: queue.Queue = queue.Queue(maxsize=max_jobs)
        self._pending: Counter[ChunkKey] = Counter()
        self._tasks = 0  # ``later`` tasks queued or running
        self._cond = threading.Condition()
        self.epoch = (
            0  # jobs finished so far: a lookup made at the same epoch would answer the same
        )
        self._thread = helper_thread(self._loop, "kvfuse-saver")
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
        """Queue ``spans`` of ``kv`` to be stored under their keys; returns how many (0 when the
        queue is full: nothing is stored, ``kv`` is not held). The slots of each span must be
        final: nothing may write them again. ``ids``: the token id of every slot of ``kv`` (at
        least up to the spans' end; recorded in the entries). With ``skip_held``, keys some tier
        already holds are not written again. ``expires_at`` / ``memory_only``: how long and where
        the entries stay (``TieredStore.put``). Never blocks."""
        t0 = time.perf_counter()
        spans = [s for s in spans if s.end <= kv.length]
        queued = bool(spans)
        if spans:
            job = (kv, codec, spans, list(ids[: max(s.end for s in spans)]), skip_held)
            with self._cond:
                self._pending.update(s.key for s in spans)
            try:
                self._queue.put_nowait((*job, expires_at, memory_only))
            except queue.Full:
                queued = False
                self._done([s.key for s in spans], finished=False)
                self.stats.add(skipped_jobs=1, skipped_spans=len(spans))
        self.stats.add(save_jobs=int(queued), handoff_s=time.perf_counter() - t0)
        return len(spans) if queued else 0

    def later(self, task: Callable[[], object], keys: Iterable[ChunkKey] = ()) -> bool:
        """Run ``task`` on the saver's thread after the saves queued so far; False (and counted)
        when the queue is full and it will not run. ``keys``: what it writes (a promotion's),
        pending till it ran, so that ``wait`` for them sees its result. Never blocks."""
        keys = list(keys)
        with self._cond:
            self._tasks += 1
            self._pending.update(keys)
        try:
            self._queue.put_nowait((_TASK, task, keys))
            return True
        except queue.Full:
            self._task_done(keys)
            self.stats.add(skipped_tasks=1)
            return False

    def _task_done(self, keys: list[ChunkKey]) -> None:
        with self._cond:
            self._tasks -= 1
        self._done(keys)

    def wait(self, keys: Iterable[ChunkKey], below: bool = True) -> bool:
        """Block until none of ``keys`` is still being saved (at most ``wait_s``); False on
        time-out. ``below``: also until the lower tiers hold those the memory tier did not keep
        (their queued writes, per key); False: only until their KV is copied out of the live
        cache (a sequence about to free it)."""
        keys = list(keys)
        t0 = time.perf_counter()
        with self._cond:
            idle = not self._busy_locked(keys)
            done = idle or self._cond.wait_for(lambda: not self._busy_locked(keys), self.wait_s)
        if done and below:
            memory = self.store.memory
            unkept = [k for k in keys if not memory.contains(k)]
            if unkept and self.store.writing(unkept):
                idle = False
                left = max(0.0, self.wait_s - (time.perf_counter() - t0))
                done = self.store.wait_written(unkept, left)
        if not idle:
            self.stats.add(save_waits=1, save_wait_s=time.perf_counter() - t0)
        return done

    def _busy_locked(self, keys: list[ChunkKey]) -> bool:
        return any(self._pending[k] for k in keys if k in self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is saved; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not +self._pending and not self._tasks, timeout)

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
            if job[0] is _TASK:
                _, task, keys = job
                self._run(task)
                job = task = None
                self._task_done(keys)
                continue
            keys = [s.key for s in job[2]]
            try:
                self._save(*job)
            finally:
                # let the live KV go now (its bytes go back to the KV budget), not at the next job
                job = None
                self._done(keys)

    def _run(self, task: Callable[[], object]) -> None:
        try:
            task()
        except Exception:
            log.exception("a store task of the saver failed; its work is left undone")
            self.stats.add(save_errors=1)

    def _save(self, kv, codec, spans, ids, skip_held, expires_at, memory_only) -> None:
        """Write one job's spans: memory now, the lower tiers queued (dropped there when full)."""
        t0 = time.perf_counter()
        try:
            todo = unheld(self.store, spans) if skip_held else spans
            items = encode_spans(kv, codec, todo, ids)
            if items:
                self.store.put(items, expires_at=expires_at, memory_only=memory_only)
            dt = time.perf_counter() - t0
            self.stats.add(
                saved_entries=len(items),
                skipped_entries=len(spans) - len(todo),
                saved_bytes=sum(len(e) for _, e in items),
                save_s=dt,
            )
            self.stats.max(save_max_s=dt)
        except Exception:
            log.exception("saving %d spans failed; they are misses for later requests", len(spans))
            self.stats.add(save_errors=1)

    def _done(self, keys: list[ChunkKey], finished: bool = True) -> None:
        with self._cond:
            self.epoch += int(finished)
            self._pending.subtract(keys)
            self._pending = +self._pending
            self._cond.notify_all()

    def close(self, timeout: float | None = 30.0) -> None:
        """Save what is queued (at most ``timeout``), then stop the thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("the saver's queue stayed full for %.0f s at close", timeout)
            return
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left)


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

    def later(self, task: Callable[[], object], keys: Iterable[ChunkKey] = ()) -> bool:
        task()
        return True

    def wait(self, keys: Iterable[ChunkKey], below: bool = True) -> bool:
        return True

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def flush_prefix(self, prefix: str, timeout: float | None = None) -> bool:
        return True

    def pending(self) -> int:
        return 0

    def close(self, timeout: float | None = 30.0) -> None:
        pass
