"""The scheduler side's bookkeeping: which chunks a request can load, which to load and save this
step. No vLLM here: the connector turns vLLM's request and scheduler-output objects into the small
records below (``NewRequest``, ``CachedRequest``), so all of this is tested with fake inputs.

A step's plan (``StepPlan``) goes to the worker inside vLLM's connector metadata: plain
dataclasses of strings and ints (it crosses process boundaries).

Keys: a request's chunk keys are kvfuse prefix keys (``kv.keys.prefix_keys``) in the namespace of
its ``cache_salt``, one list per tensor-parallel rank (each rank stores its own heads). A chunk
counts as stored only when every rank's entry is found.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvfuse.counters import Counters
from kvfuse.integrations.vllm.blocks import (
    check_alignment,
    completed_chunks,
    first_needed_chunk,
    load_limit,
    load_spans,
    lookup_chunks,
    matched_tokens,
    span_block_ids,
)
from kvfuse.kv.keys import ChunkKey

log = logging.getLogger(__name__)

# keys_for(tokens, cache_salt, n_chunks) -> per rank, the keys of the first n_chunks chunks
KeysFor = Callable[[Sequence[int], str | None, int], list[list[ChunkKey]]]
# lookup(keys) -> per key, the tier holding it (None: none); side-effect free
Lookup = Callable[[Sequence[ChunkKey]], Sequence[str | None]]


@dataclass(frozen=True)
class LoadChunk:
    """Load chunk ``index`` (entry ``keys[rank]``) into ``block_ids``: the chunk's blocks from its
    ``skip_tokens``-th token on (vLLM holds the ones before), as many as listed (the last chunk
    of a load may end before the chunk does)."""

    keys: tuple[str, ...]
    index: int
    block_ids: tuple[int, ...]
    skip_tokens: int
    tier: str | None = None  # where the scheduler's lookup found it (for statistics)
    # the chunk's token ids, which the entry must record (() = not checked)
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    chunks: tuple[LoadChunk, ...]


@dataclass(frozen=True)
class SaveChunk:
    """Save chunk ``index`` of request ``req_id``, held in ``block_ids``, as entry ``keys[rank]``."""

    req_id: str
    keys: tuple[str, ...]
    index: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...] = ()  # recorded in the entry (every reader checks them)


@dataclass
class StepPlan:
    """What the worker does this step: loads before the forward pass, saves during it."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass(frozen=True)
class Match:
    """A lookup's answer: ``tokens`` beyond ``num_computed`` can be loaded, from ``hits`` chunks
    starting at chunk ``first`` (their tiers in ``tiers``)."""

    tokens: int
    num_computed: int
    first: int
    hits: int
    tiers: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (or resumed after preemption): its prompt, the
    tokens computed before this step (vLLM's prefix cache plus the connector's load) and how many
    it computes in this step."""

    req_id: str
    prompt_token_ids: Sequence[int]
    cache_salt: str | None
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True)
class CachedRequest:
    """A request scheduled again: the blocks added this step (``resumed``: the whole table)."""

    req_id: str
    new_block_ids: Sequence[int] | None
    num_computed_tokens: int
    num_scheduled_tokens: int
    resumed: bool = False


@dataclass
class SchedulerCounters(Counters):
    """The scheduler side's statistics (the worker's are in ``worker.WorkerCounters``)."""

    lookups: int = 0  # requests admitted after a lookup (the lookup itself may run several times)
    hit_requests: int = 0  # of them, with tokens to load
    hit_tokens: int = 0  # tokens granted to vLLM (loaded instead of computed)
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    planned_loads: int = 0  # chunks sent to the worker to load
    planned_saves: int = 0  # chunks sent to the worker to save
    skipped_saves: int = 0  # prompt chunks not saved: the store holds them already


@dataclass
class _Tracker:
    """What the scheduler remembers of a running request, to plan its saves."""

    req_id: str
    tokens: list[int]  # the prompt
    cache_salt: str | None
    block_ids: list[int]
    next_save: int = 0  # chunks before this one are saved or stored already
    present: set[int] = field(default_factory=set)  # chunks the store holds (not saved again)


class Bookkeeper:
    """The scheduler side's state. ``match`` answers vLLM's lookup (side-effect free: it only
    memoizes keys and answers); ``allocated`` records that vLLM took a match; ``plan`` turns a
    scheduled step into loads and saves; ``finished`` forgets a request."""

    def __init__(
        self,
        chunk_size: int,
        block_size: int,
        keys_for: KeysFor,
        lookup: Lookup,
        *,
        load: bool = True,
        save: bool = True,
        memo_size: int = 4096,
    ) -> None:
        check_alignment(chunk_size, block_size)
        self.chunk_size, self.block_size = chunk_size, block_size
        self._keys_for, self._lookup = keys_for, lookup
        self.load_enabled, self.save_enabled = load, save
        self._memo_size = memo_size
        self._keys: OrderedDict[str, tuple[str | None, list[list[ChunkKey]]]] = OrderedDict()
        self._matches: OrderedDict[str, Match] = OrderedDict()
        self._pending: dict[str, int] = {}  # req_id -> external tokens vLLM allocated for
        self._trackers: dict[str, _Tracker] = {}
        self.counters = SchedulerCounters()

    # -- keys --------------------------------------------------------------------------------------

    def keys(
        self, req_id: str, tokens: Sequence[int], cache_salt: str | None, n_chunks: int
    ) -> list[list[ChunkKey]]:
        """Per rank, the keys of the request's first ``n_chunks`` chunks (memoized per request:
        a prompt's leading tokens never change)."""
        if n_chunks <= 0:
            return self._keys_for(tokens, cache_salt, 0)
        got = self._keys.get(req_id)
        if got is not None and got[0] == cache_salt and len(got[1][0]) >= n_chunks:
            self._keys.move_to_end(req_id)
            return [k[:n_chunks] for k in got[1]]
        keys = self._keys_for(tokens, cache_salt, n_chunks)
        self._keys[req_id] = (cache_salt, keys)
        while len(self._keys) > self._memo_size:
            self._keys.popitem(last=False)
        return keys

    def _where(self, keys: list[list[ChunkKey]]) -> tuple[str | None, ...]:
        """Per chunk, the tier of rank 0's entry if every rank's entry is stored, else None."""
        where: list[str | None] = list(self._lookup(keys[0])) if keys[0] else []
        for rank_keys in keys[1:]:
            for i, w in enumerate(self._lookup(rank_keys)):
                if w is None:
                    where[i] = None
        return tuple(where)

    # -- lookups -----------------------------------------------------------------------------------

    def match(
        self, req_id: str, tokens: Sequence[int], cache_salt: str | None, num_computed: int
    ) -> Match:
        """How many tokens beyond ``num_computed`` (vLLM's block-aligned local hit) the store can
        provide for this request: contiguous stored chunks from the chunk holding the first token
        vLLM lacks, up to the last whole block before the request's last token."""
        if not self.load_enabled:
            return Match(0, num_computed, 0, 0)
        n_chunks = lookup_chunks(len(tokens), self.chunk_size, self.block_size)
        first = first_needed_chunk(num_computed, self.chunk_size)
        if first >= n_chunks:
            return Match(0, num_computed, first, 0)
        keys = self.keys(req_id, tokens, cache_salt, n_chunks)
        where = self._where([k[first:] for k in keys])
        hits = next((i for i, w in enumerate(where) if w is None), len(where))
        limit = load_limit(len(tokens), self.block_size)
        m = Match(
            matched_tokens(num_computed, first, hits, self.chunk_size, limit),
            num_computed,
            first,
            hits,
            where[:hits],
        )
        self._matches[req_id] = m
        while len(self._matches) > self._memo_size:
            self._matches.popitem(last=False)
        return m

    def hit_tiers(self, req_id: str, tokens: int) -> dict[str, int]:
        """The ``tokens`` vLLM took from the last match of ``req_id``, by tier of the chunk each
        token comes from (the first chunk may be partly held by vLLM already)."""
        m = self._matches.get(req_id)
        if m is None or tokens <= 0:
            return {}
        out: dict[str, int] = {}
        end = m.num_computed + tokens
        for i, tier in enumerate(m.tiers):
            lo = max((m.first + i) * self.chunk_size, m.num_computed)
            hi = min((m.first + i + 1) * self.chunk_size, end)
            if hi > lo:
                out[tier or "unknown"] = out.get(tier or "unknown", 0) + hi - lo
        return out

    def allocated(self, req_id: str, external_tokens: int) -> None:
        """vLLM allocated blocks for ``external_tokens`` tokens of the request to be loaded."""
        self.counters.add(lookups=1)
        if external_tokens > 0:
            self._pending[req_id] = external_tokens
            self.counters.add(
                hit_requests=1,
                hit_tokens=external_tokens,
                hit_tokens_by_tier=self.hit_tiers(req_id, external_tokens),
            )

    # -- steps -------------------------------------------------------------------------------------

    def plan(self, new: Sequence[NewRequest], cached: Sequence[CachedRequest]) -> StepPlan:
        """The loads and saves of one scheduled step."""
        step = StepPlan()
        for r in new:
            tracker = _Tracker(
                r.req_id, list(r.prompt_token_ids), r.cache_salt, [int(b) for b in r.block_ids]
            )
            self._trackers[r.req_id] = tracker
            self._load(step, tracker, r.num_computed_tokens)
            self._first_sight(tracker)
            self._save(step, tracker, r.num_computed_tokens + r.num_scheduled_tokens)
        for r in cached:
            tracker = self._trackers.get(r.req_id)
            if tracker is None:  # never seen as new: nothing is known of it
                if self._pending.pop(r.req_id, 0):
                    log.error("kvfuse: request %s was granted a load but is unknown here", r.req_id)
                continue
            if r.resumed:
                tracker.block_ids = [int(b) for b in (r.new_block_ids or ())]
            elif r.new_block_ids:
                tracker.block_ids.extend(int(b) for b in r.new_block_ids)
            self._load(step, tracker, r.num_computed_tokens)
            self._save(step, tracker, r.num_computed_tokens + r.num_scheduled_tokens)
        if step.loads or step.saves:
            self.counters.add(
                planned_loads=sum(len(j.chunks) for j in step.loads), planned_saves=len(step.saves)
            )
        return step

    def _tracker_keys(self, tracker: _Tracker, n_chunks: int) -> list[list[ChunkKey]] | None:
        """The request's first ``n_chunks`` chunk keys per rank: memoized by ``match`` (over all
        its tokens) or computed from its prompt; None if neither covers them."""
        got = self._keys.get(tracker.req_id)
        if got is not None and got[0] == tracker.cache_salt and len(got[1][0]) >= n_chunks:
            return [k[:n_chunks] for k in got[1]]
        if n_chunks * self.chunk_size > len(tracker.tokens):
            return None
        return self.keys(tracker.req_id, tracker.tokens, tracker.cache_salt, n_chunks)

    def _load(self, step: StepPlan, tracker: _Tracker, num_computed: int) -> None:
        """Plan the load vLLM allocated blocks for (``allocated``), if any. A load that cannot be
        planned is still sent, without keys, so that the worker reports its blocks as failed and
        vLLM recomputes them (vLLM already counts those tokens as computed)."""
        external = self._pending.pop(tracker.req_id, 0)
        if external <= 0:
            return
        start, end = num_computed - external, num_computed
        spans = load_spans(start, end, self.chunk_size, self.block_size)
        keys = self._tracker_keys(tracker, -(-end // self.chunk_size))
        m = self._matches.get(tracker.req_id)
        chunks = []
        for s in spans:
            tier = None
            if m is not None and m.first <= s.index < m.first + len(m.tiers):
                tier = m.tiers[s.index - m.first]
            blocks = span_block_ids(tracker.block_ids, self.block_size, s.write_start, s.write_end)
            chunk_keys = tuple(str(k[s.index]) for k in keys) if keys is not None else ()
            ids = tuple(tracker.tokens[s.start : s.end]) if s.end <= len(tracker.tokens) else ()
            chunks.append(
                LoadChunk(chunk_keys, s.index, tuple(blocks), s.write_start - s.start, tier, ids)
            )
            tracker.present.add(s.index)
        if keys is None:
            log.error(
                "kvfuse: no keys for the load of request %s; its blocks will be reported failed",
                tracker.req_id,
            )
        step.loads.append(LoadJob(tracker.req_id, tuple(chunks)))

    def _first_sight(self, tracker: _Tracker) -> None:
        """Find which of the prompt's chunks the store holds already (they are not saved again)."""
        if not self.save_enabled:
            return
        n = len(tracker.tokens) // self.chunk_size
        todo = [i for i in range(n) if i not in tracker.present]
        keys = self._tracker_keys(tracker, n) if todo else None
        if keys is None:
            return
        where = self._where([[k[i] for i in todo] for k in keys])
        tracker.present.update(i for i, w in zip(todo, where) if w is not None)

    def _save(self, step: StepPlan, tracker: _Tracker, computed_after: int) -> None:
        """Plan the saves of the prompt chunks this step completes."""
        if not self.save_enabled:
            return
        done = completed_chunks(computed_after, len(tracker.tokens), self.chunk_size)
        if done <= tracker.next_save:
            return
        keys = self._tracker_keys(tracker, done)
        c = self.chunk_size
        for i in range(tracker.next_save, done):
            if i in tracker.present:
                self.counters.add(skipped_saves=1)
                continue
            try:
                blocks = span_block_ids(tracker.block_ids, self.block_size, i * c, (i + 1) * c)
            except ValueError as e:
                log.warning("kvfuse: chunk %d of request %s is not saved: %s", i, tracker.req_id, e)
                continue
            assert keys is not None  # done <= len(tokens) // c
            step.saves.append(
                SaveChunk(
                    tracker.req_id,
                    tuple(str(k[i]) for k in keys),
                    i,
                    tuple(blocks),
                    tuple(tracker.tokens[i * c : (i + 1) * c]),
                )
            )
            tracker.present.add(i)
        tracker.next_save = done

    def finished(self, req_id: str) -> None:
        """Forget a finished (or aborted) request."""
        self._trackers.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._keys.pop(req_id, None)
        self._matches.pop(req_id, None)

    @property
    def tracked(self) -> int:
        return len(self._trackers)
