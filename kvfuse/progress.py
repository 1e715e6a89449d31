"""Progress of the long one-time steps: a built-in model's download, join and conversion.

Where a function takes ``progress``: ``None`` shows a bar on a terminal (stderr is a TTY) and
lines otherwise, ``True`` always a bar, ``False`` nothing. A bar is tqdm's, on stderr. Lines are
for logs and CI: one when a step starts, one every ``interval`` seconds while it runs and one when
it ends, so a slow step is never silent. ``on_progress(step, done, total)`` (tests, embedders) is
called after every update, whatever is shown.

A step whose work cannot be counted (``total=None``: the tokenizer's conversion inside
transformers, a pip download) shows its elapsed time, kept current by a ticker thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

BAR, LINES, OFF = "bar", "lines", "off"
INTERVAL_S = 10.0  # seconds between two lines of a running step

ProgressCallback = Callable[[str, int, "int | None"], None]


def mode(progress: bool | str | None, stream: TextIO | None = None) -> str:
    """``BAR``, ``LINES`` or ``OFF`` for a ``progress`` argument (None: a bar on a terminal, lines
    otherwise; one of the three names: that one)."""
    if progress in (BAR, LINES, OFF):
        return progress
    if progress is False:
        return OFF
    if progress is True:
        return BAR
    isatty = getattr(sys.stderr if stream is None else stream, "isatty", None)
    try:
        return BAR if isatty is not None and isatty() else LINES
    except ValueError:  # a closed stream
        return OFF


def note(text: str, progress: bool | None = None, stream: TextIO | None = None) -> None:
    """One line about what is about to happen (shown unless ``progress`` is False)."""
    if mode(progress, stream) != OFF:
        print(f"kvfuse: {text}", file=sys.stderr if stream is None else stream, flush=True)


def amount(n: float, unit: str, unit_scale: bool) -> str:
    """``n`` with its unit, as a line shows it: ``272 tensors``, ``491.4MB``."""
    if unit_scale:
        return f"{tqdm.format_sizeof(n, divisor=1000)}{unit}"
    return f"{int(n)} {unit}".rstrip()


def status_line(
    desc: str,
    done: float,
    total: float | None,
    elapsed: float,
    unit: str = "",
    unit_scale: bool = False,
) -> str:
    """A running step's line: ``converting weights: 120/272 tensors (44%), 12 s``."""
    if total is None:
        return f"{desc}: {elapsed:.0f} s"
    shown_total = amount(total, unit, unit_scale)
    shown_done = amount(done, "", unit_scale) if unit_scale else str(int(done))
    pct = 100.0 * done / total if total else 100.0
    return f"{desc}: {shown_done}/{shown_total} ({pct:.0f}%), {elapsed:.0f} s"


class Step:
    """One step's progress, used as a context manager: ``update(n)`` as work is done."""

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "",
        *,
        progress: bool | str | None = None,
        on_progress: ProgressCallback | None = None,
        unit_scale: bool = False,
        interval: float = INTERVAL_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.desc, self.total, self.unit, self.unit_scale = desc, total, unit, unit_scale
        self.done = 0
        self._on_progress = on_progress
        self._interval = interval
        self._stream = sys.stderr if stream is None else stream
        self._mode = mode(progress, self._stream)
        self._clock = clock
        self._start = self._last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self._ticker = None
        self._closed = False
        if self._mode == BAR:
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit or "it",
                unit_scale=unit_scale,
                file=self._stream,
                bar_format="{desc}: {elapsed}" if total is None else None,
                dynamic_ncols=True,
            )
        elif self._mode == LINES:
            self._line(
                f"{desc} ({amount(total, unit, unit_scale)}) ..." if total else f"{desc} ..."
            )
        if total is None and self._mode != OFF:
            self._ticker = threading.Thread(target=self._tick, name="kvfuse-progress", daemon=True)
            self._ticker.start()

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
            elif self._mode == LINES:
                now = self._clock()
                if now - self._last >= self._interval:
                    self._last = now
                    self._line(
                        status_line(
                            self.desc,
                            self.done,
                            self.total,
                            now - self._start,
                            self.unit,
                            self.unit_scale,
                        )
                    )
        if self._on_progress is not None:
            self._on_progress(self.desc, self.done, self.total)

    def close(self, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self._mode == LINES:
                if failed:
                    self._line(f"{self.desc}: stopped after {self.elapsed:.1f} s")
                else:
                    what = (
                        f", {amount(self.done, self.unit, self.unit_scale)}" if self.total else ""
                    )
                    self._line(f"{self.desc}: done{what} in {self.elapsed:.1f} s")

    def _tick(self) -> None:
        while not self._stop.wait(1.0 if self._bar is not None else self._interval):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()
                else:
                    self._line(status_line(self.desc, self.done, None, self.elapsed))

    def _line(self, text: str) -> None:
        try:
            print(f"kvfuse: {text}", file=self._stream, flush=True)
        except ValueError:  # the stream was closed under us (e.g. a test's capture)
            pass
