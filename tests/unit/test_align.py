"""Lining prompts up against stored ids after dropped turns, on repetitive ids: the same runs as
the per-position scan it replaces, in time close to linear."""

from __future__ import annotations

import random
import time

import pytest

from kvfuse.history import Run, align
from kvfuse.history.align import _find, _id_bytes, common_prefix


def scan_find(stored, new, k, m, min_run):
    """The per-position scan ``_find`` replaced (O(n^2) on repetitive ids), as the reference."""
    w = min(8, min_run)
    if len(new) - m < min_run:
        return 0, 0
    probe = tuple(new[m : m + w])
    best_p, best_r = 0, 0
    for p in range(k + 1, len(stored) - min_run + 1):
        if stored[p] != probe[0] or tuple(stored[p : p + w]) != probe:
            continue
        n = min(len(stored) - p, len(new) - m)
        r = next((i for i in range(n) if stored[p + i] != new[m + i]), n)
        if r > best_r:
            best_p, best_r = p, r
    return (best_p, best_r) if best_r >= min_run else (0, 0)


def test_find_matches_the_scan_on_random_and_repetitive_ids():
    rng = random.Random(39)
    for trial in range(2000):
        alphabet = rng.choice([1, 2, 3, 50])
        stored = [rng.randrange(alphabet) for _ in range(rng.randint(0, 80))]
        if rng.random() < 0.5 and stored:  # the new prompt shares a run of the stored ids
            a = rng.randrange(len(stored))
            new = stored[: rng.randint(0, 5)] + stored[a : a + rng.randint(0, 60)]
        else:
            new = [rng.randrange(alphabet) for _ in range(rng.randint(0, 80))]
        new += [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))]
        k, m = rng.randint(0, 10), rng.randint(0, 6)
        min_run = rng.choice([1, 2, 4, 8, 16])
        assert _find(stored, new, k, m, min_run) == scan_find(stored, new, k, m, min_run), trial


def test_ids_as_bytes_match_whole_ids_only():
    assert len(_id_bytes([0, 1, 2**32 - 1])) == 15
    # 1 then 128 must not be found inside other ids' bytes at another offset
    hay, needle = _id_bytes([128, 1, 0x4000]), _id_bytes([1, 0x4000])
    assert hay.find(needle) == 5
    assert _id_bytes([0x10000000]).find(_id_bytes([0])) == -1
    with pytest.raises(ValueError):
        _id_bytes([-1])


@pytest.mark.parametrize("pattern", [[7], [7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
def test_32k_repetitive_ids_line_up_without_a_quadratic_scan(pattern):
    """One token id (or a short cycle) 32k times: every position starts a long match."""
    n = 32768
    stored = (pattern * n)[:n]
    system = [900, 901, 902]
    new = system + stored[1000 : n - 5]  # the stored turns after a gap, one shorter
    stored = system + [500 + i % 7 for i in range(40)] + stored
    t0 = time.perf_counter()
    al = align(stored, new, allow_gap=True)
    dt = time.perf_counter() - t0
    assert dt < 5, f"{dt:.2f} s"  # the scan it replaces took tens of seconds
    assert al.runs[0] == Run(0, 3, 0)
    p, r = _find(stored, new, 3, 3, 16)
    # the first place where the whole rest of the prompt occurs (as the scan would answer)
    assert r == len(new) - 3 and p == 43 + 1000 % len(pattern)
    assert stored[p : p + r] == new[3:]


def test_common_prefix_compares_whole_sequences():
    assert common_prefix([1] * 40000, [1] * 39999 + [2]) == 39999
    assert common_prefix((1, 2), [1, 2, 3]) == 2
