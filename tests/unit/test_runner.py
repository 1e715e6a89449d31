"""The model runner on tiny random models of every family, against transformers and against itself.

References are independent of the code under test: transformers' own implementation (logits,
greedy generation), a from-scratch recomputation (KV-cache decoding, split prefills, subsets,
permuted caches) and a textbook RoPE (rotation).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfuse.models import rope
from kvfuse.models.attention import position_mask
from kvfuse.models.config import FULL, SLIDING, RopeConfig
from kvfuse.models.loader import load_folder

FAMILIES = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma3"]
VOCAB = 512  # tests/tiny_models.py
TOL = 1e-4
FP16_EPS = 2.0**-11  # unit roundoff of float16


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny-model ops are far too small to gain from intra-op threads, and OpenMP's spinning
    barriers make them ~8x slower whenever another process holds a core (measured: 60 s -> 8 s
    for this file on 2 busy cores). Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    """name -> our fp32 Transformer for that tiny model (loaded once per module)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_folder(tiny_model_dir(name), "cpu", torch.float32)
        return loaded[name]

    return get


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """name -> transformers' fp32 model for the same folder (the reference)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            m = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32
            ).eval()
            # Greedy references must run the full 32 steps: no stop at the tiny models' eos id 2.
            m.generation_config.eos_token_id = None
            loaded[name] = m
        return loaded[name]

    return get


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g)


def assert_close(actual, expected, atol, what=""):
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol:.3g}"


def clone_cache(runner, cache):
    c = runner.new_cache(cache.capacity, dtype=cache.dtype)
    c.kv.copy_(cache.kv)
    c.positions.copy_(cache.positions)
    c.length = cache.length
    return c


def layerwise_prefill(runner, ids):
    """A full prefill through the layer-by-layer API: the exact cache and every layer's input."""
    n = ids.shape[0]
    cache = runner.new_cache(n)
    cache.positions[:n] = torch.arange(n)
    cache.length = n
    h = runner.embed(ids)
    hs = [h]
    for layer in range(runner.config.num_layers):
        h = runner.layer(layer, h, cache, slice(0, n), kv_len=n)
        hs.append(h)
    return cache, hs


def greedy(runner, ids, steps, cache=None, kv_dtype=None):
    """Prefill ``ids`` (on top of ``cache``) then decode ``steps`` tokens one at a time."""
    cache = cache if cache is not None else runner.new_cache(dtype=kv_dtype)
    logits = runner.forward(ids, cache)
    out, gaps = [], []
    for _ in range(steps):
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        out.append(int(logits.argmax()))
        logits = runner.forward([out[-1]], cache)
    return out, min(gaps)


# ------------------------------------------------------------------ 1. logits vs transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_runner, hf_model):
    runner, ref_model = tiny_runner(family), hf_model(family)
    ids = prompt(300)  # longer than the 48-token windows of mistral/gemma3 and the 256-query block
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0]
    last = runner.forward(ids, runner.new_cache())
    assert last.shape == (VOCAB,)
    assert_close(last, ref[-1], 1e-3, "last logits")
    every = runner.forward(ids, runner.new_cache(300), logits="all")
    assert every.shape == (300, VOCAB)
    assert_close(every, ref, 1e-3, "all logits")
    assert_close(every[-1], last, 1e-5, "last row of 'all' vs 'last'")  # 1 vs 300-row matmul
    assert runner.forward(ids, runner.new_cache(), logits="none") is None


# ------------------------------------------------------- 2. greedy decoding with the KV cache


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_kv_cache_equals_recompute_and_transformers(family, tiny_runner, hf_model):
    runner = tiny_runner(family)
    ids = prompt(60, seed=7)  # 60 + 32 tokens: decoding crosses the 48-token sliding windows
    cached, min_gap = greedy(runner, ids, 32)

    recomputed, seq = [], ids.tolist()
    for _ in range(32):
        logits = runner.forward(seq, runner.new_cache())  # a new cache each step: no KV reuse
        recomputed.append(int(logits.argmax()))
        seq.append(recomputed[-1])
    assert cached == recomputed

    with torch.no_grad():
        out = hf_model(family).generate(
            ids[None],
            attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
    # With this prompt every step's top-2 logit gap is >= ~2e-3 (gemma3 ~0.4), far above the
    # ~1e-5 agreement of our logits with transformers' (test above), so no near-tie can flip a
    # token; the gap is asserted so that a change of prompt/seed cannot make this test flaky.
    assert min_gap > 1e-3, f"prompt has a near-tie (gap {min_gap:.2g}); pick another seed"
    assert out[0, ids.shape[0] :].tolist() == cached


# ------------------------------------------- 3. prefill on top of a prefix == a full prefill


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 47, 48, 64, 256, 257, 299])
@pytest.mark.parametrize("via_chunk", [False, True], ids=["same-cache", "chunk-copy"])
def test_prefill_on_prefix_equals_full_prefill(family, n, via_chunk, tiny_runner):
    runner = tiny_runner(family)
    ids = prompt(300, seed=3)
    full_cache = runner.new_cache()
    full = runner.forward(ids, full_cache, logits="all")

    cache = runner.new_cache()
    assert runner.forward(ids[:n], cache, logits="none") is None
    assert cache.length == n and cache.next_position == n
    if via_chunk:  # what a cache hit does: the prefix KV arrives as a chunk in a fresh cache
        chunk = cache.chunk(0, n)
        assert chunk.kv.shape == (
            runner.config.num_layers,
            2,
            n,
            runner.config.num_kv_heads,
            runner.config.head_dim,
        )
        cache = runner.new_cache()
        cache.write(cache.length, chunk.kv, chunk.positions)
        assert cache.length == n and cache.next_position == n
    suffix = runner.forward(ids[n:], cache, logits="all")

    assert suffix.shape == (300 - n, VOCAB)
    assert_close(suffix, full[n:], TOL, "suffix logits")
    assert cache.length == 300
    assert torch.equal(cache.positions[:300], torch.arange(300))
    assert_close(cache.kv[:, :, :, :300], full_cache.kv[:, :, :, :300], TOL, "K/V of all slots")


# ----------------------------------------------------- 4. subset recomputation at one layer

SUBSET_CASES = [
    # (family, layer, prompt length, subset size)
    ("gemma3", 0, 200, 40),  # sliding (window 48), subset reaching far beyond the window
    ("gemma3", 3, 200, 40),  # sliding
    ("gemma3", 5, 200, 40),  # the global layer
    ("gemma3", 1, 700, 300),  # sliding, > 256 queries: the blocked sliding-window path
    ("gemma3", 5, 700, 300),
    ("mistral", 1, 200, 40),  # sliding (window 48)
    ("mistral", 0, 700, 300),
    ("llama", 1, 200, 40),
    ("llama3-rope", 1, 200, 40),
    ("qwen2", 0, 200, 40),
    ("qwen3", 1, 200, 40),
]


def subset_indices(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    middle = torch.randperm(n - 2, generator=g)[: k - 2] + 1
    return torch.cat([torch.tensor([0, n - 1]), middle]).sort().values


@pytest.mark.parametrize("family,layer,n,k", SUBSET_CASES)
@pytest.mark.parametrize("slots_before", ["exact", "wrong"])
def test_subset_at_a_layer_equals_full_computation(family, layer, n, k, slots_before, tiny_runner):
    runner = tiny_runner(family)
    exact, hs = layerwise_prefill(runner, prompt(n, seed=11))
    subset = subset_indices(n, k, seed=layer)
    if runner.config.window(layer):
        # mostly beyond the window
        assert int((subset >= runner.config.sliding_window).sum()) > k // 2

    cache = clone_cache(runner, exact)
    if slots_before == "wrong":  # stale K/V at the recomputed slots must be overwritten, not used
        g = torch.Generator().manual_seed(5)
        cache.kv[layer, :, :, subset] = (
            torch.randn(cache.kv[layer, :, :, subset].shape, generator=g) * 10
        )
    before = cache.kv.clone()

    out = runner.layer(layer, hs[layer][subset], cache, slots=subset, kv_len=n)

    assert_close(out, hs[layer + 1][subset], TOL, "subset outputs")
    assert_close(
        cache.kv[layer, :, :, subset],
        exact.kv[layer, :, :, subset],
        TOL,
        "K/V written at the subset slots",
    )
    others = torch.ones(n, dtype=torch.bool)
    others[subset] = False
    assert torch.equal(cache.kv[:, :, :, others], before[:, :, :, others]), (
        "non-subset slots were modified"
    )
    other_layers = [i for i in range(runner.config.num_layers) if i != layer]
    assert torch.equal(cache.kv[other_layers], before[other_layers]), "other layers were modified"
    assert torch.equal(cache.positions, exact.positions) and cache.length == n


def test_layerwise_api_equals_forward(tiny_runner):
    runner = tiny_runner("gemma3")
    ids = prompt(200, seed=11)
    cache, hs = layerwise_prefill(runner, ids)
    ref_cache = runner.new_cache()
    ref = runner.forward(ids, ref_cache, logits="all")
    assert_close(runner.logits(hs[-1]), ref, 1e-5, "logits")
    assert_close(cache.kv[:, :, :, :200], ref_cache.kv[:, :, :, :200], 1e-5, "K/V")


def test_subset_in_shuffled_order(tiny_runner):
    """Queries need not come in position order either (mask by position, not by query index)."""
    runner = tiny_runner("gemma3")
    exact, hs = layerwise_prefill(runner, prompt(200, seed=11))
    subset = subset_indices(200, 40, seed=2)
    subset = subset[torch.randperm(40, generator=torch.Generator().manual_seed(0))]
    for layer in (0, 5):
        cache = clone_cache(runner, exact)
        out = runner.layer(layer, hs[layer][subset], cache, slots=subset, kv_len=200)
        assert_close(out, hs[layer + 1][subset], TOL, f"layer {layer}")


# ------------------------------------------- 5. position-based masking with permuted slots


@pytest.mark.parametrize("family", FAMILIES)
def test_permuted_slots_forward_equals_in_order(family, tiny_runner):
    runner = tiny_runner(family)
    n = 120
    ids = prompt(n, seed=4)
    ref = runner.forward(ids, runner.new_cache(), logits="all")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(9))
    cache = runner.new_cache()
    # Slot i holds the token at position perm[i]: an index-aligned causal mask would let it see
    # later positions in earlier slots and miss earlier positions in later slots.
    out = runner.forward(ids[perm], cache, positions=perm, logits="all")
    assert_close(out, ref[perm], TOL, "logits of permuted slots")

    # Decoding the next token on top of the permuted cache (explicit position: the last slot does
    # not hold the last position) equals decoding on the in-order cache.
    in_order = runner.new_cache()
    runner.forward(ids, in_order, logits="none")
    nxt = int(ref[-1].argmax())
    assert_close(
        runner.forward([nxt], cache, positions=torch.tensor([n])),
        runner.forward([nxt], in_order),
        TOL,
        "decode step",
    )


@pytest.mark.parametrize(
    "family,layer", [("gemma3", 0), ("gemma3", 5), ("mistral", 1), ("qwen3", 1)]
)
def test_subset_over_permuted_cache(family, layer, tiny_runner):
    runner = tiny_runner(family)
    n = 200
    exact, hs = layerwise_prefill(runner, prompt(n, seed=11))
    # slot i <- position perm[i]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    cache = runner.new_cache(n)
    cache.kv[:, :, :, :n] = exact.kv[:, :, :, perm]
    cache.positions[:n] = perm
    cache.length = n
    slot_of = torch.empty(n, dtype=torch.int64)
    slot_of[perm] = torch.arange(n)
    subset = subset_indices(n, 40, seed=1)
    out = runner.layer(layer, hs[layer][subset], cache, slots=slot_of[subset], kv_len=n)
    assert_close(out, hs[layer + 1][subset], TOL, "subset outputs over a permuted cache")


# ------------------------------------------------------------------------ 6. re-rotation

MOVES = [(0, 37), (37, 0), (5000, 100), (100, 7000), (123, 123)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("src,dst", MOVES)
def test_rerotated_keys_equal_keys_projected_at_new_positions(family, src, dst, tiny_runner):
    runner = tiny_runner(family)
    n = 24
    h = runner.embed(prompt(n, seed=2)) + torch.randn(
        n, runner.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    p_src, p_dst = torch.arange(src, src + n), torch.arange(dst, dst + n)
    for layer in range(runner.config.num_layers):
        _, k_src, v_src = runner.project(layer, h, p_src)
        _, k_dst, v_dst = runner.project(layer, h, p_dst)
        assert torch.equal(v_src, v_dst)  # values carry no position
        if src != dst:
            assert (k_src - k_dst).abs().max() > 0.1  # the rotation matters: the test can fail
        moved = runner.rerotate_keys(layer, k_src, p_src, p_dst)
        assert moved.dtype == torch.float32
        assert_close(moved, k_dst, TOL, f"fp32 layer {layer}")
        # fp16 keys: rounding of the input (<= eps*|k| per element, rotation mixes two of them)
        # and of the output (eps*|k|) bounds the error by ~3 eps max|k|; 4 eps for margin.
        moved16 = runner.rerotate_keys(layer, k_src.half(), p_src, p_dst)
        assert moved16.dtype == torch.float16
        assert_close(moved16, k_dst, 4 * FP16_EPS * float(k_dst.abs().max()), f"fp16 layer {layer}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("src,dst", [(5000, 100), (100, 7000)])
def test_rerotated_cached_layer0_keys_equal_prefill_at_new_positions(family, src, dst, tiny_runner):
    """The same through ``forward(positions=...)``: layer 0 K depends on positions only via RoPE."""
    runner = tiny_runner(family)
    ids = prompt(40, seed=6)
    a, b = runner.new_cache(), runner.new_cache()
    runner.forward(ids, a, positions=torch.arange(src, src + 40), logits="none")
    runner.forward(ids, b, positions=torch.arange(dst, dst + 40), logits="none")
    assert a.next_position == src + 40 and b.next_position == dst + 40
    k_a = a.kv[0, 0, :, :40].transpose(0, 1)  # (n, kv_heads, head_dim)
    k_b = b.kv[0, 0, :, :40].transpose(0, 1)
    moved = runner.rerotate_keys(0, k_a, a.positions[:40], b.positions[:40])
    assert_close(moved, k_b, TOL, "layer 0 keys")
    assert torch.equal(a.kv[0, 1, :, :40], b.kv[0, 1, :, :40])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_move_keys_rotates_in_place_to_a_prefill_at_the_new_positions(
    family, kv_dtype, tiny_runner
):
    """A document's layer-0 KV computed at positions 0.. and moved to 300.. equals computing it at 300..
    (deeper layers differ only through attention, which sees the same relative positions)."""
    runner = tiny_runner(family)
    ids = prompt(40, seed=7)
    here, there = runner.new_cache(dtype=kv_dtype), runner.new_cache(dtype=kv_dtype)
    runner.forward(ids, here, positions=torch.arange(0, 40), logits="none")
    runner.forward(ids, there, positions=torch.arange(300, 340), logits="none")
    storage = here.kv.data_ptr()
    before_values, before_keys = here.kv[:, 1, :, :40].clone(), here.kv[:, 0, :, :40].clone()
    runner.move_keys(here, 0, 40, 300)
    assert here.kv.data_ptr() == storage  # in the live cache, no copy of it
    assert torch.equal(here.positions[:40], torch.arange(300, 340))
    assert torch.equal(here.kv[:, 1, :, :40], before_values)  # values carry no position
    k_moved, k_ref = here.kv[0, 0, :, :40].float(), there.kv[0, 0, :, :40].float()
    tol = TOL if kv_dtype == torch.float32 else 4 * FP16_EPS * float(k_ref.abs().max())
    assert_close(k_moved, k_ref, tol, "layer 0 keys moved")
    for layer in range(runner.config.num_layers):  # every layer's keys are rotated
        assert (here.kv[layer, 0, :, :40].float() - before_keys[layer].float()).abs().max() > 0.01
    runner.move_keys(here, 0, 40, 0)  # and back
    back = runner.new_cache(dtype=kv_dtype)
    runner.forward(ids, back, positions=torch.arange(0, 40), logits="none")
    assert_close(
        here.kv[0, 0, :, :40].float(), back.kv[0, 0, :, :40].float(), 2 * tol, "moved back"
    )
    with pytest.raises(ValueError, match="outside"):
        runner.move_keys(here, 0, 41, 5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_span_computed_in_the_middle_sees_only_the_keys_before_it(family, tiny_runner):
    """``forward(start=...)`` writes slots in the middle of a cache whose later slots are already full
    (a prefix computed after documents were loaded behind it): it equals a plain prefill."""
    runner = tiny_runner(family)
    ids = prompt(60, seed=9)
    ref = runner.new_cache()
    runner.forward(ids, ref, logits="none")
    cache = runner.new_cache()
    runner.forward(ids[:20], cache, logits="none")
    cache.write(20, ref.chunk(20, 60).kv, torch.arange(20, 60))  # slots 20..59 hold their exact KV
    # wrong on purpose
    runner.forward(ids[20:30], cache, positions=torch.arange(20, 30), logits="none", start=10)
    # and fixed
    runner.forward(ids[10:20], cache, positions=torch.arange(10, 20), logits="none", start=10)
    runner.forward(ids[20:40], cache, positions=torch.arange(20, 40), logits="none", start=20)
    assert cache.length == 60
    assert_close(cache.kv[:, :, :, :60], ref.kv[:, :, :, :60], TOL, "middle span")
    with pytest.raises(ValueError, match="gap"):
        runner.forward(ids[:2], cache, start=61)


def test_gemma3_local_and_global_layers_rotate_differently(tiny_runner):
    runner = tiny_runner("gemma3")
    assert runner.config.layer_types[0] == SLIDING and runner.config.layer_types[5] == FULL
    k = torch.randn(
        8,
        runner.config.num_kv_heads,
        runner.config.head_dim,
        generator=torch.Generator().manual_seed(0),
    )
    p, q = torch.arange(8), torch.arange(1000, 1008)
    local, glob = runner.rerotate_keys(0, k, p, q), runner.rerotate_keys(5, k, p, q)
    assert (local - glob).abs().max() > 0.1
    assert_close(runner.rerotate_keys(1, k, p, q), local, 0.0, "all sliding layers share a base")


def textbook_rope(x, positions, freqs):
    """Rotate-half RoPE in float64, written out from the definition (the reference)."""
    rot = 2 * freqs.shape[0]
    x = x.double()
    ang = positions.double()[:, None] * freqs.double()[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    xr = x[..., :rot]
    rotated = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, x[..., rot:]], -1)


@pytest.mark.parametrize(
    "cfg",
    [
        RopeConfig(theta=10000.0),
        RopeConfig(theta=1e6),
        RopeConfig(theta=500000.0, kind="llama3", factor=8.0, original_max_position=64),
        RopeConfig(theta=10000.0, kind="linear", factor=4.0),
        RopeConfig(theta=10000.0, partial_rotary_factor=0.5),
    ],
    ids=["default", "base1e6", "llama3", "linear", "partial"],
)
def test_rope_apply_and_rerotate_composition(cfg):
    head_dim = 64
    freqs = rope.inv_freq(cfg, head_dim)
    assert freqs.shape == (int(head_dim * cfg.partial_rotary_factor) // 2,)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, head_dim, generator=g)
    pos = torch.randint(0, 8000, (16,), generator=g)
    cos, sin = rope.cos_sin(freqs, pos, torch.float32)
    assert_close(rope.apply(x, cos, sin), textbook_rope(x, pos, freqs), 1e-5, "apply vs textbook")

    p, q, r = (
        pos,
        torch.randint(0, 8000, (16,), generator=g),
        torch.randint(0, 8000, (16,), generator=g),
    )
    k = rope.apply(x, *rope.cos_sin(freqs, p, torch.float32))
    via_q = rope.rerotate(rope.rerotate(k, p, q, freqs), q, r, freqs)
    direct = rope.rerotate(k, p, r, freqs)
    assert_close(via_q, direct, 1e-5, "p->q->r vs p->r")
    assert_close(direct, textbook_rope(x, r, freqs), 1e-5, "p->r vs rotating at r")
    assert_close(rope.rerotate(direct, r, p, freqs), k, 1e-5, "round trip")
    if cfg.partial_rotary_factor < 1:
        assert torch.equal(direct[..., head_dim // 2 :], x[..., head_dim // 2 :])


def test_llama3_scaling_changes_low_frequencies_only():
    plain = rope.inv_freq(RopeConfig(theta=500000.0), 64)
    scaled = rope.inv_freq(
        RopeConfig(theta=500000.0, kind="llama3", factor=8.0, original_max_position=64), 64
    )
    wavelen = 2 * math.pi / plain
    # high-frequency band (wavelength below original_max / high_freq_factor)
    high = wavelen < 64 / 4.0
    low = wavelen > 64 / 1.0
    assert high.any() and low.any()
    assert torch.equal(scaled[high], plain[high])
    assert_close(scaled[low], plain[low] / 8.0, 1e-12, "low band divided by factor")


# -------------------------------------------------------------------- 7. the position mask

T, F_ = True, False
MASK_CASES = [
    # (q_pos, k_pos, window, expected[q][k])
    ([0, 1, 2], [0, 1, 2], None, [[T, F_, F_], [T, T, F_], [T, T, T]]),  # causal
    ([2], [0, 1, 2, 3], None, [[T, T, T, F_]]),  # a key after the query is never visible
    ([5], [0, 3, 4, 5], 2, [[F_, F_, T, T]]),  # window 2: q-k in {0, 1}
    ([5], [1, 2, 5], 4, [[F_, T, T]]),  # q-k == 3 == window-1 allowed, q-k == 4 == window not
    ([10, 3], [7, 8, 3, 2, 11], 3, [[F_, T, F_, F_, F_], [F_, F_, T, T, F_]]),  # unsorted keys
    ([100], [0, 51, 52, 100], 49, [[F_, F_, T, T]]),
    ([0], [0], 1, [[T]]),  # window 1: only itself
    ([4, 0], [0, 4], None, [[T, T], [T, F_]]),  # queries out of order
]


@pytest.mark.parametrize("q_pos,k_pos,window,expected", MASK_CASES)
def test_position_mask(q_pos, k_pos, window, expected):
    mask = position_mask(torch.tensor(q_pos), torch.tensor(k_pos), window)
    assert mask.dtype == torch.bool
    assert mask.tolist() == expected


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("spread", ["sparse", "dense", "unsorted"])
def test_blocked_attention_equals_one_masked_call(window, spread):
    """Sparse queries (CacheBlend's recomputed tokens) are attended in blocks by position, each over
    the keys it can see; the result equals one eager pass with the full position mask."""
    from kvfuse.models.attention import attend

    g = torch.Generator().manual_seed(0)
    n_k = 900
    if spread == "dense":
        q_pos = torch.arange(n_k - 200, n_k)
    else:
        q_pos = torch.sort(torch.randperm(n_k, generator=g)[:200]).values
        if spread == "unsorted":
            q_pos = q_pos[torch.randperm(200, generator=g)]
    k_pos = torch.arange(n_k)
    q = torch.randn(4, len(q_pos), 16, generator=g)
    k, v = torch.randn(2, n_k, 16, generator=g), torch.randn(2, n_k, 16, generator=g)
    got = attend(q, k, v, q_pos, k_pos, scale=0.25, window=window, keys_sorted=True)
    scores = torch.matmul(q, k.repeat_interleave(2, 0).transpose(1, 2)) * 0.25
    scores = scores.masked_fill(~position_mask(q_pos, k_pos, window), float("-inf"))
    ref = (
        torch.matmul(torch.softmax(scores, -1), v.repeat_interleave(2, 0))
        .transpose(0, 1)
        .reshape(len(q_pos), -1)
    )
    assert (got - ref).abs().max() < 1e-5


# ---------------------------------------------------------------------------- 8. API errors


def test_forward_argument_errors(tiny_runner):
    runner = tiny_runner("llama")
    cache = runner.new_cache()
    runner.forward([5, 6, 7], cache, logits="none")
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward([], cache)
    with pytest.raises(ValueError, match="2 tokens but 3 positions"):
        runner.forward([1, 2], cache, positions=torch.tensor([3, 4, 5]))
    assert cache.length == 3 and cache.next_position == 3  # rejected calls leave the cache alone


def test_forward_bogus_logits_raises_without_touching_the_cache(tiny_runner):
    runner = tiny_runner("llama")
    cache = runner.new_cache()
    runner.forward([5, 6, 7], cache, logits="none")
    kv = cache.kv[:, :, :, :3].clone()
    with pytest.raises(ValueError, match="logits must be"):
        runner.forward([8, 9], cache, logits="bogus")
    # An argument error must not leave the two tokens in the cache: a caller that catches it would
    # otherwise decode on top of tokens it believes were never added.
    assert cache.length == 3, (
        f"forward(logits='bogus') raised but advanced the cache to {cache.length} slots"
    )
    assert torch.equal(cache.kv[:, :, :, :3], kv)


def test_cache_errors(tiny_runner):
    runner = tiny_runner("qwen3")
    c = runner.config
    cache = runner.new_cache()
    runner.forward(prompt(10), cache, logits="none")
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="cannot truncate"):
            cache.truncate(bad)
    for start, end in ((0, 11), (5, 5), (-1, 3), (6, 4)):
        with pytest.raises(ValueError, match="outside the valid range"):
            cache.chunk(start, end)
    shapes = {
        "layers": (c.num_layers + 1, 2, 4, c.num_kv_heads, c.head_dim),
        "kv_heads": (c.num_layers, 2, 4, c.num_kv_heads + 1, c.head_dim),
        "head_dim": (c.num_layers, 2, 4, c.num_kv_heads, c.head_dim * 2),
    }
    for shape in shapes.values():
        with pytest.raises(ValueError, match="does not fit"):
            cache.write(cache.length, torch.zeros(shape), torch.arange(4))
    assert cache.length == 10
    cache.truncate(4)
    assert cache.length == 4 and cache.next_position == 4
    cache.truncate(0)
    assert cache.length == 0 and cache.next_position == 0


def test_truncate_then_continue_equals_fresh_prefill(tiny_runner):
    runner = tiny_runner("mistral")
    ids, other = prompt(100, seed=1), prompt(30, seed=2)
    cache = runner.new_cache()
    runner.forward(ids, cache, logits="none")
    cache.truncate(70)
    out = runner.forward(other, cache, logits="all")
    ref = runner.forward(torch.cat([ids[:70], other]), runner.new_cache(), logits="all")[70:]
    assert_close(out, ref, TOL, "after truncate")


# ---------------------------------------------------------------------------- 9. fp16 KV


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [37, 64])
def test_fp16_kv_prefix_loaded_equals_one_go(family, n, tiny_runner):
    runner = tiny_runner(family)
    ids = prompt(100, seed=8)
    one_go, _ = greedy(runner, ids, 32, kv_dtype=torch.float16)

    prefix_cache = runner.new_cache(dtype=torch.float16)
    runner.forward(ids[:n], prefix_cache, logits="none")
    chunk = prefix_cache.chunk(0, n)
    assert chunk.dtype == torch.float16
    loaded = runner.new_cache(dtype=torch.float16)
    loaded.write(loaded.length, chunk.kv, chunk.positions)
    assert loaded.kv.dtype == torch.float16
    from_prefix, _ = greedy(runner, ids[n:], 32, cache=loaded)
    assert from_prefix == one_go

    # and fp16 KV really is stored (and used) as fp16: it differs from the fp32 run's KV
    fp32 = runner.new_cache()
    runner.forward(ids, fp32, logits="none")
    full16 = runner.new_cache(dtype=torch.float16)
    runner.forward(ids, full16, logits="none")
    assert not torch.equal(full16.kv[:, :, :, :100].float(), fp32.kv[:, :, :, :100])
    # prefix K/V (one layer deep, then the error compounds) within fp16 rounding of fp32's
    assert_close(
        full16.kv[0, :, :, :n],
        fp32.kv[0, :, :, :n],
        FP16_EPS * float(fp32.kv[0, :, :, :n].abs().max()),
        "layer 0",
    )
