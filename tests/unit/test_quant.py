"""int8 weights (``kvfuse.models.quant``): the packed linear against fp32 within its rounding bound,
per-token scales, split activations, weight packing of a loaded model, the fingerprint, the
engine's namespace."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from kvfuse_helpers import write_word_tokenizer

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.models import QuantizationUnavailable, load_model
from kvfuse.models.loader import fingerprint, load_folder, read_config, sha256_file, weight_files
from kvfuse.models.quant import (
    WEIGHT_FORMATS,
    Int8Weight,
    check_int8_supported,
    default_reduce_range,
    linear,
    quantize_weights,
    weight_bytes,
)
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier


def _w(out: int = 96, inp: int = 160, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * 0.05


def _x(rows: int, inp: int = 160, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, inp, generator=torch.Generator().manual_seed(seed))


def _weight_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst case of rounding each row of ``w`` to 127 steps of its abs-max: half a step per weight."""
    step = w.abs().amax(dim=1) / 127
    return x.abs().sum(dim=-1, keepdim=True) * step / 2


def _activation_bound(x: torch.Tensor, wq: torch.Tensor, levels: int) -> torch.Tensor:
    """Worst case of rounding one row of ``x`` to ``levels`` steps of its range: half a step per value."""
    lo, hi = (
        x.min(dim=-1, keepdim=True).values.clamp(max=0),
        x.max(dim=-1, keepdim=True).values.clamp(min=0),
    )
    return (hi - lo) / levels / 2 * wq.abs().sum(dim=1)


LEVELS = 127 if default_reduce_range() else 255


@pytest.mark.parametrize("rows", [1, 7])
def test_the_packed_linear_is_fp32_within_the_rounding_bound(rows):
    w, x = _w(), _x(rows)
    for split in (False, True):
        packed = Int8Weight(w, split=split)
        wq = packed.dequantize()
        assert (wq - w).abs().max() <= (w.abs().amax(dim=1, keepdim=True) / 127 / 2 + 1e-7).max()
        y = packed.linear(x)
        assert y.shape == (rows, 96) and y.dtype == torch.float32
        exact = x @ w.T
        bound = _weight_bound(x, w) + _activation_bound(x, wq, LEVELS) + 1e-4
        assert ((y - exact).abs() <= bound).all(), split
        # the bound is not vacuous: the error is a real fraction of it, and far below the outputs
        assert (y - exact).abs().max() < 0.05 * exact.abs().max()


def test_split_activations_are_close_to_a_weight_only_product():
    """One 8-bit rounding of the input costs ~1/255 of its range per value; the split
    (rounding + its error as a second row) leaves only the weights' rounding."""
    w, x = _w(), _x(5)
    x[2, 7] = 40.0  # an outlier channel stretches the 8-bit grid
    for rows in (x[2:3], x):
        once = Int8Weight(w, split=False)
        split = Int8Weight(w, split=True)
        weight_only = rows @ once.dequantize().T
        err_once = (once.linear(rows) - weight_only).abs().max()
        err_split = (split.linear(rows) - weight_only).abs().max()
        assert err_split * 30 < err_once, (err_split, err_once)
        assert err_split < 1e-3 * weight_only.abs().max()


def test_per_token_scales_keep_an_outlier_token_from_coarsening_the_others():
    w = _w()
    x = _x(6)
    x[0] *= 1000.0  # a token with massive activations (an attention sink, say)
    for split, shrink in ((False, 1), (True, 30)):
        packed = Int8Weight(w, split=split)
        wq = packed.dequantize()
        err = (packed.linear(x) - x @ wq.T).abs()
        # each row is rounded on a grid over its own [-abs-max, abs-max], not over the outlier's
        own = 2 * x.abs().amax(dim=1, keepdim=True)
        bound = own / LEVELS / 2 * wq.abs().sum(dim=1) / shrink + 1e-4
        assert (err <= bound).all(), split
        shared = (x.max() - x.min()) / LEVELS / 2 * wq.abs().sum(dim=1)
        assert (bound[1:] * 100 < shared).all()  # what one grid for all rows would allow


def test_bias_shapes_and_dtypes():
    w, b = _w(), torch.randn(96)
    packed = Int8Weight(w)
    x = _x(12).reshape(3, 4, 160)
    y = linear(x, packed, b)
    assert y.shape == (3, 4, 96)
    assert (y - (x @ w.T + b)).abs().max() < 0.02
    # a non-contiguous input (a slice of a wider tensor), and bf16 in -> bf16 out
    wide = _x(1, 320)
    assert torch.allclose(packed.linear(wide[:, ::2]), packed.linear(wide[:, ::2].contiguous()))
    yb = packed.linear(_x(2).bfloat16(), b.bfloat16())
    assert yb.dtype == torch.bfloat16
    assert (yb.float() - (_x(2) @ w.T + b)).abs().max() < 0.1
    # plain tensors still go through F.linear
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_a_one_signed_input_falls_back_to_one_rounding():
    """All-positive inputs leave no room in the grid for the error row; the result is still
    within the one-rounding bound."""
    w, x = _w(), _x(1).abs() + 0.1
    packed = Int8Weight(w)
    y = packed.linear(x)
    bound = _weight_bound(x, w) + _activation_bound(x, packed.dequantize(), LEVELS) + 1e-4
    assert ((y - x @ w.T).abs() <= bound).all()


def test_full_range_products_do_not_saturate():
    """The largest 8-bit inputs times the largest int8 weights: 16-bit pair sums would saturate
    (255 * 127 * 2 > 32767); ``default_reduce_range`` must pick 7-bit inputs where they would."""
    packed = Int8Weight(torch.ones(8, 256))
    y = packed.linear(torch.ones(1, 256))
    assert torch.allclose(y, torch.full((1, 8), 256.0), rtol=1e-2)
    y = packed.linear(-torch.ones(1, 256))
    assert torch.allclose(y, torch.full((1, 8), -256.0), rtol=1e-2)


def test_int8_is_cpu_only_with_a_clear_error():
    with pytest.raises(QuantizationUnavailable, match="CPU only"):
        check_int8_supported("cuda")
    with pytest.raises(QuantizationUnavailable, match="CPU only"):
        check_int8_supported(torch.device("cuda", 1))
    with pytest.raises(ValueError, match="2-d"):
        Int8Weight(torch.ones(3))


def test_quantize_weights_packs_the_projections_and_keeps_the_rest(tiny_model_dir, monkeypatch):
    folder = tiny_model_dir("qwen2")  # q/k/v bias, tied embeddings
    # plain float32 tensors, not oneDNN packs (see models.packed)
    monkeypatch.setenv("KVFUSE_KERNELS", "off")
    runner = load_folder(folder)
    w = runner.weights
    before = {name: t.clone() for name, t in [("embed", w.embed), ("wqkv", w.layers[0].wqkv)]}
    q = quantize_weights(w)
    assert quantize_weights(w, "auto") is w
    with pytest.raises(ValueError, match="auto, fp32, int8"):
        quantize_weights(w, "int4")
    # the input is untouched; the projections are packed; lookups, norms and biases stay tensors
    assert torch.equal(w.embed, before["embed"]) and torch.equal(w.layers[0].wqkv, before["wqkv"])
    assert w.lm_head is w.embed and isinstance(w.layers[0].wqkv, torch.Tensor)
    assert q.embed is w.embed and isinstance(q.lm_head, Int8Weight)
    for lw, orig in zip(q.layers, w.layers):
        for f in ("wqkv", "wo", "w_gate", "w_up", "w_down"):
            assert isinstance(getattr(lw, f), Int8Weight), f
        assert (
            lw.bqkv is orig.bqkv and lw.attn_norm is orig.attn_norm and lw.mlp_norm is orig.mlp_norm
        )
    assert quantize_weights(q).lm_head is q.lm_head  # packing twice is a no-op
    # bytes a decode step reads: about a quarter
    full, small = weight_bytes(w), weight_bytes(q)
    assert 0.25 < (small["layers"] + small["lm_head"]) / (full["layers"] + full["lm_head"]) < 0.3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_int8_logits_agree_with_fp32_on_every_family(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    fp32, int8 = load_folder(folder), load_folder(folder, weights="int8")
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = fp32.forward(ids, fp32.new_cache(64), logits="all")
    got = int8.forward(ids, int8.new_cache(64), logits="all")
    cos = F.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.995 and cos.mean() > 0.999, cos  # random weights: ~0.8% rounding each
    # decoding one token at a time (one-row products) agrees too
    cache = int8.new_cache(64)
    int8.forward(ids[:-1], cache)
    assert F.cosine_similarity(int8.forward(ids[-1:], cache), ref[-1], dim=0) > 0.995


def test_load_folder_rejects_an_unknown_format(tiny_model_dir):
    with pytest.raises(ValueError, match="auto, fp32, int8"):
        load_folder(tiny_model_dir("llama"), weights="fp8")
    with pytest.raises(QuantizationUnavailable, match="CPU only"):
        load_folder(tiny_model_dir("llama"), device="cuda", weights="int8")


def test_the_fingerprint_names_the_weight_format(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    write_word_tokenizer(folder, 512)
    _, config = read_config(folder)
    digests = [sha256_file(f) for f in weight_files(folder)]
    # as before this setting
    assert fingerprint(config, digests) == fingerprint(config, digests, "auto")
    assert fingerprint(config, digests, "int8") != fingerprint(config, digests)
    fp32 = load_model(folder, device="cpu")
    int8 = load_model(folder, device="auto", weights="int8")  # auto -> CPU for int8
    assert (fp32.weights, int8.weights) == ("auto", "int8")
    assert int8.runner.device.type == "cpu"
    assert int8.fingerprint == fingerprint(config, digests, "int8") != fp32.fingerprint
    with pytest.raises(ValueError, match="auto, fp32, int8"):
        load_model(folder, weights="float8")


def test_an_int8_engine_never_reads_full_precision_entries(tiny_model_dir, tiny_loaded):
    """Both engines on one store: the int8 model's KV lives in its own namespace."""
    fp32 = tiny_loaded("llama")
    int8 = dataclasses.replace(
        fp32,
        runner=load_folder(tiny_model_dir("llama"), weights="int8"),
        weights="int8",
        fingerprint=fingerprint(
            fp32.config, [sha256_file(f) for f in weight_files(tiny_model_dir("llama"))], "int8"
        ),
    )
    store = TieredStore(MemoryTier(64 << 20))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    writer = Engine(fp32, store, EngineSettings.of(chunk_size=32, history=False, async_save=False))
    reader = Engine(int8, store, EngineSettings.of(chunk_size=32, history=False, async_save=False))
    try:
        writer.generate(ids, params)
        assert writer.generate(ids, params).cached_tokens == 96  # fp32 reuses its own entries
        assert reader.namespace() != writer.namespace()
        assert reader.generate(ids, params).cached_tokens == 0
        assert reader.generate(ids, params).cached_tokens == 96  # and int8 its own
    finally:
        writer.close()
        reader.close()
        store.close()


def test_the_config_and_the_loader_list_the_same_formats():
    from kvfuse import config

    assert config.WEIGHT_FORMATS == WEIGHT_FORMATS


def test_the_weights_flag_reaches_the_config(monkeypatch):
    from kvfuse.cli import build_parser, config_from_args

    monkeypatch.delenv("KVFUSE_WEIGHTS", raising=False)
    monkeypatch.delenv("KVFUSE_CONFIG", raising=False)
    args = build_parser().parse_args(["generate", "--weights", "int8", "hello"])
    assert config_from_args(args).weights == "int8"
    assert config_from_args(build_parser().parse_args(["serve"])).weights == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--weights", "int4"])
