"""Which chunks a router has been told of, and in which tiers: notifications in, vLLM events out.

The tracker is fed, in order, by one thread (the publisher's): a request's chunks described by the
cache engine (``describe``: their keys, tokens and parents, so that their block hashes can be
computed), what the tiers stored and removed (``stored`` / ``removed``), and deletions by prefix
(``cleared``). It answers each with the events to send:

- ``stored(tier, key)``: a ``BlockStored`` with that tier's ``medium`` (and
  ``ownership`` for a shared tier), once per chunk and tier, for a chunk it was described;
- ``removed(tier, key)``: a ``BlockRemoved`` for a chunk announced in that tier;
- ``freed(keys)``: ``BlockRemoved`` events for chunks deleted by key from every tier;
- ``cleared(prefix)``: a ``BlockRemoved`` per tier for every announced chunk under ``prefix`` (a
  tenant's or namespace's deletion, which the Redis and S3 tiers do by prefix without naming
  keys), and ``AllBlocksCleared`` first when nothing announced is left (``DELETE /v1/kv`` of
  everything; vllm-router's clear does not reach the shared tiers' blocks, hence the removals).

It remembers at most ``capacity`` chunks, least recently announced first out: a chunk it forgets
gets its ``BlockRemoved`` events then, so a router never holds a block kvfuse could no longer
retract. Each remembered chunk costs its hashes (8 bytes a block) and a few words.

Chunks overlap: a tail and the longer tail or full chunk that later covers the same tokens
announce the same hashes for the blocks they share (``blocks.py``), and a router keeps one entry
per block and tier. So a chunk leaving a tier retracts only the blocks no other chunk announced
in that tier still holds (a prompt's tail evicted before the conversation's longer tail must not
take that tail's first blocks out of the router's index). Chunks that share any block share their
first one (the hashes chain), so the check looks only at the chunks with the same first hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvfuse.counters import Counters
from kvfuse.kv.keys import ChunkKey, Namespace

from .blocks import (
    Span,
    announced,
    block_tokens,
    chunk_blocks,
    pack_hashes,
    pack_tokens,
    parents,
    unpack_hashes,
    unpack_tokens,
)
from .wire import AllBlocksCleared, BlockRemoved, BlockStored, Event


@dataclass(frozen=True)
class TierMedium:
    """How a tier's blocks are announced: ``medium`` and, for a shared tier, ``ownership``."""

    medium: str
    ownership: str | None = None


@dataclass
class TrackerStats(Counters):
    """``described``: chunks whose blocks were computed; ``forgotten``: chunks dropped for room
    (their removals sent); ``untracked``: tier notifications of chunks never described (documents,
    content chunks, CacheGen variants, entries of another server)."""

    described: int = 0
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    forgotten: int = 0
    untracked: int = 0


class _Chunk:
    """A described chunk: its block hashes (8 bytes each), parent hash, the announced blocks'
    token ids (4 bytes each: a BlockStored carries them, and an entry written to a shared tier
    may no longer hold them in a readable form) and the tiers it was announced in (a bit each)."""

    __slots__ = ("hashes", "parent", "tokens", "tiers")

    def __init__(self, hashes: bytes, parent: int | None, tokens: bytes) -> None:
        self.hashes, self.parent, self.tokens, self.tiers = hashes, parent, tokens, 0

    @property
    def first(self) -> int:
        """The first block's hash: chunks sharing any block share this one."""
        return int.from_bytes(self.hashes[:8], "big")


class Tracker:
    """See the module docstring. ``tiers``: each tier's medium, by its index in the store."""

    def __init__(
        self,
        tiers: Sequence[TierMedium],
        block_size: int,
        chunk_size: int,
        capacity: int,
    ) -> None:
        self.tiers = tuple(tiers)
        self.block_size, self.chunk_size, self.capacity = block_size, chunk_size, capacity
        self._chunks: OrderedDict[ChunkKey, _Chunk] = OrderedDict()
        self._by_first: dict[int, list[ChunkKey]] = {}  # the chunks starting with a block
        self.stats = TrackerStats()

    def __len__(self) -> int:
        return len(self._chunks)

    def knows(self, key: ChunkKey) -> bool:
        """Whether ``key``'s blocks are computed (safe to ask from another thread: a dict probe)."""
        return key in self._chunks

    def describe(
        self, namespace: Namespace, ids: Sequence[int], spans: Sequence[Span]
    ) -> list[Event]:
        """Compute the blocks of ``spans`` (of a request's token ids ``ids``) not known yet."""
        todo = [s for s in announced(spans, self.chunk_size) if s.key not in self._chunks]
        if not todo:
            return []
        events: list[Event] = []
        for span, parent in zip(todo, parents(ids, todo, self.chunk_size, namespace)):
            events += self._learn(span.key, parent, ids[span.start : span.end])
        return events

    def found(self, key: ChunkKey, parent: ChunkKey | None, tokens: Sequence[int]) -> list[Event]:
        """Compute the blocks of a chunk found without its request (an entry the disk tier held
        at start-up: ``startup.py``), given its parent prefix key and its own token ids."""
        if key in self._chunks:
            return []
        return self._learn(key, parent, tokens)

    def _learn(self, key: ChunkKey, parent: ChunkKey | None, tokens: Sequence[int]) -> list[Event]:
        blocks = chunk_blocks(key, parent, tokens, self.block_size, self.chunk_size)
        if not blocks.count:
            return []
        toks = block_tokens(tokens, blocks.count, self.block_size)
        chunk = _Chunk(pack_hashes(blocks.hashes), blocks.parent, pack_tokens(toks))
        self._chunks[key] = chunk
        self._by_first.setdefault(chunk.first, []).append(key)
        self.stats.add(described=1)
        return self._make_room()

    def stored(self, tier: int, key: ChunkKey) -> list[Event]:
        """``key`` was written to tier ``tier``."""
        chunk = self._chunks.get(key)
        if chunk is None:
            self.stats.add(untracked=1)
            return []
        bit = 1 << tier
        if chunk.tiers & bit:
            return []
        chunk.tiers |= bit
        self._chunks.move_to_end(key)
        hashes = unpack_hashes(chunk.hashes)
        m = self.tiers[tier]
        self.stats.add(stored_events=1)
        return [
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=chunk.parent,
                token_ids=unpack_tokens(chunk.tokens),
                block_size=self.block_size,
                lora_id=None,
                medium=m.medium,
                lora_name=None,
                extra_keys=[(key.namespace_id,)] * len(hashes),
                ownership=m.ownership,
            )
        ]

    def removed(self, tier: int, key: ChunkKey) -> list[Event]:
        """``key`` left tier ``tier`` (evicted, expired, deleted)."""
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.tiers & (1 << tier):
            return []
        chunk.tiers &= ~(1 << tier)
        if not chunk.tiers:
            self._forget(key)
        return self._removal(chunk, tier)

    def freed(self, keys: Sequence[ChunkKey]) -> list[Event]:
        """``keys`` were deleted from every tier by key (a deleted stored response's entries):
        their removals from every tier they were announced in, the shared ones included (which
        do not report deletions themselves)."""
        removals: list[Event] = []
        gone = [(k, self._chunks.get(k)) for k in keys]
        gone = [(k, c) for k, c in gone if c is not None]
        for key, _ in gone:  # all of them first: they do not hold each other's blocks
            self._forget(key)
        for _, chunk in gone:
            removals += self._removals(chunk)
        return removals

    def cleared(self, prefix: str) -> list[Event]:
        """Every chunk under the storage-key ``prefix`` was deleted from every tier."""
        doomed = [k for k in self._chunks if str(k).startswith(prefix)]
        removals: list[Event] = []
        chunks = [self._chunks[k] for k in doomed]
        for key in doomed:
            self._forget(key)
        for chunk in chunks:
            removals += self._removals(chunk)
        # The memory and disk tiers report their deletions one by one before this arrives, so
        # ``doomed`` may be empty: what counts is that nothing announced is left.
        announced_left = any(c.tiers for c in self._chunks.values())
        if not announced_left:
            self.stats.add(cleared_events=1)
            return [AllBlocksCleared(), *removals]
        return removals

    def _make_room(self) -> list[Event]:
        """Forget the least recently announced chunks beyond ``capacity``, retracting them."""
        events: list[Event] = []
        while len(self._chunks) > self.capacity:
            key = next(iter(self._chunks))
            chunk = self._chunks[key]
            self._forget(key)
            self.stats.add(forgotten=1)
            events += self._removals(chunk)
        return events

    def _forget(self, key: ChunkKey) -> None:
        """Drop ``key`` from the chunks remembered (and from its first block's list)."""
        chunk = self._chunks.pop(key)
        siblings = self._by_first[chunk.first]
        siblings.remove(key)
        if not siblings:
            del self._by_first[chunk.first]

    def _removals(self, chunk: _Chunk) -> list[Event]:
        return [
            e
            for t in range(len(self.tiers))
            if chunk.tiers >> t & 1
            for e in self._removal(chunk, t)
        ]

    def _removal(self, chunk: _Chunk, tier: int) -> list[Event]:
        """The retraction of ``chunk``'s blocks from ``tier`` (already forgotten there): those no
        remembered chunk announced in ``tier`` still holds; none when every one is held."""
        held: set[int] = set()
        for key in self._by_first.get(chunk.first, ()):
            other = self._chunks[key]
            if other.tiers >> tier & 1:
                held.update(unpack_hashes(other.hashes))
        hashes = [h for h in unpack_hashes(chunk.hashes) if h not in held]
        if not hashes:
            return []
        m = self.tiers[tier]
        self.stats.add(removed_events=1)
        return [BlockRemoved(block_hashes=hashes, medium=m.medium, ownership=m.ownership)]
