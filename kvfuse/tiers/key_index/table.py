"""The key index's slot table: open addressing over the rows' digests.

``slots`` (int32, a power of two long, at most half full) holds row numbers, -1 for an empty slot.
A key's home slot is its first digest word XOR ``group * golden ratio``, masked: digests are
SHA-256 outputs, uniform already; the group (namespace, kind, variant) is mixed in because a
chunk's variants share its digest. Linear probing from there. Removal shifts the rest of the
probe run back (no tombstones), so lookups do not slow down with churn.

``probe_many`` (the tiers' batched lookups: a prompt's chain) probes a whole batch at once in
numpy; the index finishes with ``find`` the few keys whose home slot held another key.

Functions over arrays the index owns (``index.py``): the slots, and per row its digest (4
little-endian uint64 words, read through memoryviews by the scalar paths) and its group id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15
EMPTY = -1


def size_for(entries: int) -> int:
    """The smallest power of two holding ``entries`` at load <= 1/2."""
    size = 8
    while size < 2 * entries:
        size *= 2
    return size


def home(word: int, gid: int, mask: int) -> int:
    """The home slot of a key whose first digest word is ``word`` and whose group is ``gid``."""
    return (word ^ (gid * GOLDEN)) & mask


def find(slots, mask: int, dig, grp, dig_b, gid: int, digest: bytes) -> int:
    """The row holding (``gid``, ``digest``), or -1: ``slots``, ``dig`` (uint64 words), ``grp`` and
    ``dig_b`` (the digests' bytes) are memoryviews."""
    d0 = int.from_bytes(digest[:8], "little")
    s = (d0 ^ (gid * GOLDEN)) & mask
    while True:
        r = slots[s]
        if r < 0:
            return -1
        if dig[4 * r] == d0 and grp[r] == gid and dig_b[32 * r : 32 * r + 32].tobytes() == digest:
            return r
        s = (s + 1) & mask


def place(slots, mask: int, s: int, r: int) -> None:
    """Put row ``r`` in the first empty slot from its home slot ``s`` on."""
    while slots[s] >= 0:
        s = (s + 1) & mask
    slots[s] = r


def remove(slots, mask: int, r: int, home_of: Callable[[int], int]) -> None:
    """Take row ``r`` out of the table, moving later rows of its probe run into the hole unless
    their home lies cyclically in (hole, their slot] (backward-shift deletion)."""
    s = home_of(r)
    while slots[s] != r:
        s = (s + 1) & mask
    hole, j = s, s
    while True:
        j = (j + 1) & mask
        rj = slots[j]
        if rj < 0:
            break
        k = home_of(rj)
        if (hole < j and hole < k <= j) or (hole > j and (k > hole or k <= j)):
            continue
        slots[hole] = rj
        hole = j
    slots[hole] = EMPTY


def rebuild(rows: np.ndarray, words: np.ndarray, grp: np.ndarray, size: int) -> np.ndarray:
    """A table of ``size`` slots holding ``rows`` (the live ones; ``words``: every row's first
    digest word, ``grp`` its group). Vectorised insertion in rounds: each round places, per free
    target slot, the first row aiming at it; the others move one slot on. A row only passes
    occupied slots, so every key stays reachable."""
    mask = size - 1
    slots = np.full(size, EMPTY, dtype=np.int32)
    pending = rows.astype(np.int32)
    pos = (
        (words[pending] ^ (grp[pending].astype(np.uint64) * np.uint64(GOLDEN))) & np.uint64(mask)
    ).astype(np.int64)
    while pending.size:
        free = np.flatnonzero(slots[pos] < 0)
        _, first = np.unique(pos[free], return_index=True)
        won = free[first]
        slots[pos[won]] = pending[won]
        keep = np.ones(pending.size, dtype=bool)
        keep[won] = False
        pending, pos = pending[keep], (pos[keep] + 1) & mask
    return slots


def probe_many(
    slots: np.ndarray,
    rows: np.ndarray,
    grp: np.ndarray,
    raw: bytes,
    gids: int | Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """A batch of keys (digests ``raw``, 32 bytes each; group ids ``gids``, one for all or one
    each) looked for in their home slot and, when many were displaced, the slot after it (``rows``:
    the rows' digests as 32-byte items). Returns whether each was found, and the keys still
    undecided (their slot held another key: they may sit further on)."""
    mask = slots.size - 1
    if isinstance(gids, int):  # one namespace, kind and variant: a prompt's chain
        g, mix = gids, (gids * GOLDEN) & mask
    else:
        g = np.array(gids, dtype=np.uint32)
        mix = np.array([(x * GOLDEN) & mask for x in gids], dtype=np.uint32)
    q = np.frombuffer(raw, dtype="V32")
    # The home slot from the low 32 bits of the first digest word (the mask is below 2**31).
    s = (np.frombuffer(raw, dtype="<u4")[::8] ^ mix) & mask
    r = slots[s]
    held = r >= 0
    rr = np.maximum(r, 0)
    hit = (rows[rr] == q) & (grp[rr] == g) & held
    on = np.flatnonzero(held ^ hit)
    if on.size > 4:  # one more vectorised step (most displaced keys sit one slot on)
        r = slots[(s[on] + 1) & mask]
        held = r >= 0
        rr = np.maximum(r, 0)
        found = (rows[rr] == q[on]) & (grp[rr] == (g if isinstance(g, int) else g[on])) & held
        hit[on[found]] = True
        on = on[held ^ found]
    return hit, on
