"""The engine's own loop thread, as a server uses it: requests submitted from an asyncio event loop,
text and outcomes delivered back to it, withdrawal of waiting and running requests, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Outcome, Prompt, QueueClosed, Request, RequestCancelled
from kvfuse.generation import SamplingParams
from kvfuse.reuse import prefill
from kvfuse.server.events import RequestEvents
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_loaded):
    e = Engine(
        tiny_loaded("llama"),
        TieredStore(MemoryTier(1 << 26)),
        EngineSettings.of(chunk_size=16, max_queue=4, max_running=1),
    )
    e.start()
    yield e
    e.close()


def run(engine, ids, stream=True, params=PARAMS):
    async def go():
        events = RequestEvents()
        req = Request(
            Prompt.plain(ids),
            params,
            on_text=events.on_text if stream else None,
            on_done=events.on_done,
        )
        engine.submit(req)
        items = []
        while not isinstance(item := await events.next(), Outcome):
            items.append(item)
        return items, item

    return asyncio.run(go())


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def test_the_loop_runs_requests_and_delivers_text_and_outcome_to_the_event_loop(
    engine, monkeypatch
):
    pieces, outcome = run(engine, list(range(3, 40)))
    assert (
        len(pieces) > 0
        and "".join(pieces) == outcome.result.text
        and outcome.result.completion_tokens == 6
    )
    assert outcome.result.timings.queued_s >= 0
    # the first run's whole history (prompt + answer) is kept: all but the last prompt token is reused
    assert run(engine, list(range(3, 40)), stream=False)[1].result.cached_tokens == 36

    real = prefill.execute

    def failing(runner, kv, ids, plan, source, **kw):  # a fault no real input produces
        if ids[0] == 13:
            raise RuntimeError("boom")
        return real(runner, kv, ids, plan, source, **kw)

    monkeypatch.setattr(prefill, "execute", failing)
    pieces, outcome = run(engine, [13, 14, 15])  # an engine failure is this request's outcome ...
    assert pieces == [] and isinstance(outcome.error, RuntimeError)
    assert run(engine, [20, 21, 22])[1].result is not None  # ... and the loop keeps serving others
    engine.flush()  # the saver copied the last answer out of its KV: every byte of live KV is back
    state = engine.queue_state()
    assert {
        k: state[k]
        for k in ("waiting", "running", "max_queue", "skipped", "preempted", "kv_bytes_used")
    } == {
        "waiting": 0,
        "running": 0,
        "max_queue": 4,
        "skipped": 0,
        "preempted": 0,
        "kv_bytes_used": 0,
    }


def test_withdraw_stops_the_running_request_and_drops_the_waiting_one(engine):
    gate, started = threading.Event(), threading.Event()
    done: dict[str, Outcome] = {}

    def hold(piece: str) -> None:  # runs on the engine thread: holds the running request mid-answer
        started.set()
        gate.wait(10)

    running = Request(
        Prompt.plain(range(3, 30)),
        SamplingParams(max_tokens=50, ignore_eos=True),
        on_text=hold,
        on_done=lambda o: done.setdefault("run", o),
    )
    waiting = Request(
        Prompt.plain(range(5, 30)), PARAMS, on_done=lambda o: done.setdefault("wait", o)
    )
    lookups = engine.cache_stats()["store"]["lookups"]
    try:
        engine.submit(running)
        engine.submit(waiting)
        assert started.wait(10)
        assert engine.queue_state()["waiting"] == 1 and engine.queue_state()["running"] == 1
        engine.withdraw(waiting)
        engine.withdraw(running)
    finally:
        gate.set()
    wait_until(lambda: len(done) == 2)
    assert isinstance(done["wait"].error, RequestCancelled)
    result = done["run"].result
    assert result.finish_reason == "cancelled" and 1 <= result.completion_tokens < 50
    # the withdrawn request never ran
    assert engine.cache_stats()["store"]["lookups"] == lookups + 1
    s = engine.stats_snapshot()
    assert (s["requests"], s["requests_skipped"]) == (2, 1) and engine.queue_state()["skipped"] == 1


def test_a_request_cancelled_as_it_is_admitted_stops_before_its_prefill(tiny_loaded, monkeypatch):
    store = TieredStore(MemoryTier(1 << 26))
    engine = Engine(tiny_loaded("llama"), store, EngineSettings.of(chunk_size=16))
    req = Request(Prompt.plain(range(3, 40)), PARAMS)
    real = store.lookup

    # the prefill's lookup (submit's probe is not counted): the client leaves now
    def lookup(keys, count=True):
        if count:
            req.cancel.set()
        return real(keys, count=count)

    monkeypatch.setattr(store, "lookup", lookup)
    outcome = []
    req.on_done = outcome.append
    engine.submit(req)
    engine.step()
    assert outcome[0].result.finish_reason == "cancelled" and outcome[0].result.token_ids == []
    assert store.stats()["memory"]["puts"] == 0  # nothing was computed, so nothing was stored
    assert not engine.has_work()


def test_stop_cancels_waiting_requests_and_refuses_new_ones(engine):
    gate = threading.Event()
    done: dict[str, Outcome] = {}
    first = Request(
        Prompt.plain(range(3, 20)),
        PARAMS,
        on_text=lambda p: gate.wait(10),
        on_done=lambda o: done.setdefault("1", o),
    )
    second = Request(Prompt.plain(range(4, 20)), PARAMS, on_done=lambda o: done.setdefault("2", o))
    engine.submit(first)
    engine.submit(second)
    time.sleep(0.05)
    gate.set()
    engine.stop()
    assert "1" in done and "2" in done
    with pytest.raises(QueueClosed):
        engine.submit(Request(Prompt.plain([1, 2]), PARAMS))


def test_generate_waits_for_the_loop(engine):
    direct = Engine(engine.model, None, EngineSettings.of(chunk_size=16)).generate(
        list(range(3, 40)), PARAMS
    )
    assert engine.generate(list(range(3, 40)), PARAMS).token_ids == direct.token_ids
    with pytest.raises(ValueError, match="context window"):
        engine.generate([1] * engine.model.config.max_position_embeddings, PARAMS)


def test_progress_reports_a_wedge_only_while_work_waits_without_progress():
    from kvfuse.engine.loop import STEP_BACKOFF_MAX_S, Progress

    now = [100.0]
    p = Progress(clock=lambda: now[0])
    now[0] += 500
    assert p.report(busy=False, stall_after_s=60)["wedged"] is False  # idle is never wedged
    assert p.report(busy=True, stall_after_s=60)["wedged"] is True
    p.advanced()
    now[0] += 30
    r = p.report(busy=True, stall_after_s=60)
    assert r["wedged"] is False and r["seconds_since_progress"] == 30 and r["progress_steps"] == 1
    pauses = [p.step_failed() for _ in range(12)]
    assert pauses == sorted(pauses) and pauses[0] < pauses[-1] == STEP_BACKOFF_MAX_S
    assert p.report(busy=True, stall_after_s=60, loop_dead=True)["wedged"] is True
    p.step_ok()
    assert p.report(busy=True, stall_after_s=60)["failing_steps"] == 0


def test_a_cache_allocation_fault_fails_that_request_and_the_engine_goes_on(
    tiny_loaded, monkeypatch
):
    """Not the KV budget's refusal: the device's (e.g. CUDA out of memory). The request whose
    cache could not be allocated, or could not grow, fails with that error; admission backs off
    a little; the next requests run."""
    from kvfuse.engine import kv_memory
    from kvfuse.engine import scheduler as sched
    from kvfuse.models import cache

    e = Engine(tiny_loaded("llama"), None, EngineSettings.of(max_queue=8, max_running=4))
    real = cache.KVCache._alloc

    def alloc(self, capacity):
        if capacity >= 40:
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, capacity)

    monkeypatch.setattr(cache.KVCache, "_alloc", alloc)
    monkeypatch.setattr(sched, "BACKOFF_FIRST_S", 0.01)
    monkeypatch.setattr(kv_memory, "DECODE_HEADROOM", 8)  # a first cache of prompt + 8 slots
    with pytest.raises(RuntimeError, match="injected"):  # at admission: 40 prompt slots
        e.generate(list(range(1, 41)), SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="injected"):  # as it grows: 4 + 8 slots, then 76
        e.generate([1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    out = e.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3 and not e.has_work()
