"""Lining a new prompt up against the token ids of a stored history. Pure functions.

A chat turn re-sends the history as text; re-tokenized, it need not give the ids the stored KV
was built from (a generated answer is often not the canonical tokenization of its own text, and
a client may trim it). Reuse therefore never depends on equal ids: the prompt that runs takes the
*stored* ids wherever they spell the same bytes as the new prompt, and the new ids after that.
Both are tokenizations of the same text, so the model sees the text the client sent.

When the oldest turns were dropped (context-window truncation), the kept turns follow the kept
head (the system prompt) at new positions: ``align`` with ``allow_gap`` finds them further on in
the stored ids, and the ``Run`` says where they were stored, so their KV is loaded and its keys
re-rotated to the new positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_GAP_RUN = 16  # tokens: a shorter match after a gap is too likely to be chance
GAP_END_SLACK = 16  # tokens: a run after a gap must reach (about) the end of the stored ids


@dataclass(frozen=True)
class Run:
    """Slots ``[start, end)`` of the aligned prompt hold stored tokens that were at stored
    positions ``source..``: ``source == start`` is exact reuse, anything else a moved span."""

    start: int
    end: int
    source: int

    @property
    def moved(self) -> bool:
        return self.source != self.start

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Alignment:
    """The prompt to run (``ids``) and the spans of it taken from the stored ids (``runs``)."""

    ids: tuple[int, ...]
    runs: tuple[Run, ...]

    @property
    def reusable(self) -> int:
        return sum(len(r) for r in self.runs)

    @property
    def moved(self) -> bool:
        return any(r.moved for r in self.runs)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids ``a`` and ``b`` share (compared in numpy: one pass in C)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


def _common_bytes(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # the longest common byte prefix, by halving (slice compares run in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def byte_sync(
    a: Sequence[int], b: Sequence[int], table: Sequence[bytes], start: int = 0
) -> tuple[int, int]:
    """The largest ``(k, m)`` with ``a[:k]`` and ``b[:m]`` spelling the same bytes, given that
    ``a[:start] == b[:start]``: the last token boundary, common to both, before their texts differ.
    ``table[id]`` is the bytes of a token (``Tokenizer.token_bytes``)."""
    pieces_a = [table[t] for t in a[start:]]
    pieces_b = [table[t] for t in b[start:]]
    c = _common_bytes(b"".join(pieces_a), b"".join(pieces_b))
    ends_a: dict[int, int] = {0: start}  # byte offset -> token index after it (the last such index)
    off = 0
    for i, p in enumerate(pieces_a):
        off += len(p)
        if off > c:
            break
        ends_a[off] = start + i + 1
    best = (start, start)
    off = 0
    for j, p in enumerate(pieces_b):
        off += len(p)
        if off > c:
            break
        # never take an empty new token as the boundary: it would be dropped
        if off in ends_a and p:
            best = (ends_a[off], start + j + 1)
    return best


def _sync(
    a: Sequence[int], b: Sequence[int], table: Sequence[bytes] | None, start: int
) -> tuple[int, int]:
    return byte_sync(a, b, table, start) if table is not None else (start, start)


def align(
    stored: Sequence[int],
    new: Sequence[int],
    table: Sequence[bytes] | None = None,
    *,
    allow_gap: bool = False,
    min_run: int = MIN_GAP_RUN,
    end_slack: int = GAP_END_SLACK,
) -> Alignment:
    """Line ``new`` up against ``stored``.

    The head: the longest common prefix, extended by ``byte_sync`` (with a ``table``) where the
    two tokenizations differ but spell the same text. With ``allow_gap``, the rest of ``new`` is
    then looked for further on in ``stored`` (turns dropped between the head and the kept turns):
    the longest exact match of at least ``min_run`` tokens, extended by ``byte_sync`` again, and
    only if it runs on to within ``end_slack`` tokens of the end of ``stored``: kept turns are
    the latest ones, while a passage that merely recurs inside another history is not reused
    (its KV was computed in another context). The prompt that runs is the stored ids of both
    runs and the new ids of everything else.
    """
    d = common_prefix(stored, new)
    k, m = _sync(stored, new, table, d)
    ids: list[int] = list(stored[:k])
    runs = [Run(0, k, 0)] if k else []
    if allow_gap and m < len(new) and k < len(stored):
        p, r = _find(stored, new, k, m, min_run)
        k2, m2 = _sync(stored[p:], new[m:], table, r) if r else (0, 0)
        if r and p + k2 >= len(stored) - end_slack:
            runs.append(Run(len(ids), len(ids) + k2, p))
            ids += stored[p : p + k2]
            m += m2
    ids += new[m:]
    return Alignment(tuple(int(t) for t in ids), tuple(runs))


def _find(
    stored: Sequence[int], new: Sequence[int], k: int, m: int, min_run: int
) -> tuple[int, int]:
    """``(p, r)``: the position after ``k`` in ``stored`` where the longest exact run of
    ``new[m:]`` starts (the first such position), and its length (0 when no run of ``min_run``
    tokens exists).

    The longest run is the longest prefix of ``new[m:]`` that occurs in ``stored[k + 1:]`` (an
    occurrence of a longer prefix contains one of every shorter one), so it is found by halving
    its length, each try one substring search in C over the ids as bytes (``_id_bytes``) that
    gives the first occurrence: O((len(stored) + len(new)) log len(new)) byte compares in all,
    whatever the ids. The per-position scan this replaces compared a common prefix at every
    position matching the first ids: O(n^2) in Python on repetitive ids (32k of one token took
    tens of seconds). The work per request is bounded by the histories it is lined up against
    (at most ``HistoryIndex.candidates``' limit, plus a hint) times this, each history and
    prompt at most a context window long."""
    if min_run < 1 or len(new) - m < min_run or len(stored) - (k + 1) < min_run:
        return 0, 0
    hay = _id_bytes(stored[k + 1 :])
    needle = _id_bytes(new[m:])

    def first(length: int) -> int:  # the first position holding new[m:m + length], or -1
        at = hay.find(needle[: _ID_BYTES * length])
        return at // _ID_BYTES if at >= 0 else -1

    if first(min_run) < 0:
        return 0, 0
    lo, hi = min_run, min(len(new) - m, len(stored) - (k + 1))
    while lo < hi:  # the longest prefix that occurs: lo occurs, longer than hi does not
        mid = (lo + hi + 1) // 2
        if first(mid) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return k + 1 + first(lo), lo


_ID_BYTES = 5


def _id_bytes(ids: Sequence[int]) -> bytes:
    """``ids`` (each in [0, 2**32)) as 5 bytes each, 7 bits per byte with the high bit set only
    on an id's first byte: a byte string found in another such string, starting with a first
    byte, starts on an id boundary there, so a substring search matches whole ids only."""
    a = np.asarray(ids, dtype=np.int64)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    out = np.empty((a.size, _ID_BYTES), dtype=np.uint8)
    out[:, 0] = 0x80 | (a >> 28)
    for j in range(1, _ID_BYTES):
        out[:, j] = (a >> (7 * (_ID_BYTES - 1 - j))) & 0x7F
    return out.tobytes()
