"""The request queue in front of the engine, and the one worker thread that runs it.

The engine is not thread-safe and runs one request at a time, so requests wait in an explicit
``RequestQueue`` (first come, first served; ``waiting()`` shows them in order, for future
look-ahead such as prefetching a multi-turn session's KV) and one ``Scheduler`` thread takes them
one by one. The queue holds at most ``max_waiting`` requests; beyond that ``put`` raises
``QueueFull`` (the server answers 429) instead of letting latency grow without bound.

Cancellation: every job has a ``threading.Event``. A client that leaves sets it; a waiting job is
then removed (or skipped when the worker reaches it) and a running one stops at the engine's next
decode step. The event-loop side (``JobEvents``) receives text pieces and the outcome from the
worker thread through ``loop.call_soon_threadsafe``: asyncio objects are not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfuse.engine import GenerationResult

from .translate import EngineCall

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue already holds ``max_waiting`` requests."""


class QueueClosed(Exception):
    """The server is shutting down and takes no more requests."""


class JobCancelled(Exception):
    """The job never ran: its client left while it waited, or the server shut down."""


@dataclass(frozen=True)
class Outcome:
    """How a job ended: a result, or the error that prevented one (JobCancelled when it was skipped)."""

    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Job:
    """One generation request: the engine call, its cancel event, and where to report.

    ``on_text`` and ``on_done`` are called on the worker thread; ``on_done`` exactly once.
    """

    request_id: str
    tenant: str
    call: EngineCall
    on_text: Callable[[str], None] | None = None
    on_done: Callable[[Outcome], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    _done: bool = field(default=False, repr=False)

    def finish(self, outcome: Outcome) -> None:
        if self._done:
            return
        self._done = True
        if self.on_done is not None:
            try:
                self.on_done(outcome)
            except Exception:  # e.g. the event loop is already closed at shutdown
                log.debug("request %s: could not deliver its outcome", self.request_id, exc_info=True)

    @property
    def queue_wait_s(self) -> float:
        return (self.started_at or time.monotonic()) - self.enqueued_at


class RequestQueue:
    """A bounded FIFO of waiting jobs, shared by the event loop (put/remove) and the worker (take)."""

    def __init__(self, max_waiting: int):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.max_waiting = max_waiting
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.skipped = 0  # jobs dropped because they were cancelled while waiting

    def put(self, job: Job) -> None:
        """Append ``job``; QueueFull when ``max_waiting`` jobs wait already, QueueClosed after close()."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the server is shutting down")
            if len(self._jobs) >= self.max_waiting:
                raise QueueFull(f"{len(self._jobs)} requests are already waiting (server.max_queue = {self.max_waiting})")
            self._jobs.append(job)
            self._cond.notify()

    def take(self, timeout: float | None = None) -> Job | None:
        """The oldest job whose cancel event is not set (cancelled ones are skipped and finished with
        JobCancelled); None after close() once empty, or when ``timeout`` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                while self._jobs:
                    job = self._jobs.popleft()
                    if not job.cancel.is_set():
                        return job
                    self.skipped += 1
                    job.finish(Outcome(error=JobCancelled("the client left while the request was queued")))
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def remove(self, job: Job) -> bool:
        """Take ``job`` out of the queue if it is still waiting (its client left); True if it was."""
        with self._cond:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            self.skipped += 1
            return True

    def waiting(self) -> list[Job]:
        """The waiting jobs, oldest first (a snapshot)."""
        with self._cond:
            return list(self._jobs)

    def __len__(self) -> int:
        with self._cond:
            return len(self._jobs)

    def close(self) -> list[Job]:
        """Refuse new jobs; remove and return the waiting ones."""
        with self._cond:
            self._closed = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
            return jobs


class Scheduler:
    """Runs queued jobs on one worker thread with ``engine.generate``, in arrival order."""

    def __init__(self, engine, max_waiting: int):
        self.engine = engine
        self.queue = RequestQueue(max_waiting)
        self.running: Job | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvfuse-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (QueueFull / QueueClosed propagate to the caller)."""
        self.queue.put(job)

    def withdraw(self, job: Job) -> None:
        """The client of ``job`` left: drop it if it waits, stop it if it runs."""
        job.cancel.set()
        if self.queue.remove(job):
            job.finish(Outcome(error=JobCancelled("the client left while the request was queued")))

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting ones and the running one, wait for the worker."""
        for job in self.queue.close():
            job.cancel.set()
            job.finish(Outcome(error=JobCancelled("the server is shutting down")))
        running = self.running
        if running is not None:
            running.cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.0f s", timeout)

    def _loop(self) -> None:
        while True:
            job = self.queue.take()
            if job is None:
                return
            self.running = job
            job.started_at = time.monotonic()
            try:
                c = job.call
                result = self.engine.generate(c.prompt_ids, c.params, cache=c.cache, on_text=job.on_text, cancel=job.cancel)
                result.timings.queued_s = job.queue_wait_s
                outcome = Outcome(result=result)
            except Exception as e:  # reported to this request's client; the worker keeps serving others
                if not isinstance(e, ValueError):
                    log.exception("request %s failed in the engine", job.request_id)
                outcome = Outcome(error=e)
            finally:
                self.running = None
            job.finish(outcome)


class JobEvents:
    """The event-loop side of a job: an asyncio queue fed from the worker thread.

    Items are text pieces (``str``) and, last, the ``Outcome``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._items: asyncio.Queue[str | Outcome] = asyncio.Queue()

    def on_text(self, piece: str) -> None:  # worker thread
        self._loop.call_soon_threadsafe(self._items.put_nowait, piece)

    def on_done(self, outcome: Outcome) -> None:  # worker thread (or the loop, for a withdrawn job)
        self._loop.call_soon_threadsafe(self._items.put_nowait, outcome)

    async def next(self) -> str | Outcome:
        return await self._items.get()

    async def outcome(self) -> Outcome:
        """Wait for the outcome, discarding any text pieces."""
        while not isinstance(item := await self._items.get(), Outcome):
            pass
        return item
