"""A slow lower tier must not throttle the engine (issue 39, item 6): the saver's bounded queue
(skip and count, the live KV let go at once), its tasks, its per-key waits; the store's lane per
lower tier (a slow tier drops only its own writes), the per-key ``wait_written``, a bounded
close; and the server's shutdown order."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from keyed import K

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import encode_chunk
from kvfuse.reuse import saver as saver_module
from kvfuse.reuse.planner import Save
from kvfuse.reuse.saver import Saver
from kvfuse.server.state import ServerState, shutdown_order
from kvfuse.store import TieredStore
from kvfuse.store.write_behind import settled
from kvfuse.tiers import MemoryTier

KEYS = [K(f"{i:02d}") for i in range(8)]


def blob(key) -> bytes:
    kv = torch.randn((2, 2, 4, 2, 8), generator=torch.Generator().manual_seed(0)).half()
    return encode_chunk(KVChunk(kv, torch.arange(4)), key, get_codec("raw"))


class GatedTier(MemoryTier):
    """A tier whose writes wait for a gate: a slow disk or network, a fault no input produces."""

    def __init__(self, name: str, capacity: int = 10**9) -> None:
        super().__init__(capacity, name=name)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        self.gate.wait(timeout=10)
        super().put_many(items)


class LiveKV:
    """Stands in for a sequence's live KV cache: only its length is read (encoding is faked)."""

    length = 64


@pytest.fixture
def fake_encoding(monkeypatch):
    """Entries without a model: the saver's encoding of a span is a stored blob of its key."""
    monkeypatch.setattr(
        saver_module,
        "encode_spans",
        lambda kv, codec, spans, ids: [(s.key, blob(s.key)) for s in spans],
    )


def spans(*indices: int) -> list[Save]:
    return [Save(KEYS[i], 0, 16) for i in indices]


# ------------------------------------------------------------------------------ the saver
def test_a_full_saver_queue_skips_the_save_at_once_and_holds_no_kv(fake_encoding):
    memory = GatedTier("memory")  # the saver's first put waits here: its queue fills up
    store = TieredStore(memory)
    saver = Saver(store, max_jobs=1)
    first, second, third = LiveKV(), LiveKV(), LiveKV()
    assert saver.save(first, None, spans(0), range(16)) == 1
    assert memory.entered.wait(5)  # taken by the thread, held at the gate
    assert saver.save(second, None, spans(1), range(16)) == 1  # queued
    t0 = time.monotonic()
    assert saver.save(third, None, spans(2, 3), range(16)) == 0  # full: skipped, not waited for
    assert time.monotonic() - t0 < 0.5
    gone = weakref.ref(third)
    del third
    gc.collect()
    assert gone() is None  # the skipped job's live KV is not held (its KV budget goes back)
    s = saver.stats.snapshot()
    assert (s["save_jobs"], s["skipped_jobs"], s["skipped_spans"]) == (2, 1, 2)
    assert saver.wait([KEYS[2]]) and saver.pending() == 2  # a skipped key is not pending
    memory.gate.set()
    assert saver.flush(5) and saver.pending() == 0
    assert [memory.contains(k) for k in KEYS[:4]] == [True, True, False, False]
    saver.close()
    store.close()


def test_tasks_run_in_order_on_the_saver_thread_and_are_skipped_when_full(fake_encoding):
    memory = GatedTier("memory")
    store = TieredStore(memory)
    saver = Saver(store, max_jobs=1)
    ran: list[str] = []
    assert saver.save(LiveKV(), None, spans(0), range(16)) == 1
    assert memory.entered.wait(5)
    assert saver.later(lambda: ran.append(threading.current_thread().name), [KEYS[5]])
    assert not saver.later(lambda: ran.append("never"))  # the queue is full: skipped, counted
    assert saver.stats.snapshot()["skipped_tasks"] == 1
    saver.wait_s = 0.05
    assert not saver.wait([KEYS[5]], below=False)  # the task's keys are pending until it ran
    assert not saver.flush(0.05)  # the task is still to run
    saver.wait_s = 5
    memory.gate.set()
    assert saver.wait([KEYS[5]])
    assert ran == ["kvfuse-saver"]
    assert saver.flush(5)
    saver.close()
    store.close()


def test_a_key_memory_could_not_keep_is_waited_for_per_key_below(fake_encoding):
    slow = GatedTier("slow")
    store = TieredStore(MemoryTier(1), [slow])  # memory keeps nothing
    saver = Saver(store, wait_s=0.2)
    assert saver.save(LiveKV(), None, spans(0), range(16)) == 1
    assert slow.entered.wait(5)  # the saver is done; the slow tier still writes KEYS[0]
    assert saver.flush(5) and store.writing([KEYS[0]])
    assert saver.wait([KEYS[0]], below=False)  # copied out of the live KV: enough to free it
    t0 = time.monotonic()
    assert not saver.wait([KEYS[0]])  # findable only once the slow tier has it: bounded wait
    assert 0.15 < time.monotonic() - t0 < 2
    assert saver.wait([KEYS[1]])  # a key nobody writes is not waited for
    threading.Timer(0.05, slow.gate.set).start()
    saver.wait_s = 5
    assert saver.wait([KEYS[0]]) and slow.contains(KEYS[0])
    assert saver.stats.snapshot()["save_waits"] == 2
    saver.close()
    store.close()


# ------------------------------------------------------------------------------ the store
def test_a_slow_tier_drops_its_own_writes_while_a_fast_one_keeps_up():
    fast, slow = MemoryTier(10**9, name="disk"), GatedTier("redis")
    store = TieredStore(MemoryTier(10**9), [fast, slow], write_queue_size=4, write_batch=1)
    store.put([(KEYS[0], blob(KEYS[0]))])
    assert slow.entered.wait(5)  # the slow tier's writer holds KEYS[0]
    assert store.wait_written(KEYS[:1], 5)  # the fast one wrote it: its queue is empty
    store.put([(k, blob(k)) for k in KEYS[1:5]])  # both queues take them
    assert store.wait_written(KEYS[:5], 5)  # the fast tier wrote them: findable below
    t0 = time.monotonic()
    store.put([(k, blob(k)) for k in KEYS[5:8]])  # the slow tier's queue is full: dropped there
    assert time.monotonic() - t0 < 0.5
    assert store.wait_written(KEYS[5:8], 5)
    assert all(fast.contains(k) for k in KEYS) and store.writing(KEYS[1:5])
    s = store.stats()
    assert (s["disk"]["dropped_writes"], s["redis"]["dropped_writes"]) == (0, 3)
    assert s["store"]["queue_full_drops"] == 3 and s["store"]["queued_writes"] == 2 + 8 + 3
    slow.gate.set()
    assert store.flush(5)
    assert [slow.contains(k) for k in KEYS] == [True] * 5 + [False] * 3
    store.close()


def test_closing_a_store_whose_tier_hangs_ends_at_the_deadline():
    slow = GatedTier("slow")
    store = TieredStore(MemoryTier(10**9), [slow])
    store.put([(KEYS[0], blob(KEYS[0]))])
    assert slow.entered.wait(5)
    t0 = time.monotonic()
    store.close(timeout=0.2)
    assert time.monotonic() - t0 < 2
    slow.gate.set()


@pytest.mark.parametrize(
    "queued, written, expected",
    [
        ([set(), set()], [set(), set()], True),  # queued nowhere: a miss, or in memory
        ([{0}, {0}], [set(), set()], False),  # every tier still to write it
        ([set(), {0}], [{0}, set()], True),  # the fast tier wrote it, the slow one still writes
        ([{0}, set()], [set(), set()], False),  # one tier still writes it, the other dropped it
        ([set(), set()], [{0}, set()], True),
    ],
)
def test_settled(queued, written, expected):
    class Lane:
        def __init__(self, q, w):
            self.queued = {KEYS[i]: 1 for i in q}
            self.written = {KEYS[i]: None for i in w}

    lanes = [Lane(q, w) for q, w in zip(queued, written)]
    assert settled([KEYS[0]], lanes) is expected


# ------------------------------------------------------------------------------ shutdown
@pytest.mark.parametrize(
    "has_engine, owns, steps",
    [
        (True, True, ["engine", "flush", "close", "events", "responses"]),
        (True, False, ["engine", "flush", "events", "responses"]),
        (False, False, ["responses"]),
    ],
)
def test_shutdown_order(has_engine, owns, steps):
    assert shutdown_order(has_engine, owns) == steps


def test_stop_flushes_before_closing_and_closes_responses_last():
    calls: list[str] = []

    class Engine:
        def stop(self):
            calls.append("engine.stop")

        def flush(self, timeout):
            calls.append(f"engine.flush({timeout:.0f})")
            return True

        def close(self, flush_timeout):
            calls.append("engine.close")

    class Responses:
        def close(self):
            calls.append("responses.close")

    class Maintenance:
        def close(self):
            calls.append("maintenance.close")

    state = object.__new__(ServerState)  # the stop sequence only, without a config or a model
    state.engine, state.owns_engine, state.events = Engine(), True, None
    state.responses, state.maintenance = Responses(), Maintenance()
    state.phase = "serving"
    state.stop()
    assert calls == [
        "maintenance.close",
        "engine.stop",
        "engine.flush(60)",
        "engine.close",
        "responses.close",
    ]
    assert state.phase == "draining" and state.responses is None
