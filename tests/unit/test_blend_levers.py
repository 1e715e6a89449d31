"""The issue-41 levers: APE's corrected attention (exact at T = S = 1, its merge by log-sum-exp),
layer-split recompute (exact at split 0, nothing at the last layer), and the half-and-half
query-aware selection, on pure tensors and tiny random models of the real families."""

from __future__ import annotations

import math

import pytest
import torch
from test_blend import DOCS, PREFIX, SUFFIX, blended_cache, full_logits

from kvfuse.blend import BlendOptions, blend_prefill
from kvfuse.blend import levers as lv
from kvfuse.blend import select as sel
from kvfuse.models.attention import attend


@pytest.mark.parametrize(
    "first,second,k,expected",
    [
        ([9, 8, 0, 0, 0], [0, 0, 5, 4, 3], 4, [0, 1, 2, 3]),  # 2 by attention, 2 by deviation
        ([9, 8, 0, 0, 0], [9, 8, 5, 4, 3], 3, [0, 1, 2]),  # no double counting: next best
        ([1, 2, 3, 4, 5], [5, 4, 3, 2, 1], 1, [4]),  # an odd budget: attention gets the extra
        ([0, 0, 0, 0, 0], [0, 0, 0, 0, 0], 2, [0, 1]),  # ties: the earlier tokens
        ([1, 2, 3], [3, 2, 1], 0, []),
    ],
)
def test_half_each(first, second, k, expected):
    got = sel.half_each(
        torch.tensor(first, dtype=torch.float), torch.tensor(second, dtype=torch.float), k
    )
    assert got.tolist() == expected


def test_attn_plus_hkvd_selects_half_by_each_column():
    deviation = torch.tensor([[5.0, 0], [4, 0], [0, 9], [0, 8], [3, 0], [0, 0]])  # hkvd, attention
    got = sel.select("attn+hkvd", deviation, [(0, 3), (3, 6)], 4 / 6)
    assert got.tolist() == [0, 1, 2, 3]


def _qkv(seed: int, heads=4, kv_heads=2, n_q=5, n_k=12, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n_q, d, generator=g)
    k = torch.randn(kv_heads, n_k, d, generator=g)
    v = torch.randn(kv_heads, n_k, d, generator=g)
    return q, k, v, torch.arange(n_k - n_q, n_k), torch.arange(n_k)


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
def test_ape_at_t_and_s_one_is_ordinary_attention(window, softcap):
    q, k, v, qp, kp = _qkv(1)
    context = torch.zeros(12, dtype=torch.bool)
    context[2:7] = True
    kw = dict(scale=0.35, window=window, softcap=softcap)
    ref = attend(q, k, v, qp, kp, **kw)
    got = lv.ape_attend(q, k, v, qp, kp, context, temperature=1.0, lse_scale=1.0, **kw)
    assert (got - ref).abs().max() < 1e-5
    # and the correction changes it
    other = lv.ape_attend(q, k, v, qp, kp, context, temperature=0.8, lse_scale=0.9, **kw)
    assert (other - ref).abs().max() > 1e-3


def test_ape_merges_the_two_parts_by_their_scaled_log_sum_exp():
    # one head, one query, keys: two documents' (context) and one other; values one-hot
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.5, 0.0]]])
    v = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # context -> x, the rest -> y
    context = torch.tensor([True, True, False])
    t, s = 0.5, 0.8
    got = lv.ape_attend(
        q, k, v, torch.tensor([5]), torch.tensor([0, 1, 2]), context,
        scale=1.0, temperature=t, lse_scale=s,
    )  # fmt: skip
    lse_c = math.log(math.exp(1.0 / t) + math.exp(2.0 / t))
    share = 1 / (1 + math.exp(0.5 - s * lse_c))
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx([share, 1 - share], abs=1e-6)


def test_ape_without_context_keys_is_ordinary_attention():
    q, k, v, qp, kp = _qkv(2)
    none = torch.zeros(12, dtype=torch.bool)
    ref = attend(q, k, v, qp, kp, scale=0.35)
    got = lv.ape_attend(q, k, v, qp, kp, none, scale=0.35, temperature=0.5, lse_scale=0.5)
    assert (got - ref).abs().max() < 1e-5


@pytest.fixture
def runner(tiny_loaded):
    return lambda family: tiny_loaded(family).runner


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_ape_forward_at_one_is_the_runners_forward(family, runner):
    r = runner(family)
    kv, spans, s = blended_cache(r, PREFIX, DOCS, 0, torch.float32)
    context = torch.zeros(s, dtype=torch.bool)
    context[spans[0][0] : s] = True
    plain, ape = kv.fork(), kv.fork()
    ref = r.forward(SUFFIX, plain, logits="all")
    got = lv.ape_forward(r, SUFFIX, ape, context, 1.0, 1.0)
    assert (got - ref).abs().max() < 1e-4
    # a decode step after it: the cache is longer than the context mask
    step = lv.ape_forward(r, [7], ape, context, 1.0, 1.0)
    assert (step - r.forward([7], plain, logits="all")).abs().max() < 1e-4
    assert (lv.ape_forward(r, SUFFIX, kv.fork(), context, 0.7, 0.9) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_layer_split_at_zero_is_a_prefill_and_at_the_top_is_reuse(family, runner):
    r = runner(family)
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    ref = full_logits(r, ids, torch.float32)
    L = r.config.num_layers
    out = {}
    for split in (0, L):
        kv, spans, s = blended_cache(r, PREFIX, DOCS, 0, torch.float32)
        hidden = torch.cat(
            [lv.hidden_at(r, d, r.new_cache(dtype=torch.float32), split) for d in DOCS]
        )
        lv.recompute_above(r, kv, hidden, torch.arange(spans[0][0], s), split, s)
        out[split] = r.forward(SUFFIX, kv, logits="last")
    assert (out[0] - ref).abs().max() < 1e-4
    concat, _, _ = blended_cache(r, PREFIX, DOCS, 0, torch.float32)
    assert (out[L] - r.forward(SUFFIX, concat, logits="last")).abs().max() < 1e-5


def test_a_bench_selection_at_ratio_one_is_a_prefill_and_unknown_ones_are_refused(runner):
    r = runner("llama")
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float32)
    opts = BlendOptions(recompute_ratio=1.0)
    logits, _ = blend_prefill(r, kv, ids, spans[0][0], s, spans, opts, selection="attn+hkvd")
    assert (logits - full_logits(r, ids, torch.float32)).abs().max() < 1e-4
    kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float32)
    _, stats = blend_prefill(
        r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=0.2), selection="attn+hkvd"
    )
    assert stats.selected == 22
    with pytest.raises(ValueError, match="bench selection"):
        blend_prefill(r, kv, ids, spans[0][0], s, spans, opts, selection="nope")
