"""How many threads each of kvfuse's threads computes with (``kvfuse.threads``): helpers one,
whatever the process-wide count is when they first compute; the engine's thread the engine's
count, whatever a helper left the process-wide count at."""

from __future__ import annotations

import threading

import pytest
import torch

from kvfuse import threads
from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.engine.loop import EngineLoop
from kvfuse.generation import SamplingParams
from kvfuse.reuse.saver import Saver
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier


@pytest.fixture(autouse=True)
def two_threads():
    """The engine computes with two threads here (whatever the machine has), restored after."""
    before, main = threads.compute_threads(), torch.get_num_threads()
    threads.set_compute_threads(2)
    yield
    threads.set_compute_threads(before)
    torch.set_num_threads(main)


def counted_in(make_thread) -> int:
    """The thread count a thread made by ``make_thread(target)`` computes with, measured after
    the process-wide count changed between its start and its first PyTorch op."""
    started, go, seen = threading.Event(), threading.Event(), []

    def target():
        started.set()
        go.wait(10)
        torch.ones(4).add_(1)  # its first op
        seen.append(torch.get_num_threads())

    t = make_thread(target)
    t.start()
    assert started.wait(10)
    torch.set_num_threads(2)  # what the engine's thread does when it starts, after the helpers
    go.set()
    t.join(10)
    return seen[0]


def test_a_helper_computes_serially_whatever_the_count_when_it_first_computes():
    assert counted_in(lambda f: threads.helper_thread(f, "test-helper")) == 1


def test_a_plain_thread_would_take_the_process_wide_count():
    # the hazard helper_thread exists for: set before the first op, the count does not stick
    def plain(f):
        def run():
            torch.set_num_threads(1)
            f()

        return threading.Thread(target=run, daemon=True)

    assert counted_in(plain) == 2


def test_a_helper_pool_computes_serially():
    with threads.helper_pool(2, "test-pool") as pool:
        assert set(pool.map(lambda _: torch.get_num_threads(), range(8))) == {1}


def test_the_saver_thread_computes_serially():
    saver = Saver(TieredStore(MemoryTier(1 << 20)))
    seen = []
    try:
        assert saver.later(lambda: seen.append(torch.get_num_threads()))
        assert saver.flush(10)
    finally:
        saver.close()
    assert seen == [1]
    assert torch.get_num_threads() == 2  # this thread's own count is untouched


def test_the_engine_loop_computes_with_the_engines_count_after_a_helper_ran():
    threads.serial()  # a helper's call: new threads would now start from one
    threads.set_compute_threads(2)
    helper = threads.helper_thread(lambda: None, "test-helper")
    helper.start()
    helper.join(10)
    assert torch.get_num_threads() == 2
    seen = []

    class OneStep:  # what the loop asks of a scheduler: work once, then closed
        closed = True

        def has_work(self):
            return not seen

    loop = EngineLoop(lambda: seen.append(torch.get_num_threads()), OneStep())
    loop.start()
    loop.join(10)
    assert seen == [2]


def test_generate_on_the_callers_thread_uses_the_engines_count(tiny_loaded):
    engine = Engine(
        tiny_loaded("llama"), TieredStore(MemoryTier(1 << 26)), EngineSettings.of(chunk_size=16)
    )
    seen = []
    try:
        runner = engine.model.runner
        forward = runner.forward_batch

        def counted(*a, **k):
            seen.append(torch.get_num_threads())
            return forward(*a, **k)

        runner.forward_batch = counted

        def caller():
            torch.ones(4).add_(1)  # the process-wide count is one: so is this thread's
            engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))

        threads.serial()
        t = threading.Thread(target=caller)
        t.start()
        t.join(60)
    finally:
        engine.close()
    assert seen and set(seen) == {2}


def test_release_team_finds_pytorchs_openmp_and_keeps_the_threads_count():
    torch.ones(1 << 20).add_(1)  # this thread has a team now
    assert threads.release_team()
    assert torch.get_num_threads() == 2
    torch.ones(1 << 20).add_(1)  # and computes with it again


def test_starting_the_loop_hands_the_callers_thread_over(tiny_loaded):
    engine = Engine(
        tiny_loaded("llama"), TieredStore(MemoryTier(1 << 26)), EngineSettings.of(chunk_size=16)
    )
    seen = []
    forward = engine.model.runner.forward_batch

    def counted(*a, **k):
        seen.append(torch.get_num_threads())
        return forward(*a, **k)

    engine.model.runner.forward_batch = counted
    try:
        engine.start()
        assert torch.get_num_threads() == 1  # the caller no longer computes the model
        engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        engine.close()
    assert seen and set(seen) == {2}  # the loop's thread, with the engine's count
    assert torch.get_num_threads() == 2  # stopped from the thread that started it: its count back
