"""CacheBlend on a CUDA GPU: the selection and the blended logits against the CPU, ratio 1 against a
full prefill on the device, and the engine's document path on the device (documents precomputed,
loaded at other positions, read layer by layer from disk on the loader thread).

Selections are compared token by token: a token may be chosen on one device and not on the other
only if its deviation on the CPU ties (within 1e-3, relative) with the budget's threshold, the
deviation of the last token the CPU chose. Tolerances of logits: ``cuda_helpers``."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import (
    DEVICE,
    assert_fp32_close,
    assert_half_close,
    assert_same_or_near_tie,
    blended_cache,
    greedy,
    ids_of,
    tie_gap,
)
from kvfuse_helpers import SENTENCES

from kvfuse.blend import BlendOptions, blend_prefill
from kvfuse.blend import select as sel
from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

METHODS = ["hkvd", "hkvd-head", "sinks+hkvd", "attn", "hkvd-attn"]
TINY_PREFIX, TINY_DOCS, TINY_SUFFIX = (
    ids_of(20, 1, 512),
    [ids_of(37, 2, 512), ids_of(29, 3, 512), ids_of(44, 4, 512)],
    ids_of(9, 5, 512),
)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


class Recorder:
    """Wraps ``select``: keeps what each call was given and chose (the deviation on the CPU)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = sel.select

        def record(method, deviation, spans, ratio, sink_tokens=4):
            chosen = real(method, deviation, spans, ratio, sink_tokens)
            self.calls.append(
                (method, deviation.detach().float().cpu(), list(spans), ratio, sink_tokens, chosen)
            )
            return chosen

        monkeypatch.setattr(sel, "select", record)


def assert_same_selection(cpu_call, dev_call, what: str) -> None:
    method, dev_cpu, spans, ratio, sinks, chosen_cpu = cpu_call
    chosen_dev = dev_call[5]
    a, b = set(chosen_cpu.tolist()), set(chosen_dev.tolist())
    assert len(a) == len(b), f"{what}: {len(a)} chosen on the CPU, {len(b)} on the device"
    if a == b:
        return
    scores = sel.head_scores(dev_cpu) if dev_cpu.dim() == 2 else dev_cpu
    fixed = set(sel.first_tokens(spans, sinks)) if method == "sinks+hkvd" else set()
    threshold = min(float(scores[t]) for t in a - fixed)
    for t in a ^ b:
        assert t not in fixed, f"{what}: sink token {t} chosen on one device only"
        gap = abs(float(scores[t]) - threshold)
        assert gap <= 1e-3 * abs(threshold) + 1e-9, (
            f"{what}: token {t} chosen on one device only, its deviation {float(scores[t]):.6g} is not a tie "
            f"with the threshold {threshold:.6g}"
        )


def test_select_takes_scores_on_the_device(device):
    """The selection runs on the CPU whatever device the deviations are on (a CUDA deviation used to
    index the CPU candidates with CUDA indices)."""
    g = torch.Generator().manual_seed(3)
    spans = [(0, 37), (37, 66), (66, 110)]
    for method, dev in (
        ("hkvd", torch.rand(110, generator=g)),
        ("hkvd-head", torch.rand(110, 3, generator=g)),
        ("sinks+hkvd", torch.rand(110, generator=g)),
        ("sinks", torch.rand(110, generator=g)),
    ):
        on_cpu = sel.select(method, dev, spans, 0.2)
        on_dev = sel.select(method, dev.to(device), spans, 0.2)
        assert on_dev.device.type == "cpu" and torch.equal(on_dev, on_cpu), method


# ------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma3"])
def test_ratio_one_on_the_device_is_a_full_prefill(family, tiny_on):
    r = tiny_on(family).runner
    ids = TINY_PREFIX + sum(TINY_DOCS, []) + TINY_SUFFIX
    full = r.forward(ids, r.new_cache(dtype=torch.float16), logits="last")
    for method in METHODS:
        kv, spans, s = blended_cache(r, TINY_PREFIX, TINY_DOCS, len(TINY_SUFFIX), torch.float16)
        logits, stats = blend_prefill(
            r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=1.0, method=method)
        )
        assert logits.device.type == DEVICE.type
        assert_fp32_close(logits, full, f"{family} {method} ratio 1")
        assert stats.selected == 110


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_partial_blend_selects_and_computes_as_on_the_cpu(
    family, tiny_loaded, tiny_on, monkeypatch
):
    rec = Recorder(monkeypatch)
    ids = TINY_PREFIX + sum(TINY_DOCS, []) + TINY_SUFFIX
    for method in METHODS:
        out = {}
        for where, r in (("cpu", tiny_loaded(family).runner), ("device", tiny_on(family).runner)):
            kv, spans, s = blended_cache(r, TINY_PREFIX, TINY_DOCS, len(TINY_SUFFIX), torch.float32)
            out[where] = blend_prefill(
                r,
                kv,
                ids,
                spans[0][0],
                s,
                spans,
                BlendOptions(recompute_ratio=0.2, method=method, check_layer=0),
            )
        cpu_call, dev_call = rec.calls[-2:]
        assert_same_selection(cpu_call, dev_call, f"{family} {method}")
        if torch.equal(out["cpu"][1].recomputed, out["device"][1].recomputed):
            assert_fp32_close(out["device"][0], out["cpu"][0], f"{family} {method} blended logits")


# ------------------------------------------------------------------------------- SmolLM2


def documents(tok) -> tuple[list[int], list[list[int]], list[int]]:
    prefix = tok.encode_chat([{"role": "system", "content": "Answer from the passages."}])[:-1]
    docs = [
        tok.encode(" ".join(SENTENCES[i:] + SENTENCES[:i]), add_special_tokens=False)
        for i in (0, 3, 5)
    ]
    question = tok.encode(
        "\nQuestion: Who built the lighthouse, and when?\nAnswer:", add_special_tokens=False
    )
    return prefix, docs, question


@pytest.mark.parametrize("method", METHODS)
def test_smollm2_blend_selects_and_computes_as_on_the_cpu(
    method, smollm2_cpu, smollm2_on, monkeypatch
):
    """float32 on both: the same tokens recomputed (up to ties) and, when identical, the same logits."""
    rec = Recorder(monkeypatch)
    prefix, docs, question = documents(smollm2_cpu.tokenizer)
    ids = prefix + sum(docs, []) + question
    out = {}
    for where, r in (("cpu", smollm2_cpu.runner), ("device", smollm2_on(torch.float32).runner)):
        # no fp16 rounding flips
        kv, spans, s = blended_cache(r, prefix, docs, len(question), torch.float32)
        out[where] = blend_prefill(
            r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=0.15, method=method)
        )
    assert_same_selection(rec.calls[-2], rec.calls[-1], f"smollm2 {method}")
    if torch.equal(out["cpu"][1].recomputed, out["device"][1].recomputed):
        assert_fp32_close(out["device"][0], out["cpu"][0], f"smollm2 {method} blended logits")


def test_smollm2_bf16_blend_at_ratio_one_is_its_full_prefill(smollm2_cpu, smollm2_on):
    r = smollm2_on(torch.bfloat16).runner
    prefix, docs, question = documents(smollm2_cpu.tokenizer)
    ids = prefix + sum(docs, []) + question
    kv, spans, s = blended_cache(r, prefix, docs, len(question), torch.float16)
    logits, stats = blend_prefill(
        r, kv, ids, spans[0][0], s, spans, BlendOptions(recompute_ratio=1.0)
    )
    assert stats.selected == sum(len(d) for d in docs)
    full = r.forward(ids, r.new_cache(dtype=torch.float16))
    assert_half_close(logits, full, torch.bfloat16, "bf16 blend at ratio 1 vs bf16 prefill")
    ref = smollm2_cpu.runner.forward(ids, smollm2_cpu.runner.new_cache())
    assert_half_close(logits, ref, torch.bfloat16, "bf16 blend at ratio 1 vs CPU fp32 prefill")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_blends_documents_from_memory_and_layer_by_layer_from_disk(
    dtype, smollm2_cpu, smollm2_on, tmp_path
):
    """The engine on the device: documents precomputed and stored, then a blended prompt with them
    in another order (keys moved) from memory, and after a restart from disk, read layer by layer
    by the loader thread into the device's cache while the blend computes: the same answer each
    time, the same number of tokens recomputed; at ratio 1 the answer of a full prefill."""
    model = smollm2_on(dtype)
    prefix, docs, question = documents(model.tokenizer)
    settings = EngineSettings.of(
        chunk_size=256, blend=BlendOptions(recompute_ratio=0.15, store_blended=False)
    )
    warm = TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)])
    engine = Engine(model, warm, settings)
    # documents computed and stored
    first = engine.generate(Prompt.of(prefix, docs, question), GREEDY)
    swapped = Prompt.of(prefix, docs[::-1], question)
    from_memory = engine.generate(swapped, GREEDY)
    assert set(from_memory.hit_tiers) == {"memory"} and len(from_memory.hit_tiers) >= 3
    n_docs = sum(len(d) for d in docs)
    assert first.recomputed_tokens == from_memory.recomputed_tokens == sel.budget(n_docs, 0.15)
    engine.close()
    # a restart: documents on disk only
    cold = TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)])
    engine = Engine(model, cold, settings)
    from_disk = engine.generate(swapped, GREEDY)
    assert set(from_disk.hit_tiers) == {"disk"} and from_disk.token_ids == from_memory.token_ids
    assert from_disk.recomputed_tokens == from_memory.recomputed_tokens
    engine.close()
    # ratio 1 on the device: the answer of a full prefill of the same prompt
    engine = Engine(
        model,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(
            chunk_size=256, blend=BlendOptions(recompute_ratio=1.0, store_blended=False)
        ),
    )
    # stores the documents
    engine.generate(Prompt.of(prefix, docs, question), SamplingParams(max_tokens=1))
    blended = engine.generate(Prompt.of(prefix, docs, question), GREEDY)
    engine.close()
    assert blended.recomputed_tokens == n_docs
    ids = prefix + sum(docs, []) + question
    ref, gaps = greedy(model.runner, ids, GREEDY.max_tokens)
    limit = tie_gap(dtype, model.runner.forward(ids, model.runner.new_cache()))
    assert_same_or_near_tie(
        blended.token_ids, ref, gaps, limit, f"{dtype} ratio-1 blend vs full prefill"
    )
