"""Content-defined chunks of token ids: boundaries that depend on the tokens, not on where they are.

Prefix chunks are cut every ``chunk_size`` tokens from the prompt's start, so a passage moved by
one token gets other chunks. Content-defined chunks are cut where the tokens say: the same run of
tokens is cut at the same places wherever it appears, apart from its edges, so a retrieved
passage seen before in another prompt, in another order or after another passage, has chunks
(and keys, ``keys.content_keys``) that the tiers already hold.

The rule (pure; ``boundaries`` is table-tested):

- every token id gets a 64-bit hash (a fixed integer mix, the same on every machine); the hash
  of position ``i`` mixes the ids of its ``WINDOW`` tokens ``i - WINDOW + 1 .. i``;
- a cut goes after token ``i`` when its hash is the smallest of the positions within ``radius``
  of it (ties: the earlier position wins). Two such minima are more than ``radius`` apart, so
  chunks are at least ``min_size = radius + 1`` tokens long, about twice that on average;
- a cut depends only on the tokens from ``i - radius - WINDOW + 1`` to ``i + radius``: inside a
  run of tokens, every such cut at least ``horizon()`` tokens past its start and ``radius``
  before its end is the same whatever surrounds the run;
- a stretch longer than ``max_size`` without a cut (repeated tokens, whose hashes tie) is split
  into equal parts between its two cuts, so those splits depend on content too: from the run's
  first context-free cut to its last, every cut and every chunk is the same wherever it appears;
- positions before the first full window and before ``min_size`` tokens are never cuts (the
  first chunk is at least ``min_size`` long); only the prompt's last chunk may be shorter.

Line breaks (``separators``: the ids whose text ends with a newline, ``separator_ids``): the
rule above loses a passage's edges, about a chunk at each end (the chunk across its first token
depends on what precedes it), some 12% of a RAG prompt of 300-token passages. Texts put together
from passages almost always join them with line breaks, so a prompt is first cut into *segments*
after line breaks, and each segment is cut by the rule above on its own: a passage that starts
after a line break and ends with one has the same chunks in every prompt, edges included. A line
of at least ``min_size`` tokens is a segment of its own; a run of shorter lines (code, lists) is
one segment, so chunks do not shrink to single short lines. Whether a cut goes after a line
depends only on that line and the next, so a long line's segment never depends on its neighbours.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

WINDOW = 4  # tokens mixed into one position's hash
MIN_SIZE = 12  # the default shortest chunk (radius 11: about 23 tokens on average)
MAX_SIZE = 64  # the default longest chunk

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_NONE = np.uint64(2**64 - 1)  # "no hash": never a cut, never beats a real one


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _rotl(x: np.ndarray, k: int) -> np.ndarray:
    k %= 64
    return x if k == 0 else (x << np.uint64(k)) | (x >> np.uint64(64 - k))


def position_hashes(ids: Sequence[int] | np.ndarray, window: int = WINDOW) -> np.ndarray:
    """The hash of every position (``_NONE`` before the first full window): ``(n,)`` uint64."""
    arr = np.asarray(ids, dtype=np.int64)
    n = arr.shape[0]
    out = np.full(n, _NONE, dtype=np.uint64)
    if n < window:
        return out
    with np.errstate(over="ignore"):
        g = _mix(arr.astype(np.uint64) + _GOLDEN)
        acc = np.zeros(n - window + 1, dtype=np.uint64)
        for j in range(window):  # position i mixes ids i-j, each rotated by its distance
            acc ^= _rotl(g[window - 1 - j : n - j], 13 * j)
        out[window - 1 :] = np.minimum(_mix(acc + _GOLDEN), _NONE - np.uint64(1))
    return out


def horizon(min_size: int = MIN_SIZE, window: int = WINDOW) -> int:
    """How far into a run of tokens a cut must be not to depend on what precedes the run: a cut
    after token ``i`` depends on the ids ``i - (min_size - 1) - (window - 1) .. i + min_size - 1``."""
    return min_size + window - 1


def separator_ids(token_bytes: Sequence[bytes]) -> np.ndarray:
    """The ids (sorted) whose bytes end with a line break: where ``boundaries`` may start a segment."""
    return np.array([i for i, b in enumerate(token_bytes) if b.endswith(b"\n")], dtype=np.int64)


def segments(
    ids: Sequence[int] | np.ndarray, separators: np.ndarray | None, min_size: int = MIN_SIZE
) -> list[int]:
    """Where ``ids`` is cut into segments: ``[0, s1, ..., n]``. A line is what ends with a run of
    separator tokens; each line of at least ``min_size`` tokens is a segment, and every run of
    consecutive shorter lines is one (``[0, n]`` without separators)."""
    arr = np.asarray(ids, dtype=np.int64)
    n = arr.shape[0]
    if separators is None or len(separators) == 0 or n == 0:
        return [0, n] if n else [0]
    sep = np.isin(arr, separators)
    ends = np.flatnonzero(sep[:-1] & ~sep[1:]) + 1  # after the last separator of each run
    lines = [0, *ends.tolist(), n]
    out = [0]
    # keep cut b unless the lines on both sides are short
    for a, b, c in zip(lines, lines[1:], lines[2:]):
        if b - a >= min_size or c - b >= min_size:
            out.append(b)
    return out + [n]


def boundaries(
    ids: Sequence[int] | np.ndarray,
    min_size: int = MIN_SIZE,
    max_size: int = MAX_SIZE,
    window: int = WINDOW,
    separators: np.ndarray | None = None,
) -> list[int]:
    """The cuts of ``ids``: ``[0, c1, ..., n]`` (chunk ``j`` is ``[cuts[j], cuts[j + 1])``); see
    the module docstring. ``[0]`` for no tokens. ``separators``: the line-break ids
    (``separator_ids``) that start segments, each cut on its own; None: one segment."""
    if not (1 <= min_size and 2 * min_size <= max_size):
        raise ValueError(
            f"content chunks need 1 <= min_size and 2 * min_size <= max_size, got {min_size}, {max_size}"
        )
    arr = np.asarray(ids, dtype=np.int64)
    segs = segments(arr, separators, min_size)
    if len(segs) <= 2:
        return _cut(arr, min_size, max_size, window)
    out = [0]
    for a, b in zip(segs, segs[1:]):
        out += [a + c for c in _cut(arr[a:b], min_size, max_size, window)[1:]]
    return out


def _cut(ids: np.ndarray, min_size: int, max_size: int, window: int) -> list[int]:
    """``boundaries`` of one segment: the content rule of the module docstring."""
    h = position_hashes(ids, window)
    n, radius = h.shape[0], min_size - 1
    if n == 0:
        return [0]
    h[: min(n, min_size - 1)] = _NONE  # the first chunk is at least min_size long
    padded = np.concatenate(
        [np.full(radius, _NONE, dtype=np.uint64), h, np.full(radius, _NONE, dtype=np.uint64)]
    )
    if radius:
        views = np.lib.stride_tricks.sliding_window_view(padded, radius)
        left, right = views[:n], views[radius + 1 : radius + 1 + n]  # [i - r, i) and (i, i + r]
        is_cut = (h != _NONE) & (h < left.min(axis=1)) & (h <= right.min(axis=1))
    else:
        is_cut = h != _NONE
    cuts = [0] + [int(i) + 1 for i in np.flatnonzero(is_cut) if int(i) + 1 < n] + [n]
    return _split_long(cuts, max_size)


def _split_long(cuts: list[int], max_size: int) -> list[int]:
    """``cuts`` with every chunk longer than ``max_size`` split into equal parts (sizes differing
    by at most one, each at least ``max_size // 2``)."""
    out = [cuts[0]]
    for a, b in zip(cuts, cuts[1:]):
        length = b - a
        parts = -(-length // max_size)
        out += [a + (length * k) // parts for k in range(1, parts)] + [b]
    return out


def chunks(
    ids: Sequence[int] | np.ndarray,
    min_size: int = MIN_SIZE,
    max_size: int = MAX_SIZE,
    window: int = WINDOW,
    separators: np.ndarray | None = None,
) -> list[tuple[int, int]]:
    """``[start, end)`` of every content-defined chunk of ``ids``, in order, covering them all."""
    cuts = boundaries(ids, min_size, max_size, window, separators)
    return list(zip(cuts, cuts[1:]))
