"""The cache engine: everything between a request's prompt and the KV it reuses and leaves.

The serving loop (``kvfuse.engine``) sees one object, a ``CacheEngine`` (or ``NoCache`` with the
cache off), and calls it at each role of a request, in this order (vLLM's connector roles, in
kvfuse's words):

=====================================  ==========================================================
``key(prompt, cache, blend, ...)``      on submit: namespace, keys, a stored history lined up
                                        (hashing only) -> the request's ``Reuse``
``begin(reuse, kv, tag)`` / ``ready()``  on admission, off the step: plan (one lookup after the
                                        pending saves) and load from the tiers; ``ready()``
                                        gives back the sequences that are done
``load(reuse, kv, ready)``             on the step: what needs the model (documents, a blend, a
                                        KV stream) -> ``Filled`` (the last span left to compute)
``prefilled(reuse, kv, ids)``          first token out: count what was reused, save new chunks
``finish(reuse, kv, generated)``       done: keep the history (or the answer), count
``release(reuse)``                     preempted: the plan's saves copied out before KV is freed
``close()``                            loader, prefetcher and saver stopped, store flushed
=====================================  ==========================================================

Around them: ``computing`` (the scheduler's defer rule), ``watch`` (the queue the store
prefetches by), ``check``, ``namespace``, ``precompute_documents``, ``counters``/``tier_stats``/
``tenant_usage``, ``clear``/``free``/``flush``.

Modules, in a request's order: ``options`` (``CacheOptions``), ``keying`` (+ ``auto_reuse``),
``state`` (``Reuse``), ``planner`` (pure plans), ``loader`` + ``prefill`` + ``fetch`` (off the
step), ``plan_executor`` (+ ``kv_stream``, ``kv_stream_reader``), ``computing``,
``cache_writer`` + ``saver`` + ``retention`` (writes off the request path), ``offline``
(precompute), ``stats``, ``parts`` (what a cache engine is made of), ``cache_engine``.
"""

from .cache_engine import CacheEngine, NoCache, open_cache
from .kv_stream import KVStreamReport, LoadEstimates
from .loader import Loaded
from .options import CacheOptions
from .plan_executor import Filled
from .planner import (
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
from .prefill import ReadyPlan
from .retention import Breakpoint, Retention
from .state import Reuse, Usage
from .stats import ReuseStats

__all__ = [
    "Breakpoint",
    "CacheEngine",
    "CacheOptions",
    "Compute",
    "Filled",
    "KVStreamReport",
    "Load",
    "LoadEstimates",
    "Loaded",
    "NoCache",
    "Plan",
    "Precompute",
    "PromptKeys",
    "ReadyPlan",
    "Retention",
    "Reuse",
    "ReuseStats",
    "Save",
    "Usage",
    "make_plan",
    "open_cache",
    "prompt_keys",
    "replan",
]
