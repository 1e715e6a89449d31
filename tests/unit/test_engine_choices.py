"""``n`` choices, logprobs and penalties in the engine, on tiny random models (CPU).

The choices of a request share one prompt prefill (forked KV copies), each samples with its own
seed and constraint, and a forked choice that is queued or preempted recomputes its prompt and
its own tokens. Logprobs (of the output and, with ``prompt_logprobs``, of the prompt) equal a
full forward pass of the same weights over prompt + output, with and without a cache hit.
Tiny fp32 models make near-ties rare, so outputs are compared exactly, as in test_batching.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt, Request, RequestCancelled
from kvfuse.generation import SamplingParams
from kvfuse.models.cache import slot_bytes
from kvfuse.sampling import choice_seed
from kvfuse.sampling import processors as P
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

CH = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded("llama")


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_for(model, cached: bool = True, **kw) -> Engine:
    store = TieredStore(MemoryTier(64 << 20)) if cached else None
    settings = EngineSettings.of(chunk_size=CH, history=False, async_save=False, **kw)
    return Engine(model, store, settings)


def sampled(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **kw)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(engine: Engine, ids, params, **kw):
    """Submit one request and step until it is done: its outcome."""
    done = []
    request = Request(Prompt.plain(ids), params, on_done=done.append, **kw)
    engine.submit(request)
    while not done:
        engine.step()
    return done[0]


def drained(engine: Engine) -> bool:
    engine.flush()
    return engine.scheduler.memory.budget.used == 0 and not engine.has_work()


# ------------------------------------------------------------------------------ one prefill, n choices


def test_n_choices_share_one_prompt_prefill_and_each_samples_with_its_seed(model):
    engine = engine_for(model)
    ids = ids_of(100, 1)
    passes = []  # the token count of each sequence's part of each pass (not the items: KV refs)
    forward_batch = model.runner.forward_batch
    engine.model.runner.forward_batch = lambda items: (
        passes.append([len(i.ids) for i in items]),
        forward_batch(items),
    )[1]
    try:
        result = engine.generate(ids, sampled(6, n=3, seed=5))
    finally:
        del engine.model.runner.forward_batch
    s = engine.stats_snapshot()
    assert (s["requests"], s["prompt_tokens"], s["choices_forked"]) == (1, 100, 2)
    prompt_computed = sum(n for counts in passes for n in counts if n > 1)
    assert prompt_computed == 100  # the prompt once (its chunks), not once per choice
    assert s["step_tokens"] == 100 + 3 * 5  # then one token per choice per step, after the first
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.completion_tokens == 18 and result.prompt_tokens == 100
    assert len({tuple(c.token_ids) for c in result.choices}) == 3
    # choice i is what one request seeded with choice i's seed generates alone
    alone = engine_for(model, cached=False)
    for c in result.choices:
        one = alone.generate(ids, sampled(6, seed=choice_seed(5, c.index)))
        assert c.token_ids == one.token_ids and c.text == one.text
    assert result.text == result.choices[0].text and result.finish_reason == "length"
    again = engine.generate(ids, sampled(6, n=3, seed=5))
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in result.choices]
    assert again.cached_tokens > 0 and drained(engine)
    engine.close()


def test_the_prompt_chunks_are_stored_once(model):
    engine = engine_for(model)
    store = engine.cache.store
    engine.generate(ids_of(100, 2), sampled(4, n=4, seed=1))
    writes = store.stats()["memory"]["entries"]
    assert writes == 100 // CH  # the whole chunks, by the parent alone
    engine.close()


def test_each_choice_gets_its_own_constraint(model):
    made = []

    class Structure:
        def matcher(self):
            made.append(Only({3 + len(made)}))
            return made[-1]

    engine = engine_for(model)
    result = engine.generate(ids_of(40, 3), sampled(3, n=3, seed=2, structure=Structure()))
    assert len(made) == 3
    assert [set(c.token_ids) for c in result.choices] == [{3}, {4}, {5}]
    engine.close()


class Only:
    """A constraint that allows one set of tokens only."""

    def __init__(self, allowed):
        self.allowed = allowed
        self.done = False

    def mask(self, logits):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[list(self.allowed)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def accept(self, token):
        assert token in self.allowed


# ------------------------------------------------------------------------------ queued, preempted, cancelled


def test_forked_choices_queued_or_preempted_recompute_and_lose_nothing(model):
    """A budget too small for every choice's copy: some wait in the queue, and copies that
    outgrow their first allocation preempt others (forked ones among them); each, run again,
    recomputes the prompt and its own tokens, and ends with the one greedy answer."""
    ids, params = ids_of(40, 4), greedy(90, n=3)
    ref = engine_for(model, cached=False).generate(ids, greedy(90)).token_ids
    limit = 2 * 130 * slot_bytes(model.config, torch.float16)
    engine = engine_for(model, kv_memory_bytes=limit, max_running=4)
    victims = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (victims.append(seq.choice), preempt(seq))[1]
    outcome = run(engine, ids, params)
    assert [c.token_ids for c in outcome.result.choices] == [ref] * 3
    s = engine.stats_snapshot()
    assert s["choices_queued"] + s["choices_forked"] == 2 and s["choices_queued"] >= 1
    assert any(v > 0 for v in victims), victims
    assert engine.scheduler.memory.budget.peak <= limit and drained(engine)
    engine.close()


def test_max_running_reserves_places_for_the_choices(model):
    engine = engine_for(model, max_running=3)
    first = Request(Prompt.plain(ids_of(30, 5)), greedy(4, n=3))
    second = Request(Prompt.plain(ids_of(30, 6)), greedy(4))
    engine.submit(first)
    engine.submit(second)
    engine.step()
    running = engine.scheduler.running()
    assert [(s.request, s.choice) for s in running] == [(first, 0), (first, 1), (first, 2)]
    while engine.has_work():
        engine.step()
        assert len(engine.scheduler.running()) <= 3
    assert first.done and second.done
    engine.close()


def test_cancelling_stops_every_choice_and_frees_their_kv(model):
    engine = engine_for(model)
    cancel = threading.Event()
    seen = []

    def on_delta(d):
        seen.append(d.index)
        if len(seen) == 7:
            cancel.set()

    outcome = run(engine, ids_of(50, 7), sampled(30, n=3, seed=3), on_delta=on_delta, cancel=cancel)
    reasons = [c.finish_reason for c in outcome.result.choices]
    assert reasons == ["cancelled"] * 3 and set(seen) == {0, 1, 2}
    assert all(len(c.token_ids) < 30 for c in outcome.result.choices)
    assert drained(engine)
    engine.close()


def test_withdrawing_drops_queued_choices_too(model):
    limit = 150 * slot_bytes(model.config, torch.float16)  # one copy at a time
    engine = engine_for(model, kv_memory_bytes=limit)
    done = []
    request = Request(Prompt.plain(ids_of(40, 8)), greedy(20, n=3), on_done=done.append)
    engine.submit(request)
    while not any(s.choice for s in engine.scheduler.waiting()):
        engine.step()
    engine.withdraw(request)
    while engine.has_work():
        engine.step()
    assert isinstance(done[0].error, RequestCancelled) and len(done) == 1
    s = engine.stats_snapshot()
    assert s["requests"] == 1 and drained(engine)
    engine.close()


def test_an_error_in_one_choice_ends_the_request_and_stops_the_others(model):
    calls = []

    class Failing:
        done = False

        def mask(self, logits):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("this constraint broke")
            return logits

        def accept(self, token):
            pass

    class Structure:
        def matcher(self):
            return Failing()

    engine = engine_for(model)
    outcome = run(engine, ids_of(30, 9), sampled(20, n=3, seed=1, structure=Structure()))
    assert isinstance(outcome.error, RuntimeError) and outcome.result is None
    assert drained(engine)
    engine.close()


# ------------------------------------------------------------------------------ logprobs


def reference_logprobs(model, kv_dtype, ids: list[int]) -> torch.Tensor:
    """Log-softmax of a full forward pass over ``ids`` (every position's logits)."""
    with torch.inference_mode():
        cache = model.runner.new_cache(len(ids), dtype=kv_dtype)
        logits = model.runner.forward(ids, cache, logits="all")
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_reference(model, engine, ids, result, top):
    out = result.choices[0]
    ref = reference_logprobs(model, engine.kv_dtype, ids + out.token_ids)
    n = len(ids)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == n
    entries = result.prompt_logprobs[1:] + out.logprobs
    tokens = ids[1:] + out.token_ids
    assert [e.token for e in entries] == tokens
    got = torch.tensor([e.logprob for e in entries])
    want = ref[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for row, e in enumerate(entries):
        values, order = torch.topk(ref[row], top)
        assert [t for t, _ in e.top] == order.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_logprobs_equal_a_full_forward_pass_with_and_without_a_cache_hit(tiny_loaded, family):
    model = tiny_loaded(family)
    ids = ids_of(3 * CH + 9, 10)
    params = sampled(8, seed=4, logprobs=3, prompt_logprobs=3)
    cold = engine_for(model, cached=False)
    result = cold.generate(ids, params)
    assert result.cached_tokens == 0
    check_against_reference(model, cold, ids, result, 3)
    warm = engine_for(model)
    warm.generate(ids, greedy(1))  # stores the prompt's whole chunks
    hit = warm.generate(ids, params)
    assert hit.cached_tokens == 3 * CH
    check_against_reference(model, warm, ids, hit, 3)
    assert hit.choices[0].token_ids == result.choices[0].token_ids
    warm.close()


def test_prompt_logprobs_leave_the_generation_unchanged(model):
    engine = engine_for(model)
    ids = ids_of(70, 11)
    plain = engine.generate(ids, greedy(10))
    with_lp = engine.generate(ids, greedy(10, logprobs=0, prompt_logprobs=0))
    assert with_lp.token_ids == plain.token_ids and with_lp.cached_tokens > 0
    assert all(e.top == () for e in with_lp.choices[0].logprobs)
    assert plain.choices[0].logprobs is None and plain.prompt_logprobs is None
    engine.close()


def test_deltas_stream_each_choice_with_its_logprobs_after_the_prompts(model):
    engine = engine_for(model)
    ids = ids_of(50, 12)
    deltas = []
    outcome = run(
        engine, ids, sampled(5, n=2, seed=9, logprobs=1, prompt_logprobs=1), on_delta=deltas.append
    )
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == 50
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for c in outcome.result.choices:
        mine = [d for d in deltas[1:] if d.index == c.index]
        assert "".join(d.text for d in mine) == c.text
        assert [e for d in mine for e in d.logprobs] == c.logprobs
    engine.close()


# ------------------------------------------------------------------------------ penalties


def reference_greedy(model, kv_dtype, ids, params: SamplingParams) -> list[int]:
    """Greedy decoding one token at a time with the processors applied by hand, in vLLM's
    order: bias, repetition, frequency / presence."""
    out: list[int] = []
    with torch.inference_mode():
        cache = model.runner.new_cache(len(ids) + params.max_tokens, dtype=kv_dtype)
        logits = model.runner.forward(ids, cache).float()
        for _ in range(params.max_tokens):
            vocab = logits.shape[-1]
            counts = P.token_counts(out, vocab)
            seen = (P.token_counts(ids, vocab) + counts) > 0
            x = P.logit_bias(logits, params.logit_bias)
            x = P.repetition_penalty(x, seen, params.repetition_penalty)
            x = P.frequency_presence(x, counts, params.frequency_penalty, params.presence_penalty)
            out.append(int(torch.argmax(x)))
            logits = model.runner.forward([out[-1]], cache).float()
    return out


PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=-0.5, presence_penalty=0.7, repetition_penalty=1.3),
    dict(logit_bias={7: 5.0, 8: -100.0}, frequency_penalty=2.0),
]


@pytest.mark.parametrize("fields", PENALTIES, ids=lambda f: ",".join(f))
def test_greedy_with_penalties_equals_a_reference_computation(model, fields):
    engine = engine_for(model, cached=False)
    ids = ids_of(30, 13) + ids_of(30, 13)  # a repetitive prompt: the repetition penalty bites
    params = greedy(12, **fields)
    got = engine.generate(ids, params).token_ids
    assert got == reference_greedy(model, engine.kv_dtype, ids, params)
    if "logit_bias" in fields:
        assert 8 not in got


def test_the_penalties_change_what_greedy_decoding_picks(model):
    engine = engine_for(model, cached=False)
    ids = ids_of(30, 14)
    plain = engine.generate(ids, greedy(16)).token_ids
    penalised = engine.generate(ids, greedy(16, frequency_penalty=2.0, presence_penalty=2.0))
    assert len(set(penalised.token_ids)) > len(set(plain))
    assert engine.generate(ids, greedy(4, logit_bias={42: 100.0})).token_ids == [42] * 4
