"""Writing a request's KV to the cache: its new entries, how long they stay, and its history.

A request writes at three moments:

- a missing document computed on its own (``precomputed``): stored at once, since the prompt loads
  it right after;
- after its prefill (``after_prefill``): the entries read from below memory are promoted into
  memory, the plan's new chunks and the partial chunks its cache breakpoints mark are saved (its
  content chunks, with automatic reuse, unless a tier holds them already), and the entries it
  reused are kept at least as long as it asks (``retention.keep_until``). When the server
  publishes KV events, a plain prompt with history on also saves its partial last chunk, in
  memory only (``prompt_tail``): its history is saved, and announced, only after the answer's
  last token went out, so a client's next turn could reach a router first; this way the router
  has seen the conversation's blocks since the prefill (a short chat's only blocks are its tail);
- when its turn ends (``after_turn``): for a plain prompt, the ids its KV holds are recorded in the
  history index and the entries its prompt's chunks do not cover (the answer's chunks, the partial
  last chunk as a tail) are saved; without history, the answer's whole chunks when it asks to
  store generated tokens. Not after a blend (documents, found spans): its KV is not a prefill's.

Saves go to the saver (``Saver``: a thread, so that no request waits for a store write; or
``SyncSaver`` with ``cache.async_save: false``), each group of spans with its write policy
(``retention.write_policy``: expiry, memory only).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvfuse.codecs.base import Codec
from kvfuse.history import HistoryIndex, Record
from kvfuse.kv.format import Entry
from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.models.cache import KVCache
from kvfuse.store import TieredStore

from .options import CacheOptions
from .planner import (
    Load,
    Save,
    breakpoint_saves,
    generated_saves,
    history_entries,
    tail_saves,
)
from .retention import Retention, keep_until, write_policy
from .saver import Saver, SyncSaver
from .state import Reuse

log = logging.getLogger(__name__)


class CacheWriter:
    """One engine's writes to its store; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        saver: Saver | SyncSaver,
        codec: Codec,
        chunk_size: int,
        retention: Retention | None,
        store_generated: bool,
        history: HistoryIndex | None,
    ):
        self.store, self.saver, self.codec, self.chunk_size = store, saver, codec, chunk_size
        self.retention = retention  # of requests that do not say (prompt_cache_retention)
        self.store_generated = store_generated
        self.history = history
        # KV events for routers (``kvfuse.events.hub.KVEvents``), when the server publishes them:
        # told of the chunks written and found (their tokens) and of deletions.
        self.events = None

    def policy(self, cache: CacheOptions, end: int) -> tuple[float | None, bool]:
        """``(expires_at, memory_only)`` of an entry of a request's KV ending at token ``end``."""
        return write_policy(
            end, cache.retention or self.retention, cache.breakpoints, self.store.clock()
        )

    def precomputed(self, cache: CacheOptions, key: ChunkKey, entry: Entry, end: int) -> None:
        """Save a document's KV computed on its own, whose last token is the prompt's ``end``."""
        expires_at, memory_only = self.policy(cache, end)
        self.store.put([(key, entry)], expires_at=expires_at, memory_only=memory_only)

    def after_prefill(self, r: Reuse, kv: KVCache, ids: list[int]) -> None:
        """Promote what the prefill read from below memory, save its new chunks (and the partial
        chunks its breakpoints mark), and keep what it reused as long as it asks. ``ids``: the
        token id of every slot of ``kv``."""
        plan, filled, prompt = r.plan, r.filled, r.prompt
        if self.events is not None:  # before the promotions' memory puts announce them
            self.events.describe(r.namespace, prompt.ids, exact_loads(plan.loads))
        promotions = filled.promotions.entries(self.codec)
        if promotions:  # after the first token, off the step: it asks the lower tiers' expiries
            self.saver.later(partial(self.store.promote, promotions), [k for k, _ in promotions])
        saves = [s for s in plan.saves if s.key.kind is not ChunkKind.CONTENT]
        planned = len(saves)
        if r.keys is not None and r.cache.breakpoints and prompt.is_prefix_only:
            saves += breakpoint_saves(
                prompt.ids,
                r.keys.prefix,
                r.cache.breakpoints,
                self.chunk_size,
                r.namespace,
                {s.key for s in saves},
            )
        if saves:
            r.usage.stored += self.save(r, kv, ids, saves, skip_held=len(saves) > planned)
        tail = self.prompt_tail(r, {s.key for s in saves})
        if tail:  # a copy for the router's sake: not counted as written, never below memory
            r.usage.stored += self.save(r, kv, ids, tail, True, written=False, memory_only=True)
        content = [s for s in plan.saves if s.key.kind is ChunkKind.CONTENT]
        # a copy of KV saved under the chain too, or found spans' neighbours: not counted as written
        if content:
            r.usage.stored += self.save(r, kv, ids, content, skip_held=True, written=False)
        self.retain(r, plan.loads)

    def prompt_tail(self, r: Reuse, planned: set[ChunkKey]) -> list[Save]:
        """The prompt's partial last chunk, saved at prefill where KV events are published and
        the turn's history will be kept (see the module docstring); else nothing."""
        prompt = r.prompt
        if self.events is None or self.history is None or r.keys is None:
            return []
        if not prompt.is_prefix_only or r.plan.blended:
            return []
        n = len(prompt.ids)
        return tail_saves(prompt.ids, r.keys.prefix, [n], self.chunk_size, r.namespace, planned)

    def after_turn(self, r: Reuse, kv: KVCache, generated: list[int]) -> None:
        """The turn is over: keep its history (a plain prompt with history on), or store the
        answer's whole chunks (``store_generated``)."""
        if r.keys is None or r.plan.blended:  # a blend's KV is not a prefill's: no history
            return
        n = r.prompt_len
        state = r.prompt.ids + generated[: kv.length - n]  # the ids the turn's KV holds
        if self.history is not None and r.prompt.is_prefix_only:
            self._keep_history(r, kv, state)
            return
        store_generated = r.cache.store_generated
        if store_generated is None:
            store_generated = self.store_generated
        if store_generated and r.prompt.is_plain:
            spans = generated_saves(
                state, kv.length, self.chunk_size, r.namespace, len(r.keys.prefix)
            )
            r.usage.stored += self.save(r, kv, state, spans)

    def _keep_history(self, r: Reuse, kv: KVCache, state: list[int]) -> None:
        """Remember the ids the turn's KV holds (the prompt and the answer tokens fed back) and save
        the entries the prompt's own chunks do not cover, the partial last chunk as a tail."""
        ch = self.chunk_size
        entries = history_entries(state, ch, r.namespace)
        new = [
            Save(e.key, e.source, e.source + e.tokens)
            for e in entries
            if e.source + e.tokens > len(r.keys.prefix) * ch
        ]
        key = r.cache.history_key
        kept = self.history.add(r.scope, state, r.namespace, tuple(entries), key, replaces=r.record)
        ids = np.asarray(state, dtype=np.uint32)
        r.usage.kept = kept or Record(r.scope, ids, r.namespace, tuple(entries), key)
        r.usage.stored += self.save(r, kv, state, new, skip_held=True)

    def save(
        self,
        r: Reuse,
        kv: KVCache,
        ids: list[int],
        spans: list[Save],
        skip_held: bool = False,
        written: bool = True,
        memory_only: bool = False,
    ) -> int:
        """Save spans of a request's live cache ``kv`` (``ids``: the token id of each of its
        slots), each group of spans with its write policy, through the saver. Returns how many
        entries. ``written``: count the prompt tokens in the request's ``written`` tokens;
        ``memory_only``: keep them in memory whatever the policy says."""
        n = r.prompt_len
        if self.events is not None:  # before the saver's tier puts announce them
            self.events.describe(r.namespace, ids, spans)
        if written:
            r.usage.written += sum(min(s.end, n) - s.start for s in spans if s.start < n)
        groups: dict[tuple[float | None, bool], list[Save]] = {}
        for s in spans:
            expires_at, memory = self.policy(r.cache, s.end)
            groups.setdefault((expires_at, memory or memory_only), []).append(s)
        return sum(
            self.saver.save(
                kv, self.codec, group, ids, skip_held, expires_at=expires_at, memory_only=memory
            )
            for (expires_at, memory), group in groups.items()
        )

    def retain(self, r: Reuse, loads: tuple[Load, ...]) -> None:
        """Entries this request reuses stay at least as long as it asks (a retention duration, a
        breakpoint's ttl): their expiry is extended, never shortened."""
        c = r.cache
        retention = c.retention or self.retention
        if not loads or (retention is None and not c.breakpoints):
            return
        now = self.store.clock()
        groups: dict[float, list[ChunkKey]] = {}
        for x in loads:
            until = keep_until(x.end, retention, c.breakpoints, now)
            if until is not None and x.tier is not None:
                groups.setdefault(until, []).append(x.key)
        for until, keys in groups.items():  # memory now; the lower tiers' round trips off the step
            self.store.extend(keys, until, lower=False)
            self.saver.later(partial(self.store.extend_below, keys, until))

    # -- maintenance ----------------------------------------------------------------------------

    def counters(self) -> dict:
        """The histories remembered and the saver's counters (``saver``: saves, their time off the
        request path, waits), where they are on."""
        out: dict = {}
        if self.history is not None:
            out["history_records"] = len(self.history)
            # refused when read back: unsigned, badly signed, or outside their scope (records.py)
            out["history_records_refused"] = sum(self.history.refused.values())
        if isinstance(self.saver, Saver):  # a SyncSaver saves on the request path: no figures
            out["saver"] = {**self.saver.stats.snapshot(), "pending": self.saver.pending()}
        return out

    def close(self, timeout: float | None = None) -> bool:
        """Save what is queued and flush the store's lower-tier writes, together within
        ``timeout`` (None: as long as they take), and only then stop the saver and close the
        store: their own joins get what is left of it, so a slow tier cannot hold a shutdown
        past the deadline. False when the flush did not end in time (the rest is lost)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        flushed = self.flush(timeout)
        if not flushed:
            log.warning("the queued saves and writes did not finish within %.0f s", timeout)
        self.saver.close(left())
        self.store.close(left())
        return flushed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the saver's queued saves, then the store's queued lower-tier writes; False if
        ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.saver.flush(timeout):
            return False
        return self.store.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def free(self, keys: Iterable[str], timeout: float | None = None) -> dict[str, int]:
        """Remove the entries of ``keys`` (their string forms) from every tier, after the saves
        still queued for them (the store's queued writes waited for at most ``timeout``); entries
        removed per tier."""
        parsed = []
        for k in keys:
            try:
                parsed.append(ChunkKey.parse(k))
            except ValueError:
                log.warning("not a chunk key, not freed: %r", k)
        self.saver.wait(parsed)
        removed = self.store.delete(parsed, timeout)
        if self.events is not None:
            self.events.freed(parsed)
        return removed

    def clear(self, prefix: str, timeout: float | None = None) -> Cleared:
        """Delete every entry and history record whose key starts with ``prefix`` (a tenant's tag,
        or with a salt's: ``kv.keys.salt_prefix``), after the saves queued under ``prefix`` and
        the store's queued writes, waited for at most ``timeout`` in all (None: until done; a
        flood of other tenants' saves cannot hold it). Not ``complete`` when the wait ran out:
        what was stored is deleted, but a write still queued may land afterwards."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        complete = self.saver.flush_prefix(prefix, timeout)
        complete = self.store.flush(left()) and complete
        if self.history is not None:
            self.history.delete_prefix(prefix)
        removed = self.store.delete_prefix(prefix, 0.0 if deadline is not None else None)
        if self.events is not None:
            self.events.cleared(prefix)
        return Cleared(removed, complete)


@dataclass(frozen=True)
class Cleared:
    """What a clear did: entries removed per tier, and whether it ran after every write queued
    under its prefix (``complete``) or gave up waiting for some (repeat it to catch them)."""

    removed: dict[str, int]
    complete: bool


def exact_loads(loads: Sequence[Load]) -> list[Load]:
    """The loads whose entry is exactly their span at the position it was stored at (no moved or
    partly used history entries): the chunks a router can be told this server holds as they are."""
    return [
        x for x in loads if not x.moved and x.offset == 0 and x.stored_tokens == x.end - x.start
    ]
