"""Continuous batching on tiny random models: the batched runner step against one sequence at a time,
and the engine's scheduling (KV memory budget, preemption, chunked prefill, cancellation,
starvation) against the outputs of running the same requests one by one.

Tiny fp32 models make near-ties rare, so outputs are compared exactly here; the integration test
(``tests/integration/test_batching_real.py``) compares real SmolLM2 outputs with the near-tie rule.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt, Request
from kvfuse.generation import SamplingParams
from kvfuse.models.cache import KVBudget, OutOfKVMemory, slot_bytes
from kvfuse.models.transformer import BatchItem
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ids_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ------------------------------------------------------------------------------ the runner step


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batched_step_computes_what_each_sequence_computes_alone(family, tiny_loaded):
    """Prefill chunks and decodes of sequences with different lengths and positions share one pass;
    each gets the logits and the KV of its own ``forward`` (gemma3: sliding-window layers too)."""
    runner = tiny_loaded(family).runner
    prompts = [ids_of(n, seed) for n, seed in ((40, 1), (7, 2), (90, 3))]
    alone, caches = [], []
    for p in prompts:
        c = runner.new_cache(160)
        alone.append([runner.forward(p[:30], c, logits="last") if len(p) > 30 else None])
        caches.append(c)
    # one pass: the rest of prompt 0 (a chunk), prompt 1 whole, a chunk of prompt 2
    batched = [runner.new_cache(160) for _ in prompts]
    runner.forward(prompts[0][:30], batched[0], logits="none")
    runner.forward(prompts[2][:30], batched[2], logits="none")
    out = runner.forward_batch(
        [
            BatchItem(prompts[0][30:], batched[0]),
            BatchItem(prompts[1], batched[1]),
            BatchItem(prompts[2][30:60], batched[2], logits=False),
        ]
    )
    ref0 = runner.forward(prompts[0][30:], caches[0])
    ref1 = runner.forward(prompts[1], caches[1])
    runner.forward(prompts[2][30:60], caches[2], logits="none")
    assert out[2] is None
    torch.testing.assert_close(out[0], ref0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref1, atol=1e-4, rtol=1e-4)
    for b, c in zip(batched, caches):
        assert b.length == c.length
        torch.testing.assert_close(
            b.kv[:, :, :, : b.length], c.kv[:, :, :, : c.length], atol=1e-4, rtol=1e-4
        )
    # then decodes of all three, at their own positions
    out = runner.forward_batch([BatchItem([5], b) for b in batched])
    for o, c in zip(out, caches):
        torch.testing.assert_close(o, runner.forward([5], c), atol=1e-4, rtol=1e-4)


def test_a_batched_step_can_rewrite_slots_in_the_middle(tiny_loaded):
    """``BatchItem.start`` writes slots before the valid end (a prompt's last token over a loaded
    entry that covers it), exactly as ``forward(start=...)``."""
    runner = tiny_loaded("llama").runner
    p = ids_of(30, 4)
    ref, got = runner.new_cache(40), runner.new_cache(40)
    runner.forward(p, ref, logits="none")
    runner.forward(p, got, logits="none")
    a = runner.forward(p[-1:], ref, positions=torch.tensor([29]), start=29)
    (b,) = runner.forward_batch([BatchItem(p[-1:], got, positions=torch.tensor([29]), start=29)])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got.length == 30


# ------------------------------------------------------------------------------ the KV budget


def test_the_budget_counts_every_buffer_and_refuses_beyond_its_limit(tiny_loaded):
    runner = tiny_loaded("llama").runner
    per_slot = slot_bytes(runner.config, torch.float16)
    budget = KVBudget(150 * per_slot)
    a = runner.new_cache(60, torch.float16, budget=budget)
    assert budget.used == 60 * per_slot
    with pytest.raises(OutOfKVMemory, match="do not fit the KV budget"):
        runner.new_cache(91, torch.float16, budget=budget)
    a.length = 60
    # Growing copies into a new buffer: both count while it happens (60 + 80 slots), the old one
    # goes after; the usual growth (60 + 64 slots) would not fit, so it grows exactly as asked.
    a.reserve(80)
    assert budget.used == 80 * per_slot and a.capacity == 80 and budget.peak == 140 * per_slot
    with pytest.raises(OutOfKVMemory):
        a.reserve(90)  # 80 + 90 > 150
    assert a.capacity == 80 and budget.used == 80 * per_slot
    del a
    assert budget.used == 0
    b = runner.new_cache(10, torch.float16, budget=budget)
    b.release()
    assert budget.used == 0 and b.length == 0 and b.capacity == 0


def engine_for(loaded, **kw) -> Engine:
    return Engine(loaded, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=16, **kw))


def one_by_one(loaded, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = Engine(loaded, None, EngineSettings.of(chunk_size=16, max_running=1))
    return [engine.generate(ids, params).token_ids for ids, params in requests]


def run_all(
    engine: Engine, requests, cancel_after: dict[int, int] | None = None, max_steps: int = 10_000
):
    """Submit every request, then step until all are done; returns (results, steps, peak running)."""
    results: dict[int, object] = {}
    reqs = []
    for i, (ids, params) in enumerate(requests):
        pieces = []

        def on_text(piece, i=i, pieces=pieces):
            pieces.append(piece)
            if cancel_after and i in cancel_after and len(pieces) >= cancel_after[i]:
                reqs[i].cancel.set()

        r = Request(
            Prompt.plain(ids),
            params,
            on_text=on_text,
            on_done=lambda o, i=i: results.__setitem__(i, o),
        )
        reqs.append(r)
        engine.submit(r)
    steps = peak = 0
    while engine.has_work():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running()))
        assert (
            engine.scheduler.memory.budget.limit is None
            or engine.scheduler.memory.budget.used <= engine.scheduler.memory.budget.limit
        )
        assert steps < max_steps
    return [results[i] for i in range(len(requests))], steps, peak


def test_concurrent_requests_give_the_outputs_of_running_them_one_by_one(tiny_loaded):
    """Different lengths, a prefix hit, different max_tokens, a stop string and one request
    cancelled mid-way, all in flight together with chunked prefill."""
    loaded = tiny_loaded("llama")
    shared = ids_of(48, 10)
    requests = [
        (ids_of(70, 11), greedy(12)),
        (shared + ids_of(5, 12), greedy(9)),
        (ids_of(3, 13), greedy(20)),
        (shared + ids_of(9, 14), greedy(15)),
        (ids_of(130, 15), greedy(6)),
        (ids_of(20, 16), greedy(30)),
    ]
    ref = one_by_one(loaded, requests)
    # a stop string: the text of request 5's tokens 4-5 in the reference
    stop_text = loaded.tokenizer.decode(ref[5][4:6])
    requests[5] = (requests[5][0], greedy(30, stop=(stop_text,)))
    engine = engine_for(loaded, max_running=8, max_step_tokens=40)
    engine.generate(shared + ids_of(3, 17), greedy(2))  # the shared prefix is cached: hits below
    outcomes, steps, peak = run_all(engine, requests, cancel_after={2: 4})
    assert peak > 1  # they really ran together
    for i, o in enumerate(outcomes):
        r = o.result
        if i == 2:
            assert r.finish_reason == "cancelled" and 4 <= len(r.token_ids) < 20
            assert r.token_ids == ref[2][: len(r.token_ids)]
        elif i == 5:
            assert r.finish_reason == "stop" and stop_text not in r.text
            assert ref[5][: len(r.token_ids)] == r.token_ids and len(r.token_ids) <= 6
        else:
            assert r.token_ids == ref[i], i
    assert outcomes[1].result.cached_tokens >= 32 and outcomes[3].result.cached_tokens >= 32
    s = engine.stats_snapshot()
    # several sequences per step on average
    assert s["steps"] > 0 and s["step_sequences"] > s["steps"]
    engine.close()


def test_the_memory_budget_is_never_exceeded_and_preempted_requests_lose_nothing(tiny_loaded):
    """A budget that holds about two of these sequences: the others wait, and sequences whose
    answers outgrow their first allocation preempt the most recently admitted ones (their KV
    freed, recomputed later); every request still ends with its one-by-one output."""
    loaded = tiny_loaded("qwen3")
    requests = [(ids_of(20 + 5 * i, 20 + i), greedy(90 + 5 * i)) for i in range(6)]
    ref = one_by_one(loaded, requests)
    per_slot = slot_bytes(loaded.config, torch.float16)
    limit = 2 * 130 * per_slot
    engine = engine_for(loaded, max_running=6, max_step_tokens=64, kv_memory_bytes=limit)
    outcomes, steps, peak = run_all(engine, requests)
    assert [o.result.token_ids for o in outcomes] == ref
    assert (
        engine.scheduler.memory.budget.peak <= limit
        and engine.scheduler.memory.budget.peak > limit // 2
    )
    assert engine.stats_snapshot()["preemptions"] > 0 and engine.queue_state()["preempted"] > 0
    engine.flush()
    assert engine.scheduler.memory.budget.used == 0
    engine.close()


def test_a_request_larger_than_the_whole_budget_is_refused_up_front(tiny_loaded):
    loaded = tiny_loaded("llama")
    per_slot = slot_bytes(loaded.config, torch.float16)
    engine = engine_for(loaded, kv_memory_bytes=100 * per_slot)
    with pytest.raises(ValueError, match="more than the engine's whole KV memory budget"):
        engine.submit(Request(Prompt.plain(ids_of(60, 1)), greedy(41)))
    assert engine.generate(ids_of(60, 1), greedy(40)).finish_reason == "length"  # 100 slots: fits
    engine.close()


def test_a_long_prompt_behind_many_short_ones_finishes_within_a_bounded_number_of_steps(
    tiny_loaded,
):
    """No starvation: admission is first come, first served, and a prompt is computed in chunks
    of the step's token budget left after the decodes, so a long prompt queued behind many short
    requests starts within one step of its turn and progresses every step."""
    loaded = tiny_loaded("llama")
    max_running, step_tokens = 4, 32
    engine = engine_for(loaded, max_running=max_running, max_step_tokens=step_tokens)
    shorts = [(ids_of(5, 30 + i), greedy(25)) for i in range(12)]
    long_prompt, long_tokens = ids_of(300, 50), 5
    done_at: dict[int, int] = {}
    step = 0
    reqs = []
    for i, (ids, params) in enumerate(shorts + [(long_prompt, greedy(long_tokens))]):
        r = Request(Prompt.plain(ids), params, on_done=lambda o, i=i: done_at.setdefault(i, step))
        reqs.append(r)
        engine.submit(r)
    while engine.has_work():
        step += 1
        engine.step()
    long_i = len(shorts)
    # The shorts ahead run max_running at a time, 26 steps each wave (prefill + 25 tokens); the
    # long prompt is admitted when the last wave ahead of it leaves a place, then needs at most
    # ceil(300 / (step_tokens - decodes)) chunk steps and long_tokens decode steps.
    waves = -(-len(shorts) // max_running)
    chunk_steps = -(-len(long_prompt) // (step_tokens - (max_running - 1)))
    bound = waves * 26 + chunk_steps + long_tokens + 2
    assert done_at[long_i] <= bound, (done_at[long_i], bound)
    assert all(r.done for r in reqs)
    engine.close()


def test_a_request_cancelled_during_its_chunked_prefill_ends_without_a_token(tiny_loaded):
    loaded = tiny_loaded("llama")
    # max_prefill_tokens None: 16 prompt tokens a step even with nothing decoding
    engine = engine_for(loaded, max_running=2, max_step_tokens=16, max_prefill_tokens=None)
    done = []
    r = Request(Prompt.plain(ids_of(100, 3)), greedy(5), on_done=done.append)
    other = Request(Prompt.plain(ids_of(10, 4)), greedy(5), on_done=done.append)
    engine.submit(r)
    engine.submit(other)
    engine.step()
    engine.step()  # r's prompt is being computed, 16 tokens a step
    assert not r.done
    r.cancel.set()
    while engine.has_work():
        engine.step()
    results = {id(o.result): o.result for o in done}
    assert len(done) == 2
    cancelled = [x for x in results.values() if x.finish_reason == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0].token_ids == []
    engine.flush()
    assert engine.scheduler.memory.budget.used == 0
    engine.close()


def test_a_prompt_takes_max_prefill_tokens_a_step_only_while_nothing_decodes(tiny_loaded):
    loaded = tiny_loaded("llama")
    requests = [(ids_of(100, 3), greedy(200)), (ids_of(100, 4), greedy(5))]
    ref = one_by_one(loaded, requests)
    engine = engine_for(loaded, max_running=2, max_step_tokens=16, max_prefill_tokens=128)
    outcomes: list[list] = [[], []]
    reqs = [
        Request(Prompt.plain(ids), params, on_done=outcomes[i].append)
        for i, (ids, params) in enumerate(requests)
    ]
    engine.submit(reqs[0])
    engine.step()  # nothing decodes: the whole 100-token prompt in one pass
    (seq,) = engine.scheduler.running()
    assert seq.decoding and not seq.prefill.fill
    engine.submit(reqs[1])  # planned and loaded off the step: it joins a later step
    grew = []  # the second prompt's tokens computed per step while the first decodes
    while engine.has_work():
        running = engine.scheduler.running()
        decoding = any(s.request is reqs[0] and s.decoding for s in running)
        late = next((s for s in running if s.request is reqs[1] and s.prefill.fill), None)
        before = late.prefill.fill_start if late is not None else None
        if late is None and not any(s.request is reqs[1] for s in running):
            time.sleep(0.005)  # its loader thread gets the cores while the first one decodes
        engine.step()
        if decoding and late is not None:
            grew.append(late.prefill.fill_start - before)
    # 15-16 tokens a step beside one decode (the step it joins in is not seen from here: it
    # joins the batch inside that step)
    assert max(grew) <= 16 and sum(grew) >= 100 - 16 and len(grew) >= 5
    assert [o[0].result.token_ids for o in outcomes] == ref
    engine.close()


def test_the_loop_thread_batches_requests_submitted_from_several_threads(tiny_loaded):
    loaded = tiny_loaded("gemma3")
    requests = [(ids_of(10 + 9 * i, 60 + i), greedy(10 + i)) for i in range(5)]
    ref = one_by_one(loaded, requests)
    engine = engine_for(loaded, max_running=5)
    engine.start()
    out: dict[int, list[int]] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: out.__setitem__(i, engine.generate(*requests[i]).token_ids)
        )
        for i in range(len(requests))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [out[i] for i in range(len(requests))] == ref
    engine.close()


def test_requests_sharing_a_prefix_submitted_together_compute_it_once(tiny_loaded):
    """The second request waits (deferred, others pass it) while the first computes the shared
    chunks, then loads them: a burst of questions over one document set reuses it."""
    loaded = tiny_loaded("llama")
    shared = ids_of(64, 70)
    requests = [
        (shared + ids_of(6, 71), greedy(5)),
        (ids_of(12, 72), greedy(5)),
        (shared + ids_of(4, 73), greedy(5)),
    ]
    ref = one_by_one(loaded, requests)
    engine = engine_for(loaded, max_running=4, max_step_tokens=24)
    outcomes, steps, peak = run_all(engine, requests)
    assert [o.result.token_ids for o in outcomes] == ref
    # all four shared chunks, computed by request 0 only
    assert outcomes[2].result.cached_tokens == 64
    # 1 overtook the deferred 2
    assert outcomes[1].result.timings.queued_s <= outcomes[2].result.timings.queued_s
    engine.close()
