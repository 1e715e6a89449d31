"""Batching on a CUDA GPU: ``forward_batch`` against ``forward`` of each sequence alone on the same
device (and against the CPU), and the engine's continuous batching against the same requests run
one by one. Tolerances: ``cuda_helpers``."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import (
    DEVICE,
    assert_fp32_close,
    assert_half_close,
    assert_same_or_near_tie,
    greedy,
    ids_of,
    tie_gap,
)
from kvfuse_helpers import long_text

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt, Request
from kvfuse.generation import SamplingParams
from kvfuse.models.transformer import BatchItem
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier


def batched_and_alone(runner, prompts, kv_dtype):
    """One batched pass (the rest of prompt 0 after 30 tokens, prompt 1 whole, a chunk of prompt 2
    without logits), then a batched decode step of all three; and the same, one sequence at a time."""
    alone, batched = (
        [runner.new_cache(400, dtype=kv_dtype) for _ in prompts],
        [runner.new_cache(400, dtype=kv_dtype) for _ in prompts],
    )
    for caches in (alone, batched):
        runner.forward(prompts[0][:30], caches[0], logits="none")
        runner.forward(prompts[2][:30], caches[2], logits="none")
    out = runner.forward_batch(
        [
            BatchItem(prompts[0][30:], batched[0]),
            BatchItem(prompts[1], batched[1]),
            BatchItem(prompts[2][30:60], batched[2], logits=False),
        ]
    )
    ref = [
        runner.forward(prompts[0][30:], alone[0]),
        runner.forward(prompts[1], alone[1]),
        runner.forward(prompts[2][30:60], alone[2], logits="none"),
    ]
    assert out[2] is None and ref[2] is None
    step = runner.forward_batch([BatchItem([5], b) for b in batched])
    ref_step = [runner.forward([5], c) for c in alone]
    return out[:2] + step, ref[:2] + ref_step, batched, alone


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_tiny_batched_step_equals_each_sequence_alone(family, tiny_on):
    runner = tiny_on(family).runner
    prompts = [ids_of(n, seed) for n, seed in ((40, 1), (7, 2), (90, 3))]
    got, ref, batched, alone = batched_and_alone(runner, prompts, torch.float32)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.device.type == DEVICE.type
        assert_fp32_close(g, r, f"{family} item {i}")
    for b, c in zip(batched, alone):
        assert b.length == c.length
        assert_fp32_close(b.kv[:, :, :, : b.length], c.kv[:, :, :, : c.length], f"{family} KV")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_batched_step_equals_each_sequence_alone(dtype, smollm2_cpu, smollm2_on):
    runner = smollm2_on(dtype).runner
    tok = smollm2_cpu.tokenizer
    prompts = [
        tok.encode(long_text(2))[:120],
        tok.encode("Write a short poem about the sea."),
        tok.encode(long_text(3))[40:240],
    ]
    got, ref, _, _ = batched_and_alone(runner, prompts, torch.float16)
    cpu = batched_and_alone(smollm2_cpu.runner, prompts, torch.float16)[1]
    for i, (g, r, c) in enumerate(zip(got, ref, cpu)):
        if dtype == torch.float32:
            assert_fp32_close(g, r, f"item {i}: batched vs alone")
            assert_fp32_close(g, c, f"item {i}: batched vs CPU")
        else:
            assert_half_close(g, r, dtype, f"item {i}: batched vs alone")
            assert_half_close(g, c, dtype, f"item {i}: batched vs CPU fp32")


def test_engine_batches_concurrent_requests_like_one_by_one(smollm2_cpu, smollm2_on):
    """Six requests submitted together (one with a cached shared prefix, chunked prefills within the
    step budget) give each the greedy answer of running it alone, up to near-ties (float32)."""
    model = smollm2_on(torch.float32)
    tok = model.tokenizer
    shared = long_text(2)
    texts = [
        shared + "\n\nWhat is the lighthouse's history?",
        "Write a short poem about the sea.",
        shared + "\n\nWho skates in winter?",
        "List three uses of copper.",
        "Explain what a hash table is.",
        "Give me a recipe for pancakes.",
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    max_tokens = [24, 16, 20, 32, 12, 28]
    refs = [greedy(model.runner, ids, n) for ids, n in zip(prompts, max_tokens)]
    engine = Engine(
        model,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(max_running=8, max_step_tokens=128),
    )
    try:
        # the shared prefix, cached
        engine.generate(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
        done: dict[int, object] = {}
        for i, (ids, n) in enumerate(zip(prompts, max_tokens)):
            engine.submit(
                Request(
                    Prompt.plain(ids),
                    SamplingParams(max_tokens=n, ignore_eos=True),
                    on_done=lambda o, i=i: done.__setitem__(i, o),
                )
            )
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, len(engine.scheduler.running()))
    finally:
        engine.close()
    assert len(done) == len(prompts) and most >= 4  # they ran together
    assert done[2].result.cached_tokens >= 256  # the shared prefix was reused inside the batch
    ref_logits = model.runner.forward(prompts[0], model.runner.new_cache())
    for i, (tokens, gaps) in enumerate(refs):
        r = done[i].result
        assert r.finish_reason == "length" and len(r.token_ids) == max_tokens[i]
        assert_same_or_near_tie(
            r.token_ids, tokens, gaps, tie_gap(torch.float32, ref_logits), f"request {i}"
        )
