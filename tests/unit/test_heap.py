"""The heap given back while the engine rests (``kvfuse.heap``): when ``IdleRelease`` releases
(once per busy period, after ``after_s`` idle seconds, never with None), what it counts, and that
``release`` really returns freed heap pages to the kernel."""

from __future__ import annotations

import os

import pytest
import torch

from kvfuse import heap
from kvfuse.resident import MB, resident_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _idle(after_s, sizes=(500, 300)):
    clock, calls, rss = Clock(), [], list(sizes)
    rel = heap.IdleRelease(
        after_s,
        give_back=lambda: calls.append(clock.now) or True,
        clock=clock,
        resident=lambda: rss.pop(0) if rss else None,
    )
    return rel, clock, calls


# (after_s, [(seconds later, steps), ...], the calls that release)
CASES = [
    (2.0, [(0, 0), (1, 0), (1.5, 0)], []),  # not idle long enough
    (2.0, [(0, 0), (2, 0)], [1]),  # 2 s at one count
    (2.0, [(0, 0), (2, 0), (5, 0), (9, 0)], [1]),  # once per busy period
    (2.0, [(0, 0), (2, 0), (3, 7), (4, 7), (5, 7)], [1, 4]),  # work, then idle again
    (2.0, [(0, 3), (1.9, 4), (3.8, 5), (5.8, 5)], [3]),  # each step restarts the clock
    (0.0, [(0, 0), (1, 0), (2, 1)], [0, 2]),  # at once
    (None, [(0, 0), (60, 0), (600, 0)], []),  # never
]


@pytest.mark.parametrize("after_s, calls, released", CASES)
def test_idle_release_is_due_once_per_busy_period(after_s, calls, released):
    rel, clock, made = _idle(after_s, sizes=[500, 300] * len(calls))
    start = clock.now
    for i, (later, steps) in enumerate(calls):
        clock.now = start + later
        assert rel(steps) is False  # never asks the loop to skip its wait
        assert (clock.now in made) == (i in released)
    assert rel.releases == len(released) == len(made)


def test_idle_release_counts_the_bytes_given_back():
    rel, clock, _ = _idle(0.0, sizes=[500, 300, 300, 400, None, 100])
    rel(1)  # 500 -> 300
    rel(2)  # 300 -> 400: grew meanwhile, counts nothing
    rel(3)  # unknown -> 100: counts nothing
    assert rel.releases == 3 and rel.released_bytes == 200


def test_idle_release_where_glibc_has_no_trim_counts_nothing():
    rel = heap.IdleRelease(0.0, give_back=lambda: False, clock=Clock(), resident=lambda: 1)
    assert rel(1) is False and rel.releases == 0 and rel.released_bytes == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="no /proc here")
def test_release_gives_freed_heap_pages_back():
    if not heap.tune():  # freed buffers kept in the heap, as the engine runs
        pytest.skip("not glibc")
    held, keep = [], []
    for _ in range(96):  # 1 MB buffers in the heap, each followed by a small one that stays
        held.append(torch.ones(MB // 4))
        keep.append(torch.ones(64))
    del held
    before = resident_bytes()
    assert heap.release()
    assert before - resident_bytes() > 48 * MB
