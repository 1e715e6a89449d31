"""The engine: requests -> sequences -> one step at a time -> results.

Layout, in the order a request goes through it:

- ``prompt``          a prompt as segments: ``[prefix][documents...][suffix]``
- ``prompt_builder``  text, ids, chat messages and documents -> a ``Prompt`` (truncation, context window)
- ``request``         what callers submit and get back: ``Request``, ``CacheOptions``, ``GenerationResult``
- ``keying``          a request -> its ``Sequence``: namespace, keys, a stored history lined up
- ``sequence``        one request's state: prefill, decode and usage parts
- ``scheduler``       the bounded queue, admission and each step's batch; with ``kv_memory`` (the
                      live KV budget, preemption) and ``computing`` (chunks being computed)
- ``prefill``         lookup -> fetch (and replan) -> precompute -> fill, for an admitted sequence
- ``planner``         pure: segments + where the tiers hold their keys -> a ``Plan``
- ``fetch``           a plan's entries read and checked before it runs
- ``plan_executor``   one loop that executes a plan from its KV source (entries in hand, a blend)
- ``kv_stream``       pure rules of the KV stream (encoding per chunk within a budget);
                      ``kv_stream_reader`` its source (a reader thread)
- ``cache_writer``    what a request writes: new chunks, retention, histories; ``saver`` its thread
- ``core``            ``Engine``: submit / step / generate, and the narrow API the server reads
- ``loop``            the engine's own thread, for servers
"""

from kvfuse.prompts.prompt import Prompt, Segment, SegmentKind
from kvfuse.reuse.planner import (
    Compute,
    Load,
    Plan,
    Precompute,
    PromptKeys,
    Save,
    make_plan,
    prompt_keys,
    replan,
)
from kvfuse.reuse.retention import Breakpoint, Retention

from .core import Engine
from .request import (
    CacheOptions,
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
    "Compute",
    "Engine",
    "EngineStats",
    "GenerationResult",
    "Load",
    "Outcome",
    "Plan",
    "Precompute",
    "Prompt",
    "PromptKeys",
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
    "Save",
    "Timings",
    "make_plan",
    "prompt_keys",
    "replan",
]
