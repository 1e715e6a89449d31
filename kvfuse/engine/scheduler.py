"""The engine's request queue and what runs at each step.

``Scheduler.schedule(admit)`` decides one engine step: the waiting sequences to drop (their
client left: cancelled while queued), the sequences to admit, and the running ones (every
running sequence takes part in every step: continuous batching). Waiting sequences are admitted
first come, first served, up to ``max_running`` at a time and while ``admit(seq)`` (the engine's
callback, which takes the sequence's KV memory from the budget) says it fits; admission stops at
the first one that does not, so a large request is never overtaken forever by small ones (no
starvation). A running sequence the engine preempts (``preempt``: its KV was needed by older
ones) goes back to the front of the queue and keeps what it generated. The queue holds at most
``max_waiting`` sequences; beyond that ``add`` raises ``QueueFull`` (the server answers 429)
instead of letting latency grow without bound.

The queue's look-ahead (``lookahead()``: which requests wait, in order, with the keys they will
ask for) is what the store reads to prefetch entries before the requests that need them run.

``add``/``remove`` come from other threads (the server's event loop); ``schedule``/``finish``
from the engine's. One condition variable guards the queue and wakes the engine loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfuse.kv.keys import ChunkKey

from .request import QueueClosed, QueueFull
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """What one engine step does."""

    skipped: list[Sequence] = field(default_factory=list)  # cancelled while waiting: finish them
    admitted: list[Sequence] = field(default_factory=list)  # admitted now: plan, load, start their prefill
    running: list[Sequence] = field(default_factory=list)  # every running sequence, oldest first

    @property
    def empty(self) -> bool:
        return not self.skipped and not self.running


class Scheduler:
    """FIFO admission with a bounded queue; see the module docstring."""

    def __init__(self, max_waiting: int = 64, max_running: int = 16):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.max_waiting = max_waiting
        self.max_running = max_running
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self.skipped = 0  # sequences dropped because they were cancelled while waiting
        self.preempted = 0  # running sequences put back in the queue

    # -- other threads --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; QueueFull when ``max_waiting`` wait already, QueueClosed after close()."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (max_queue = {self.max_waiting})")
            seq.status = SequenceStatus.WAITING
            self._waiting.append(seq)
            self._cond.notify_all()

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out of the queue if it still waits (its client left); True if it was."""
        with self._cond:
            try:
                self._waiting.remove(seq)
            except ValueError:
                return False
            self.skipped += 1
            return True

    def close(self) -> list[Sequence]:
        """Refuse new sequences; remove and return the waiting ones."""
        with self._cond:
            self._closed = True
            out = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            return out

    def wake(self) -> None:
        """Wake a ``wait_for_work`` (e.g. a running request was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- the engine thread ----------------------------------------------------------------------

    def schedule(self, admit: Callable[[Sequence], bool] = lambda seq: True,
                 defer: Callable[[Sequence], bool] = lambda seq: False) -> ScheduledStep:
        """The next step: drop cancelled waiting sequences, admit the oldest waiting ones while
        there is room (``max_running``) and ``admit`` accepts them, run everything running.

        ``defer(seq)`` True passes over a waiting sequence for this step, keeping its place: the
        engine defers a prompt whose leading chunks a running sequence is computing right now, so
        that it loads them once stored instead of computing them a second time alongside."""
        step = ScheduledStep()
        with self._cond:
            kept: deque[Sequence] = deque()
            for seq in self._waiting:
                if seq.request.cancel.is_set():
                    step.skipped.append(seq)
                else:
                    kept.append(seq)
            self._waiting = kept
            self.skipped += len(step.skipped)
            for seq in list(self._waiting):
                if len(self._running) >= self.max_running:
                    break
                if defer(seq):
                    continue  # keeps its place; later ones may be admitted
                if not admit(seq):
                    break
                self._waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                if seq.request.started_at is None:
                    seq.request.started_at = time.monotonic()
                self._running.append(seq)
                step.admitted.append(seq)
            step.running = [s for s in self._running if s.status is SequenceStatus.RUNNING]
        return step

    def preempt(self, seq: Sequence) -> None:
        """Put running ``seq`` back at the front of the queue (its KV was freed to make room); it
        is admitted again before anything that arrived after it. Not refused when the queue is full:
        it was accepted already."""
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self._waiting.appendleft(seq)
            self.preempted += 1

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done (whatever the reason): it leaves the running set."""
        with self._cond:
            seq.status = SequenceStatus.FINISHED
            if seq in self._running:
                self._running.remove(seq)

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._waiting or self._running)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until something waits or runs (True), or ``timeout`` passes / close() (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting or self._running or self._closed, timeout) and \
                bool(self._waiting or self._running)

    # -- views ----------------------------------------------------------------------------------

    def waiting(self) -> list[Sequence]:
        """The waiting sequences, oldest first (a snapshot)."""
        with self._cond:
            return list(self._waiting)

    def running(self) -> list[Sequence]:
        with self._cond:
            return list(self._running)

    def lookahead(self) -> list[tuple[str, list[ChunkKey]]]:
        """``(request id, planned keys)`` of every waiting sequence, in the order they will run."""
        with self._cond:
            return [(s.request.request_id, s.keys.all() if s.keys is not None else []) for s in self._waiting]

    def upcoming_keys(self) -> list[ChunkKey]:
        """Every key the waiting sequences will ask for, in run order, each once."""
        return list(dict.fromkeys(k for _, keys in self.lookahead() for k in keys))

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)
