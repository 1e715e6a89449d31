"""The engine's own thread: a step whenever there is work, until the engine stops.

A server submits requests from its event loop and lets this thread run them; results and text
pieces reach the server through each request's callbacks. The loop ends once the scheduler is
closed (``Engine.stop``) and the sequences still running have finished (they were cancelled, so
each ends at its next step). When nothing waits or runs, it does one piece of idle work at a time
(``idle``: the online blend guard's checks), then looks at the queue again. It knows only the
step to run, the idle work, and the scheduler to wait on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineLoop(threading.Thread):
    def __init__(
        self,
        step: Callable[[], object],
        scheduler: Scheduler,
        idle: Callable[[], bool] = lambda: False,
    ):
        super().__init__(name="kvfuse-engine", daemon=True)
        self.step, self.scheduler, self.idle = step, scheduler, idle

    def run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                if self.scheduler.closed:
                    return
                if not self._idle_work():
                    self.scheduler.wait_for_work(timeout=1.0)
                continue
            try:
                self.step()
            except Exception:  # step() ends failing requests itself; this is a bug in the engine
                log.exception("engine step failed")

    def _idle_work(self) -> bool:
        """Nothing to serve: one piece of background work (``idle``); whether there was any."""
        try:
            return self.idle()
        except Exception:
            log.exception("idle work failed")
            return False
