"""Planning and loading admitted sequences' KV off the engine's step.

Reading a prompt's entries from disk, Redis or S3 (and waiting for the previous turn's saves)
takes milliseconds to seconds; done inside the step, every running sequence would wait for it.
The ``Loader`` does it on threads of its own: ``start`` hands it a sequence's ``Reuse`` and live
cache, a worker plans and reads it (``Prefiller.plan``: lookup, fetch, and the loads themselves
when that is all the plan needs), and ``done`` gives the engine's thread the sequences that are
ready, with their ``ReadyPlan`` or the error that ended them; ``wake`` tells the engine's loop
that one is. Meanwhile the others keep decoding. When nothing else runs there is nothing to keep
going, and the engine waits for the loads it started (``wait_idle``). A sequence is in one
worker's hands at a time, and no step touches its cache until ``done`` returned it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfuse.models.cache import KVCache
from kvfuse.threads import helper_thread

from .prefill import Prefiller, ReadyPlan
from .state import Reuse

log = logging.getLogger(__name__)

_STOP = object()


@dataclass
class Loaded:
    """A sequence the loader is done with: its tag (what ``start`` was given), and its plan or
    the error that ended it."""

    tag: object
    ready: ReadyPlan | None = None
    error: BaseException | None = None


class Loader:
    """Worker threads that plan and load sequences; see the module docstring."""

    def __init__(
        self, prefiller: Prefiller, wake: Callable[[], None], workers: int = 2, stats=None
    ):
        self.prefiller, self.wake, self.stats = prefiller, wake, stats
        self._jobs: queue.Queue = queue.Queue()
        self._done: list[Loaded] = []
        self._lock = threading.Condition()
        self._busy = 0
        self._threads = [helper_thread(self._work, f"kvfuse-loader-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def start(self, r: Reuse, kv: KVCache, tag: object) -> None:
        """Plan and load ``r`` into ``kv`` on a worker; ``tag`` comes back from ``done``."""
        with self._lock:
            self._busy += 1
        self._jobs.put((r, kv, tag))

    def done(self) -> list[Loaded]:
        """The sequences finished since the last call (the engine's thread takes them over)."""
        with self._lock:
            out, self._done = self._done, []
            return out

    def wait_idle(self, timeout: float) -> bool:
        """Block until no worker holds a sequence (False if ``timeout`` passed first)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._busy == 0, timeout)

    def busy(self) -> int:
        """Sequences started and not yet returned by ``done``."""
        with self._lock:
            return self._busy + len(self._done)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            r, kv, tag = job
            t0 = time.perf_counter()
            out = Loaded(tag)
            try:
                out.ready = self.prefiller.plan(r, kv)
            except Exception as e:  # the engine ends that request with it, not the loop
                log.exception("request %s: planning its prompt failed", r.request_id)
                e.__traceback__ = None  # the frames would keep its KV alive
                out.error = e
            finally:
                job = r = kv = None
            if self.stats is not None:
                self.stats.add(offstep_loads=1, offstep_load_s=time.perf_counter() - t0)
            with self._lock:
                self._busy -= 1
                self._done.append(out)
                self._lock.notify_all()
            self.wake()

    def close(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._jobs.put(_STOP)
        for t in self._threads:
            t.join(timeout)
