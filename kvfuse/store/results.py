"""The values the tiered store answers with: where keys are (``LookupResult``), what a fetch got
(``Fetched``), one encoded copy (``Encoded``), a layer range (``LayerRange``), and its own counters
(``StoreCounters``, what ``stats()["store"]`` reports).

A module of their own so that the store, the pieces it is made of (checked reads, write-behind,
transcoding, prefetch counts: each adds to ``StoreCounters``) and their callers (the engine's
planner and loaders) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfuse.counters import Counters
from kvfuse.kv.format import Entry


@dataclass(frozen=True)
class LookupResult:
    """``where[i]`` = the name of the fastest tier holding key ``i`` (None: no tier has it)."""

    where: tuple[str | None, ...]

    @property
    def hits(self) -> int:
        """The length of the longest prefix of keys held by some tier."""
        return next((i for i, w in enumerate(self.where) if w is None), len(self.where))

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tier of each of the first ``hits`` keys."""
        return self.where[: self.hits]  # type: ignore[return-value]


@dataclass(frozen=True)
class Fetched:
    """What ``fetch`` got for one key: the checked entry and the tier that served it (None, None
    on a miss), and how many unusable copies were found (and removed) on the way."""

    entry: Entry | None
    tier: str | None
    rejected: int = 0


@dataclass(frozen=True)
class Encoded:
    """What ``fetch_encoded`` read: the checked entry, its size in the tier, and the variant it is
    ("" for the chunk's primary copy)."""

    entry: Entry
    nbytes: int
    variant: str


@dataclass(frozen=True)
class LayerRange:
    """The decoded KV of layers ``[first, last)`` of one entry, ``(n, 2, tokens, kv_heads,
    head_dim)``, with the entry's positions and the tier it came from."""

    kv: torch.Tensor
    positions: torch.Tensor
    first: int
    last: int
    tier: str


@dataclass
class StoreCounters(Counters):
    """The store's own counters (``stats()["store"]``, with ``queue_depth`` added)."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    promotions: int = 0
    unusable_entries: int = 0  # checked_reads.py
    signature_unsigned: int = 0  # of those: no signature, while signing is on
    signature_mismatch: int = (
        0  # of those: a signature no accepted key made (or a payload it does not cover)
    )
    queued_writes: int = 0  # write_behind.py
    queue_full_drops: int = 0
    prefetched: int = 0  # prefetch.py
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    reencoded: int = 0  # transcode.py
    reencode_errors: int = 0
