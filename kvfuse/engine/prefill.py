"""Admission's prefill: a sequence's prompt looked up, planned, fetched, precomputed and filled.

``Prefiller.admit(seq)`` runs four steps, one function each:

1. ``lookup``: where the tiers hold the prompt's keys (after the previous turn's pending saves of
   those keys, and, for a plain prompt without a lined-up history, a stored history's tail found
   by content: ``Keying.probe_tail``), and, with automatic reuse, its content chunks after the
   chain's hits (``planner.content_lookups``: one batched lookup, not counted as the chain's);
2. ``fetch``: the plan (``planner.replan``: the lookup, less the keys found unusable), and every
   entry it loads, read and checked in one batch; an entry that turns out missing or damaged is
   planned around and the new plan's loads read too, until all of them are in hand;
3. ``precompute``: documents no tier holds, computed on their own and stored;
4. ``fill``: the plan executed into the live KV (``plan_executor.execute``), from the entries in
   hand, as a KV stream when the request has a load budget and chunks in slow tiers, or as a blend
   when it has documents or found spans.

A load that fails while the plan runs (``LoadFailed``: an entry that does not decode, a document's
layer that cannot be read) is planned around and the prefill starts again, at most
``MAX_ATTEMPTS`` times. A plain prompt's last compute is left to the engine's batched steps
(``PrefillState.fill``, chunked prefill); anything else is prefilled here. A preempted sequence
admitted again also computes the tokens it had generated.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvfuse.codecs.base import Codec
from kvfuse.kv.format import Entry, encode_entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.models import LoadedModel
from kvfuse.store import TieredStore

from .cache_writer import CacheWriter
from .fetch import FetchedEntries, fetch_entries, streamed
from .keying import Keying
from .kv_memory import initial_slots
from .kv_stream import LoadEstimates
from .kv_stream_reader import StreamedSource
from .plan_executor import BlendRun, Filled, KVSource, LoadFailed, execute
from .planner import Plan, Precompute, content_lookups, full_prefill, replan
from .saver import Saver
from .sequence import Sequence
from .stats import EngineStats

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # executions of a plan whose loads fail mid-way: each one plans around a key more


@dataclass
class ReadyPlan:
    """A plan and the entries it loads, read before it runs."""

    plan: Plan
    got: FetchedEntries
    kv_stream: bool  # slow-tier chunks are left to the KV stream


class Prefiller:
    """The prefill of one engine's sequences; see the module docstring."""

    def __init__(
        self,
        model: LoadedModel,
        store: TieredStore | None,
        saver: Saver | None,
        keying: Keying,
        writer: CacheWriter | None,
        kv_dtype: torch.dtype,
        codec: Codec,
        kv_slo_ms: float | None,
        stats: EngineStats,
        estimates: LoadEstimates,
    ):
        self.runner, self.store, self.saver, self.keying, self.writer = (
            model.runner,
            store,
            saver,
            keying,
            writer,
        )
        self.kv_dtype, self.codec, self.kv_slo_ms = kv_dtype, codec, kv_slo_ms
        self.stats, self.estimates = stats, estimates

    def admit(self, seq: Sequence, chunked: bool = True) -> None:
        """Plan and load ``seq``'s prompt into its cache; leaves ``seq.prefill`` with the plan, the
        result and the ids still to compute (none: the caller samples the first token)."""
        if not seq.started:
            seq.start_clock()
        if seq.kv is None:  # Engine.score: outside the scheduler and its budget
            seq.kv = self.runner.new_cache(initial_slots(seq), dtype=self.kv_dtype)
        where, found = self.lookup(seq) if seq.keys is not None else ((), ())
        filled = self._attempts(seq, where, found, chunked)
        if filled is not None:  # None: cancelled
            self._left_to_compute(seq, filled)

    def _attempts(self, seq: Sequence, where: tuple, found: tuple, chunked: bool) -> Filled | None:
        """Fetch, precompute and fill, planning around the keys whose loads fail; None when the
        request was cancelled meanwhile."""
        unusable: set[ChunkKey] = set()
        for _ in range(MAX_ATTEMPTS):
            fetched = self.fetch(seq, where, unusable, found)
            seq.prefill.plan = fetched.plan
            if seq.request.cancel.is_set():  # e.g. the client left just as the request was admitted
                seq.cancel()
                return None
            self.precompute(seq, fetched)
            try:
                return self.fill(seq, fetched, chunked)
            except LoadFailed as e:
                log.warning("request %s: %s; computing it instead", seq.request.request_id, e)
                self.stats.add(chunk_load_failures=1)
                unusable.add(e.key)
        raise RuntimeError("the prompt's entries could not be loaded after several attempts")

    def lookup(self, seq: Sequence) -> tuple[tuple, tuple]:
        """Where each of ``seq``'s keys is held (None: nowhere), and each of its content chunks
        (None also where not looked up); its lookup time in its timings."""
        t0 = time.perf_counter()
        keys = seq.keys
        if self.saver is not None:
            self.saver.wait(keys.all())  # the previous turn's KV, if still being saved
        where = self.store.lookup(keys.all()).where
        if seq.request.prompt.is_prefix_only and not keys.runs:
            where = self.keying.probe_tail(seq, where)  # a stored history's tail, or a breakpoint's
        found = self._find_spans(seq, where)
        seq.timings.lookup_s = time.perf_counter() - t0
        return where, found

    def _find_spans(self, seq: Sequence, where: tuple) -> tuple:
        """Where each content chunk after the chain's hits is held (one batched lookup, after
        the saves still pending for them); counted in the sequence's usage."""
        chunks = seq.keys.content
        asked = content_lookups(seq.keys, where)
        if not asked:
            return (None,) * len(chunks)
        keys = [chunks[i].key for i in asked]
        if self.saver is not None:
            self.saver.wait(keys)  # an earlier prompt's chunks, if still being saved
        tiers = self.store.lookup(keys, count=False).where
        found: list[str | None] = [None] * len(chunks)
        for i, tier in zip(asked, tiers):
            found[i] = tier
        hits = sum(t is not None for t in tiers)
        seq.usage.span_lookups = (hits, len(tiers) - hits)
        return tuple(found)

    def fetch(
        self, seq: Sequence, where: tuple, unusable: set[ChunkKey], found: tuple = ()
    ) -> ReadyPlan:
        """The plan around ``unusable`` keys, and its loads' entries read; keys found unusable on
        the way are added to ``unusable`` and planned around too (each round adds some, so this
        ends). A new plan can load entries the one before did not (a stored history's entry over
        slots the chain covered until its damaged chunk broke it): those are read and checked as
        well, never loaded unread."""
        prompt = seq.request.prompt
        if seq.keys is None:  # the cache is off for this request: compute everything
            return ReadyPlan(full_prefill(prompt), FetchedEntries(), False)
        t0 = time.perf_counter()
        plan = replan(prompt, seq.keys, where, unusable, found)
        kv_stream = (
            bool(self._slo_ms(seq))
            and not plan.blended
            and any(streamed(self.store, x) for x in plan.loads)
        )
        got, rejected = FetchedEntries(), 0
        while True:
            more = fetch_entries(
                self.store,
                self.runner,
                self.kv_dtype,
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
            plan = replan(prompt, seq.keys, where, unusable, found)
        seq.timings.load_s += time.perf_counter() - t0
        self.stats.add(chunk_load_failures=rejected)
        return ReadyPlan(plan, got, kv_stream)

    def precompute(self, seq: Sequence, fetched: ReadyPlan) -> None:
        """Compute and store the documents no tier holds (each once)."""
        plan, entries = fetched.plan, fetched.got.entries
        for pre in plan.precomputes:
            if pre.key in entries:
                continue
            entries[pre.key] = precompute_entry(self.runner, self.kv_dtype, self.codec, pre)
            end = max((x.end for x in plan.loads if x.key == pre.key), default=seq.prompt_len)
            self.writer.precomputed(seq.request.cache, pre.key, entries[pre.key], end)
            seq.usage.stored += 1

    def fill(self, seq: Sequence, fetched: ReadyPlan, chunked: bool) -> Filled:
        """Execute the plan into ``seq``'s cache from the source its loads need."""
        plan, got, ids = fetched.plan, fetched.got, seq.request.prompt.ids
        seq.kv.truncate(0)
        if fetched.kv_stream:
            source = StreamedSource(
                plan,
                got.entries,
                got.served,
                self.store,
                self.runner,
                self.kv_dtype,
                ids,
                self._slo_ms(seq) / 1000,
                self.estimates,
            )
            return execute(self.runner, seq.kv, ids, plan, source)
        source = KVSource(got.entries, got.served, self.store)
        if plan.blended:
            return execute(
                self.runner,
                seq.kv,
                ids,
                plan,
                source,
                blend=BlendRun(seq.blend, self.store, self.kv_dtype),
            )
        return execute(self.runner, seq.kv, ids, plan, source, defer_last=chunked)

    def _slo_ms(self, seq: Sequence) -> float | None:
        """The request's budget for loading KV from slow tiers (its own, else the engine's)."""
        own = seq.request.cache.kv_slo_ms
        return own if own is not None else self.kv_slo_ms

    def measure(self, seq: Sequence) -> None:
        """A prefill is complete: its KV stream's figures into the engine's counters, or, for a
        plain prompt, its compute speed into the estimates the KV stream plans with."""
        plan, filled = seq.prefill.plan, seq.prefill.filled
        if filled.kv_stream is not None:
            r = filled.kv_stream
            self.stats.add(
                streamed_requests=1,
                stream_slo_violations=int(not r.met),
                stream_chunks=dict(r.chunks),
                stream_bytes=r.bytes_read,
            )
        elif not plan.blended and plan.computed_tokens:
            self.estimates.computed(plan.computed_tokens, filled.compute_s)

    def _left_to_compute(self, seq: Sequence, filled: Filled) -> None:
        """What the batched steps compute: the prompt's deferred last span, then the tokens
        generated before a preemption."""
        p = seq.prefill
        p.filled = filled
        n = seq.prompt_len
        if filled.rest is not None and filled.rest[1] != n:
            raise RuntimeError("a plan's last compute must end the prompt")
        p.fill_start = filled.rest[0] if filled.rest is not None else n
        p.fill = (seq.request.prompt.ids + seq.token_ids)[p.fill_start :]


def precompute_entry(runner, kv_dtype: torch.dtype, codec: Codec, step: Precompute) -> Entry:
    """A document's KV computed on its own, behind ``step.context``, as an entry of its tokens."""
    ids = list(step.context) + list(step.ids)
    scratch = runner.new_cache(len(ids), dtype=kv_dtype)
    runner.forward(ids, scratch, logits="none")
    return encode_entry(
        scratch.chunk(len(step.context), len(ids)), step.key, codec, token_ids=step.ids
    )
