"""The blocked projection kernel (``kernels/linear.cpp``, ``packed.BlockedWeight``) against
``F.linear``: float32 and int8 weights, every row count a step or a prefill uses (the one-row
path, register tiles of 1-6 rows, row chunks), widths that are not a multiple of the 16-channel
block, biases, inputs that are not contiguous or not float32, and clear errors for a mismatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfuse.models import packed
from kvfuse.models.packed import BlockedWeight


@pytest.fixture(scope="module", autouse=True)
def ext(cpu_kernels):
    return cpu_kernels


def _data(out: int, inp: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(out, inp, generator=g) / inp**0.5,
        torch.randn(rows, inp, generator=g),
        torch.randn(out, generator=g),
    )


# (out, in): one partial block, exact blocks, a partial last block, k not a multiple of the unroll
# or of the k chunk (128 / 512), and SmolLM2's attention output shape.
SHAPES = [(5, 3), (16, 8), (17, 5), (40, 130), (64, 515), (576, 576)]
ROWS = [1, 2, 5, 6, 7, 13, 33, 49, 100]


@pytest.mark.parametrize("out,inp", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_float32_blocks_compute_f_linear(out, inp, rows):
    w, x, b = _data(out, inp, rows, seed=out * 1000 + rows)
    bw = BlockedWeight(w)
    for bias in (None, b):
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
        torch.testing.assert_close(bw.linear(x, bias), ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(bw.dequantize(), w)


@pytest.mark.parametrize("out,inp", SHAPES)
@pytest.mark.parametrize("rows", [1, 6, 13, 100])
def test_int8_blocks_compute_the_dequantized_product(out, inp, rows):
    """int8 rounds the weights only: the product is that of the dequantized weight with float32
    inputs; the weight is per-channel symmetric int8 (error at most half a step)."""
    w, x, b = _data(out, inp, rows, seed=7 + rows)
    bw = BlockedWeight(w, "int8")
    wq = bw.dequantize()
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((wq - w).abs() <= step / 2 + 1e-7).all()
    ref = F.linear(x.double(), wq.double(), b.double()).float()
    torch.testing.assert_close(bw.linear(x, b), ref, atol=3e-5, rtol=3e-5)
    assert bw.nbytes == out * inp + 4 * out and BlockedWeight(w).nbytes == 4 * out * inp


def test_inputs_of_any_layout_and_dtype():
    w, x, b = _data(48, 64, 10, seed=3)
    bw = BlockedWeight(w)
    wide = torch.randn(10, 128)
    torch.testing.assert_close(
        bw.linear(wide[:, ::2]), F.linear(wide[:, ::2], w), atol=2e-5, rtol=2e-5
    )
    batched = torch.randn(2, 5, 64)  # leading dimensions are kept
    torch.testing.assert_close(bw.linear(batched, b), F.linear(batched, w, b), atol=2e-5, rtol=2e-5)
    y = bw.linear(x.bfloat16(), b.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (10, 48)
    torch.testing.assert_close(
        y.float(), F.linear(x.bfloat16().float(), w, b.bfloat16().float()), atol=0.05, rtol=0.02
    )
    assert bw.linear(torch.empty(0, 64)).shape == (0, 48)


def test_mismatches_are_clear_errors(ext):
    w, x, _ = _data(20, 8, 3, seed=1)
    bw = BlockedWeight(w)
    with pytest.raises(RuntimeError, match="x has 7 features, the weight expects 8"):
        bw.linear(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="bias"):
        bw.linear(x, torch.randn(19))
    with pytest.raises(RuntimeError, match="scales"):
        ext.blocked_linear(x, BlockedWeight(w, "int8").blocks, 20)
    with pytest.raises(ValueError, match="2-d"):
        BlockedWeight(torch.randn(4))
    with pytest.raises(ValueError, match="float32 or int8"):
        BlockedWeight(w, "int4")


def test_the_threads_split_the_blocks_without_changing_the_result():
    """Each output channel is computed by one thread in a fixed order: the result does not depend
    on the number of threads."""
    w, x, _ = _data(999, 96, 9, seed=11)
    bw = BlockedWeight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bw.linear(x)
        torch.set_num_threads(2)
        assert torch.equal(bw.linear(x), one)
    finally:
        torch.set_num_threads(before)


def test_pack_weights_uses_blocks_where_the_kernels_build(tiny_model_dir):
    from kvfuse.models.loader import load_folder
    from kvfuse.models.quant import identity_of

    fp32, int8 = (
        load_folder(tiny_model_dir("qwen2")),
        load_folder(tiny_model_dir("qwen2"), weights="int8"),
    )
    assert packed.available(torch.device("cpu"), torch.float32)
    for lw in fp32.weights.layers:
        assert all(
            isinstance(getattr(lw, f), BlockedWeight) and getattr(lw, f).fmt == "float32"
            for f in ("wqkv", "wo", "w_gate", "w_up", "w_down")
        )
    assert isinstance(fp32.weights.embed, torch.Tensor) and fp32.weights.lm_head.fmt == "float32"
    assert isinstance(int8.weights.lm_head, BlockedWeight) and int8.weights.lm_head.fmt == "int8"
    assert (
        identity_of(fp32.weights) is None and identity_of(int8.weights) == "int8-rowwise-f32act-v1"
    )


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_long_pass_goes_to_the_gemm_with_the_same_product(monkeypatch, fmt):
    """From ``GEMM_ROWS`` rows the product runs as ``F.linear`` on the unpacked weight (a prefill
    pass); it is the blocked kernel's product up to float rounding, biases included."""
    w, x, b = _data(40, 130, 24, seed=7)
    bw = BlockedWeight(w, fmt)
    kernel = bw.linear(x, b)
    monkeypatch.setattr(packed, "GEMM_ROWS", 24)
    calls = []
    real = F.linear
    monkeypatch.setattr(packed.F, "linear", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(bw.linear(x, b), kernel, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(bw.linear(x[:23], b), kernel[:23], atol=0, rtol=0)
    assert calls == [1]  # 24 rows took the GEMM, 23 the kernel
