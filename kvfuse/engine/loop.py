"""The engine's own thread: ``step()`` whenever there is work, until the engine stops.

A server submits requests from its event loop and lets this thread run them; results and text
pieces reach the server through each request's callbacks. The loop ends once the scheduler is
closed (``Engine.stop``) and the sequences still running have finished (they were cancelled, so
each ends at its next step).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger(__name__)


class EngineLoop(threading.Thread):
    def __init__(self, engine: Engine):
        super().__init__(name="kvfuse-engine", daemon=True)
        self.engine = engine

    def run(self) -> None:
        scheduler = self.engine.scheduler
        while True:
            if not scheduler.has_work():
                if scheduler.closed:
                    return
                scheduler.wait_for_work(timeout=1.0)
                continue
            try:
                self.engine.step()
            except Exception:  # step() ends failing requests itself; this is a bug in the engine
                log.exception("engine step failed")
