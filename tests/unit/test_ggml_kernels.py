"""The GGUF weight kernels (``kernels/ggml.cpp`` through ``models.ggml.GGMLWeight``) against gguf's
reference dequantization and ``F.linear`` on the dequantized weight: every type the kernels read,
one row (decode), a few rows, many rows (the register-tiled path), the long-product path, several
parts with a bias, embedding lookups; on every instruction set this CPU runs, and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from kvfuse.models import ggml, packed

TYPES = list(ggml.TYPES)
_K_TYPES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


@pytest.fixture(scope="module")
def ops(cpu_kernels):
    return cpu_kernels


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, ops):
    """Each instruction set of the kernels this CPU runs (the other is skipped)."""
    features = ops.cpu_features()
    if request.param == "avx512" and not all(
        features[f] for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")
    ):
        pytest.skip("this CPU has no AVX-512")
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa("auto")


def raw(type_name: str, rows: int, cols: int, seed: int = 0) -> ggml.RawTensor:
    """A (rows, cols) tensor of ``type_name``: floats quantized by gguf where it can, else random
    blocks with sane fp16 scales (gguf has no K-type quantizer)."""
    rng = np.random.default_rng(seed)
    t = GGMLQuantizationType[type_name]
    if type_name in _K_TYPES:
        size, scale_at = _K_TYPES[type_name]
        blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for off in scale_at:
            scale = rng.uniform(0.001, 0.02, size=(rows, cols // 256)).astype(np.float16)
            blocks[..., off : off + 2] = scale.view(np.uint8).reshape(rows, cols // 256, 2)
        data = blocks.reshape(rows, -1)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        data = np.ascontiguousarray(quants.quantize(w, t)).view(np.uint8).reshape(rows, -1)
    return ggml.RawTensor(torch.from_numpy(data.copy()), int(t.value), (rows, cols))


def reference(t: ggml.RawTensor) -> torch.Tensor:
    return ggml.dequantized(t)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf(ops, isa, type_name):
    t = raw(type_name, 19, 512, seed=1)
    got = ops.ggml_dequantize(t.data, t.type, 512)
    torch.testing.assert_close(got, reference(t), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 13, 40])
def test_product_equals_linear_of_the_dequantized_weight(ops, isa, type_name, n):
    t = raw(type_name, 37, 768, seed=n)
    w = ggml.GGMLWeight([t], ops)
    x = torch.randn(n, 768, generator=torch.Generator().manual_seed(n))
    want = F.linear(x.double(), reference(t).double()).float()
    torch.testing.assert_close(w.linear(x), want, rtol=1e-4, atol=1e-3)


def test_parts_of_other_types_with_a_bias_and_leading_dims(ops, isa):
    """A fused q/k/v whose parts a file quantizes differently: one product, stacked outputs (the
    threads' shares of the output channels begin and end inside parts)."""
    parts = [raw("Q4_K", 37, 512, 1), raw("Q4_K", 19, 512, 2), raw("Q6_K", 11, 512, 3)]
    w = ggml.GGMLWeight(parts, ops)
    assert w.shape == (67, 512) and w.fmt == "q4_k+q6_k"
    dense = torch.cat([reference(p) for p in parts])
    bias = torch.randn(67)
    for n in (1, 9):
        x = torch.randn(2, n, 512)
        torch.testing.assert_close(
            w.linear(x, bias), F.linear(x, dense, bias), rtol=1e-4, atol=1e-3
        )
    torch.testing.assert_close(w.dequantize(), dense)
    assert w.nbytes == sum(p.data.numel() for p in parts)


def test_long_products_take_the_gemm_in_slices(ops, monkeypatch):
    t = raw("Q8_0", 50, 256, 4)
    w = ggml.GGMLWeight([t], ops)
    monkeypatch.setattr(packed, "GEMM_ROWS", 8)
    monkeypatch.setattr(ggml, "GEMM_SLICE", 16 * 256)  # 16 output channels per slice: 4 slices
    x = torch.randn(12, 256)
    torch.testing.assert_close(w.linear(x), F.linear(x, reference(t)), rtol=1e-4, atol=1e-4)


def test_rows_are_an_embedding_lookup(ops):
    t = raw("Q8_0", 30, 128, 5)
    w = ggml.GGMLWeight([t], ops)
    ids = torch.tensor([[3, 0], [29, 3]])
    torch.testing.assert_close(w.rows(ids), F.embedding(ids, reference(t)))
    with pytest.raises(RuntimeError, match="out of range"):
        w.rows(torch.tensor([30]))


def test_isas_agree(ops):
    """Where the CPU has AVX-512, both tables compute the same products up to rounding."""
    if not ops.cpu_features()["avx512f"]:
        pytest.skip("this CPU has no AVX-512")
    t = raw("Q4_K", 40, 512, 6)
    x = torch.randn(7, 512)
    try:
        ops.set_isa("avx2")
        a = ops.ggml_linear(x, [t.data], [t.type])
        ops.set_isa("avx512")
        b = ops.ggml_linear(x, [t.data], [t.type])
    finally:
        ops.set_isa("auto")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_refusals(ops):
    t = raw("Q4_0", 4, 64)
    with pytest.raises(RuntimeError, match="row bytes"):
        ops.ggml_linear(torch.randn(1, 96), [t.data], [t.type])
    with pytest.raises(RuntimeError, match="not one kvfuse's kernels read"):
        ops.ggml_linear(torch.randn(1, 64), [t.data], [10])  # Q2_K
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        ops.set_isa("sse2")
    assert not ggml.RawTensor(t.data, t.type, (4, 48)).readable()  # not whole blocks
    assert not ggml.RawTensor(t.data, 10, (4, 64)).readable()  # Q2_K


def test_projection_falls_back_to_float32_for_types_the_kernels_do_not_read(ops):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    t = ggml.RawTensor(
        torch.from_numpy(
            np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.Q8_0)).view(np.uint8)
        ),
        ggml.TYPES["Q8_0"],
        (8, 256),
    )
    assert isinstance(ggml.projection([t], ops), ggml.GGMLWeight)
    assert isinstance(ggml.projection([t], None), torch.Tensor)  # no kernels: float32
    mixed = ggml.projection([t, torch.from_numpy(w)], ops)  # a float32 part: all float32
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (16, 256)
