"""A tier behind a slow link: reads take as long as a bandwidth trace says (CacheGen's traces).

``ThrottledTier(inner, trace, period_s)`` delegates everything to ``inner`` (``DelegatingTier``). The link's bandwidth
changes over time: trace value ``k`` (Gbit/s, times ``scale``) holds from ``k * period_s`` to
``(k + 1) * period_s`` after ``reset()`` (the trace repeats). Each read that returns data (``get``,
``get_many``, ``read_range``) then lasts until its bytes have gone through the link at those
bandwidths, starting when the link is free (one read at a time, as on one connection). A loader
that recomputes a chunk instead of reading it does not stop the link's clock, as on a real
network. Writes and lookups are not slowed: the streaming loader adapts to the read path.
``scale`` converts the trace to this machine (see ``bench/streaming.py``), and the clock and
sleep are injectable so tests run without waiting (that clock times the link; expiries are on
``inner``'s ``clock``, which ``clock`` here reads and sets, as ``DelegatingTier`` does).

This is a measurement and test fixture, not a production tier: it slows a real tier exactly as
a slower link would, so the loader is exercised against real reads and real decoding.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier, nbytes
from kvfuse.tiers.delegating import DelegatingTier


def load_trace(path: str | Path, row: int | None = None) -> list[float]:
    """Bandwidths (Gbit/s) of a JSONL trace file (``{"bw": [...]}`` per line): one row, or all
    rows concatenated."""
    rows = [json.loads(line)["bw"] for line in Path(path).read_text().splitlines() if line.strip()]
    if row is not None:
        return [float(x) for x in rows[row]]
    return [float(x) for r in rows for x in r]


class ThrottledTier(DelegatingTier):
    """``inner`` whose reads follow ``trace`` (Gbit/s times ``scale``, one value per ``period_s``).
    Everything but the reads is ``inner``'s (``DelegatingTier``); every read goes through the
    throttled ``get`` or ``read_range`` (``read_with`` too, so no streaming read gets around the
    link)."""

    streams_reads = False
    read_with = Tier.read_with  # through self.get: throttled

    def __init__(
        self,
        inner: Tier,
        trace: Sequence[float],
        scale: float = 1.0,
        period_s: float = 0.2,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not trace or any(not b > 0 for b in trace):
            raise ValueError("a bandwidth trace needs at least one value, all > 0")
        if not scale > 0 or not period_s > 0:
            raise ValueError(f"scale and period_s must be > 0, got {scale}, {period_s}")
        super().__init__(inner)
        self.trace, self.scale, self.period_s = list(trace), scale, period_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._t0 = clock()
        self._free_at = self._t0
        self.reads = 0
        self.waited_s = 0.0

    def bandwidth_at(self, t: float) -> float:
        """The link's bandwidth at time ``t``, bytes per second."""
        k = int((t - self._t0) // self.period_s) % len(self.trace)
        return self.trace[k] * self.scale * 1e9 / 8

    def reset(self) -> None:
        """Start the trace again from its first value, now (e.g. at the start of a request)."""
        with self._lock:
            self._t0 = self._free_at = self._clock()

    def transfer_end(self, start: float, size: int) -> float:
        """When ``size`` bytes sent from ``start`` have gone through the link."""
        t, left = start, float(size)
        k = int((t - self._t0) // self.period_s)
        while left > 0:
            segment_end = self._t0 + (k + 1) * self.period_s
            if segment_end <= t:  # float rounding at a boundary: the next segment
                k += 1
                continue
            bw = self.trace[k % len(self.trace)] * self.scale * 1e9 / 8
            can = bw * (segment_end - t)
            if can >= left:
                return t + left / bw
            left -= can
            t, k = segment_end, k + 1
        return t

    def _throttle(self, started: float, size: int) -> None:
        with self._lock:
            begin = max(started, self._free_at)
            end = self.transfer_end(begin, size)
            self._free_at = end
            self.reads += 1
        wait = end - self._clock()
        if wait > 0:
            self.waited_s += wait
            self._sleep(wait)

    def get(self, key: ChunkKey) -> Blob | None:
        t = self._clock()
        value = self.inner.get(key)
        if value is not None:
            self._throttle(t, nbytes(value))
        return value

    def get_many(self, keys: Iterable[ChunkKey]) -> list[Blob | None]:
        return [self.get(k) for k in keys]

    def read_range(self, key: ChunkKey, start: int, stop: int):
        t = self._clock()
        value = self.inner.read_range(key, start, stop)
        if value is not None:
            self._throttle(t, memoryview(value).nbytes)
        return value
