"""The engine's request queue and what runs at each step.

``Scheduler.schedule()`` decides one engine step: the waiting sequences to drop (their client
left: cancelled while queued), the sequence to admit and prefill, and the running sequences to
decode. Waiting sequences are admitted first come, first served, up to ``max_running`` at a time
(one for now: the runner serves one sequence per step; continuous batching raises it). The
queue holds at most ``max_waiting`` sequences; beyond that ``add`` raises ``QueueFull`` (the
server answers 429) instead of letting latency grow without bound.

The queue's look-ahead (``lookahead()``: which requests wait, in order, with the keys they will
ask for) is what the store reads to prefetch entries before the requests that need them run.

``add``/``remove`` come from other threads (the server's event loop); ``schedule``/``finish``
from the engine's. One condition variable guards the queue and wakes the engine loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvfuse.kv.keys import ChunkKey

from .request import QueueClosed, QueueFull
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """What one engine step does."""

    skipped: list[Sequence] = field(default_factory=list)  # cancelled while waiting: finish them
    prefill: Sequence | None = None  # admitted now: plan, load, prefill, first token
    decode: list[Sequence] = field(default_factory=list)  # running: one more token each

    @property
    def empty(self) -> bool:
        return not self.skipped and self.prefill is None and not self.decode


class Scheduler:
    """FIFO admission with a bounded queue; see the module docstring."""

    def __init__(self, max_waiting: int = 64, max_running: int = 1):
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

    def schedule(self) -> ScheduledStep:
        """The next step: drop cancelled waiting sequences, admit the oldest waiting one if there
        is room, otherwise decode the running ones."""
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
            step.decode = [s for s in self._running if s.status is SequenceStatus.RUNNING]
            if len(self._running) < self.max_running and self._waiting:
                seq = self._waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.request.started_at = time.monotonic()
                self._running.append(seq)
                step.prefill = seq
        return step

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
