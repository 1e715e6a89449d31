"""One request's use of the cache, from keying to its last save (``Reuse``), and what it reused.

The serving loop holds a ``Reuse`` per sequence and hands it back to the ``CacheEngine`` at each
role (plan, load, prefilled, finish, release) without looking inside; the engine's result and
counters read its ``usage`` once the prompt's KV is complete. A preempted sequence keeps its
``Reuse`` (its keys and blend) but plans and loads again: ``preempted()`` says what that resets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvfuse.blend.options import BlendOptions
from kvfuse.history.records import Record
from kvfuse.kv.keys import ChunkKey, Namespace
from kvfuse.prompts.prompt import Prompt

from .auto_reuse import settled
from .kv_stream import KVStreamReport
from .options import CacheOptions
from .plan_executor import Filled
from .planner import BLENDED, Plan, PromptKeys


@dataclass
class Usage:
    """What the request's prompt reused and recomputed, and what it stored and kept."""

    reused: int = 0  # prompt tokens whose KV was loaded, not computed
    # of those, tokens of documents and found spans (blended; the rest: exact loads)
    span_reused: int = 0
    recomputed: int = 0  # document (or found span) tokens a blend recomputed in context
    span_lookups: tuple[int, int] = (0, 0)  # content chunks looked up: (found, missing)
    history_reused: int = 0  # prompt tokens loaded from a stored history's entries
    moved_reused: int = 0  # of those, at new positions
    hit_tiers: tuple[str, ...] = ()  # the tier of each entry it reused
    stored: int = 0  # entries written
    written: int = 0  # prompt tokens whose KV was handed to the cache
    # how slow-tier chunks were loaded (kv_slo_ms), if they were
    kv_stream: KVStreamReport | None = None
    kept: Record | None = None  # the history record of the KV kept when the turn ended


@dataclass(eq=False)
class Reuse:
    """One request's keys, plan and reuse (see the module docstring). ``prompt`` is the prompt as
    it runs: lined up with a stored history's ids, or made plain when its documents are not
    blended. ``namespace``/``keys`` None: the request does not use the cache."""

    request_id: str
    prompt: Prompt
    cache: CacheOptions
    blend: BlendOptions
    namespace: Namespace | None = None
    keys: PromptKeys | None = None
    documents: bool = False  # it came with documents: its result says how they were used
    auto: str = "off"  # automatic reuse (``auto_reuse.STATUSES``): ``on`` until planned
    record: Record | None = None  # the stored history this prompt was lined up with
    scope: str = ""  # where its own history record goes (the namespace's key prefix)
    cancel: threading.Event = field(default_factory=threading.Event)
    plan: Plan | None = None
    filled: Filled | None = None  # what executing the plan produced
    # the chunks it computes and will store (``computing.ComputingChunks``)
    computing: frozenset[ChunkKey] = frozenset()
    counted: bool = False  # its prefill was counted (``count``): a preempted rerun is not
    usage: Usage = field(default_factory=Usage)
    lookup_s: float = 0.0
    load_s: float = 0.0
    # the blend it would have used had the online guard not turned blending off (None: it did not)
    shadow: BlendOptions | None = None
    # the saver's epoch when a stored history's tail was looked for on submit (None: not yet)
    probed: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def preempted(self) -> None:
        """Its live KV was freed: the plan and what it produced go; keys and usage stay."""
        self.plan, self.filled = None, None

    def count(self) -> None:
        """The prompt's KV is complete: count what it reused (loads from a tier, less those the KV
        stream recomputed instead, less the document tokens a blend recomputed in context), from
        which tiers, how much of it came from a stored history, and how much from blended loads
        (documents, found spans)."""
        plan, filled, u = self.plan, self.filled, self.usage
        skipped = set(filled.recomputed_loads)
        from_store = [x for x in plan.loads if x.tier is not None and x not in skipped]
        u.hit_tiers = tuple(filled.served[x.key] for x in from_store)
        u.reused = plan.reused_tokens - sum(x.end - x.start for x in skipped)
        u.kv_stream = filled.kv_stream
        self.counted = True
        self.auto = settled(self.auto, len(plan.found_spans))
        if self.keys is not None and self.keys.history:
            stored = {e.key for e in self.keys.history}
            u.history_reused = plan.reused_by(lambda x: x.key in stored and x not in skipped)
            u.moved_reused = plan.reused_by(
                lambda x: x.key in stored and x.moved and x not in skipped
            )
        if plan.blended:
            recomputed = filled.recomputed_positions
            cached_slots = torch.zeros(self.prompt_len, dtype=torch.bool)
            for x in from_store:
                cached_slots[x.start : x.end] = True
            u.recomputed = int(recomputed.numel())
            in_context = int(cached_slots[recomputed].sum())  # recomputed in context: not reused
            u.reused -= in_context
            u.span_reused = plan.reused_by(lambda x: x.key.kind in BLENDED) - in_context

    @property
    def used_blend(self) -> BlendOptions | None:
        """The blend its result reports: the request's, when documents or found spans were blended."""
        return self.blend if self.documents or self.auto == "blended" else None

    def counters(self) -> dict:
        """What this finished request adds to the reuse counters (``ReuseStats``)."""
        u = self.usage
        out = {"chunks_stored": u.stored}
        if not self.counted:
            return out
        out.update(
            tokens_reused=u.reused,
            tokens_prefilled=self.prompt_len - u.reused,
            tokens_recomputed=u.recomputed,
            blended_requests=int(self.plan.has_documents),
            history_requests=int(self.record is not None),
            history_tokens_reused=u.history_reused,
            moved_tokens_reused=u.moved_reused,
            hits_by_tier={tier: u.hit_tiers.count(tier) for tier in set(u.hit_tiers)},
            auto_requests={self.auto: 1},
            span_hits=u.span_lookups[0],
            span_misses=u.span_lookups[1],
            span_tokens_reused=u.span_reused if not self.documents else 0,
        )
        if self.used_blend is not None:
            out["blends"] = {blend_label(self.blend): 1}
        return out


def blend_label(blend: BlendOptions) -> str:
    """How a request's documents were used, for counters: ``method:budget:source``."""
    return f"{blend.method}:{blend.recompute_ratio:g}:{blend.source}"
