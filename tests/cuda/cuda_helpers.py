"""Shared by the CUDA tests: the device under test, models moved onto it, and the tolerances.

The reference is always kvfuse's own runner on the CPU in float32 (what the CPU test suite checks
against transformers). Two kinds of comparison, with the reasons for their bounds:

- **float32 on the device vs float32 on the CPU** (``assert_fp32_close``): the same arithmetic in
  another summation order (cuBLAS / SDPA kernels vs the CPU's), TF32 off (PyTorch's default for
  float32 matmuls; ``torch.backends.cuda.matmul.allow_tf32``). Bound: ``2e-3 + 1e-4 * max|ref|``,
  about 6e-3 on SmolLM2's logits (max |logit| ~38). Two CPU computations of differently shaped
  matmuls already differ by ~1e-4 there (``tests/integration/test_real_models.py``); the bound
  leaves a factor of ~20 for the device's other kernels. A real error (a wrong mask or position,
  stale or misplaced KV, a lost rotation) moves logits by 0.1 to 10.
- **bfloat16 / float16 compute vs float32** (``assert_half_close``): rounding each matmul's output to
  8 (bf16) or 11 (fp16) significant bits changes logits by up to ~2 (bf16) on single positions, so
  they are compared as distributions. Measured with kvfuse's runner on the CPU (SmolLM2, 256 tokens
  of text, every position): bf16 mean KL(fp32 || bf16) 1.0e-3, max 8.7e-3, argmax agreement 98.4%,
  disagreements only where fp32's top-2 gap < 0.10; fp16 mean KL 1.7e-5, max 2.7e-4, agreement
  99.6%, gaps < 0.005. The bounds are ~10x those (``HALF``); a wrong mask gives KL > 0.5.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

#: The device the tests put kvfuse on: ``cuda`` (``KVFUSE_TEST_DEVICE`` may name ``cuda:1``, or
#: ``cpu`` for a dry run of the tests' own logic on a machine without a GPU).
DEVICE = torch.device(os.environ.get("KVFUSE_TEST_DEVICE", "cuda"))


@dataclass(frozen=True)
class HalfBounds:
    mean_kl: float  # mean over positions of KL(fp32 || half)
    max_kl: float  # at any position
    tie_gap: float  # an argmax may differ from fp32's only where fp32's top-2 gap is below this


HALF = {
    torch.bfloat16: HalfBounds(mean_kl=1e-2, max_kl=0.1, tie_gap=0.5),
    torch.float16: HalfBounds(mean_kl=2e-4, max_kl=5e-3, tie_gap=0.05),
}


def fp32_tol(ref: torch.Tensor) -> float:
    return 2e-3 + 1e-4 * float(ref.abs().max())


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    diff, tol = float((got - ref).abs().max()), fp32_tol(ref)
    assert diff <= tol, (
        f"{what}: max abs diff {diff:.3g} > {tol:.3g} (float32 matmul precision: "
        f"{torch.get_float32_matmul_precision()})"
    )


def kl_rows(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) of each row of logits."""
    p = torch.log_softmax(ref.float().cpu(), dim=-1)
    q = torch.log_softmax(got.float().cpu(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1)


def assert_half_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Rows of logits computed in ``dtype`` against float32 ones: see the module docstring."""
    b = HALF[dtype]
    got, ref = (
        got.detach().float().cpu().reshape(-1, ref.shape[-1]),
        ref.detach().float().cpu().reshape(-1, ref.shape[-1]),
    )
    assert torch.isfinite(got).all(), f"{what}: non-finite logits in {dtype}"
    kl = kl_rows(ref, got)
    assert float(kl.mean()) <= b.mean_kl, f"{what}: mean KL {float(kl.mean()):.3g} > {b.mean_kl}"
    assert float(kl.max()) <= b.max_kl, f"{what}: max KL {float(kl.max()):.3g} > {b.max_kl}"
    top = ref.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    differ = ref.argmax(-1) != got.argmax(-1)
    if differ.any():
        worst = float(gap[differ].max())
        assert worst < b.tie_gap, (
            f"{what}: argmax differs where fp32's top-2 gap is {worst:.3g} (>= {b.tie_gap})"
        )


def tie_gap(dtype: torch.dtype, ref_logits: torch.Tensor | None = None) -> float:
    """The top-2 gap below which two greedy runs (``dtype`` vs the reference) may pick differently."""
    if dtype == torch.float32:
        return 2 * fp32_tol(ref_logits) if ref_logits is not None else 2e-2
    return HALF[dtype].tie_gap


def greedy(runner, ids: Sequence[int], steps: int, kv_dtype: torch.dtype = torch.float16):
    """Greedy tokens of ``ids`` (one prefill, then one token per pass, the engine's KV dtype by
    default) and the top-2 logit gap at each step."""
    with torch.inference_mode():
        cache = runner.new_cache(len(ids) + steps, dtype=kv_dtype)
        logits = runner.forward(list(ids), cache)
        tokens, gaps = [], []
        for _ in range(steps):
            top = torch.topk(logits.float(), 2).values
            gaps.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            logits = runner.forward([tokens[-1]], cache)
    return tokens, gaps


def assert_same_or_near_tie(
    got: list[int], ref: list[int], gaps: list[float], max_gap: float, what: str
) -> None:
    """``got`` equals ``ref``, or first departs from it at a step whose reference top-2 gap is a near-tie."""
    if got == ref[: len(got)] and len(got) == len(ref):
        return
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert first < len(gaps) and gaps[first] < max_gap, (
        f"{what}: departs at step {first} ({got[first : first + 3]} vs {ref[first : first + 3]}), where the "
        f"reference's top-2 gap is {gaps[first] if first < len(gaps) else float('nan'):.3g} (>= {max_gap:.3g})"
    )


def on_device(loaded, dtype: torch.dtype, device: torch.device = DEVICE):
    """A ``LoadedModel`` with the same weights, tokenizer and identity, run on ``device`` in ``dtype``."""
    from kvfuse.models import LoadedModel
    from kvfuse.models.loader import load_folder

    runner = load_folder(loaded.folder, device, dtype)
    return LoadedModel(
        loaded.name, loaded.folder, runner, loaded.tokenizer, loaded.fingerprint, loaded.weights
    )


def ids_of(n: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blended_cache(runner, prefix, docs, n_suffix, kv_dtype, context=()):
    """The prefix computed, each document computed alone (behind ``context``) and moved into place,
    suffix slots ready: what the engine hands the blender (as in tests/unit/test_blend.py)."""
    kv = runner.new_cache(64, dtype=kv_dtype)
    runner.forward(list(prefix), kv, logits="none")
    spans = []
    for doc in docs:
        alone = runner.new_cache(dtype=kv_dtype)
        runner.forward(list(context) + list(doc), alone, logits="none")
        start = kv.length
        kv.write(
            start,
            alone.chunk(len(context), len(context) + len(doc)).kv,
            torch.arange(len(context), len(context) + len(doc)),
        )
        runner.move_keys(kv, start, start + len(doc), start)
        spans.append((start, start + len(doc)))
    suffix_start, n = kv.length, kv.length + n_suffix
    kv.reserve(n)
    kv.positions[suffix_start:n] = torch.arange(suffix_start, n)
    kv.kv[:, :, :, suffix_start:n] = 0
    kv.length = n
    return kv, spans, suffix_start
