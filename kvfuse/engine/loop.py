"""The engine's own thread: a step whenever there is work, until the engine stops.

A server submits requests from its event loop and lets this thread run them; results and text
pieces reach the server through each request's callbacks. The loop ends once the scheduler is
closed (``Engine.stop``) and the sequences still running have finished (they were cancelled, so
each ends at its next step). It knows only the step to run and the scheduler to wait on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineLoop(threading.Thread):
    def __init__(self, step: Callable[[], object], scheduler: Scheduler):
        super().__init__(name="kvfuse-engine", daemon=True)
        self.step, self.scheduler = step, scheduler

    def run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                if self.scheduler.closed:
                    return
                self.scheduler.wait_for_work(timeout=1.0)
                continue
            try:
                self.step()
            except Exception:  # step() ends failing requests itself; this is a bug in the engine
                log.exception("engine step failed")
