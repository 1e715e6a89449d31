"""Automatic reuse: cached passages found inside plain prompts, at any position (``blend.auto``).

Applications rarely send kvfuse's ``documents``: a RAG framework sends one prompt string (a
system text, retrieved passages in relevance order, the question). With automatic reuse on, such
a plain prompt is also cut into content-defined chunks (``kv/content.py``): the same passage has
the same chunk keys wherever it appears, apart from the chunks at its edges. The prompt is then
planned as its longest prefix hit, then the chunks found in the tiers after it (one batched
lookup of the chunks past the chain's hits: ``planner.content_lookups``), blended like documents
with the method and budget of the request's blend (``recompute_ratio: auto``: the model's
calibrated one), then computation (``planner.found_spans``). A prompt of at least
``auto_min_tokens`` tokens stores the chunks that were not found, after its prefill, as
position-independent entries (at the positions they were computed at; moved when loaded).

Where automatic reuse does not apply, the plan is today's (``status``):

- ``off``: not asked (``blend.auto: off`` and no ``blend_auto`` in the request);
- ``skipped``: the prompt has ``documents`` or cache breakpoints, or does not use the cache;
- ``prefix``: the request's blend is ``prefix`` (the model's calibration found no budget that
  keeps its answers): found spans would change the answers, so none is looked for;
- ``on``, then after the prefill ``blended`` (found spans used) or ``none_found``.

A prompt that blended found spans holds approximate KV after its first span: its prefix chunks
from there on and its history are not stored (``planner``, ``CacheWriter.after_turn``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from kvfuse.blend.options import BlendOptions
from kvfuse.kv import content
from kvfuse.kv.keys import Namespace, content_keys

from .options import CacheOptions
from .planner import ContentChunk, PromptKeys

STATUSES = ("off", "skipped", "prefix", "none_found", "blended")


@dataclass(frozen=True)
class AutoReuse:
    """One engine's automatic reuse: its default (``blend.auto``) and storage bound."""

    default_on: bool = False
    min_tokens: int = 1024  # prompts at least this long store their content chunks

    @classmethod
    def of(cls, blend: BlendOptions) -> AutoReuse:
        return cls(blend.auto_reuse, blend.auto_min_tokens)

    def status(self, cache: CacheOptions, blend: BlendOptions, *, cached: bool, plain: bool) -> str:
        """Whether a request's prompt looks for found spans (``on``) or why not (see the module
        docstring). ``cached``: it uses the cache; ``plain``: it came without documents and its
        prompt is one prefix segment."""
        on = cache.auto_reuse if cache.auto_reuse is not None else self.default_on
        if not on:
            return "off"
        if not cached or not plain or cache.breakpoints:
            return "skipped"
        return "on" if blend.blends else "prefix"

    def with_content(
        self,
        keys: PromptKeys,
        ids: Sequence[int],
        namespace: Namespace,
        separators: np.ndarray | None = None,
    ) -> PromptKeys:
        """``keys`` with the content chunks of the prompt ``ids`` (hashing only); ``separators``:
        the tokenizer's line-break ids (``content.separator_ids``), where segments start."""
        spans = content.chunks(ids, separators=separators)
        chunks = tuple(
            ContentChunk(k, s, e) for k, (s, e) in zip(content_keys(ids, spans, namespace), spans)
        )
        return replace(keys, content=chunks, store_content=len(ids) >= self.min_tokens)


def settled(status: str, found_spans: int) -> str:
    """A request's status once its prefill is planned: ``on`` becomes ``blended`` or ``none_found``."""
    if status != "on":
        return status
    return "blended" if found_spans else "none_found"
