"""The engine: requests -> sequences -> one step at a time -> results.

Layout (the order a request goes through it):

- ``prompt``     a prompt as segments: ``[prefix][documents...][suffix]``
- ``request``    what callers submit and get back: ``Request``, ``CacheOptions``, ``GenerationResult``
- ``scheduler``  the bounded queue and what each step runs (admission, cancellation, look-ahead)
- ``planner``    pure: segments + where the tiers hold their keys -> a ``Plan`` (load/move/compute/store)
- ``executor``   carries a plan out on the model runner and the store
- ``sequence``   one request's state inside the engine; ``stats``: the engine's counters
- ``core``       ``Engine``: submit / step / generate, and the narrow API the server reads
- ``loop``       the engine's own thread, for servers
"""

from .core import KV_DTYPES, Engine
from .planner import Compute, Load, Plan, Precompute, PromptKeys, Store, make_plan, prompt_keys, replan
from .prompt import Prompt, Segment, SegmentKind
from .request import (CacheOptions, GenerationResult, Outcome, QueueClosed, QueueFull, Request, RequestCancelled,
                      Timings)
from .retention import Breakpoint, Retention
from .scheduler import ScheduledStep, Scheduler
from .sequence import Sequence, SequenceStatus
from .stats import EngineStats

__all__ = [
    "KV_DTYPES", "Breakpoint", "CacheOptions", "Compute", "Engine", "EngineStats", "GenerationResult", "Load", "Outcome", "Plan",
    "Precompute", "Prompt", "PromptKeys", "QueueClosed", "QueueFull", "Request", "RequestCancelled", "Retention", "ScheduledStep",
    "Scheduler", "Segment", "SegmentKind", "Sequence", "SequenceStatus", "Store", "Timings", "make_plan",
    "prompt_keys", "replan",
]
