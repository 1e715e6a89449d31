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

MIN_GAP_RUN = 16  # tokens: a shorter match after a gap is too likely to be chance
GAP_END_SLACK = 16  # tokens: a run after a gap must reach (about) the end of the stored ids
_WINDOW = 8


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
    """The number of leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


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
    ``new[m:]`` starts, and its length (0 when no run of ``min_run`` tokens exists)."""
    w = min(_WINDOW, min_run)
    if len(new) - m < min_run:
        return 0, 0
    probe = tuple(new[m : m + w])
    best_p, best_r = 0, 0
    for p in range(k + 1, len(stored) - min_run + 1):
        if stored[p] != probe[0] or tuple(stored[p : p + w]) != probe:
            continue
        r = common_prefix(stored[p:], new[m:])
        if r > best_r:
            best_p, best_r = p, r
    return (best_p, best_r) if best_r >= min_run else (0, 0)
