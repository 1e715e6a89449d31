"""A compact LRU index of chunk keys: what the memory and disk tiers know they hold, in about 60
bytes per entry (issue 15: a tier's index must hold a million entries in at most 100 bytes each).

Why a structure of its own: both tiers kept ``OrderedDict[ChunkKey, size or value]``, which costs
about 265 bytes per entry: the key object (a slotted object, its digest as a ``bytes`` object, its
hash as an ``int``) plus the dictionary's slots and LRU links. Here a key is not kept as an object.
Its 32-byte digest sits in a numpy row and what thousands of keys share (namespace, kind,
variant) sits once in a small table of *groups*. A key object is only rebuilt when a caller
asks for keys (eviction, listings).

Layout (row r = one entry; the row arrays grow by a quarter when full)::

    digest     uint64[cap * 4]  the SHA-256 digest, little-endian words (row r: words 4r..4r+3)
    group      uint32[cap]      id of (namespace_id, kind, variant); FREE for an unused row
    size       int64[cap]       the entry's bytes
    prev, next int32[cap]       the LRU list, least recent first (``lists.py``); free rows chain
                                through next
    slots      int32[2**k]      open addressing, linear probing, load <= 1/2 (``table.py``)
    values     list | None      the memory tier's values (one pointer per row)

Scalar paths read the arrays through memoryviews (a few times faster than numpy scalar indexing).

**Owners** (``owner_of``, given by tiers with per-tenant quotas, ``tiers/eviction.py``): each
group belongs to an owner (a small int, computed once per group from its namespace), and every
row is also on its owner's own LRU list (a second ``RowLists``, 8 more bytes per row), with each
owner's bytes and entries kept: an owner's oldest entry is found without walking the others'.
Without ``owner_of`` none of this is kept.

Not thread-safe: the owning tier's lock guards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from kvfuse.kv.keys import ChunkKey, ChunkKind
from kvfuse.tiers.key_index import table
from kvfuse.tiers.key_index.lists import NIL, RowLists

FREE = 0xFFFFFFFF  # the group of an unused row (never a real group id)
_VECTOR_MIN = 8  # below this many keys, scalar probes are faster than numpy's per-call overhead
_GOLDEN = table.GOLDEN
_group_of = attrgetter("group")  # "<namespace_id>:<kind>:<variant>", interned (see ChunkKey)


class KeyIndex:
    """``ChunkKey -> (size, value)`` in least-recent-first order, compactly (see the module
    docstring). ``with_values``: keep a value per entry (the memory tier's blobs)."""

    def __init__(
        self,
        with_values: bool = False,
        rows: int = 64,
        owner_of: Callable[[str], int] | None = None,
    ) -> None:
        self._groups: dict[str, int] = {}  # ChunkKey.group -> group id
        self._group_keys: list[tuple[str, ChunkKind, str]] = []
        # Owners (see the module docstring): namespace id -> owner, per group its owner, per owner
        # its LRU list (one of ``_olists``), its bytes and its entries.
        self._owner_of = owner_of
        self._group_owner: list[int] = []
        self._olists = RowLists() if owner_of is not None else None
        self._obytes: list[int] = []
        self._ocount: list[int] = []
        self._values: list[Any] | None = [] if with_values else None
        self._len = 0
        self._lru = RowLists()  # one list: every entry, least recent first
        self._lru.ensure(1)
        self._free = NIL  # the first unused row; the others chain through the LRU's next links
        self._cap = 0
        self._dig = np.zeros(0, dtype="<u8")
        self._grp = np.zeros(0, dtype=np.uint32)
        self._size = np.zeros(0, dtype=np.int64)
        self._grow_rows(max(4, rows))
        self._set_slots(np.full(table.size_for(max(4, rows)), table.EMPTY, dtype=np.int32))

    # -- storage --------------------------------------------------------------------------------

    def _views(self) -> None:
        # Scalar reads and writes go through memoryviews (Python ints, no numpy scalar objects).
        self._dig_v = memoryview(self._dig)
        self._dig_b = memoryview(self._dig).cast("B")
        # one 32-byte item per row: one comparison per digest
        self._dig_rows = self._dig.view("V32")
        self._grp_v = memoryview(self._grp)
        self._size_v = memoryview(self._size)

    def _release_views(self) -> None:
        for name in ("_dig_v", "_dig_b", "_grp_v", "_size_v"):
            view = self.__dict__.pop(name, None)
            if view is not None:
                view.release()

    def _grow_rows(self, cap: int) -> None:
        old = self._cap

        def grown(a: np.ndarray, n: int, fill: int) -> np.ndarray:
            b = np.full(n, fill, dtype=a.dtype)
            b[: a.size] = a
            return b

        self._release_views()
        self._dig = grown(self._dig, cap * 4, 0)
        self._grp = grown(self._grp, cap, FREE)
        self._size = grown(self._size, cap, 0)
        self._lru.grow(cap)
        # the new rows chain into the free list
        self._lru.next[old : cap - 1] = np.arange(old + 1, cap, dtype=np.int32)
        self._lru.next[cap - 1] = self._free
        self._free = old
        if self._olists is not None:
            self._olists.grow(cap)
        if self._values is not None:
            self._values.extend([None] * (cap - old))
        self._cap = cap
        self._views()

    def _set_slots(self, slots: np.ndarray) -> None:
        view = self.__dict__.pop("_slots_v", None)
        if view is not None:
            view.release()
        self._slots = slots
        self._mask = slots.size - 1
        self._slots_v = memoryview(slots)

    def _home(self, row: int) -> int:
        """Row ``row``'s home slot (``table.home``, inlined: it is on every put and removal)."""
        return (self._dig_v[4 * row] ^ (self._grp_v[row] * _GOLDEN)) & self._mask

    def _rehash(self, size: int) -> None:
        """A new slot table of ``size`` slots holding every live row."""
        live = np.flatnonzero(self._grp[: self._cap] != FREE)
        self._set_slots(table.rebuild(live, self._dig.reshape(-1, 4)[:, 0], self._grp, size))

    # -- lookups --------------------------------------------------------------------------------

    def _find(self, key: ChunkKey) -> int:
        """The row of ``key``, or -1."""
        gid = self._groups.get(_group_of(key))
        if gid is None:
            return -1
        return table.find(
            self._slots_v, self._mask, self._dig_v, self._grp_v, self._dig_b, gid, key.digest
        )

    def __len__(self) -> int:
        return self._len

    def __contains__(self, key: ChunkKey) -> bool:
        return self._find(key) >= 0

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is held, for a batch: one vectorised probe (``table.probe_many``),
        then scalar probes for the few keys it left undecided."""
        n = len(keys)
        if n < _VECTOR_MIN or not self._len:
            return [self._find(k) >= 0 for k in keys]
        groups = list(map(_group_of, keys))
        if groups.count(groups[0]) == n:  # one namespace, kind and variant: a prompt's chain
            gids = self._groups.get(groups[0])
            if gids is None:
                return [False] * n
        else:
            gids = [FREE if x is None else x for x in map(self._groups.get, groups)]
        raw = b"".join([k.digest for k in keys])
        hit, undecided = table.probe_many(self._slots, self._dig_rows, self._grp, raw, gids)
        out = hit.tolist()
        for i in undecided.tolist():
            out[i] = self._find(keys[i]) >= 0
        return out

    def size(self, key: ChunkKey) -> int | None:
        """The size recorded for ``key``, or None when it is not held."""
        r = self._find(key)
        return None if r < 0 else self._size_v[r]

    def value(self, key: ChunkKey, default: Any = None) -> Any:
        """The value kept for ``key`` (``with_values``), or ``default``."""
        r = self._find(key)
        return default if r < 0 else self._values[r]

    # -- recency --------------------------------------------------------------------------------

    def _unlink(self, r: int) -> None:
        self._lru.unlink(r)
        if self._olists is not None:
            self._olists.unlink(r, self._group_owner[self._grp_v[r]])

    def _append(self, r: int) -> None:
        self._lru.append(r)
        if self._olists is not None:
            self._olists.append(r, self._group_owner[self._grp_v[r]])

    def _to_end(self, r: int) -> None:
        """Make row ``r`` the most recent (of all, and of its owner)."""
        self._lru.move_to_end(r)
        if self._olists is not None:
            self._olists.move_to_end(r, self._group_owner[self._grp_v[r]])

    def use(self, key: ChunkKey) -> tuple[int, Any] | None:
        """``key``'s (size, value), made the most recent entry; None when it is not held."""
        r = self._find(key)
        if r < 0:
            return None
        self._to_end(r)
        return self._size_v[r], None if self._values is None else self._values[r]

    def touch(self, key: ChunkKey) -> bool:
        """Make ``key`` the most recent entry; False if it is not held."""
        return self.use(key) is not None

    # -- changes --------------------------------------------------------------------------------

    def _group_id(self, key: ChunkKey) -> int:
        g = _group_of(key)
        gid = self._groups.get(g)
        if gid is None:
            gid = self._groups[g] = len(self._group_keys)
            self._group_keys.append((key.namespace_id, key.kind, key.variant))
            if self._owner_of is not None:
                self._group_owner.append(self._owner(key.namespace_id))
        return gid

    def _owner(self, namespace_id: str) -> int:
        """The owner of a namespace, with its list and counts made room for."""
        o = self._owner_of(namespace_id)
        self._olists.ensure(o + 1)
        while len(self._obytes) <= o:
            self._obytes.append(0)
            self._ocount.append(0)
        return o

    def _owned(self, r: int, size: int, count: int) -> None:
        """Row ``r``'s owner holds ``size`` more bytes and ``count`` more entries."""
        if self._owner_of is not None:
            o = self._group_owner[self._grp_v[r]]
            self._obytes[o] += size
            self._ocount[o] += count

    def put(self, key: ChunkKey, size: int, value: Any = None) -> int | None:
        """Hold ``key`` with ``size`` (and ``value``) as the most recent entry. Returns the size it
        had, or None when it is new."""
        r = self._find(key)
        if r >= 0:
            old = self._size_v[r]
            self._size_v[r] = size
            self._owned(r, size - old, 0)
            if self._values is not None:
                self._values[r] = value
            self._to_end(r)
            return old
        if 2 * (self._len + 1) > self._slots.size:
            self._rehash(2 * self._slots.size)
        if self._free == NIL:
            self._grow_rows(self._cap + max(64, self._cap // 4))
        gid = self._group_id(key)
        r = self._free
        self._free = self._lru.next_v[r]
        self._dig_b[32 * r : 32 * r + 32] = key.digest
        self._grp_v[r] = gid
        self._size_v[r] = size
        if self._values is not None:
            self._values[r] = value
        self._append(r)
        self._owned(r, size, 1)
        table.place(self._slots_v, self._mask, self._home(r), r)
        self._len += 1
        return None

    def _remove_row(self, r: int) -> tuple[int, Any]:
        """Drop row ``r`` from the slots, the LRU lists and the rows; returns (size, value)."""
        table.remove(self._slots_v, self._mask, r, self._home)
        self._unlink(r)
        size = self._size_v[r]
        self._owned(r, -size, -1)
        value = None
        if self._values is not None:
            value, self._values[r] = self._values[r], None
        self._grp_v[r] = FREE
        self._lru.next_v[r] = self._free
        self._free = r
        self._len -= 1
        return size, value

    def pop(self, key: ChunkKey) -> tuple[int, Any] | None:
        """Remove ``key``; returns its (size, value), or None when it was not held."""
        r = self._find(key)
        return None if r < 0 else self._remove_row(r)

    def pop_oldest(self, owner: int | None = None) -> tuple[ChunkKey, int, Any]:
        """Remove and return the least recent entry (of ``owner``, if given) as (key, size, value);
        KeyError when there is none."""
        r = self._lru.head() if owner is None else self._owner_lists().head(owner)
        if r == NIL:
            raise KeyError(
                "pop_oldest from an empty KeyIndex"
                if owner is None
                else f"owner {owner} holds nothing"
            )
        key = self._key(r)
        size, value = self._remove_row(r)
        return key, size, value

    # -- owners ---------------------------------------------------------------------------------

    def _owner_lists(self) -> RowLists:
        if self._olists is None:
            raise ValueError("this KeyIndex keeps no owners (give owner_of)")
        return self._olists

    def owner_of(self, key: ChunkKey) -> int:
        """The owner of ``key``'s entries (held or not)."""
        gid = self._groups.get(_group_of(key))
        return self._group_owner[gid] if gid is not None else self._owner(key.namespace_id)

    def owner_bytes(self, owner: int) -> int:
        return self._obytes[owner] if owner < len(self._obytes) else 0

    def owner_entries(self, owner: int) -> int:
        return self._ocount[owner] if owner < len(self._ocount) else 0

    def owners(self) -> list[int]:
        """The owners holding at least one entry."""
        return [o for o, n in enumerate(self._ocount) if n]

    # -- listing --------------------------------------------------------------------------------

    def _key(self, r: int) -> ChunkKey:
        ns, kind, variant = self._group_keys[self._grp_v[r]]
        return ChunkKey(ns, bytes(self._dig_b[32 * r : 32 * r + 32]), kind, variant)

    def _rows(self, owner: int | None = None) -> Iterator[int]:
        return self._lru.rows() if owner is None else self._owner_lists().rows(owner)

    def keys(self) -> list[ChunkKey]:
        """Every key, least recent first (the eviction order)."""
        return [self._key(r) for r in self._rows()]

    def items(self, owner: int | None = None) -> Iterator[tuple[ChunkKey, int, Any]]:
        """(key, size, value) per entry (of ``owner``, if given), least recent first. Entries may
        be removed meanwhile."""
        for r in self._rows(owner):
            yield self._key(r), self._size_v[r], None if self._values is None else self._values[r]

    def keys_with_prefix(self, prefix: str) -> list[ChunkKey]:
        """The keys whose ``str`` starts with ``prefix`` (a tenant's or a namespace's entries):
        whole groups are chosen by their ``<namespace>:<kind>:`` text, keys of a group only when
        the prefix reaches into the digest."""
        whole, partial = [], []
        for gid, (ns, kind, variant) in enumerate(self._group_keys):
            head = f"{ns}:{kind.value}:"
            if head.startswith(prefix):
                whole.append(gid)
            elif prefix.startswith(head):
                partial.append(gid)
        out: list[ChunkKey] = []
        if whole or partial:
            live = self._grp[: self._cap]
            for gid in whole:
                out.extend(self._key(int(r)) for r in np.flatnonzero(live == gid))
            for gid in partial:
                out.extend(
                    k
                    for k in (self._key(int(r)) for r in np.flatnonzero(live == gid))
                    if str(k).startswith(prefix)
                )
        return out

    def nbytes(self) -> int:
        """Bytes this index holds in its arrays and group table (not the values themselves)."""
        arrays = sum(a.nbytes for a in (self._dig, self._grp, self._size, self._slots))
        lists = self._lru.nbytes + (self._olists.nbytes if self._olists is not None else 0)
        values = 8 * len(self._values) + 56 if self._values is not None else 0
        return arrays + lists + values + 200 * len(self._group_keys)

    # -- bulk -----------------------------------------------------------------------------------

    def load(
        self,
        groups: Sequence[tuple[str, ChunkKind, str]],
        group_of_row: np.ndarray,
        digests: bytes,
        sizes: np.ndarray,
    ) -> None:
        """Fill an empty index at once (the disk tier's start-up scan): row i has group
        ``groups[group_of_row[i]]``, digest ``digests[32 i : 32 i + 32]`` and ``sizes[i]``; rows
        are given least recent first and must be distinct keys."""
        if self._len:
            raise ValueError("KeyIndex.load fills an empty index only")
        n = len(sizes)
        if len(digests) != 32 * n or len(group_of_row) != n:
            raise ValueError(
                f"KeyIndex.load: {n} sizes, {len(group_of_row)} groups and {len(digests)} digest bytes"
            )
        ids = np.array(
            [
                self._group_id(ChunkKey(ns, bytes(32), kind, variant))
                for ns, kind, variant in groups
            ],
            dtype=np.uint32,
        )
        self._release_views()
        cap = max(4, n + n // 8)
        self._values = [None] * cap if self._values is not None else None
        self._dig = np.zeros(cap * 4, dtype="<u8")
        self._dig[: 4 * n] = np.frombuffer(digests, dtype="<u8")
        self._grp = np.full(cap, FREE, dtype=np.uint32)
        self._grp[:n] = ids[np.asarray(group_of_row, dtype=np.intp)] if n else ids[:0]
        self._size = np.zeros(cap, dtype=np.int64)
        self._size[:n] = sizes
        self._lru.reset(cap)
        self._lru.link(np.arange(n, dtype=np.int32))
        self._lru.next[n : cap - 1] = np.arange(n + 1, cap, dtype=np.int32)  # the free rows
        self._free = n if n < cap else NIL
        self._cap, self._len = cap, n
        if self._olists is not None:
            self._load_owners(cap, n)
        self._views()
        self._rehash(table.size_for(n))

    def _load_owners(self, cap: int, n: int) -> None:
        """The owners' lists of freshly loaded rows 0..n-1 (in LRU order, so each owner's rows in
        row order are its LRU order)."""
        self._olists.reset(cap)
        owner_of_group = np.array(self._group_owner, dtype=np.int64)
        row_owner = owner_of_group[self._grp[:n]] if n else np.zeros(0, dtype=np.int64)
        for o in np.unique(row_owner).tolist():
            rows = np.flatnonzero(row_owner == o).astype(np.int32)
            self._olists.link(rows, o)
            self._obytes[o] = int(self._size[rows].sum())
            self._ocount[o] = int(rows.size)
