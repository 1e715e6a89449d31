"""The per-row kernels (``kernels/pointwise.cpp`` through ``models.pointwise``) against PyTorch's
expressions: RMSNorm (rows, heads of a strided q/k view), the residual add + norm, silu and
gelu-tanh gating, RoPE with full and partial rotation; and the fallbacks (no kernel, bf16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvfuse.models import pointwise, rope


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ref_norm(x, w, eps):
    return F.rms_norm(x.double(), w.shape, w.double(), eps).float()


@pytest.mark.parametrize("n,d", [(1, 576), (7, 64), (16, 896), (3, 5)])
def test_rms_norm_rows(ops, n, d):
    x, w = torch.randn(n, d, generator=_g(n)) * 3, torch.randn(d, generator=_g(d))
    torch.testing.assert_close(
        pointwise.rms_norm(x, w, 1e-6, ops), _ref_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5
    )


def test_rms_norm_of_heads_in_a_strided_view(ops):
    """q/k norms run on views of the fused qkv product: rows of head_dim, not contiguous overall."""
    qkv = torch.randn(5, 12 * 16, generator=_g(1))
    q = qkv[:, : 8 * 16].view(5, 8, 16)
    assert not q.is_contiguous()
    w = torch.randn(16, generator=_g(2))
    got = pointwise.rms_norm(q, w, 1e-5, ops)
    torch.testing.assert_close(got, _ref_norm(q, w, 1e-5), atol=1e-5, rtol=1e-5)
    assert got.shape == (5, 8, 16)


def test_add_rms_norm(ops):
    h, d, w = (
        torch.randn(4, 96, generator=_g(3)),
        torch.randn(4, 96, generator=_g(4)),
        torch.randn(96, generator=_g(5)),
    )
    s, y = pointwise.add_rms_norm(h, d, w, 1e-6, ops)
    torch.testing.assert_close(s, h + d)
    torch.testing.assert_close(y, _ref_norm(h + d, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation(ops, act):
    gate, up = torch.randn(6, 300, generator=_g(6)) * 4, torch.randn(6, 300, generator=_g(7))
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(
        pointwise.gated_act(gate, up, act, ops), a * up, atol=1e-5, rtol=1e-5
    )
    both = torch.cat([gate, up], dim=1)  # column ranges of one product
    torch.testing.assert_close(
        pointwise.gated_act(both[:, :300], both[:, 300:], act, ops), a * up, atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary embeddings
def test_rope_matches_the_tensor_expression(ops, rot):
    x = torch.randn(5, 3, 64, generator=_g(8))
    freqs = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    cos, sin = rope.cos_sin(freqs, torch.tensor([0, 3, 7, 100, 4095]), torch.float32)
    torch.testing.assert_close(
        pointwise.rope(x, cos, sin, ops), rope.apply(x, cos, sin), atol=1e-6, rtol=1e-6
    )
    view = torch.randn(5, 6 * 64, generator=_g(9))[:, 64:].view(5, 5, 64)[:, 1:4]  # strided heads
    torch.testing.assert_close(
        pointwise.rope(view, cos, sin, ops), rope.apply(view, cos, sin), atol=1e-6, rtol=1e-6
    )


def test_without_the_kernel_or_in_bf16_pytorch_computes_the_same(ops):
    x, w = torch.randn(3, 32, generator=_g(10)), torch.randn(32, generator=_g(11))
    torch.testing.assert_close(
        pointwise.rms_norm(x, w, 1e-6, None),
        pointwise.rms_norm(x, w, 1e-6, ops),
        atol=1e-5,
        rtol=1e-5,
    )
    y = pointwise.rms_norm(x.bfloat16(), w, 1e-6, ops)  # not float32: PyTorch's path, bf16 out
    assert y.dtype == torch.bfloat16
    g, u = torch.randn(2, 8), torch.randn(2, 8)
    torch.testing.assert_close(
        pointwise.gated_act(g, u, "silu", None), pointwise.gated_act(g, u, "silu", ops)
    )


def test_bad_shapes_are_errors(ops):
    with pytest.raises(RuntimeError, match="norm weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.gated_act(torch.randn(2, 8), torch.randn(2, 7), 0)
    with pytest.raises(RuntimeError, match="exceed"):
        ops.rope(torch.randn(2, 1, 8), torch.randn(2, 5), torch.randn(2, 5))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_fused_layer_halves_compute_the_step_by_step_path(ops, tiny_model_dir, family, weights):
    """``kernels/layer.cpp`` (one call per half layer) against the same kernels called one by
    one from Python: a prefill and a batched decode step give the same logits (q/k/v bias, q/k
    norms, sandwich norms and gelu included across the families)."""
    from kvfuse.models.loader import load_folder
    from kvfuse.models.transformer import BatchItem

    runner = load_folder(tiny_model_dir(family), weights=weights)
    assert runner.backend.fused
    ids = torch.randint(3, 500, (29,), generator=_g(4)).tolist()
    outs = []
    for fused in (True, False):
        runner.backend = dataclasses.replace(runner.backend, fused=fused)
        caches = [runner.new_cache(64), runner.new_cache(64)]
        first = runner.forward(ids, caches[0], logits="all")
        runner.forward(ids[:11], caches[1], logits="none")
        outs.append(
            [
                first,
                *runner.forward_batch([BatchItem([7], caches[0]), BatchItem(ids[11:], caches[1])]),
            ]
        )
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "family,weights,kv_dtype",
    [
        ("llama", "auto", torch.float16),
        ("llama", "int8", torch.float32),
        ("qwen2", "auto", torch.float32),
        ("qwen3", "int8", torch.float16),
        ("gemma3", "auto", torch.float16),
        ("gemma3", "int8", torch.bfloat16),
    ],
)
def test_whole_stack_in_one_call_is_the_layer_loop_bit_for_bit(
    ops, tiny_model_dir, family, weights, kv_dtype, monkeypatch
):
    """``kernels/stack.cpp`` (every layer of a decode step in one call) against the runner's
    Python loop over the same kernels: decode steps of three sequences (different lengths, one
    without logits), then short appends of several tokens each, give identical logits and
    identical caches."""
    from kvfuse.models.loader import load_folder
    from kvfuse.models.transformer import BatchItem

    runner = load_folder(tiny_model_dir(family), weights=weights)
    assert (
        runner.backend.stack is not None and len(runner.backend.stack) == runner.config.num_layers
    )
    calls = []
    real = ops.run_stack
    monkeypatch.setattr(ops, "run_stack", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(3, 500, (40,), generator=_g(5)).tolist()
    results = []
    full = runner.backend
    for stacked in (True, False):
        runner.backend = full if stacked else dataclasses.replace(full, stack=None)
        caches = [runner.new_cache(80, dtype=kv_dtype) for _ in range(3)]
        for cache, n in zip(caches, (40, 23, 9)):
            runner.forward(ids[:n], cache, logits="none")
        steps = [
            runner.forward_batch(
                [
                    BatchItem([5 + t], caches[0]),
                    BatchItem([9 + t], caches[1], logits=False),
                    BatchItem([11 + t], caches[2]),
                ]
            )
            for t in range(3)
        ]
        steps.append(
            runner.forward_batch(
                [
                    BatchItem(ids[:5], caches[0]),
                    BatchItem(ids[5:16], caches[1]),
                    BatchItem(ids[16:19], caches[2], logits=False),
                ]
            )
        )
        results.append((steps, [c.kv[:, :, :, : c.length].clone() for c in caches]))
    assert len(calls) == 4  # every step above took the one-call path when the stack was there
    (steps_a, kv_a), (steps_b, kv_b) = results
    for out_a, out_b in zip(steps_a, steps_b):
        assert [o is None for o in out_a] == [o is None for o in out_b]
        for a, b in zip(out_a, out_b):
            if a is not None:
                assert torch.equal(a, b)
    for a, b in zip(kv_a, kv_b):
        assert torch.equal(a, b)


def test_a_prefill_chunk_in_the_step_keeps_the_layer_loop(ops, tiny_model_dir, monkeypatch):
    """A step with a sequence of more new tokens than the attention kernel takes (a prefill chunk)
    cannot run as one stack call: it runs layer by layer and still gives every sequence its logits."""
    from kvfuse.models.loader import load_folder
    from kvfuse.models.transformer import BatchItem

    runner = load_folder(tiny_model_dir("llama"), weights="auto")
    monkeypatch.setattr(
        ops, "run_stack", lambda *a: pytest.fail("run_stack used for a prefill chunk")
    )
    ids = torch.randint(3, 500, (40,), generator=_g(6)).tolist()
    a, b = runner.new_cache(64), runner.new_cache(64)
    runner.forward(ids[:10], a, logits="none")
    out = runner.forward_batch([BatchItem([3], a), BatchItem(ids, b)])
    ref = runner.forward(ids, runner.new_cache(64))
    assert out[0] is not None and out[0].shape == ref.shape
    torch.testing.assert_close(out[1], ref, atol=1e-4, rtol=1e-4)
