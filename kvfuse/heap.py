"""glibc's heap: freed buffers kept for reuse while the engine works, given back while it rests.

Every cache hit and store allocates buffers of several MB, and a long prompt's step allocates
activations of tens of MB per layer. By default glibc serves such sizes with fresh ``mmap``s, or
trims freed heap memory back to the kernel, so each new buffer costs page faults on first touch:
measured here, copying 16 chunks of 6 MB ran at ~1 GB/s that way and at ~9 GB/s once freed
memory is kept and reused. ``tune`` keeps it (``tune_malloc``).

The price is a resident size that does not shrink after a peak: a 2,048-token prompt left
~120-200 MB of freed activations in the heap (SmolLM2, measured with ``malloc_trim``), beyond the
weights, the KV and the runtime. So the engine gives the kept memory back once it has been idle
for ``engine.release_idle_s`` seconds (``IdleRelease``, from the engine loop's idle work), once
per busy period: a busy server keeps its buffers, a resting one holds what it uses. The next
request after a release pays the first-touch faults again (measured: ~3% on a cold 2,048-token
prompt, within this machine's noise).

Elsewhere than glibc every function here is a no-op that says so (False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

from .resident import resident_bytes

# glibc mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def tune(mmap_threshold: int = 256 << 20, trim_threshold: int = 2 << 30) -> bool:
    """Keep freed buffers below ``mmap_threshold`` bytes in the heap for reuse, and up to
    ``trim_threshold`` free bytes at its top; whether glibc took both settings."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def release() -> bool:
    """Give every free page of every arena back to the kernel (``malloc_trim(0)``); whether
    glibc has the call."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


class IdleRelease:
    """The engine's heap release: called from its idle work with the count of steps it has run
    (``Progress.steps``), it releases once the count has stood still for ``after_s`` seconds, and
    not again until the count moves. ``after_s`` None: never. Counts the releases and the bytes
    they gave back (the resident size before minus after)."""

    def __init__(
        self,
        after_s: float | None,
        give_back: Callable[[], bool] = release,
        clock: Callable[[], float] = time.monotonic,
        resident: Callable[[], int | None] = resident_bytes,
    ) -> None:
        self.after_s, self.give_back, self.clock, self.resident = (
            after_s,
            give_back,
            clock,
            resident,
        )
        self._seen: int | None = None  # the step count last seen
        self._since = 0.0  # when it was first seen
        self._released: int | None = None  # the step count at the last release
        self.releases = 0
        self.released_bytes = 0

    def due(self, steps: int) -> bool:
        """Whether to release now, at ``steps`` (pure but for the clock and the state it keeps)."""
        now = self.clock()
        if steps != self._seen:
            self._seen, self._since = steps, now
        if self.after_s is None or steps == self._released:
            return False
        return now - self._since >= self.after_s

    def __call__(self, steps: int) -> bool:
        """Release if due; False always (nothing more to do at once: the loop may wait)."""
        if not self.due(steps):
            return False
        self._released = steps
        before = self.resident()
        if self.give_back():
            after = self.resident()
            self.releases += 1
            if before is not None and after is not None:
                self.released_bytes += max(0, before - after)
        return False
