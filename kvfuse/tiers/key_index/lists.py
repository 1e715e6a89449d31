"""The key index's recency lists: doubly linked lists of rows, least recent first.

A list links row numbers through two int32 arrays, ``prev`` and ``next`` (8 bytes a row), and has
a head (least recent) and a tail (most recent). Several lists can share one pair of arrays as
long as a row is on at most one of them: the index keeps one ``RowLists`` with a single list, its
LRU order over every entry, and, for tiers with per-tenant quotas, a second one with a list per
owner, so that an owner's oldest entry is its list's head (``index.py``).

Scalar reads and writes go through memoryviews (Python ints, no numpy scalar objects). Not
thread-safe: the owning tier's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NIL = -1  # no row: the end of a list


class RowLists:
    """Lists of rows over shared ``prev``/``next`` arrays of ``cap`` rows (see the module
    docstring); list ``l`` is ``heads[l]`` .. ``tails[l]``."""

    def __init__(self, cap: int = 0) -> None:
        self.heads: list[int] = []
        self.tails: list[int] = []
        self.prev = np.full(cap, NIL, dtype=np.int32)
        self.next = np.full(cap, NIL, dtype=np.int32)
        self._views()

    def _views(self) -> None:
        self.prev_v = memoryview(self.prev)
        self.next_v = memoryview(self.next)

    def _release_views(self) -> None:
        self.prev_v.release()
        self.next_v.release()

    @property
    def nbytes(self) -> int:
        return self.prev.nbytes + self.next.nbytes

    def grow(self, cap: int) -> None:
        """Room for rows up to ``cap`` (the new ones on no list)."""
        self._release_views()
        for name in ("prev", "next"):
            old = getattr(self, name)
            new = np.full(cap, NIL, dtype=np.int32)
            new[: old.size] = old
            setattr(self, name, new)
        self._views()

    def reset(self, cap: int) -> None:
        """Arrays of ``cap`` rows and every list empty (a bulk load follows: ``link``)."""
        self._release_views()
        self.prev = np.full(cap, NIL, dtype=np.int32)
        self.next = np.full(cap, NIL, dtype=np.int32)
        self.heads = [NIL] * len(self.heads)
        self.tails = [NIL] * len(self.tails)
        self._views()

    def ensure(self, lists: int) -> None:
        """Lists ``0 .. lists - 1`` exist (new ones empty)."""
        while len(self.heads) < lists:
            self.heads.append(NIL)
            self.tails.append(NIL)

    def head(self, lst: int = 0) -> int:
        """The least recent row of list ``lst`` (NIL: empty or no such list)."""
        return self.heads[lst] if lst < len(self.heads) else NIL

    def unlink(self, r: int, lst: int = 0) -> None:
        """Take row ``r`` off list ``lst``."""
        prev, nxt = self.prev_v, self.next_v
        p, n = prev[r], nxt[r]
        if p == NIL:
            self.heads[lst] = n
        else:
            nxt[p] = n
        if n == NIL:
            self.tails[lst] = p
        else:
            prev[n] = p

    def append(self, r: int, lst: int = 0) -> None:
        """Put row ``r`` at the end of list ``lst`` (its most recent)."""
        prev, nxt = self.prev_v, self.next_v
        tail = self.tails[lst]
        prev[r], nxt[r] = tail, NIL
        if tail == NIL:
            self.heads[lst] = r
        else:
            nxt[tail] = r
        self.tails[lst] = r

    def move_to_end(self, r: int, lst: int = 0) -> None:
        """Make row ``r`` the most recent of list ``lst`` (``unlink`` then ``append``, in one
        call: every read of an entry does it)."""
        tail = self.tails[lst]
        if r == tail:
            return
        prev, nxt = self.prev_v, self.next_v
        p, n = prev[r], nxt[r]  # n is a row: r is not the tail
        if p == NIL:
            self.heads[lst] = n
        else:
            nxt[p] = n
        prev[n] = p
        prev[r], nxt[r] = tail, NIL
        nxt[tail] = r
        self.tails[lst] = r

    def rows(self, lst: int = 0) -> Iterator[int]:
        """The rows of list ``lst``, least recent first; the caller may remove each as it comes."""
        r, nxt = self.head(lst), self.next_v
        while r != NIL:
            following = nxt[r]  # read first: the caller may remove r
            yield r
            r = following

    def link(self, rows: np.ndarray, lst: int = 0) -> None:
        """Make list ``lst`` exactly ``rows`` (int32, least recent first), all at once."""
        self.ensure(lst + 1)
        if not rows.size:
            self.heads[lst] = self.tails[lst] = NIL
            return
        self.next[rows[:-1]] = rows[1:]
        self.prev[rows[1:]] = rows[:-1]
        self.prev[rows[0]] = self.next[rows[-1]] = NIL
        self.heads[lst], self.tails[lst] = int(rows[0]), int(rows[-1])
