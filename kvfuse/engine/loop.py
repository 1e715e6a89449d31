"""The engine's own thread: a step whenever there is work, until the engine stops.

A server submits requests from its event loop and lets this thread run them; results and text
pieces reach the server through each request's callbacks. The loop ends once the scheduler is
closed (``Engine.stop``) and the sequences still running have finished (they were cancelled, so
each ends at its next step). When nothing waits or runs, it does one piece of idle work at a time
(``idle``: the online blend guard's checks, the heap given back once idle long enough), then looks
at the queue again. It knows only the step to run, the idle work, and the scheduler to wait on. It
computes with the engine's thread count (``kvfuse.threads``), whatever count a new thread would
start from.

A step that raises is a bug or a fault the engine could not pin on one request (those end the
request they belong to): the loop retries, but backs off (``STEP_BACKOFF_FIRST_S``, doubling up
to ``STEP_BACKOFF_MAX_S``) instead of spinning at once, and ``Progress`` records when a step last
did anything, which is what ``/health`` reports and calls wedged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvfuse.threads import use_compute_threads

from .scheduler import Scheduler

log = logging.getLogger(__name__)

STEP_BACKOFF_FIRST_S = 0.01
STEP_BACKOFF_MAX_S = 1.0


class Progress:
    """When the engine last made progress (a step that ran the model, admitted or finished a
    request) and how many steps in a row raised. Written by the engine thread, read by others
    (plain attribute reads and writes: each is atomic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()
        self.steps = 0  # steps that made progress
        self.failures = 0  # steps in a row that raised
        self.failed_steps = 0  # in all

    def advanced(self) -> None:
        self.last, self.steps = self.clock(), self.steps + 1

    def idle(self) -> None:
        """Nothing to do: idle is not stuck, the stall clock starts when work arrives."""
        self.last = self.clock()

    def step_ok(self) -> None:
        self.failures = 0

    def step_failed(self) -> float:
        """Count a step that raised; the pause before the next one."""
        self.failures += 1
        self.failed_steps += 1
        return min(STEP_BACKOFF_FIRST_S * 2 ** (self.failures - 1), STEP_BACKOFF_MAX_S)

    def report(self, busy: bool, stall_after_s: float, loop_dead: bool = False) -> dict:
        """What ``/health`` shows: ``wedged`` when there is work and no progress for
        ``stall_after_s`` seconds (or the loop thread is gone). An idle engine is never wedged,
        however long ago its last step."""
        idle_s = self.clock() - self.last
        return {
            "progress_steps": self.steps,
            "seconds_since_progress": round(idle_s, 3) if busy else 0.0,
            "failing_steps": self.failures,
            "failed_steps": self.failed_steps,
            "wedged": loop_dead or (busy and idle_s > stall_after_s),
        }


class EngineLoop(threading.Thread):
    def __init__(
        self,
        step: Callable[[], object],
        scheduler: Scheduler,
        idle: Callable[[], bool] = lambda: False,
        progress: Progress | None = None,
    ):
        super().__init__(name="kvfuse-engine", daemon=True)
        self.step, self.scheduler, self.idle = step, scheduler, idle
        self.progress = progress or Progress()

    def run(self) -> None:
        use_compute_threads()  # a helper may have left PyTorch's count for new threads at one
        while True:
            if not self.scheduler.has_work():
                if self.scheduler.closed:
                    return
                if not self._idle_work():
                    self.scheduler.wait_for_work(timeout=1.0)
                self.progress.idle()
                continue
            try:
                self.step()
                self.progress.step_ok()
            except Exception:  # step() ends failing requests itself; this is a bug in the engine
                pause = self.progress.step_failed()
                log.exception(
                    "engine step failed (%d in a row); next try in %.2f s",
                    self.progress.failures,
                    pause,
                )
                time.sleep(pause)  # not woken by submits: a flood of them must not make it spin

    def _idle_work(self) -> bool:
        """Nothing to serve: one piece of background work (``idle``); whether there was any."""
        try:
            return self.idle()
        except Exception:
            log.exception("idle work failed")
            return False
