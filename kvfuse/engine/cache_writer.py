"""Writing a request's KV to the cache: its new entries, how long they stay, and its history.

A request writes at three moments:

- a missing document computed on its own (``precomputed``): stored at once, since the prompt loads
  it right after;
- after its prefill (``after_prefill``): the entries read from below memory are promoted into
  memory, the plan's new chunks and the partial chunks its cache breakpoints mark are saved (its
  content chunks, with automatic reuse, unless a tier holds them already), and the entries it
  reused are kept at least as long as it asks (``retention.keep_until``);
- when its turn ends (``after_turn``): for a plain prompt, the ids its KV holds are recorded in the
  history index and the entries its prompt's chunks do not cover (the answer's chunks, the partial
  last chunk as a tail) are saved; without history, the answer's whole chunks when it asks to
  store generated tokens. Not after a blend (documents, found spans): its KV is not a prefill's.

Saves go to the ``Saver`` thread when there is one (no request waits for a store write), each group
of spans with its write policy (``retention.write_policy``: expiry, memory only), or are written on
the calling thread without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np

from kvfuse.codecs.base import Codec
from kvfuse.history import HistoryIndex, Record
from kvfuse.kv.format import Entry
from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.store import TieredStore

from .planner import Load, Save, breakpoint_saves, generated_saves, history_entries
from .request import CacheOptions
from .retention import Retention, keep_until, write_policy
from .saver import Saver, save_now
from .sequence import Sequence

log = logging.getLogger(__name__)


class CacheWriter:
    """One engine's writes to its store; see the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        saver: Saver | None,
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

    def policy(self, cache: CacheOptions, end: int) -> tuple[float | None, bool]:
        """``(expires_at, memory_only)`` of an entry of a request's KV ending at token ``end``."""
        return write_policy(
            end, cache.retention or self.retention, cache.breakpoints, self.store.clock()
        )

    def precomputed(self, cache: CacheOptions, key: ChunkKey, entry: Entry, end: int) -> None:
        """Save a document's KV computed on its own, whose last token is the prompt's ``end``."""
        expires_at, memory_only = self.policy(cache, end)
        self.store.put([(key, entry)], expires_at=expires_at, memory_only=memory_only)

    def after_prefill(self, seq: Sequence) -> None:
        """Promote what the prefill read from below memory, save its new chunks (and the partial
        chunks its breakpoints mark), and keep what it reused as long as it asks."""
        req, plan, filled = seq.request, seq.prefill.plan, seq.prefill.filled
        self.store.promote(filled.promotions.entries(self.codec))  # after the first token
        saves = [s for s in plan.saves if s.key.kind is not ChunkKind.CONTENT]
        planned = len(saves)
        if seq.keys is not None and req.cache.breakpoints and req.prompt.is_prefix_only:
            saves += breakpoint_saves(
                req.prompt.ids,
                seq.keys.prefix,
                req.cache.breakpoints,
                self.chunk_size,
                seq.namespace,
                {s.key for s in saves},
            )
        if saves:
            seq.usage.stored += self.save(seq, saves, skip_held=len(saves) > planned)
        content = [s for s in plan.saves if s.key.kind is ChunkKind.CONTENT]
        if content:  # a copy of KV saved under the chain too, or found spans' neighbours: not counted as written
            seq.usage.stored += self.save(seq, content, skip_held=True, written=False)
        self.retain(seq, plan.loads)

    def after_turn(self, seq: Sequence) -> None:
        """The turn is over: keep its history (a plain prompt with history on), or store the
        answer's whole chunks (``store_generated``)."""
        req = seq.request
        if (
            seq.keys is None or seq.prefill.plan.blended
        ):  # a blend's KV is not a prefill's: no history
            return
        if self.history is not None and req.prompt.is_prefix_only:
            self._keep_history(seq)
            return
        store_generated = (
            req.cache.store_generated
            if req.cache.store_generated is not None
            else self.store_generated
        )
        if store_generated and req.prompt.is_plain:
            n = seq.prompt_len
            full = req.prompt.ids + seq.token_ids[: seq.kv.length - n]
            spans = generated_saves(
                full, seq.kv.length, self.chunk_size, seq.namespace, len(seq.keys.prefix)
            )
            seq.usage.stored += self.save(seq, spans)

    def _keep_history(self, seq: Sequence) -> None:
        """Remember the ids the turn's KV holds (the prompt and the answer tokens fed back) and save
        the entries the prompt's own chunks do not cover, the partial last chunk as a tail."""
        req, n, ch = seq.request, seq.prompt_len, self.chunk_size
        state = req.prompt.ids + seq.token_ids[: seq.kv.length - n]
        entries = history_entries(state, ch, seq.namespace)
        new = [
            Save(e.key, e.source, e.source + e.tokens)
            for e in entries
            if e.source + e.tokens > len(seq.keys.prefix) * ch
        ]
        kept = self.history.add(
            seq.scope,
            state,
            seq.namespace,
            tuple(entries),
            req.cache.history_key,
            replaces=seq.record,
        )
        seq.usage.kept = kept or Record(
            seq.scope,
            np.asarray(state, dtype=np.uint32),
            seq.namespace,
            tuple(entries),
            req.cache.history_key,
        )
        seq.usage.stored += self.save(seq, new, skip_held=True)

    def save(
        self, seq: Sequence, spans: list[Save], skip_held: bool = False, written: bool = True
    ) -> int:
        """Save spans of ``seq``'s live cache, each group of spans with its write policy: handed to
        the saver thread, or written now without one. Returns how many entries. ``written``: count
        the prompt tokens in the request's ``written`` tokens."""
        req, kv = seq.request, seq.kv
        ids = req.prompt.ids + list(seq.token_ids)  # the token id of every slot of the live KV
        if written:
            seq.usage.written += sum(
                min(s.end, seq.prompt_len) - s.start for s in spans if s.start < seq.prompt_len
            )
        groups: dict[tuple[float | None, bool], list[Save]] = {}
        for s in spans:
            groups.setdefault(self.policy(req.cache, s.end), []).append(s)
        n = 0
        for (expires_at, memory_only), group in groups.items():
            if self.saver is not None:
                n += self.saver.save(
                    kv,
                    self.codec,
                    group,
                    ids,
                    skip_held,
                    expires_at=expires_at,
                    memory_only=memory_only,
                )
            else:
                n += save_now(
                    self.store,
                    kv,
                    self.codec,
                    group,
                    ids,
                    skip_held,
                    expires_at=expires_at,
                    memory_only=memory_only,
                )
        return n

    def retain(self, seq: Sequence, loads: tuple[Load, ...]) -> None:
        """Entries this request reuses stay at least as long as it asks (a retention duration, a
        breakpoint's ttl): their expiry is extended, never shortened."""
        c = seq.request.cache
        retention = c.retention or self.retention
        if not loads or (retention is None and not c.breakpoints):
            return
        now = self.store.clock()
        groups: dict[float, list[ChunkKey]] = {}
        for x in loads:
            until = keep_until(x.end, retention, c.breakpoints, now)
            if until is not None and x.tier is not None:
                groups.setdefault(until, []).append(x.key)
        for until, keys in groups.items():
            self.store.extend(keys, until)

    # -- maintenance ----------------------------------------------------------------------------

    def counters(self) -> dict:
        """The histories remembered and the saver's counters (``saver``: saves, their time off the
        request path, waits), where they are on."""
        out: dict = {}
        if self.history is not None:
            out["history_records"] = len(self.history)
        if self.saver is not None:
            out["saver"] = {**self.saver.stats.snapshot(), "pending": self.saver.pending()}
        return out

    def close(self) -> None:
        """Save what is queued, stop the saver, then flush the store's writes and close it."""
        if self.saver is not None:
            self.saver.close()
        self.store.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the saver's queued saves, then the store's queued lower-tier writes; False if
        ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.saver is not None and not self.saver.flush(timeout):
            return False
        return self.store.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def free(self, keys: Iterable[str]) -> dict[str, int]:
        """Remove the entries of ``keys`` (their string forms) from every tier, after the saves
        still queued for them; entries removed per tier."""
        parsed = []
        for k in keys:
            try:
                parsed.append(ChunkKey.parse(k))
            except ValueError:
                log.warning("not a chunk key, not freed: %r", k)
        if self.saver is not None:
            self.saver.wait(parsed)
        return self.store.delete(parsed)

    def clear(self, prefix: str) -> dict[str, int]:
        """Delete every entry and history record whose key starts with ``prefix`` (a tenant tag or
        a namespace's), after the queued writes; entries removed per tier."""
        self.flush()
        if self.history is not None:
            self.history.delete_prefix(prefix)
        return self.store.delete_prefix(prefix)
