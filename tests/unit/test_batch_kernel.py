"""The batched CPU attention kernel (``kvfuse.models.kernels``) against the PyTorch attention it
replaces: the same position mask (causal by position, sliding windows, unsorted keys as CacheBlend
leaves them), soft-capping, KV stored as fp32 / fp16 / bf16, and the runner's batched step with
the kernel on and off.

The kernel is built once per machine; where a C++ compiler is present it must build (a broken
build would otherwise leave every step silently on the slow path)."""

from __future__ import annotations

import pytest
import torch

from kvfuse.models import attention
from kvfuse.models.cpu import kernels
from kvfuse.models.transformer import BatchItem

FAMILIES = ["llama", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def ext(cpu_kernels):
    return cpu_kernels


def _seq(n: int, cap: int, dtype, shuffle: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, 2, cap, 16, generator=g).to(dtype)
    pos = torch.zeros(cap, dtype=torch.int64)
    # gaps, like blended documents
    pos[:n] = torch.randperm(n, generator=g) * 2 if shuffle else torch.arange(n) * 2
    return kv, pos


def _reference(q, seqs, lens, q_seq, q_pos, layer, scale, window, softcap):
    rows = []
    for i, (qs, qp) in enumerate(zip(q_seq, q_pos)):
        kv, pos = seqs[qs]
        n = lens[qs]
        rows.append(
            attention.attend(
                q[i : i + 1].transpose(0, 1),
                kv[layer, 0, :, :n],
                kv[layer, 1, :, :n],
                torch.tensor([qp]),
                pos[:n],
                scale=scale,
                window=window,
                softcap=softcap,
            )
        )
    return torch.cat(rows)


def _kernel(ext, q, seqs, lens, q_seq, q_pos, layer, scale, window, softcap):
    """The kernel's attention, with ``_reference``'s arguments (None: no window, no soft-cap)."""
    kvs, positions = [s[0] for s in seqs], [s[1] for s in seqs]
    return ext.attend(
        q, kvs, positions, lens, q_seq, q_pos, layer, scale, window or 0, softcap or 0.0
    )


CASES = [  # (kv dtype, window, softcap, shuffled key positions)
    (torch.float32, None, None, False),
    (torch.float16, None, None, False),
    (torch.bfloat16, None, None, False),
    (torch.float16, 9, None, False),
    (torch.float32, None, 5.0, False),
    (torch.float16, 7, 5.0, True),
    (torch.float32, None, None, True),
]


@pytest.mark.parametrize("dtype,window,softcap,shuffle", CASES)
def test_the_kernel_computes_the_position_masked_attention(ext, dtype, window, softcap, shuffle):
    lens = [1, 5, 40, 33]
    seqs = [_seq(n, n + 8, dtype, shuffle, seed) for seed, n in enumerate(lens)]
    # queries: one past the end, inside the range (sees only earlier keys), and several per sequence
    q_seq = [0, 1, 2, 2, 2, 3, 3]
    q_pos = [0, 3, 79, 40, 11, 64, 1]
    q = torch.randn(len(q_seq), 4, 16, generator=torch.Generator().manual_seed(9))
    got = _kernel(ext, q, seqs, lens, q_seq, q_pos, 1, 0.25, window, softcap)
    want = _reference(q, seqs, lens, q_seq, q_pos, 1, 0.25, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


SPANS = [  # (keys per sequence, window, softcap, shuffled): one decoding sequence, its keys in spans
    ([700], None, None, False),
    ([700], 50, None, True),  # most spans see no key: their partials count for nothing
    ([129, 3], None, 5.0, True),
    ([300, 290, 64], 9, None, False),
]


@pytest.mark.parametrize("lens,window,softcap,shuffle", SPANS)
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_long_keys_cut_into_spans_merge_to_the_same_attention(
    ext, lens, window, softcap, shuffle, threads
):
    seqs = [_seq(n, n + 4, torch.float16, shuffle, seed) for seed, n in enumerate(lens)]
    q_seq = list(range(len(lens)))  # one query per sequence: fewer rows than threads
    q_pos = [2 * n - 1 for n in lens]
    q = torch.randn(len(q_seq), 4, 16, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kernel(ext, q, seqs, lens, q_seq, q_pos, 2, 0.25, window, softcap)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, seqs, lens, q_seq, q_pos, 2, 0.25, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_rounds_like_a_tensor_copy(ext, dtype):
    bufs = [_seq(10, 20, dtype, False, s)[0] for s in range(3)]
    want = [b.clone() for b in bufs]
    # k and v are strided views of a fused projection, as in the runner
    qkv = torch.randn(6, 4 * 16 + 2 * 2 * 16)
    k, v = qkv[:, 64:96].view(6, 2, 16), qkv[:, 96:].view(6, 2, 16)
    spans = [(0, 3, 2), (2, 0, 3), (5, 19, 1)]  # (first row, first slot, rows)
    ext.write_kv(bufs, 2, k, v, [s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans])
    for w, (r, s, n) in zip(want, spans):
        w[2, 0, :, s : s + n] = k[r : r + n].transpose(0, 1)
        w[2, 1, :, s : s + n] = v[r : r + n].transpose(0, 1)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)


def test_bad_arguments_are_errors_not_crashes(ext):
    kv, pos = _seq(4, 8, torch.float32, False, 0)
    q = torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match="length beyond capacity"):
        ext.attend(q, [kv], [pos], [9], [0], [3], 0, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="unknown sequence"):
        ext.attend(q, [kv], [pos], [4], [1], [3], 0, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="slots out of range"):
        ext.write_kv([kv], 0, torch.randn(1, 2, 16), torch.randn(1, 2, 16), [0], [8], [1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_batched_step_is_the_same_with_the_kernel_on_and_off(ext, family, kv_dtype, tiny_loaded):
    """Decodes (kernel) next to a prefill chunk (SDPA) in one step, with fp16 KV read in place:
    logits and written KV equal the PyTorch path's up to float rounding."""
    runner = tiny_loaded(family).runner
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (50, 9, 70)]

    def step(use_kernels: bool):
        runner.use_kernels = use_kernels
        try:
            caches = [runner.new_cache(120, kv_dtype) for _ in prompts]
            runner.forward(prompts[0][:40], caches[0], logits="none")
            runner.forward(prompts[2], caches[2], logits="none")
            items = [
                BatchItem(prompts[0][40:], caches[0]),
                BatchItem(prompts[1], caches[1], logits=False),
                BatchItem([7], caches[2]),
            ]
            out = runner.forward_batch(items)
            out += runner.forward_batch([BatchItem([11], c) for c in caches])
            return out, caches
        finally:
            runner.use_kernels = True

    (on, kv_on), (off, kv_off) = step(True), step(False)
    assert on[1] is None and off[1] is None
    for a, b in zip(on, off):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(kv_on, kv_off):
        assert a.length == b.length
        torch.testing.assert_close(
            a.kv[:, :, :, : a.length].float(),
            b.kv[:, :, :, : b.length].float(),
            atol=1e-3,
            rtol=1e-3,
        )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_packed_float32_weights_compute_what_plain_weights_compute(
    family, tiny_model_dir, monkeypatch
):
    """``weights: auto`` on the CPU loads packed projections (``models.packed``: blocks for the
    kernel); logits of a prefill and of a batched step equal those of plain tensors up to float
    rounding."""
    from kvfuse.models import packed
    from kvfuse.models.loader import load_folder

    if not packed.available(torch.device("cpu"), torch.float32):
        pytest.skip("this PyTorch build has no oneDNN linear")
    fast = load_folder(tiny_model_dir(family))
    kind = packed.BlockedWeight if kernels.get() is not None else packed.PackedWeight
    monkeypatch.setenv("KVFUSE_KERNELS", "off")
    plain = load_folder(tiny_model_dir(family))
    assert isinstance(fast.weights.layers[0].w_up, kind)
    assert isinstance(fast.weights.lm_head, kind)
    assert isinstance(plain.weights.layers[0].w_up, torch.Tensor)
    ids = torch.randint(3, 500, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = []
    for runner in (fast, plain):
        caches = [runner.new_cache(64), runner.new_cache(64)]
        first = runner.forward(ids, caches[0], logits="all")
        runner.forward(ids[:20], caches[1], logits="none")
        step = runner.forward_batch([BatchItem([9], caches[0]), BatchItem(ids[20:], caches[1])])
        outs.append([first, *step])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_sequences_with_different_kv_dtypes_share_a_step(ext, tiny_loaded):
    """The attention kernel reads one KV dtype per call: a step mixing fp32 and fp16 caches takes
    the PyTorch path and gives each sequence what it gets alone."""
    runner = tiny_loaded("llama").runner
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (30, 12)]
    caches = [runner.new_cache(64, torch.float32), runner.new_cache(64, torch.float16)]
    for p, c in zip(prompts, caches):
        runner.forward(p, c, logits="none")
    out = runner.forward_batch([BatchItem([5], caches[0]), BatchItem([6], caches[1])])
    for p, c, tok, got in zip(prompts, (torch.float32, torch.float16), (5, 6), out):
        alone = runner.new_cache(64, c)
        runner.forward(p, alone, logits="none")
        torch.testing.assert_close(got, runner.forward([tok], alone), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "queries,keys,kernel",
    [
        (1, 100_000, True),  # decode: always the kernel
        (4, 5_000, True),  # a few queries: the kernel whatever the history
        (5, 800, True),  # 4,000 scores
        (5, 900, False),  # 4,500 scores: SDPA
        (16, 256, True),
        (16, 257, False),
        (17, 10, False),  # beyond the kernel's query limit
        (1, 0, True),
    ],
)
def test_which_sequences_take_the_attention_kernel(queries, keys, kernel):
    from kvfuse.models.batch import kernel_fits

    assert kernel_fits(queries, keys) is kernel
