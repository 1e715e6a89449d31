"""The engine's scheduler, without a model: admission, the queue limit, cancellation while queued and
while running, removal, and the look-ahead order the store prefetches by."""

from __future__ import annotations

import threading

import pytest
import torch

from kvfuse.blend import BlendOptions
from kvfuse.engine import (
    Prompt,
    QueueClosed,
    QueueFull,
    Request,
    Scheduler,
    Sequence,
    SequenceStatus,
)
from kvfuse.engine.kv_memory import KVMemory
from kvfuse.engine.scheduler import prefill_shares, step_budget
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import Namespace
from kvfuse.models.cache import slot_bytes
from kvfuse.reuse import CacheOptions, Reuse
from kvfuse.reuse.planner import prompt_keys

NS = Namespace("model", "float16", "L2xH1xD4")


def seq(name: str, ids=(1, 2, 3), keyed: bool = False, max_tokens: int = 256) -> Sequence:
    prompt = Prompt.plain(ids)
    reuse = Reuse(name, prompt, CacheOptions(), BlendOptions())
    if keyed:
        reuse.namespace, reuse.keys = NS, prompt_keys(prompt, 4, NS)
    return Sequence(Request(prompt, SamplingParams(max_tokens=max_tokens), request_id=name), reuse)


def names(seqs) -> list[str]:
    return [s.request.request_id for s in seqs]


def test_admission_is_first_come_first_served_up_to_max_running():
    s = Scheduler(max_waiting=4, max_running=2)
    a, b, c = seq("a"), seq("b"), seq("c")
    for x in (a, b, c):
        s.add(x)
    assert names(s.waiting()) == ["a", "b", "c"] and all(
        x.status is SequenceStatus.WAITING for x in (a, b, c)
    )
    step = s.schedule()
    assert step.admitted == [a, b] and step.running == [a, b] and step.skipped == []
    assert (
        a.status is SequenceStatus.RUNNING
        and a.request.started_at is not None
        and names(s.waiting()) == ["c"]
    )
    step = s.schedule()  # a and b run together: c waits for a free place
    assert step.admitted == [] and step.running == [a, b]
    s.finish(a)
    assert a.status is SequenceStatus.FINISHED and s.running() == [b]
    step = s.schedule()
    assert step.admitted == [c] and step.running == [b, c]
    s.finish(b)
    s.finish(c)
    assert s.schedule().empty and not s.has_work()


def test_admission_stops_at_the_first_sequence_that_does_not_fit(tiny_loaded):
    """Admission takes each sequence's live KV from the budget in queue order and stops at the
    first refusal: a large request is never overtaken by the smaller ones behind it."""
    runner = tiny_loaded("llama").runner
    per_slot = slot_bytes(runner.config, torch.float16)
    # a: 3 prompt tokens + 64 slots to decode; big: 50 + 64; c: 3 + 1 (max_tokens=1). 150 slots
    # hold a, or big and c, but not a and big.
    memory = KVMemory(runner, torch.float16, 150 * per_slot)
    s = Scheduler(max_waiting=4, max_running=8, memory=memory)
    a, big, c = seq("a"), seq("big", ids=range(50)), seq("c", max_tokens=1)
    for x in (a, big, c):
        s.add(x)
    step = s.schedule()
    assert step.admitted == [a] and names(s.waiting()) == [
        "big",
        "c",
    ]  # c would fit, but waits behind big
    assert memory.budget.used == a.kv.capacity * per_slot == 67 * per_slot
    s.finish(a)
    memory.release(a)
    assert s.schedule().admitted == [big, c] and memory.budget.used == (114 + 4) * per_slot


def test_a_preempted_sequence_goes_back_first_in_line_and_keeps_its_start_time():
    s = Scheduler(max_waiting=1, max_running=2)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.schedule()
    s.add(b)  # the queue is full again
    s.schedule()
    started = a.request.started_at
    s.preempt(a)  # allowed although the queue is full: a was accepted already
    assert a.status is SequenceStatus.WAITING and names(s.waiting()) == ["a"] and s.running() == [b]
    assert s.preempted == 1
    step = s.schedule()
    assert step.admitted == [a] and step.running == [b, a] and a.request.started_at == started


def test_queue_limit_order_and_close():
    s = Scheduler(max_waiting=2, max_running=1)
    a, b, c = seq("a"), seq("b"), seq("c")
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFull, match="max_queue = 2"):
        s.add(c)
    assert names(s.waiting()) == ["a", "b"] and len(s) == 2
    assert s.schedule().admitted == [a]  # admitted: a slot in the queue freed up
    s.add(c)
    assert s.close() == [b, c] and s.closed
    with pytest.raises(QueueClosed):
        s.add(seq("d"))
    assert s.waiting() == [] and s.running() == [a]


def test_cancelled_while_queued_is_skipped_and_reported():
    s = Scheduler(max_waiting=4)
    a, b, c = seq("a"), seq("b"), seq("c")
    for x in (a, b, c):
        s.add(x)
    a.request.cancel.set()  # a's client left while it waited
    c.request.cancel.set()
    step = s.schedule()
    assert step.skipped == [a, c] and step.admitted == [b] and s.skipped == 2 and s.waiting() == []


def test_cancelled_while_running_keeps_its_place_until_the_engine_ends_it():
    s = Scheduler(max_waiting=4, max_running=1)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    assert s.schedule().admitted == [a]
    a.request.cancel.set()  # the engine sees it at a's next step and finishes it
    step = s.schedule()
    assert step.running == [a] and step.admitted == []
    s.finish(a)
    assert s.schedule().admitted == [b]


def test_remove_frees_the_slot_and_counts():
    s = Scheduler(max_waiting=1)
    a = seq("a")
    s.add(a)
    assert s.remove(a.request) == [a] and s.remove(a.request) == [] and s.skipped == 1
    s.add(seq("b"))


def test_lookahead_lists_waiting_requests_in_run_order_with_their_keys():
    s = Scheduler(max_waiting=4, max_running=1)
    shared = list(range(8))
    a, b, c = (
        seq("a", shared + [9], keyed=True),
        seq("b", shared + [7, 7, 7, 7], keyed=True),
        seq("c"),
    )
    for x in (a, b, c):
        s.add(x)
    look = s.lookahead()
    assert [name for name, _ in look] == ["a", "b", "c"]
    assert look[0][1] == a.reuse.keys.all() and len(look[1][1]) == 3 and look[2][1] == []
    # every key once, in the order the requests will need them
    assert s.upcoming_keys() == a.reuse.keys.all() + [b.reuse.keys.all()[2]]
    assert s.schedule().admitted == [a]  # a runs: it is no longer ahead
    assert [name for name, _ in s.lookahead()] == ["b", "c"]


def test_wait_for_work_wakes_on_add_and_on_close():
    s = Scheduler(max_waiting=4)
    assert s.wait_for_work(timeout=0.01) is False
    got = []
    t = threading.Thread(target=lambda: got.append(s.wait_for_work(timeout=10)))
    t.start()
    s.add(seq("a"))
    t.join(5)
    assert got == [True]
    s.schedule()
    s.finish(s.running()[0])
    t = threading.Thread(target=lambda: got.append(s.wait_for_work(timeout=10)))
    t.start()
    s.close()
    t.join(5)
    assert got == [True, False]


@pytest.mark.parametrize(
    "step,prefill,decoding,expected",
    [
        (256, 2048, False, 2048),  # nothing decodes: the prefill budget
        (256, 2048, True, 256),  # decodes wait on the step: the step budget
        (256, None, False, 256),  # unset: the step budget always
        (4096, 2048, False, 4096),  # never below the step budget
        (16, 16, False, 16),
    ],
)
def test_step_budget(step, prefill, decoding, expected):
    assert step_budget(step, prefill, decoding) == expected


@pytest.mark.parametrize(
    "fills,budget,expected",
    [
        ([], 256, []),
        ([3000], 2048, [2048]),  # one prompt: the whole budget
        ([3000, 63], 2048, [1985, 63]),  # a returning turn joins the pass of a long cold prompt
        ([3000, 63, 40], 2048, [1945, 63, 40]),  # shortest first, the rest to the long one
        ([100, 50], 120, [70, 50]),  # the oldest's floor (16), the shortest (50), then 54 more
        ([3000, 500, 500], 256, [16, 240, 0]),  # floor first; ties go to the older
        ([3000, 300], 0, [16, 0]),  # decodes took the budget: the oldest still progresses
        ([10, 3000], -5, [10, 0]),  # its floor is never more than its fill
        ([40, 20], 1000, [40, 20]),  # everything fits: each computes its whole fill
    ],
)
def test_prefill_shares(fills, budget, expected):
    assert prefill_shares(fills, budget) == expected


def test_bad_limits():
    with pytest.raises(ValueError):
        Scheduler(max_waiting=0)
    with pytest.raises(ValueError):
        Scheduler(max_running=0)


def test_a_head_sequence_larger_than_the_whole_budget_is_refused_not_waited_for(tiny_loaded):
    """What runs can be longer than what submit checked (a prompt lined up with a stored history):
    a head sequence that could not fit even an empty budget is refused with the reason, and the
    ones behind it are admitted in the same step; one that only waits for memory still blocks."""
    runner = tiny_loaded("llama").runner
    per_slot = slot_bytes(runner.config, torch.float16)
    memory = KVMemory(runner, torch.float16, 100 * per_slot)
    s = Scheduler(max_waiting=4, max_running=8, memory=memory)
    huge, small = seq("huge", ids=range(200), max_tokens=1), seq("small", max_tokens=1)
    s.add(huge)
    s.add(small)
    step = s.schedule()
    assert [x for x, _ in step.refused] == [huge] and "kv_memory_bytes" in str(step.refused[0][1])
    assert step.admitted == [small] and names(s.waiting()) == []
    # 40 + 58 slots do not fit beside small's 4 now, but fit an empty budget: they wait
    s.add(seq("later", ids=range(40), max_tokens=58))
    s.add(seq("behind", max_tokens=1))
    step = s.schedule()
    assert step.refused == [] and step.admitted == [] and names(s.waiting()) == ["later", "behind"]
