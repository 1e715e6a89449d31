"""kvfuse's runner on a CUDA GPU against itself on the CPU in float32 (the reference).

Logits and KV in float32 (close to float32 rounding), in bfloat16 and float16 (close as
distributions), greedy answers (identical, or departing only at a near-tie), prefix reuse on the
device (a prefill in two parts, also through a chunk copied to the CPU and back, equals one
prefill), moved keys, the tiny random model of every family, and int8 weights refused on a GPU.
Tolerances and their reasons: ``cuda_helpers``.
"""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import (
    DEVICE,
    HALF,
    assert_fp32_close,
    assert_half_close,
    assert_same_or_near_tie,
    fp32_tol,
    greedy,
    ids_of,
    tie_gap,
)
from kvfuse_helpers import long_text

FAMILIES = [
    "llama",
    "llama3-rope",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
]  # mistral, gemma3: sliding windows of 48
HALVES = [torch.bfloat16, torch.float16]


def text_ids(model, n: int = 256) -> list[int]:
    ids = model.tokenizer.encode_chat(
        [{"role": "user", "content": long_text(3) + "\n\nSummarise the text above."}]
    )
    assert len(ids) >= n
    return ids[:n]


def france(model) -> list[int]:
    return model.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )


def kv_of(cache) -> torch.Tensor:
    return cache.chunk(0, cache.length).kv.float()


def test_the_device_is_the_one_asked_for(device):
    x = torch.arange(4, device=device)
    assert x.device.type == DEVICE.type
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        print(
            f"\n{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"bf16 supported: {torch.cuda.is_bf16_supported()}"
        )


# ------------------------------------------------------------------- tiny models of every family


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_families_match_the_cpu_in_float32(family, tiny_loaded, tiny_on):
    """300 tokens (past every sliding window), all logits and every layer's KV, then 8 greedy steps."""
    cpu, dev = tiny_loaded(family).runner, tiny_on(family).runner
    ids = ids_of(300, 11)
    ref_cache, got_cache = cpu.new_cache(), dev.new_cache()
    ref = cpu.forward(ids, ref_cache, logits="all")
    got = dev.forward(ids, got_cache, logits="all")
    assert got.device.type == DEVICE.type and got_cache.kv.device.type == DEVICE.type
    assert_fp32_close(got, ref, f"{family} logits")
    assert_fp32_close(kv_of(got_cache), kv_of(ref_cache), f"{family} KV")
    ref_tokens, gaps = greedy(cpu, ids, 8, torch.float32)
    got_tokens, _ = greedy(dev, ids, 8, torch.float32)
    assert_same_or_near_tie(
        got_tokens, ref_tokens, gaps, tie_gap(torch.float32, ref), f"{family} greedy"
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", HALVES)
def test_tiny_families_in_half_precision_are_close_to_float32(family, dtype, tiny_loaded, tiny_on):
    ids = ids_of(200, 12)
    ref = tiny_loaded(family).runner.forward(
        ids, tiny_loaded(family).runner.new_cache(), logits="all"
    )
    dev = tiny_on(family, dtype).runner
    got = dev.forward(ids, dev.new_cache(), logits="all")
    assert got.dtype == dtype
    assert_half_close(got, ref, dtype, f"{family} {dtype} logits")


# ------------------------------------------------------------------------- SmolLM2, real weights


def test_smollm2_float32_logits_and_kv_match_the_cpu(smollm2_cpu, smollm2_on):
    ids = text_ids(smollm2_cpu)
    ref_cache = smollm2_cpu.runner.new_cache(dtype=torch.float32)
    ref = smollm2_cpu.runner.forward(ids, ref_cache, logits="all")
    dev = smollm2_on(torch.float32).runner
    got_cache = dev.new_cache(dtype=torch.float32)
    got = dev.forward(ids, got_cache, logits="all")
    assert_fp32_close(got, ref, "smollm2 fp32 logits of every position")
    assert_fp32_close(kv_of(got_cache), kv_of(ref_cache), "smollm2 fp32 KV of every layer")


@pytest.mark.parametrize("dtype", HALVES)
def test_smollm2_half_compute_is_close_to_cpu_float32(dtype, smollm2_cpu, smollm2_on):
    ids = text_ids(smollm2_cpu)
    ref = smollm2_cpu.runner.forward(ids, smollm2_cpu.runner.new_cache(), logits="all")
    dev = smollm2_on(dtype).runner
    # the engine's KV dtype
    got = dev.forward(ids, dev.new_cache(dtype=torch.float16), logits="all")
    assert_half_close(got, ref, dtype, f"smollm2 {dtype} logits of every position")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_greedy_answer_matches_the_cpu(dtype, smollm2_cpu, smollm2_on):
    ids = france(smollm2_cpu)
    ref_tokens, gaps = greedy(smollm2_cpu.runner, ids, 24)
    got_tokens, _ = greedy(smollm2_on(dtype).runner, ids, 24)
    limit = tie_gap(dtype, smollm2_cpu.runner.forward(ids, smollm2_cpu.runner.new_cache()))
    assert_same_or_near_tie(got_tokens, ref_tokens, gaps, limit, f"smollm2 {dtype} greedy")
    # fp32's first step is a near-tie ("The" 0.085 over "L"): bf16 may say "L'Étoile"
    if dtype == torch.float32:
        assert "Paris" in smollm2_cpu.tokenizer.decode(got_tokens)


@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float16),
    ],
    ids=["fp32", "fp32-fp16kv", "bf16-fp16kv"],
)
@pytest.mark.parametrize("via", ["same-cache", "chunk-copy"])
def test_prefix_reuse_on_the_device_equals_a_full_prefill(
    dtype, kv_dtype, via, smollm2_cpu, smollm2_on
):
    """Half the prompt, then the rest (in the same cache, or after the prefix's KV went to the CPU as
    a chunk and back into a new device cache) gives the logits of one prefill of the whole prompt.
    Only the matmuls' shapes differ: float32 throughout is compared to float32 rounding; with fp16
    KV (the engine's default) a K/V value may round to the neighbouring fp16 value, and with bf16
    compute every output does, so those are compared as distributions, at fp16's and bf16's bounds."""
    runner = smollm2_on(dtype).runner
    ids = text_ids(smollm2_cpu, 300)
    k = 256  # a chunk boundary
    full = runner.forward(ids, runner.new_cache(dtype=kv_dtype), logits="all")[k:]
    first = runner.new_cache(dtype=kv_dtype)
    runner.forward(ids[:k], first, logits="none")
    if via == "chunk-copy":
        chunk = first.chunk(0, k)  # on the CPU, as the tiers hold it
        assert chunk.kv.device.type == "cpu" and chunk.kv.dtype == kv_dtype
        first = runner.new_cache(dtype=kv_dtype)
        first.write(0, chunk.kv, chunk.positions)
        assert first.kv.device.type == DEVICE.type
    rest = runner.forward(ids[k:], first, logits="all")
    if kv_dtype == torch.float32:
        assert_fp32_close(rest, full, f"prefix reuse ({via})")
        return
    bounds = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    assert_half_close(rest, full, bounds, f"prefix reuse ({via}, {dtype}, KV {kv_dtype})")
    ref = smollm2_cpu.runner.forward(ids, smollm2_cpu.runner.new_cache(), logits="all")[k:]
    assert_half_close(
        rest, ref, bounds, f"prefix reuse ({via}, {dtype}, KV {kv_dtype}) vs CPU fp32"
    )


# gemma3: local and global layers rotate differently
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_moved_keys_on_the_device_equal_a_prefill_at_the_new_positions(family, tiny_on):
    runner = tiny_on(family).runner
    ids = ids_of(40, 7)
    here, there = runner.new_cache(), runner.new_cache()
    runner.forward(ids, here, positions=torch.arange(0, 40), logits="none")
    runner.forward(ids, there, positions=torch.arange(300, 340), logits="none")
    values = here.kv[:, 1, :, :40].clone()
    runner.move_keys(here, 0, 40, 300)
    assert torch.equal(here.positions[:40].cpu(), torch.arange(300, 340))
    assert torch.equal(here.kv[:, 1, :, :40], values)
    assert_fp32_close(
        here.kv[0, 0, :, :40], there.kv[0, 0, :, :40], f"{family} layer-0 keys moved to 300"
    )
    # and the layers after it, whose inputs saw the same relative positions: the whole KV
    assert_fp32_close(here.kv[:, :, :, :40], there.kv[:, :, :, :40], f"{family} KV moved to 300")


def test_int8_weights_are_refused_on_a_gpu_with_the_fix(tiny_model_dir, device):
    from kvfuse.models import QuantizationUnavailable
    from kvfuse.models.loader import load_folder

    if device.type != "cuda":
        pytest.skip("a dry run on the CPU: int8 weights run there")
    with pytest.raises(QuantizationUnavailable, match="CPU only.*weights: auto"):
        load_folder(tiny_model_dir("llama"), device, torch.float32, "int8")


def test_calibration_measures_take_device_logits(smollm2_cpu, smollm2_on):
    """``kvfuse calibrate`` scores teacher-forced logits on the engine's device (here: the GPU)."""
    from kvfuse.calibration.measure import kl, nll

    ids = text_ids(smollm2_cpu, 64)
    ref = smollm2_cpu.runner.forward(ids, smollm2_cpu.runner.new_cache(), logits="all")[:-1]
    got = smollm2_on(torch.float32).runner.forward(
        ids, smollm2_on(torch.float32).runner.new_cache(), logits="all"
    )[:-1]
    assert got.device.type == DEVICE.type
    assert nll(got, ids[1:]) == pytest.approx(nll(ref, ids[1:]), abs=1e-3)
    assert 0 <= kl(ref.to(got.device), got) < 1e-4


def test_half_bounds_are_tighter_than_what_a_wrong_mask_gives(tiny_loaded):
    """The bounds can fail: a runner whose queries see the keys after them (no causal mask) is caught."""
    from kvfuse.models import attention

    runner = tiny_loaded("llama").runner
    ids = ids_of(64, 13)
    ref = runner.forward(ids, runner.new_cache(), logits="all")
    real = attention._sdpa
    try:
        attention._sdpa = lambda q, k, v, mask, scale, softcap, causal=False: real(
            q, k, v, None, scale, softcap
        )
        wrong = runner.forward(ids, runner.new_cache(), logits="all")
    finally:
        attention._sdpa = real
    for dtype in HALF:
        with pytest.raises(AssertionError):
            assert_half_close(wrong, ref, dtype, "wrong mask")
    assert float((wrong - ref).abs().max()) > fp32_tol(ref)
