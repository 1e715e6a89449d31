"""Worker processes that encode and decode layers in parallel (``constriction`` holds the GIL).

``WorkerPool.run(op, jobs)`` sends one job per worker (the caller splits the layers), waits for
all replies and returns them in order. A job whose worker died, or that could not be sent, is
run in this process instead: a broken worker costs speed, never a result. Workers start on first
use and are plain child processes (``python -m kvfuse.entropy.worker``): no ``fork`` of a
threaded server, no re-import of the parent's ``__main__``.

Calls are serialized by one lock (a call uses every worker); callers keep calls small (one chunk)
so that a background encode never holds a request's decode back for long.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading

from kvfuse.entropy.worker import read_frame, run_job, write_frame

log = logging.getLogger(__name__)


class JobError(ValueError):
    """A job the coder rejected (bad bytes, bad values): the message says why."""


class _Worker:
    def __init__(self) -> None:
        # The child's environment: this process's, passed through whole (the worker must import
        # kvfuse as this process does: PYTHONPATH, a venv's variables), with one thread per math
        # library. Nothing here is read as kvfuse's configuration (that is kvfuse.config's), so
        # this copy is the one os.environ use outside config/ (tests/unit/test_layout.py).
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvfuse.entropy.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


class WorkerPool:
    """``size`` coding workers (0: everything runs in the calling process)."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"pool size must be >= 0, got {size}")
        self.size = size
        self._workers: list[_Worker | None] = [None] * size
        self._lock = threading.Lock()
        self.fallbacks = 0  # jobs run in-process because a worker failed
        self._closed = False

    def _worker(self, i: int) -> _Worker | None:
        w = self._workers[i]
        if w is None or not w.alive():
            try:
                w = self._workers[i] = _Worker()
            except OSError as e:
                log.warning("cannot start a coding worker: %s", e)
                return None
        return w

    def warm(self) -> None:
        """Start the workers now (a server about to use them), not at the first request."""
        with self._lock:
            for i in range(self.size):
                self._worker(i)

    def run(self, op: str, jobs: list[tuple]) -> list:
        """The result of each job (``worker.run_job``), in order. JobError on a rejected job."""
        if self.size == 0 or len(jobs) <= 1 or self._closed:
            return [_unwrap((True, run_job(op, job))) for job in jobs]
        with self._lock:
            sent: list[_Worker | None] = []
            for i, job in enumerate(jobs):
                w = self._worker(i % self.size) if i < self.size else None
                if w is not None:
                    try:
                        write_frame(w.proc.stdin, (op, job))
                    except (OSError, ValueError, pickle.PicklingError):
                        self._drop(i % self.size)
                        w = None
                sent.append(w)
            replies = []
            for i, (job, w) in enumerate(zip(jobs, sent)):
                reply = None
                if w is not None:
                    try:
                        frame = read_frame(w.proc.stdout)
                        reply = None if frame is None else pickle.loads(frame)
                    except (OSError, EOFError, pickle.UnpicklingError):
                        reply = None
                    if reply is None:
                        self._drop(i % self.size)
                if reply is None:
                    self.fallbacks += w is not None
                    try:
                        reply = (True, run_job(op, job))
                    except ValueError as e:
                        reply = (False, str(e))
                replies.append(reply)
        return [_unwrap(r) for r in replies]

    def _drop(self, i: int) -> None:
        w, self._workers[i] = self._workers[i], None
        if w is not None:
            log.warning("coding worker %d failed; its jobs run in-process until it restarts", i)
            w.proc.kill()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for i, w in enumerate(self._workers):
                if w is not None:
                    w.close()
                self._workers[i] = None


def _unwrap(reply: tuple):
    ok, value = reply
    if not ok:
        raise JobError(value)
    return value


_shared: WorkerPool | None = None
_shared_lock = threading.Lock()


def default_size() -> int:
    """One worker per core; none on a single core (workers would only compete with the caller)."""
    cores = os.cpu_count() or 1
    return cores if cores > 1 else 0


def shared_pool() -> WorkerPool:
    """The process's pool (``default_size()`` workers unless ``set_shared_pool`` chose), created
    on first use and closed at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WorkerPool(default_size())
            atexit.register(_shared.close)
        return _shared


def set_shared_pool(size: int) -> WorkerPool:
    """Replace the process's pool with one of ``size`` workers (the configuration's ``codec_workers``)."""
    global _shared
    with _shared_lock:
        old, _shared = _shared, WorkerPool(size)
        atexit.register(_shared.close)
    if old is not None:
        old.close()
    return _shared
