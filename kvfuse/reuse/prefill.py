"""A sequence's prompt planned and loaded into its live KV, in two halves.

``plan`` runs off the engine's step (on the loader thread, ``loader.Loader``), since it only
reads: one wait for the pending saves of the prompt's keys, one batched lookup (a stored
history's tail probed by content when no record lined the prompt up, and, with automatic reuse,
the content chunks after the chain's hits), then the plan (``planner.replan``) and every entry
it loads, read and checked in one batch; an entry that turns out missing or damaged is planned
around and the new plan's loads read too, until all of them are in hand. When the plan needs
nothing but those entries before the prompt's last span (the usual cache hit: a prefix or a
stored history, the rest computed by the batched steps), it is executed here too, into the
sequence's own cache, which no step touches until the sequence is ready.

``fill`` runs on the engine's thread and does what needs the model: documents no tier holds,
computed on their own and stored (``precompute``), and the plan executed (``plan_executor``)
when it computes more than its last span, streams slow-tier chunks (``kv_slo_ms``) or blends.

A load that fails while the plan runs (``LoadFailed``: an entry that does not decode, a
document's layer that cannot be read) is planned around and the prefill starts again, at most
``MAX_ATTEMPTS`` times. A plain prompt's last compute is left to the engine's batched steps
(``Filled.rest``, chunked prefill); anything else is prefilled here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models.cache import KVCache

from .fetch import FetchedEntries, fetch_entries, streamed
from .kv_stream_reader import StreamedSource
from .parts import Parts
from .plan_executor import BlendRun, Filled, KVSource, LoadFailed, execute
from .planner import Plan, Precompute, content_lookups, full_prefill, replan
from .state import Reuse

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # executions of a plan whose loads fail mid-way: each one plans around a key more


@dataclass
class ReadyPlan:
    """A plan and the entries it loads, read before it runs."""

    plan: Plan
    got: FetchedEntries
    kv_stream: bool  # slow-tier chunks are left to the KV stream
    where: tuple = ()  # the lookup it was planned from
    found: tuple = ()  # where each content chunk is held


class Prefiller:
    """The two halves of a sequence's prefill; see the module docstring."""

    def __init__(self, parts: Parts):
        self.p = parts

    # -- off the step ---------------------------------------------------------------------------

    def plan(self, r: Reuse, kv: KVCache, chunked: bool = True) -> ReadyPlan:
        """Look up, plan and read ``r``'s prompt, and execute the plan into ``kv`` now when it
        only loads entries before its deferred last span (``r.filled`` is then set)."""
        where, found = self.lookup(r) if r.keys is not None else ((), ())
        unusable: set[ChunkKey] = set()
        for _ in range(MAX_ATTEMPTS):
            ready = self.fetch(r, where, unusable, found)
            r.plan = ready.plan
            if r.cancel.is_set() or not (chunked and only_loads(ready)):
                return ready
            try:
                r.filled = self._execute(r, kv, ready, chunked)
                return ready
            except LoadFailed as e:
                self._failed(r, e, unusable)
        raise RuntimeError("the prompt's entries could not be loaded after several attempts")

    def lookup(self, r: Reuse) -> tuple[tuple, tuple]:
        """Where each of ``r``'s keys is held (None: nowhere), and each of its content chunks
        (None also where not looked up), after the pending saves of those keys."""
        t0 = time.perf_counter()
        keys = r.keys
        content = [c.key for c in keys.content]
        self.p.saver.wait(keys.all() + content)  # e.g. the previous turn's KV, still being saved
        where = self.p.store.lookup(keys.all()).where
        saver = self.p.saver
        if (
            r.prompt.is_prefix_only
            and not keys.runs
            and (r.probed != saver.epoch or saver.pending())
        ):
            where = self.p.keying.probe_tail(r, where)  # a stored history's tail, or a breakpoint's
        found = self._find_spans(r, where)
        r.lookup_s = time.perf_counter() - t0
        return where, found

    def _find_spans(self, r: Reuse, where: tuple) -> tuple:
        """Where each content chunk after the chain's hits is held (one batched lookup);
        counted in the request's usage."""
        chunks = r.keys.content
        asked = content_lookups(r.keys, where)
        if not asked:
            return (None,) * len(chunks)
        tiers = self.p.store.lookup([chunks[i].key for i in asked], count=False).where
        found: list[str | None] = [None] * len(chunks)
        for i, tier in zip(asked, tiers):
            found[i] = tier
        hits = sum(t is not None for t in tiers)
        r.usage.span_lookups = (hits, len(tiers) - hits)
        return tuple(found)

    def fetch(
        self, r: Reuse, where: tuple, unusable: set[ChunkKey], found: tuple = ()
    ) -> ReadyPlan:
        """The plan around ``unusable`` keys, and its loads' entries read; keys found unusable on
        the way are added to ``unusable`` and planned around too (each round adds some, so this
        ends). A new plan can load entries the one before did not (a stored history's entry over
        slots the chain covered until its damaged chunk broke it): those are read and checked as
        well, never loaded unread."""
        if r.keys is None:  # the cache is off for this request: compute everything
            return ReadyPlan(full_prefill(r.prompt), FetchedEntries(), False)
        t0 = time.perf_counter()
        p, prompt = self.p, r.prompt
        plan = replan(prompt, r.keys, where, unusable, found)
        kv_stream = (
            bool(self._slo_ms(r))
            and not plan.blended
            and any(streamed(p.store, x) for x in plan.loads)
        )
        got, rejected = FetchedEntries(), 0
        while True:
            more = fetch_entries(
                p.store,
                p.runner,
                p.kv_dtype,
                plan,
                prompt.ids,
                blended=plan.blended,
                kv_stream=kv_stream,
                have=set(got.entries),
            )
            rejected += more.rejected
            got.entries.update(more.entries)
            got.served.update(more.served)
            if not more.unusable:
                break
            unusable |= more.unusable
            plan = replan(prompt, r.keys, where, unusable, found)
        r.load_s += time.perf_counter() - t0
        p.stats.add(chunk_load_failures=rejected)
        return ReadyPlan(plan, got, kv_stream, where, found)

    # -- on the engine's step -------------------------------------------------------------------

    def fill(self, r: Reuse, kv: KVCache, ready: ReadyPlan, chunked: bool) -> Filled | None:
        """What ``plan`` left: precompute missing documents and execute the plan into ``kv``
        (replanning around loads that fail). None when the request was cancelled meanwhile."""
        unusable: set[ChunkKey] = set()
        for _ in range(MAX_ATTEMPTS):
            if r.filled is not None:
                return r.filled
            if r.cancel.is_set():  # e.g. the client left just as the request was admitted
                return None
            self.precompute(r, ready)
            try:
                r.filled = self._execute(r, kv, ready, chunked)
            except LoadFailed as e:
                self._failed(r, e, unusable)
                ready = self.fetch(r, ready.where, unusable, ready.found)
                r.plan = ready.plan
        if r.filled is None:
            raise RuntimeError("the prompt's entries could not be loaded after several attempts")
        return r.filled

    def precompute(self, r: Reuse, ready: ReadyPlan) -> None:
        """Compute and store the documents no tier holds (each once)."""
        plan, entries, p = ready.plan, ready.got.entries, self.p
        for pre in plan.precomputes:
            if pre.key in entries:
                continue
            entries[pre.key] = precompute_entry(p.runner, p.kv_dtype, p.codec, pre)
            end = max((x.end for x in plan.loads if x.key == pre.key), default=r.prompt_len)
            p.writer.precomputed(r.cache, pre.key, entries[pre.key], end)
            r.usage.stored += 1

    def _execute(self, r: Reuse, kv: KVCache, ready: ReadyPlan, chunked: bool) -> Filled:
        """Execute the plan into ``kv`` from the source its loads need."""
        p, plan, got, ids = self.p, ready.plan, ready.got, r.prompt.ids
        kv.truncate(0)
        if ready.kv_stream:
            source = StreamedSource(
                plan,
                got.entries,
                got.served,
                p.store,
                p.runner,
                p.kv_dtype,
                ids,
                self._slo_ms(r) / 1000,
                p.estimates,
            )
            return execute(p.runner, kv, ids, plan, source)
        source = KVSource(got.entries, got.served, p.store)
        if plan.blended:
            blend = BlendRun(r.blend, p.store, p.kv_dtype)
            return execute(p.runner, kv, ids, plan, source, blend=blend)
        return execute(p.runner, kv, ids, plan, source, defer_last=chunked)

    def _failed(self, r: Reuse, e: LoadFailed, unusable: set[ChunkKey]) -> None:
        log.warning("request %s: %s; computing it instead", r.request_id, e)
        self.p.stats.add(chunk_load_failures=1)
        unusable.add(e.key)

    def _slo_ms(self, r: Reuse) -> float | None:
        """The request's budget for loading KV from slow tiers (its own, else the engine's)."""
        own = r.cache.kv_slo_ms
        return own if own is not None else self.p.kv_slo_ms

    def measure(self, r: Reuse) -> None:
        """A prefill is complete: its KV stream's figures into the counters, or, for a plain
        prompt, its compute speed into the estimates the KV stream plans with."""
        plan, filled = r.plan, r.filled
        if filled.kv_stream is not None:
            s = filled.kv_stream
            self.p.stats.add(
                streamed_requests=1,
                stream_slo_violations=int(not s.met),
                stream_chunks=dict(s.chunks),
                stream_bytes=s.bytes_read,
            )
        elif not plan.blended and plan.computed_tokens:
            self.p.estimates.computed(plan.computed_tokens, filled.compute_s)


def only_loads(ready: ReadyPlan) -> bool:
    """Whether executing ``ready`` needs no model before the deferred last span: no document to
    precompute, no blend, no KV stream (which may recompute), and no compute but the last."""
    plan = ready.plan
    return not (ready.kv_stream or plan.blended or plan.precomputes or len(plan.computes) > 1)


def precompute_entry(runner, kv_dtype: torch.dtype, codec: Codec, step: Precompute) -> Entry:
    """A document's KV computed on its own, behind ``step.context``, as an entry of its tokens."""
    ids = list(step.context) + list(step.ids)
    scratch = runner.new_cache(len(ids), dtype=kv_dtype)
    runner.forward(ids, scratch, logits="none")
    return encode_entry(
        scratch.chunk(len(step.context), len(ids)), step.key, codec, token_ids=step.ids
    )
