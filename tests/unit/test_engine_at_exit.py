"""The exit hook of ``kvfuse.engine.at_exit``: every engine still open is closed once, with the
bounded flush; closed or collected ones are gone; one that fails does not stop the others."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvfuse.engine import at_exit


@pytest.fixture(autouse=True)
def own_set(monkeypatch):
    """A set of open engines of this test's own: other tests' real engines stay out of it."""
    monkeypatch.setattr(at_exit, "_open", weakref.WeakSet())


class FakeEngine:
    def __init__(self, flushed: bool = True, fails: bool = False):
        self.calls: list[float | None] = []
        self.flushed, self.fails = flushed, fails

    def close(self, flush_timeout=None):
        self.calls.append(flush_timeout)
        if self.fails:
            raise RuntimeError("boom")
        return self.flushed


def test_close_all_closes_each_open_engine_once_with_the_bounded_flush():
    a, b = FakeEngine(), FakeEngine(flushed=False)
    at_exit.register(a)
    at_exit.register(b)
    assert at_exit.close_all() == 2
    assert a.calls == [at_exit.FLUSH_AT_EXIT_S] and b.calls == [at_exit.FLUSH_AT_EXIT_S]
    assert at_exit.close_all() == 0  # nothing left: a second run closes nothing again


def test_unregistered_and_collected_engines_are_not_closed():
    closed, dropped = FakeEngine(), FakeEngine()
    at_exit.register(closed)
    at_exit.register(dropped)
    at_exit.unregister(closed)
    del dropped
    gc.collect()
    assert at_exit.close_all() == 0
    assert closed.calls == []


def test_a_failing_close_does_not_stop_the_others(caplog):
    bad, good = FakeEngine(fails=True), FakeEngine()
    at_exit.register(bad)
    at_exit.register(good)
    assert at_exit.close_all(1.0) == 2
    assert bad.calls == [1.0] and good.calls == [1.0]
    assert "closing an engine failed" in caplog.text
