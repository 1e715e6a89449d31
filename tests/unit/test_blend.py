"""CacheBlend on tiny random models of every family (CPU): ratio 1 is a full prefill, ratio 0 is the
plain concatenation of moved document KV, one document is an exact prefix, and the engine's
document path (precompute, load at any position, layer-by-layer loading from disk, the blended
chain, damaged entries) gives the answers it should."""

from __future__ import annotations

import pytest
import torch

from kvfuse.blend import BlendOptions, blend_prefill
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import document_key, prefix_keys
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.disk.files import key_to_filename

CH = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
]  # mistral and gemma3: sliding windows of 48


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX, DOCS, SUFFIX = ids_of(20, 1), [ids_of(37, 2), ids_of(29, 3), ids_of(44, 4)], ids_of(9, 5)


def blended_cache(runner, prefix, docs, n_suffix, kv_dtype, context=()):
    """The prefix computed, each document computed alone (behind ``context``) and moved into place,
    suffix slots ready: what the engine hands the blender."""
    kv = runner.new_cache(64, dtype=kv_dtype)
    runner.forward(prefix, kv, logits="none")
    spans = []
    for doc in docs:
        alone = runner.new_cache(dtype=kv_dtype)
        runner.forward(list(context) + doc, alone, logits="none")
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


def full_logits(runner, ids, kv_dtype):
    return runner.forward(ids, runner.new_cache(dtype=kv_dtype), logits="last")


@pytest.fixture
def runner(tiny_loaded):
    return lambda family: tiny_loaded(family).runner


# ------------------------------------------------------------------------------ the blender


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-3)])
def test_ratio_one_reproduces_a_full_prefill(family, kv_dtype, tol, runner):
    r = runner(family)
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    for method in ("hkvd", "sinks+hkvd", "hkvd-head", "attn", "hkvd-attn"):
        kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), kv_dtype)
        opts = BlendOptions(recompute_ratio=1.0, method=method)
        logits, stats = blend_prefill(r, kv, ids, spans[0][0], s, spans, opts)
        ref = full_logits(r, ids, kv_dtype)
        assert (logits - ref).abs().max() <= tol, (method, float((logits - ref).abs().max()))
        assert stats.selected == sum(len(d) for d in DOCS)


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_is_the_concatenation_of_moved_document_kv(family, runner):
    r = runner(family)
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float16)
    before = kv.kv[:, :, :, :s].clone()
    logits, stats = blend_prefill(
        r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=0.0)
    )
    # no document KV was touched
    assert stats.selected == 0 and torch.equal(kv.kv[:, :, :, :s], before)
    concat, _, _ = blended_cache(r, PREFIX, DOCS, 0, torch.float16)
    ref = r.forward(SUFFIX, concat, logits="last")  # the suffix over the plain concatenation
    assert (logits - ref).abs().max() <= 1e-5
    # and that is not a prefill
    assert (logits - full_logits(r, ids, torch.float16)).abs().max() > 1e-3


# with 2 layers, the check layer is the last one
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_partial_ratios_sit_between_full_reuse_and_full_prefill(family, runner):
    r = runner(family)
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    ref = full_logits(r, ids, torch.float32)
    err = {}
    for ratio in (0.0, 0.3, 1.0):
        kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float32)
        logits, stats = blend_prefill(
            r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=ratio)
        )
        err[ratio] = float((logits - ref).abs().max())
        assert stats.selected == round(ratio * 110)
    assert err[1.0] < err[0.3] < err[0.0]


def test_the_check_layer_the_deviation_and_gradual_filtering(runner):
    r = runner("gemma3")  # 6 layers
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    for opts in (
        BlendOptions(recompute_ratio=0.2, check_layer=0),
        BlendOptions(recompute_ratio=0.2, check_layer=3),
        BlendOptions(recompute_ratio=0.2, deviation="k"),
        BlendOptions(recompute_ratio=0.2, gradual=True),
    ):
        kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float32)
        _, stats = blend_prefill(r, kv, ids, spans[0][0], s, spans, opts)
        check = opts.check_layer
        # full layers and the check layer: all tokens
        assert stats.active[: check + 1] == [110] * (check + 1)
        if opts.gradual:  # twice the budget at the check layer, shrinking to it over three layers
            assert (
                stats.selected == 44 and stats.active[2:5] == [44, 37, 29] and stats.active[5] == 22
            )
        else:
            assert stats.selected == 22 and all(a == 22 for a in stats.active[check + 1 :])


# ------------------------------------------------------------------------------ the engine


def engine_with(model, store, **blend) -> Engine:
    return Engine(
        model,
        store,
        EngineSettings.of(chunk_size=CH, blend=BlendOptions(**{"store_blended": False, **blend})),
    )


def baseline(model, ids) -> list[int]:
    return Engine(model, None, EngineSettings.of(chunk_size=CH)).generate(ids, GREEDY).token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_ratio_one_answers_as_a_full_prefill(family, tiny_loaded):
    model = tiny_loaded(family)
    engine = engine_with(model, TieredStore(MemoryTier(1 << 26)), recompute_ratio=1.0)
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    expected = baseline(model, prompt.ids)
    first = engine.generate(prompt, GREEDY)  # documents precomputed on their own, then blended
    again = engine.generate(prompt, GREEDY)  # documents loaded
    assert first.token_ids == expected and again.token_ids == expected
    n_docs = sum(len(d) for d in DOCS)
    assert (first.cached_tokens, first.recomputed_tokens, first.stored_chunks) == (0, n_docs, 1 + 3)
    assert (again.cached_tokens, again.recomputed_tokens) == (
        16,
        n_docs,
    )  # every document token recomputed
    assert again.hit_tiers == ("memory",) * 4


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_one_through_the_blend_path_has_a_full_prefills_logits(family, tiny_loaded):
    """Issue 41: the blend path at recompute_ratio 1.0 is exact: teacher-forced logits over the
    answer equal a full prefill's of the identical token ids within float rounding (documents
    precomputed alone, loaded at new positions, every token recomputed), and the documents
    prompt is exactly those ids."""
    model = tiny_loaded(family)
    engine = engine_with(model, TieredStore(MemoryTier(1 << 26)), recompute_ratio=1.0)
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    assert prompt.ids == PREFIX + sum(DOCS, []) + SUFFIX
    answer = baseline(model, prompt.ids)
    (full,) = engine.score(prompt.ids, [answer], cache=CacheOptions(enabled=False))
    engine.generate(prompt, GREEDY)  # the documents cached alone
    (blended,) = engine.score(prompt, [answer])
    scale = float(full.abs().max())
    assert (blended - full).abs().max() <= 1e-4 + 32 * torch.finfo(torch.float32).eps * scale
    assert torch.equal(blended.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_document_behind_its_context_is_an_exact_prefix(family, tiny_loaded):
    model = tiny_loaded(family)
    doc, q = ids_of(45, 6), ids_of(7, 7)
    for ratio in (0.0, 0.15, 1.0):
        engine = engine_with(model, TieredStore(MemoryTier(1 << 26)), recompute_ratio=ratio)
        for _ in range(2):  # precomputed, then loaded
            result = engine.generate(Prompt.of(documents=[doc], suffix=q), GREEDY)
            assert result.token_ids == baseline(model, doc + q), ratio
        assert result.cached_tokens == 45 - result.recomputed_tokens


def test_documents_in_any_order_repeated_and_at_the_end(tiny_loaded):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 26))
    engine = engine_with(model, store, recompute_ratio=0.2)
    engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY)
    engine.flush()  # the saves are asynchronous: count the puts once they are done
    puts = store.stats()["memory"]["puts"]
    # other positions: keys moved
    swapped = engine.generate(Prompt.of(PREFIX, DOCS[::-1], SUFFIX), GREEDY)
    assert swapped.stored_chunks == 0 and store.stats()["memory"]["puts"] == puts
    assert swapped.hit_tiers == ("memory",) * 4 and swapped.recomputed_tokens == round(0.2 * 110)
    twice = engine.generate(Prompt.of(PREFIX, [DOCS[0], DOCS[1], DOCS[0]], SUFFIX), GREEDY)
    assert twice.hit_tiers == ("memory",) * 4 and len(twice.token_ids) == GREEDY.max_tokens
    # no question: the last token is computed
    ending = engine.generate(Prompt.of(PREFIX, DOCS), GREEDY)
    assert len(ending.token_ids) == GREEDY.max_tokens and ending.recomputed_tokens == round(
        0.2 * 109
    )


def test_a_blended_prompt_is_stored_and_reused_as_an_exact_prefix(tiny_loaded):
    model = tiny_loaded("qwen3")
    store = TieredStore(MemoryTier(1 << 26))
    engine = engine_with(model, store, recompute_ratio=0.2, store_blended=True)
    first = engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY)
    # prefix chunk, three documents, the blended chain (130 // 16)
    assert first.stored_chunks == 1 + 3 + 8
    other_question = ids_of(12, 8)
    hit = engine.generate(Prompt.of(PREFIX, DOCS, other_question), GREEDY)
    assert (
        hit.hit_tiers == ("memory",) * 8 and hit.recomputed_tokens == 0 and hit.cached_tokens == 128
    )
    # the chain: the prefix keys of everything before the question, in the namespace of the blend settings
    chain = prefix_keys(PREFIX + sum(DOCS, []), CH, engine.namespace(blend=engine.cache.blend))
    assert all(store.memory.get(k) is not None for k in chain)
    # other blend settings or a plain prompt with the same tokens never see the blended KV
    other = Engine(
        model, store, EngineSettings.of(chunk_size=CH, blend=BlendOptions(recompute_ratio=0.5))
    )
    assert other.generate(Prompt.of(PREFIX, DOCS, other_question), GREEDY).recomputed_tokens == 55
    flat = engine.generate(PREFIX + sum(DOCS, []) + other_question, GREEDY)
    assert flat.cached_tokens == 16 and flat.token_ids == baseline(
        model, PREFIX + sum(DOCS, []) + other_question
    )


def test_a_question_aware_blend_is_stored_for_its_question_only(tiny_loaded):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 26))
    engine = engine_with(model, store, recompute_ratio=0.2, method="hkvd-attn", store_blended=True)
    first = engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY)
    assert first.recomputed_tokens == 22 and first.stored_chunks == 1 + 3 + 8
    # the selection follows the question
    other = engine.generate(Prompt.of(PREFIX, DOCS, ids_of(9, 12)), GREEDY)
    assert other.recomputed_tokens == 22
    # the very same prompt: an exact prefix hit
    same = engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY)
    assert (
        same.recomputed_tokens == 0
        and same.cached_tokens == 128
        and same.hit_tiers == ("memory",) * 8
    )


def test_attention_selection_picks_what_the_question_attends_to(runner):
    from kvfuse.blend.blender import _attention_mass

    r = runner("llama")
    ids = PREFIX + sum(DOCS, []) + SUFFIX
    kv, spans, s = blended_cache(r, PREFIX, DOCS, len(SUFFIX), torch.float32)
    r.forward(SUFFIX, kv, positions=torch.arange(s, len(ids)), logits="none", start=s)
    h = r.embed(torch.tensor(SUFFIX))
    for layer in range(1):
        h_next = r.layer(layer, h, kv, slice(s, len(ids)), kv_len=len(ids))
    q, _, _ = r.project(1, h_next, kv.positions[s : len(ids)])
    doc_slots = torch.arange(spans[0][0], s)
    mass = _attention_mass(r, 1, q, torch.arange(s, len(ids)), kv, len(ids), doc_slots)
    assert mass.shape == (110,) and (mass >= 0).all()
    # the whole distribution of every head and query sums to 1: the documents get part of it
    total = _attention_mass(
        r, 1, q, torch.arange(s, len(ids)), kv, len(ids), torch.arange(len(ids))
    )
    assert float(total.sum()) == pytest.approx(r.config.num_heads * len(SUFFIX), rel=1e-4)
    assert 0 < float(mass.sum()) < float(total.sum())


def test_documents_on_disk_load_layer_by_layer_and_are_promoted(tiny_loaded, tmp_path):
    model = tiny_loaded("gemma3")
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    warm = TieredStore(MemoryTier(1 << 26), [DiskTier(tmp_path, 1 << 30)])
    first = engine_with(model, warm, recompute_ratio=0.15)
    expected = first.generate(prompt, GREEDY)
    first.close()  # its saves flushed, then the store closed
    # a restart: documents on disk only
    store = TieredStore(MemoryTier(1 << 26), [DiskTier(tmp_path, 1 << 30)])
    engine = engine_with(model, store, recompute_ratio=0.15)
    cold = engine.generate(prompt, GREEDY)
    assert cold.token_ids == expected.token_ids and cold.hit_tiers == ("disk",) * 4
    # the prefix chunk fetched whole, 3 documents rebuilt; promoted off the step, by the saver
    assert engine.flush(10) and store.stats()["store"]["promotions"] == 4
    warm_again = engine.generate(prompt, GREEDY)
    assert warm_again.hit_tiers == ("memory",) * 4 and warm_again.token_ids == expected.token_ids


def test_a_damaged_document_on_disk_is_computed_again_mid_blend(tiny_loaded, tmp_path):
    model = tiny_loaded("llama")
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    warm = TieredStore(MemoryTier(1 << 26), [DiskTier(tmp_path, 1 << 30)])
    engine = engine_with(model, warm, recompute_ratio=0.15)
    expected = engine.generate(prompt, GREEDY)
    ns = engine.namespace()
    engine.close()  # its saves flushed, then the store closed
    (path,) = tmp_path.rglob(key_to_filename(document_key(DOCS[1], ns)))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x20  # in the last layer: found only when the blend gets there
    path.write_bytes(bytes(data))
    store = TieredStore(MemoryTier(1 << 26), [DiskTier(tmp_path, 1 << 30)])
    engine = engine_with(model, store, recompute_ratio=0.15)
    again = engine.generate(prompt, GREEDY)
    assert again.token_ids == expected.token_ids and again.stored_chunks == 1  # the document again
    assert again.hit_tiers == (
        "memory",
        "disk",
        "disk",
    )  # the prefix chunk was promoted by the first attempt
    assert (
        engine.stats_snapshot()["chunk_load_failures"] == 1
        and store.stats()["store"]["unusable_entries"] == 1
    )
    store.flush()
    assert engine.generate(prompt, GREEDY).hit_tiers == ("memory",) * 4


def test_documents_need_the_cache_and_tokens(tiny_loaded):
    model = tiny_loaded("llama")
    engine = engine_with(model, TieredStore(MemoryTier(1 << 26)))
    with pytest.raises(ValueError, match="cache"):
        engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY, cache=CacheOptions(enabled=False))
    with pytest.raises(ValueError, match="empty"):
        Prompt.of(PREFIX, [DOCS[0], []], SUFFIX)
    with pytest.raises(ValueError, match="context window"):
        engine.generate(Prompt.of(PREFIX, [ids_of(4090, 9)], SUFFIX), GREEDY)
    with pytest.raises(ValueError, match="check_layer"):
        # the tiny llama has 3 layers
        Engine(model, None, EngineSettings.of(blend=BlendOptions(check_layer=3)))


def test_score_gives_teacher_forced_logits_through_the_request_path(tiny_loaded):
    model = tiny_loaded("gemma3")
    r = model.runner
    cont_a, cont_b = ids_of(5, 10), ids_of(3, 11)
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    ref = r.forward(prompt.ids + cont_a, r.new_cache(dtype=torch.float16), logits="all")[
        len(prompt) - 1 :
    ]
    engine = engine_with(model, TieredStore(MemoryTier(1 << 26)), recompute_ratio=1.0)
    a, b = engine.score(prompt, [cont_a, cont_b])
    assert a.shape == (6, r.config.vocab_size) and b.shape == (4, r.config.vocab_size)
    assert (a - ref).abs().max() <= 1e-3 and torch.equal(a[0], b[0])
    (reuse_a,) = engine.score(
        prompt, [cont_a], blend=BlendOptions(recompute_ratio=0.0, store_blended=False)
    )
    assert (reuse_a - ref).abs().max() > 1e-3  # full reuse is not a prefill ...
    # ... and a plain prompt without a cache is
    plain = Engine(model, None).score(prompt.ids, [cont_a])[0]
    assert (plain - ref).abs().max() <= 1e-3
