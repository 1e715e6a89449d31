"""The serving loop: requests -> sequences -> one step at a time -> results.

Layout, in the order a request goes through it:

- ``request``     what callers submit and get back: ``Request``, ``GenerationResult``, ``Outcome``
- ``sequence``    one request's state: the cache engine's ``Reuse``, prefill, decode
- ``scheduler``   the bounded queue, admission and each step's batch; with ``kv_memory`` (the
                  live KV budget, preemption)
- ``core``        ``Engine``: submit / step (schedule -> run -> post-process) / generate, and the
                  narrow API the server reads
- ``loop``        the engine's own thread, for servers
- ``stats``       the serving loop's counters

What is reused and how (keys, plans, loads, saves) is the cache engine's (``kvfuse.reuse``):
the loop calls it at each role of a request. ``Prompt``, ``CacheOptions``, ``Breakpoint`` and
``Retention`` are re-exported here because callers build requests from them.
"""

from kvfuse.prompts.prompt import Prompt, Segment, SegmentKind
from kvfuse.reuse import Breakpoint, CacheOptions, Retention

from .core import Engine
from .request import (
    Choice,
    Delta,
    GenerationResult,
    Outcome,
    QueueClosed,
    QueueFull,
    Request,
    RequestCancelled,
    Timings,
)
from .scheduler import ScheduledStep, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

__all__ = [
    "Breakpoint",
    "CacheOptions",
    "Choice",
    "Delta",
    "Engine",
    "EngineStats",
    "GenerationResult",
    "Outcome",
    "Prompt",
    "QueueClosed",
    "QueueFull",
    "Request",
    "RequestCancelled",
    "Retention",
    "ScheduledStep",
    "Scheduler",
    "Segment",
    "SegmentKind",
    "Sequence",
    "SequenceStatus",
    "Timings",
]
