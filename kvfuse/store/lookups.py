"""The store's walks down its tiers, fastest first: where each key is held (``holders``, for
``lookup``), its first usable copy (``first_copies``, for ``fetch``), and the expiry it has below
memory (``expiries_below``, for ``promote``).

Each walk asks every tier once for the keys still pending, as one batch (a prompt's chain is one
call per tier, not one per key), and stops at the first tier that answers for all of them. Tiers
are called through ``guarded``: one that raises is a counted miss, never a failed walk. What the
store does with the answers (its counters, promotion, prefetch counts) is ``core.py``'s; these
functions only read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfuse.kv.format import Entry, EntrySpec
from kvfuse.kv.keys import ChunkKey
from kvfuse.store.checked_reads import CheckedReads
from kvfuse.store.results import Fetched
from kvfuse.tiers.base import Tier, guarded

Promotion = tuple[ChunkKey, Entry, float | None]  # a lower-tier hit: key, entry, its expiry there


def holders(tiers: Sequence[Tier], keys: Sequence[ChunkKey]) -> list[str | None]:
    """Per key, the name of the fastest tier holding it (None: no tier has it). Side-effect-free
    in the tiers (``contains_many``: no recency, no hit or miss counts) but for expired entries,
    which are misses and removed."""
    holder: list[str | None] = [None] * len(keys)
    pending = list(range(len(keys)))
    for tier in tiers:
        if not pending:
            break
        asked = [keys[i] for i in pending]
        found = guarded(tier, "contains_many", tier.contains_many, [False] * len(pending), asked)
        if all(found):  # the usual answer of the memory tier to a prompt it holds
            for i in pending:
                holder[i] = tier.name
            break
        still = []
        for i, ok in zip(pending, found):
            if ok:
                holder[i] = tier.name
            else:
                still.append(i)
        pending = still
    return holder


def first_copies(
    tiers: Sequence[Tier],
    memory: Tier,
    reads: CheckedReads,
    keys: Sequence[ChunkKey],
    specs: Sequence[EntrySpec | None],
) -> tuple[list[Fetched], list[Promotion]]:
    """Per key, its entry from the fastest tier with a usable copy, checked (``reads``: a damaged
    copy is removed from its tier and the next tier tried), with the tier that served it and the
    unusable copies found on the way; and the hits below ``memory`` to promote, each with the
    expiry it has where it was read."""
    entries: list[Entry | None] = [None] * len(keys)
    served: list[str | None] = [None] * len(keys)
    rejected = [0] * len(keys)
    pending = list(range(len(keys)))
    promote: list[Promotion] = []
    for tier in tiers:
        if not pending:
            break
        below = tier is not memory
        asked = [keys[i] for i in pending]
        # A promoted copy keeps the expiry it has here, asked before the read: an entry that
        # expires in between is then promoted with a time passed, i.e. not at all.
        expiries = (
            guarded(tier, "expiries", tier.expiries, [None] * len(pending), asked)
            if below
            else None
        )
        opened = reads.batch(tier, asked, [specs[i] for i in pending], below)
        still = []
        for j, (i, (entry, bad)) in enumerate(zip(pending, opened)):
            if entry is None:
                rejected[i] += bad
                still.append(i)
                continue
            if below:
                promote.append((keys[i], entry, expiries[j]))
            entries[i], served[i] = entry, tier.name
        pending = still
    return [Fetched(e, t, r) for e, t, r in zip(entries, served, rejected)], promote


def expiries_below(
    lower: Sequence[Tier],
    keys: Sequence[ChunkKey],
    variants: Callable[[ChunkKey], list[ChunkKey]],
) -> tuple[list[float | None], list[bool]]:
    """Per key: its expiry in the first of the ``lower`` tiers holding it, and whether one does. A
    key held by none is looked for again as its ``variants`` (the CacheGen copies)."""
    expiries: list[float | None] = [None] * len(keys)
    held = [False] * len(keys)
    for stage in (lambda k: [k], variants):
        pending = [(i, c) for i in range(len(keys)) if not held[i] for c in stage(keys[i])]
        for tier in lower:
            if not pending:
                break
            asked = [c for _, c in pending]
            times = guarded(tier, "expiries", tier.expiries, [None] * len(asked), asked)
            for (i, _), t in zip(pending, times):
                if t is not None and not held[i]:  # an expiry: held (when asked)
                    expiries[i], held[i] = t, True
            rest = [(i, c) for i, c in pending if not held[i]]
            asked = [c for _, c in rest]
            found = (
                guarded(tier, "contains_many", tier.contains_many, [False] * len(rest), asked)
                if rest
                else []
            )
            for (i, _), ok in zip(rest, found):
                held[i] = held[i] or bool(ok)
            pending = [(i, c) for i, c in pending if not held[i]]
    return expiries, held
