"""Thread-safe counters: the one type behind every set of statistics kvfuse reports.

A counters class is a dataclass of ``int`` fields (and ``dict[str, int]`` fields for counts by
name, e.g. hits by tier) whose updates and reads go through one lock, so a reader such as
``/metrics`` on the server's event loop never sees a half-applied update from the engine thread.
Subclasses only declare fields::

    @dataclass
    class TierStats(Counters):
        hits: int = 0
        misses: int = 0
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, fields


@dataclass
class Counters:
    """Base of every counters dataclass; see the module docstring."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lock", threading.Lock())

    def add(self, **counts) -> None:
        """Add to several counters at once: ``add(hits=1, bytes_out=n)``; a dict field takes a dict
        of increments by name (``add(hits_by_tier={"disk": 2})``)."""
        with self._lock:
            for name, n in counts.items():
                current = getattr(self, name)
                if isinstance(current, dict):
                    for k, v in n.items():
                        current[k] = current.get(k, 0) + v
                else:
                    setattr(self, name, current + n)

    def max(self, **values) -> None:
        """Raise counters to at least the given values (high-water marks such as a maximum latency)."""
        with self._lock:
            for name, v in values.items():
                if v > getattr(self, name):
                    setattr(self, name, v)

    def snapshot(self) -> dict:
        """A consistent copy of every counter (dict fields copied too)."""
        with self._lock:
            return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)}

    def __getstate__(self):  # a lock cannot be pickled or deep-copied; the counts can
        return self.snapshot()

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self.__post_init__()
