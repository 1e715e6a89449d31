"""The vLLM connector's bookkeeping without vLLM: chunk/block arithmetic, layouts learned from fake
attention-backend writers (the packings of vLLM's CPU, FlashAttention, FlashInfer and CPU-AMX
kernels), the scheduler side's plans from fake scheduler inputs, the worker side's loads and
saves on fake paged caches with a real kvfuse store, and the settings and namespace.

The vLLM-facing class is tested against a real vLLM server in tests/vllm (scripts/test_vllm.sh).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from kvfuse.codecs import get_codec
from kvfuse.config import ConfigError
from kvfuse.integrations.vllm import blocks as B
from kvfuse.integrations.vllm.layout import LayoutError, probe_layout
from kvfuse.integrations.vllm.plan import (
    Bookkeeper,
    CachedRequest,
    LoadChunk,
    LoadJob,
    NewRequest,
    SaveChunk,
)
from kvfuse.integrations.vllm.settings import (
    kv_namespace,
    model_fingerprint,
    read_settings,
    weights_digest,
)
from kvfuse.integrations.vllm.worker import CacheLayers, KVWorker
from kvfuse.kv.format import open_entry
from kvfuse.kv.keys import ChunkKey, prefix_keys
from kvfuse.store import TieredStore
from kvfuse.tiers.disk import DiskTier
from kvfuse.tiers.memory import MemoryTier

# --------------------------------------------------------------------------------------------------
# chunks vs blocks


@pytest.mark.parametrize(
    "chunk,block,expected", [(256, 16, 16), (256, 128, 2), (256, 256, 1), (512, 32, 16)]
)
def test_alignment_blocks_per_chunk(chunk, block, expected):
    assert B.check_alignment(chunk, block) == expected


@pytest.mark.parametrize("chunk,block", [(256, 96), (100, 64), (64, 128), (0, 16), (256, 0)])
def test_alignment_errors_say_what_to_set(chunk, block):
    with pytest.raises(B.AlignmentError) as e:
        B.check_alignment(chunk, block)
    if chunk > 0 and block > 0:
        assert "multiple of vLLM's block size" in str(e.value) and "chunk_size" in str(e.value)


@pytest.mark.parametrize(
    "tokens,block,expected",
    [
        (0, 128, 0),
        (1, 128, 0),
        (128, 128, 0),
        (129, 128, 128),
        (2048, 128, 1920),
        (2049, 128, 2048),
        (4000, 128, 3968),
        (4000, 16, 3984),
    ],
)
def test_load_limit_leaves_the_last_token_in_whole_blocks(tokens, block, expected):
    assert B.load_limit(tokens, block) == expected


@pytest.mark.parametrize(
    "tokens,chunk,block,expected",
    [
        (0, 256, 128, 0),
        (1, 256, 128, 0),
        (256, 256, 128, 1),
        (256, 256, 256, 0),
        (257, 256, 256, 1),
        (1024, 256, 128, 4),  # the 4th chunk starts before the limit (896): loaded in part
        (1024, 256, 256, 3),
        (1000, 256, 128, 3),  # chunk 3 is not full: no key
        (2048, 256, 128, 8),
        (4000, 256, 128, 15),
    ],
)
def test_lookup_chunks(tokens, chunk, block, expected):
    assert B.lookup_chunks(tokens, chunk, block) == expected


@pytest.mark.parametrize(
    "computed,first,hits,limit,expected",
    [
        (0, 0, 3, 10_000, 768),
        (0, 0, 0, 10_000, 0),
        (384, 1, 2, 10_000, 384),
        (512, 2, 1, 10_000, 256),
        (768, 3, 0, 10_000, 0),
        (1024, 2, 1, 10_000, 0),
        (0, 0, 8, 1920, 1920),  # the last chunk up to the limit only
        (1920, 7, 1, 1920, 0),
    ],
)
def test_matched_tokens(computed, first, hits, limit, expected):
    assert B.matched_tokens(computed, first, hits, 256, limit) == expected


def test_load_spans_partial_first_and_last_chunks():
    # vLLM holds 384 tokens (3 blocks of 128); the store has chunks 1 and 2 (tokens 256..768).
    spans = B.load_spans(384, 768, 256, 128)
    assert spans == [B.ChunkSpan(1, 256, 512, 384, 512), B.ChunkSpan(2, 512, 768, 512, 768)]
    assert [s.written_tokens for s in spans] == [128, 256]
    assert B.load_spans(0, 512, 256, 16) == [
        B.ChunkSpan(0, 0, 256, 0, 256),
        B.ChunkSpan(1, 256, 512, 256, 512),
    ]
    # a 2048-token prompt: 7 chunks and the first block of the 8th (the last block is vLLM's)
    spans = B.load_spans(0, 1920, 256, 128)
    assert len(spans) == 8 and spans[-1] == B.ChunkSpan(7, 1792, 2048, 1792, 1920)
    assert B.load_spans(512, 512, 256, 16) == []
    with pytest.raises(ValueError):
        B.load_spans(100, 512, 256, 16)  # not block aligned
    with pytest.raises(ValueError):
        B.load_spans(0, 300, 256, 16)  # not block aligned


def test_block_ids_and_slot_mapping():
    table = [7, 3, 9, 4]
    assert B.span_block_ids(table, 16, 16, 48) == [3, 9]
    with pytest.raises(ValueError):
        B.span_block_ids(table, 16, 0, 80)  # beyond the table
    with pytest.raises(ValueError):
        B.span_block_ids(table, 16, 8, 32)  # not block aligned
    slots = B.slot_mapping(table, 16, 14, 18)
    assert slots == [7 * 16 + 14, 7 * 16 + 15, 3 * 16 + 0, 3 * 16 + 1]
    assert B.kernel_block_ids([2, 5], 128, 32) == [8, 9, 10, 11, 20, 21, 22, 23]
    assert B.kernel_block_ids([2, 5], 32, 32) == [2, 5]
    with pytest.raises(B.AlignmentError):
        B.kernel_block_ids([1], 128, 48)
    # A manager slot is the same number as the kernel slot (vLLM's kernels index by kernel block).
    for t in range(0, 256, 7):
        s = B.slot_mapping([2, 5], 128, t, t + 1)[0]
        kb = B.kernel_block_ids([[2, 5][t // 128]], 128, 32)[(t % 128) // 32]
        assert s == kb * 32 + t % 32


@pytest.mark.parametrize(
    "after,prompt,expected",
    [
        (0, 1000, 0),
        (255, 1000, 0),
        (256, 1000, 1),
        (2048, 1000, 3),
        (1024, 1024, 4),
        (5000, 1024, 4),
    ],
)
def test_completed_chunks_are_prompt_chunks(after, prompt, expected):
    assert B.completed_chunks(after, prompt, 256) == expected


# --------------------------------------------------------------------------------------------------
# fake attention-backend writers: (kind, token-in-block, head, dim) -> flat position in a block


def _pos_cpu_vec(n, h, d, hp, cp):
    """vLLM CPU_ATTN vec/vec16: per head, a K plane stored [D, N] then a V plane [N, D]."""

    def pos(kind, t, head, dim):
        inner = dim * n + t if kind == 0 else n * d + t * d + dim
        return head * n * cp + inner

    return pos


def _pos_cpu_amx(n, h, d, hp, cp):
    """vLLM CPU_ATTN amx (bf16): K as int32 quad-words in groups of 16 tokens, V packed in token pairs."""

    def pos(kind, t, head, dim):
        if kind == 0:
            inner = 2 * ((t // 16) * 16 * (d // 2) + (dim // 2) * 16 + t % 16) + dim % 2
        else:
            inner = n * d + (t // 2) * 32 + t % 2 + (dim // 16) * n * 16 + (dim % 16) * 2
        return head * n * cp + inner

    return pos


def _pos_flash(n, h, d, hp, cp):
    """FLASH_ATTN / TRITON_ATTN: a token's K in channels [0, D), V in [D, 2D) (cp may pad)."""

    def pos(kind, t, head, dim):
        return (head * n + t) * cp + kind * d + dim

    return pos


def _pos_flashinfer(n, h, d, hp, cp):
    """FLASHINFER: the K heads, then the V heads."""

    def pos(kind, t, head, dim):
        return ((kind * h + head) * n + t) * cp + dim

    return pos


LAYOUTS = {  # name -> (position function, view shape of one block (H', N, C') from (N, H, D))
    "cpu_vec": (_pos_cpu_vec, lambda n, h, d: (h, n, 2 * d)),
    "cpu_amx": (_pos_cpu_amx, lambda n, h, d: (h, n, 2 * d)),
    "flash": (_pos_flash, lambda n, h, d: (h, n, 2 * d)),
    "flashinfer": (_pos_flashinfer, lambda n, h, d: (2 * h, n, d)),
    "flash_padded": (_pos_flash, lambda n, h, d: (h, n, 2 * d + 8)),
}


def _fake_writer(name: str, view: torch.Tensor, h: int, d: int):
    """A writer in the interface of ``probe_layout``: writes K/V of tokens at vLLM slots, indexing
    the 4-D view (any strides) by (block, H', N, C')."""
    fn, _ = LAYOUTS[name]
    _, hp, n, cp = view.shape
    pos = fn(n, h, d, hp, cp)
    t = torch.arange(n)[:, None, None]
    hh = torch.arange(h)[None, :, None]
    dd = torch.arange(d)[None, None, :]
    # (N, H, D) flat positions per kind
    tables = [pos(k, t, hh, dd).expand(n, h, d) for k in (0, 1)]

    def write(key, value, slots):
        blk, off = slots // n, slots % n
        for kind, src in ((0, key), (1, value)):
            p = tables[kind][off]  # (T, H, D)
            view[blk[:, None, None].expand_as(p), p // (n * cp), (p // cp) % n, p % cp] = src

    return write


def _cache(
    name: str, blocks: int, n: int, h: int, d: int, dtype, layers: int = 1, strided: bool = False
):
    """Per-layer views [B, H', N, C'] of one allocation; ``strided``: H' outside B (vLLM's LHBNC)."""
    hp, _, cp = LAYOUTS[name][1](n, h, d)
    if strided:
        raw = torch.zeros(layers, hp, blocks, n, cp, dtype=dtype)
        return [raw[i].permute(1, 0, 2, 3) for i in range(layers)]
    raw = torch.zeros(layers, blocks, hp, n, cp, dtype=dtype)
    return [raw[i] for i in range(layers)]


def _random_kv(tokens, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, h, d, generator=g).to(dtype)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_learns_the_layout_and_round_trips(name, dtype):
    n, h, d = (32, 2, 32) if name == "cpu_amx" else (16, 3, 8)
    if name == "cpu_amx" and dtype == torch.float32:
        pytest.skip("the AMX kernels are bf16 only")
    view = _cache(name, 10, n, h, d, dtype)[0]
    view.fill_(7)  # whatever block 0 holds is restored after the probe
    layout = probe_layout(view, _fake_writer(name, view, h, d), h, d)
    assert torch.all(view == 7)
    assert layout.dense == (name != "flash_padded")
    view.zero_()
    # vLLM writes a request's tokens at its slots; gather reads them back in token order.
    table = [6, 2, 9]
    kv = _random_kv(3 * n, h, d, dtype)
    _fake_writer(name, view, h, d)(kv[0], kv[1], torch.tensor(B.slot_mapping(table, n, 0, 3 * n)))
    got = layout.gather(view, torch.tensor(table))
    assert torch.equal(got, kv)
    # scatter writes exactly the bytes vLLM's writer would have written.
    other = torch.zeros_like(view)
    layout.scatter(other, torch.tensor(table), kv)
    assert torch.equal(other, view)


def test_probe_on_a_strided_view_and_kernel_blocks():
    n_kernel, block_size, h, d = (
        16,
        64,
        2,
        8,
    )  # vLLM splits each 64-token block into 4 kernel blocks
    views = _cache("cpu_vec", 4 * 6, n_kernel, h, d, torch.bfloat16, layers=2, strided=True)
    assert not views[1].is_contiguous()
    layout = probe_layout(views[1], _fake_writer("cpu_vec", views[1], h, d), h, d)
    layers = CacheLayers({"a": views[0], "b": views[1]}, ["a", "b"], layout, block_size)
    table = [5, 1]  # manager blocks
    kv = _random_kv(2 * block_size, h, d, torch.bfloat16, seed=3)
    # vLLM's slots are computed with the manager block size and address kernel blocks alike.
    _fake_writer("cpu_vec", views[1], h, d)(
        kv[0], kv[1], torch.tensor(B.slot_mapping(table, block_size, 0, 128))
    )
    assert torch.equal(layout.gather(views[1], layers.kernel_blocks(table)), kv)
    assert torch.all(views[0] == 0)  # the other layer untouched


def test_describe_names_the_cpu_transposed_k_plane():
    view = _cache("cpu_vec", 2, 128, 3, 64, torch.bfloat16)[0]
    layout = probe_layout(view, _fake_writer("cpu_vec", view, 3, 64), 3, 64)
    assert (
        layout.describe()
        == "K[t,h,d] at h*16384 + d*128 + t, V[t,h,d] at 8192 + h*16384 + t*64 + d"
    )


def test_probe_rejects_writers_it_cannot_read_exactly():
    h, d, n = 2, 8, 16
    view = _cache("flash", 4, n, h, d, torch.float32)[0]
    good = _fake_writer("flash", view, h, d)

    def quantizing(k, v, s):
        good(k * 0.5, v * 0.5, s)

    def drops_a_token(k, v, s):
        good(k[:-1], v[:-1], s[:-1])

    def duplicates(k, v, s):
        good(k[:1].expand_as(k), v, torch.zeros_like(s))

    def mixes_k_and_v(k, v, s):
        good(torch.where(torch.rand(k.shape) < 0.5, k, v), v, s)

    for writer in (quantizing, drops_a_token, duplicates):
        with pytest.raises(LayoutError):
            probe_layout(view, writer, h, d)
        assert torch.all(view == 0)  # restored even on failure
    with pytest.raises(LayoutError):
        probe_layout(view, good, h + 1, d)  # the spec's head count is not what the backend writes
    with pytest.raises(LayoutError, match="float16, bfloat16 and float32"):
        probe_layout(torch.zeros(4, h, n, 2 * d, dtype=torch.uint8), good, h, d)


# --------------------------------------------------------------------------------------------------
# the scheduler side, with fake scheduler inputs and a real (memory) store

CHUNK, BLOCK = 256, 128


def _ns(salt="", rank=0, tp=1):
    return kv_namespace(
        "vllm-test", "bfloat16", 4, 2, 8, cache_salt=salt or None, tp_rank=rank, tp_size=tp
    )


def _keeper(store: TieredStore, tp: int = 1, **kw) -> Bookkeeper:
    def keys_for(tokens, salt, n):
        return [
            prefix_keys(list(tokens[: n * CHUNK]), CHUNK, _ns(salt or "", r, tp)) for r in range(tp)
        ]

    return Bookkeeper(
        CHUNK, BLOCK, keys_for, lambda keys: store.lookup(keys, count=False).where, **kw
    )


def _store_chunks(store: TieredStore, tokens, chunks, salt="", rank=0, tp=1):
    """Put entries (any bytes will do for lookups) under the keys of the given chunks."""
    keys = prefix_keys(tokens[: (max(chunks) + 1) * CHUNK], CHUNK, _ns(salt, rank, tp))
    store.put([(keys[i], b"x") for i in chunks])
    return keys


@pytest.fixture
def mem_store():
    s = TieredStore(MemoryTier(1 << 30))
    yield s
    s.close()


def _prompt(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


def test_match_counts_contiguous_chunks_leaving_the_last_token(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(1024)  # 4 full chunks; the last block (with the last token) is vLLM's
    assert keeper.match("r", p, None, 0).tokens == 0
    _store_chunks(mem_store, p, [0, 1, 2, 3])
    assert keeper.match("r", p, None, 0).tokens == 896
    assert keeper.match("r", p + [5], None, 0).tokens == 1024
    assert keeper.match("r", p[:1000], None, 0).tokens == 768  # chunk 3 is not full: no key


def test_match_partial_hits(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(2000)
    _store_chunks(mem_store, p, [0, 1, 3, 4])  # chunk 2 missing: the chain stops there
    m = keeper.match("r", p, None, 0)
    assert (m.tokens, m.hits, m.tiers) == (512, 2, ("memory", "memory"))
    # vLLM holds 384 tokens already: the hit continues from inside chunk 1.
    m = keeper.match("r", p, None, 384)
    assert (m.tokens, m.first, m.hits) == (128, 1, 1)
    # vLLM holds chunks 0-2 itself: the store's chunk 2 (missing) is not asked for; 3 and 4 load.
    m = keeper.match("r", p, None, 768)
    assert (m.tokens, m.first, m.hits) == (512, 3, 2)
    # vLLM holds more than the store: nothing to load.
    assert keeper.match("r", p, None, 1280).tokens == 0


def test_match_is_side_effect_free(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(1500)
    _store_chunks(mem_store, p, [0, 1, 2])
    before = mem_store.stats()
    for _ in range(3):
        # chunk 3 (needed up to 1408) is not stored
        assert keeper.match("r", p, None, 0).tokens == 768
    assert mem_store.stats() == before
    assert keeper.plan([], []).loads == []  # a match alone plans nothing


def test_cache_salt_separates_namespaces(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(700)
    _store_chunks(mem_store, p, [0, 1], salt="tenant-a")
    assert keeper.match("r1", p, "tenant-a", 0).tokens == 512
    assert keeper.match("r2", p, "tenant-b", 0).tokens == 0
    assert keeper.match("r3", p, None, 0).tokens == 0


def test_tensor_parallel_chunks_count_only_when_every_rank_has_them(mem_store):
    keeper = _keeper(mem_store, tp=2)
    p = _prompt(1000)
    _store_chunks(mem_store, p, [0, 1, 2], rank=0, tp=2)
    _store_chunks(mem_store, p, [0], rank=1, tp=2)
    assert keeper.match("r", p, None, 0).tokens == 256
    assert (
        _ns("", 0, 2).kv_layout == "L4xH2xD8/tp0of2"
        and _ns("", 0, 2).digest() != _ns("", 1, 2).digest()
    )


def test_plan_load_and_saves_of_a_new_request(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(1300)  # 5 full chunks
    keys = _store_chunks(mem_store, p, [0, 1])
    table = list(range(100, 111))  # 11 blocks of 128
    m = keeper.match("r", p, None, 128)  # vLLM's prefix cache holds the first block
    assert m.tokens == 384
    keeper.allocated("r", m.tokens)
    step = keeper.plan([NewRequest("r", p, None, table, 512, 788)], [])
    (job,) = step.loads
    assert job.chunks == (
        LoadChunk((str(keys[0]),), 0, (101,), 128, "memory", tuple(p[:256])),
        LoadChunk((str(keys[1]),), 1, (102, 103), 0, "memory", tuple(p[256:512])),
    )
    # 512 + 788 = 1300 computed: chunks 2, 3, 4 are new and saved; 0 and 1 are stored already.
    all_keys = prefix_keys(p[:1280], CHUNK, _ns())
    assert [(s.index, s.block_ids, s.keys, s.token_ids) for s in step.saves] == [
        (i, tuple(table[2 * i : 2 * i + 2]), (str(all_keys[i]),), tuple(p[256 * i : 256 * (i + 1)]))
        for i in (2, 3, 4)
    ]
    assert keeper.counters.snapshot()["hit_tokens"] == 384
    assert keeper.counters.snapshot()["hit_tokens_by_tier"] == {"memory": 384}
    keeper.finished("r")
    assert keeper.tracked == 0


def test_plan_saves_each_chunk_once_across_chunked_prefill(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(1100)  # 4 full chunks
    keeper.allocated("r", 0)
    s1 = keeper.plan([NewRequest("r", p, None, list(range(8)), 0, 600)], [])
    assert [s.index for s in s1.saves] == [0, 1]  # 600 tokens computed: chunks 0 and 1
    s2 = keeper.plan([], [CachedRequest("r", [8, 9], 600, 500)])
    assert [(s.index, s.block_ids) for s in s2.saves] == [(2, (4, 5)), (3, (6, 7))]
    s3 = keeper.plan([], [CachedRequest("r", None, 1100, 1)])  # decoding: nothing new
    assert not s3


def test_plan_resumed_request_replaces_its_block_table(mem_store):
    keeper = _keeper(mem_store)
    p = _prompt(800)
    keeper.plan([NewRequest("r", p, None, [1, 2, 3, 4, 5, 6, 7], 0, 300)], [])  # chunk 0 saved
    step = keeper.plan([], [CachedRequest("r", [40, 41, 42, 43, 44, 45, 46], 0, 800, resumed=True)])
    assert [(s.index, s.block_ids) for s in step.saves] == [(1, (42, 43)), (2, (44, 45))]


def test_plan_switches_and_unplannable_loads(mem_store):
    p = _prompt(900)
    _store_chunks(mem_store, p, [0, 1, 2])
    keeper = _keeper(mem_store, load=False)
    assert keeper.match("r", p, None, 0).tokens == 0
    keeper = _keeper(mem_store, save=False)
    keeper.allocated("r", keeper.match("r", p, None, 0).tokens)
    step = keeper.plan([NewRequest("r", p, None, list(range(8)), 768, 132)], [])
    assert len(step.loads[0].chunks) == 3 and step.saves == []
    # a load vLLM was promised but whose keys are gone (memo evicted, prompt too short) is still
    # sent, without keys, so that the worker reports its blocks failed
    keeper = _keeper(mem_store, memo_size=0)
    keeper.allocated("s", keeper.match("s", p + [1] * 300, None, 0).tokens)
    step = keeper.plan([NewRequest("s", p[:300], None, list(range(9)), 768, 1)], [])
    assert [c.keys for c in step.loads[0].chunks] == [(), (), ()]


# --------------------------------------------------------------------------------------------------
# the worker side: real tiers, fake paged caches

H, D, NL = 2, 8, 4  # kv heads, head dim, layers
KB = 64  # kernel block (= vLLM block) tokens in these tests


def _worker_setup(tmp_path, name="cpu_vec", layerwise=True, lower=None, blocks=40):
    views = _cache(name, blocks, KB, H, D, torch.bfloat16, layers=NL)
    layout = probe_layout(views[0], _fake_writer(name, views[0], H, D), H, D)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NL)]
    layers = CacheLayers(dict(zip(names, views)), names, layout, KB)
    store = TieredStore(
        MemoryTier(1 << 30), lower if lower is not None else [DiskTier(tmp_path / "kv", 1 << 30)]
    )
    worker = KVWorker(
        store,
        get_codec("raw"),
        layers,
        dtype=torch.bfloat16,
        kv_heads=H,
        head_dim=D,
        chunk_size=CHUNK,
        layerwise=layerwise,
    )
    return worker, layers, store, names


def _fill_request(layers, table, tokens, seed=0):
    """What vLLM's forward pass leaves in the cache: every layer's KV of ``tokens`` tokens."""
    kvs = []
    for i, view in enumerate(layers.views):
        kv = _random_kv(tokens, H, D, torch.bfloat16, seed=seed * 100 + i)
        _fake_writer("cpu_vec", view, H, D)(
            kv[0], kv[1], torch.tensor(B.slot_mapping(table, KB, 0, tokens))
        )
        kvs.append(kv)
    return torch.stack(kvs)  # (layers, 2, tokens, H, D)


def _run_step(worker, layers, names, loads=(), saves=()):
    worker.start_loads(list(loads))
    for i, n in enumerate(names):
        worker.wait_layer(n)
        worker.save_layer(n, layers.views[i], list(saves))
    worker.end_step()
    return worker.take_failed_blocks()


def _save_chunks(worker, layers, names, table, n_chunks, keys, tokens=None):
    ids = [tuple(tokens[i * CHUNK : (i + 1) * CHUNK]) if tokens else () for i in range(n_chunks)]
    saves = [
        SaveChunk("r", (str(keys[i]),), i, tuple(table[4 * i : 4 * i + 4]), ids[i])
        for i in range(n_chunks)
    ]
    assert _run_step(worker, layers, names, saves=saves) == set()
    assert worker.flush(30)


def _keys(tokens):
    return prefix_keys(tokens, CHUNK, kv_namespace("vllm-test", "bfloat16", NL, H, D))


@pytest.mark.parametrize("layerwise", [True, False])
def test_worker_saves_then_loads_bit_exact(tmp_path, layerwise):
    worker, layers, store, names = _worker_setup(tmp_path, layerwise=layerwise)
    table = list(range(3, 15))  # 12 blocks of 64 = 3 chunks
    kv = _fill_request(layers, table, 768)
    p = _prompt(768)
    keys = _keys(p)
    _save_chunks(worker, layers, names, table, 3, keys, p)
    for i in range(3):  # the stored entries hold exactly vLLM's KV, at their positions
        entry = open_entry(bytes(store.lower[0].get(keys[i])), keys[i])
        assert torch.equal(entry.decode(), kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        assert torch.equal(entry.positions, torch.arange(i * CHUNK, (i + 1) * CHUNK))
        assert entry.token_ids.tolist() == p[i * CHUNK : (i + 1) * CHUNK]
    s = worker.counters.snapshot()
    assert (s["saved_chunks"], s["saved_tokens"], s["save_dropped"]) == (3, 768, 0)
    # a new engine: empty caches, the entries on disk only
    worker.close()
    store.close()
    worker, layers, store, names = _worker_setup(tmp_path, layerwise=layerwise)
    new_table = list(range(20, 32))
    job = LoadJob(
        "r2",
        tuple(
            LoadChunk(
                (str(keys[i]),),
                i,
                tuple(new_table[4 * i : 4 * i + 4]),
                0,
                None,
                tuple(p[i * CHUNK : (i + 1) * CHUNK]),
            )
            for i in range(3)
        ),
    )
    assert _run_step(worker, layers, names, loads=[job]) == set()
    for i, view in enumerate(layers.views):
        assert torch.equal(layers.layout.gather(view, layers.kernel_blocks(new_table)), kv[i])
    s = worker.counters.snapshot()
    assert (s["loaded_chunks"], s["loaded_tokens"], s["loaded_chunks_by_tier"]) == (
        3,
        768,
        {"disk": 3},
    )
    worker.close()
    store.close()


def test_worker_partial_chunk_load_leaves_vllms_blocks(tmp_path):
    worker, layers, store, names = _worker_setup(tmp_path)
    table = list(range(0, 8))
    kv = _fill_request(layers, table, 512)
    keys = _keys(_prompt(512))
    _save_chunks(worker, layers, names, table, 2, keys)
    for v in layers.views:
        v.zero_()
    marker = torch.full((2, 64, H, D), 3.0, dtype=torch.bfloat16)
    for v in layers.views:  # vLLM holds block 4 (tokens 256..320) from its own prefix cache
        layers.layout.scatter(v, torch.tensor([4]), marker)
    # load tokens 320..512 of chunk 1 only (skip its first block)
    job = LoadJob("r", (LoadChunk((str(keys[1]),), 1, (5, 6, 7), 64),))
    assert _run_step(worker, layers, names, loads=[job]) == set()
    for i, v in enumerate(layers.views):
        assert torch.equal(layers.layout.gather(v, torch.tensor([4])), marker)
        assert torch.equal(layers.layout.gather(v, torch.tensor([5, 6, 7])), kv[i][:, 320:512])
        assert torch.all(layers.layout.gather(v, torch.tensor([0, 1, 2, 3])) == 0)
    worker.close()
    store.close()


def test_worker_reports_failed_loads_instead_of_using_them(tmp_path):
    worker, layers, store, names = _worker_setup(tmp_path, lower=None)
    table = list(range(8))
    _fill_request(layers, table, 512)
    keys = _keys(_prompt(512))
    _save_chunks(worker, layers, names, table, 2, keys)
    worker.close()
    store.close()
    # damage layer 2 of chunk 1 on disk: its checksum no longer matches
    path = Path(DiskTier(tmp_path / "kv", 1 << 30)._path(keys[1]))
    raw = bytearray(path.read_bytes())
    raw[-(NL - 2) * 2 * CHUNK * H * D * 2 - 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    worker, layers, store, names = _worker_setup(tmp_path)
    missing = prefix_keys(
        _prompt(768, seed=9), CHUNK, kv_namespace("vllm-test", "bfloat16", NL, H, D)
    )[2]
    job = LoadJob(
        "r",
        (
            LoadChunk((str(keys[0]),), 0, (10, 11, 12, 13), 0),
            LoadChunk((str(keys[1]),), 1, (14, 15, 16, 17), 0),
            LoadChunk((str(missing),), 2, (18, 19, 20, 21), 0),
            LoadChunk((), 3, (22, 23, 24, 25), 0),
        ),
    )  # no key for this rank
    assert _run_step(worker, layers, names, loads=[job]) == set(range(14, 26))
    s = worker.counters.snapshot()
    assert (s["loaded_chunks"], s["load_failed_chunks"], s["load_failed_blocks"]) == (1, 3, 12)
    # removed
    assert store.stats()["store"]["unusable_entries"] == 1 and not store.lookup([keys[1]]).hits
    assert worker.take_failed_blocks() == set()  # reported once
    worker.close()
    store.close()


def test_worker_never_stores_a_chunk_missing_a_layer(tmp_path):
    worker, layers, store, names = _worker_setup(tmp_path)
    table = list(range(4))
    _fill_request(layers, table, 256)
    keys = _keys(_prompt(256))
    saves = [SaveChunk("r", (str(keys[0]),), 0, tuple(table))]
    for i, n in enumerate(names[:-1]):  # the last layer's save never came
        worker.save_layer(n, layers.views[i], saves)
    worker.end_step()
    assert worker.flush(10)
    assert store.lookup([keys[0]]).hits == 0
    assert worker.counters.snapshot()["save_dropped"] == 1
    worker.close()
    store.close()


def test_scheduler_and_worker_in_two_processes_share_only_the_lower_tiers(tmp_path):
    """The worker's memory tier is its own: a scheduler in another process (its own store over the
    same disk folder) counts only what the disk holds, which the worker can then read."""
    worker, layers, wstore, names = _worker_setup(tmp_path)
    sstore = TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path / "kv", 1 << 30)])

    def keys_for(tokens, salt, n):
        return [
            prefix_keys(
                list(tokens[: n * CHUNK]), CHUNK, kv_namespace("vllm-test", "bfloat16", NL, H, D)
            )
        ]

    keeper = Bookkeeper(CHUNK, KB, keys_for, lambda k: sstore.lookup(k, count=False).where)
    p = _prompt(800)
    keeper.allocated("a", keeper.match("a", p, None, 0).tokens)
    step = keeper.plan([NewRequest("a", p, None, list(range(13)), 0, 800)], [])
    assert [s.index for s in step.saves] == [0, 1, 2]
    kv = _fill_request(layers, list(range(13)), 800)
    assert _run_step(worker, layers, names, saves=step.saves) == set()
    assert worker.flush(30)
    # memory-only in the worker: invisible to the scheduler
    only_mem = _keys(_prompt(300, seed=5))[0]
    wstore.put([(only_mem, b"x")], memory_only=True)
    assert sstore.lookup([only_mem]).hits == 0
    # the repeated prompt: the scheduler sees the disk entries; the worker loads them bit-exact
    m = keeper.match("b", p, None, 0)
    assert (m.tokens, m.tiers) == (768, ("disk", "disk", "disk"))
    keeper.allocated("b", m.tokens)
    table = list(range(20, 33))
    step = keeper.plan([NewRequest("b", p, None, table, 768, 32)], [])
    assert step.saves == []  # stored already
    for v in layers.views:
        v.zero_()
    assert _run_step(worker, layers, names, loads=step.loads) == set()
    for i, v in enumerate(layers.views):
        assert torch.equal(
            layers.layout.gather(v, layers.kernel_blocks(table[:12])), kv[i][:, :768]
        )
    worker.close()
    wstore.close()
    sstore.close()


# --------------------------------------------------------------------------------------------------
# settings and namespace


def test_settings_from_extra_config_over_kvfuse_config(tmp_path):
    cfg = tmp_path / "kvfuse.yaml"
    cfg.write_text("cache:\n  chunk_size: 512\n  codec: int8\n")
    s = read_settings(
        {
            "config": str(cfg),
            "disk_path": str(tmp_path / "kv"),
            "cache.memory_bytes": "64MiB",
            "layerwise": "false",
            "model_fingerprint": "my-model",
        },
        env={"KVFUSE_CACHE_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    c = s.config.cache
    assert (s.chunk_size, c.codec, c.disk_path, c.memory_bytes, c.redis_url) == (
        512,
        "int8",
        str(tmp_path / "kv"),
        64 << 20,
        "redis://127.0.0.1:1/0",
    )
    assert (s.load, s.save, s.layerwise, s.model_fingerprint) == (True, True, False, "my-model")
    assert read_settings({}, env={}).chunk_size == 256
    assert read_settings({}, env={}).layerwise is None  # auto
    assert read_settings({"layerwise": "auto"}, env={}).layerwise is None
    assert read_settings({"layerwise": True}, env={}).layerwise is True


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            {"chunk_sise": 256},
            "unknown setting 'chunk_sise' in kv_connector_extra_config; valid settings",
        ),
        (
            {"chunk_size": "big"},
            r"cache.chunk_size: expected an integer.*kv_connector_extra_config",
        ),
        ({"codec": "zip"}, "unknown codec 'zip'"),
        ({"load": "maybe"}, "load: expected true or false"),
        ({"layerwise": "sometimes"}, "layerwise: expected true, false or auto"),
        ({"save_queue": 0}, "save_queue: expected an integer >= 1"),
        ({"enabled": False}, "remove the kvfuse connector"),
    ],
)
def test_settings_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        read_settings(extra, env={})


def test_model_fingerprint_names_the_weights(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(300_000))
    d1 = weights_digest(folder)

    def fp(w):
        return model_fingerprint(str(folder), dtype="torch.bfloat16", hf_config={"a": 1}, weights=w)

    assert fp(d1) == fp(weights_digest(folder)) and fp(d1).startswith("vllm-")
    raw = bytearray((folder / "model.safetensors").read_bytes())
    # a fine-tune changes weights everywhere; a sample sees the middle of the file
    raw[150_000] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(raw))
    assert weights_digest(folder) != d1
    assert weights_digest(tmp_path / "nothing") is None
    assert model_fingerprint("m", dtype="torch.float32") != model_fingerprint(
        "m", dtype="torch.bfloat16"
    )
    assert model_fingerprint("m", revision="a") != model_fingerprint("m", revision="b")


def test_namespace_fields():
    ns = kv_namespace("vllm-x", "bfloat16", 30, 3, 64, salt="deploy", cache_salt="t1")
    assert (ns.kv_layout, ns.kv_dtype, ns.salt) == ("L30xH3xD64", "bfloat16", "deploy\x00t1")
    assert kv_namespace("vllm-x", "bfloat16", 30, 3, 64).salt == ""
    with pytest.raises(ValueError):
        kv_namespace("vllm-x", "bfloat16", 30, 3, 64, tp_rank=2, tp_size=2)


def test_package_imports_without_vllm():
    import kvfuse.integrations.vllm as pkg

    assert set(pkg.__all__) >= {"KvfuseConnector"}
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="vllm"):
            pkg.KvfuseConnector  # noqa: B018
    with pytest.raises(AttributeError):
        pkg.NoSuchThing  # noqa: B018


def test_chunk_keys_are_plain_kvfuse_prefix_keys():
    p = _prompt(600)
    keys = prefix_keys(p[:512], CHUNK, _ns())
    assert [ChunkKey.parse(str(k)) for k in keys] == keys


@pytest.mark.parametrize("layers", [1, 2, 3, 7, 30, 64])
def test_layer_groups_cover_every_layer_once_first_alone(layers):
    from kvfuse.integrations.vllm.worker import layer_groups

    groups = layer_groups(layers)
    assert groups[0] == (0, 1)
    assert [i for a, b in groups for i in range(a, b)] == list(range(layers))
    assert len(groups) <= 2 + max(0, layers - 2).bit_length()


def test_a_prompt_of_whole_chunks_loads_all_but_its_last_block(tmp_path):
    """1024 tokens = 4 stored chunks: the load stops at the last whole block before the last
    token (960 with 64-token blocks), writing the 4th chunk in part."""
    worker, layers, store, names = _worker_setup(tmp_path)
    p = _prompt(1024)
    keys = _keys(p)
    table = list(range(16))
    kv = _fill_request(layers, table, 1024)
    _save_chunks(worker, layers, names, table, 4, keys, p)

    def keys_for(tokens, salt, n):
        return [
            prefix_keys(
                list(tokens[: n * CHUNK]), CHUNK, kv_namespace("vllm-test", "bfloat16", NL, H, D)
            )
        ]

    keeper = Bookkeeper(CHUNK, KB, keys_for, lambda k: store.lookup(k, count=False).where)
    m = keeper.match("r", p, None, 0)
    assert m.tokens == 960
    keeper.allocated("r", m.tokens)
    new_table = list(range(20, 36))
    step = keeper.plan([NewRequest("r", p, None, new_table, 960, 64)], [])
    assert [(c.index, c.block_ids, c.skip_tokens) for c in step.loads[0].chunks][-1] == (
        3,
        (32, 33, 34),
        0,
    )
    for v in layers.views:
        v.zero_()
    assert _run_step(worker, layers, names, loads=step.loads) == set()
    for i, v in enumerate(layers.views):
        assert torch.equal(layers.layout.gather(v, torch.tensor(new_table[:15])), kv[i][:, :960])
        # vLLM computes it
        assert torch.all(layers.layout.gather(v, torch.tensor(new_table[15:])) == 0)
    assert worker.counters.snapshot()["loaded_tokens"] == 960
    worker.close()
    store.close()


@pytest.mark.parametrize("layerwise", [True, False])
def test_an_entry_holding_other_tokens_is_a_failed_load(tmp_path, layerwise):
    """An entry filed under a chunk's key but recording other token ids (a writer's bug, a copied
    file) is never written into vLLM's blocks."""
    worker, layers, store, names = _worker_setup(tmp_path, layerwise=layerwise)
    p = _prompt(256)
    keys = _keys(p)
    _fill_request(layers, list(range(4)), 256)
    _save_chunks(worker, layers, names, list(range(4)), 1, keys, p)
    other = list(reversed(p))
    job = LoadJob("r", (LoadChunk((str(keys[0]),), 0, (10, 11, 12, 13), 0, None, tuple(other)),))
    assert _run_step(worker, layers, names, loads=[job]) == {10, 11, 12, 13}
    assert torch.all(layers.layout.gather(layers.views[0], torch.tensor([10, 11, 12, 13])) == 0)
    worker.close()
    store.close()
