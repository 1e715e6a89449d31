"""Automatic reuse on tiny random models (CPU): passages of a plain prompt found in the tiers at
other positions (content-defined chunks stored by earlier prompts) are loaded and blended; a
budget of 1 answers as a full prefill; off, ``prefix`` blends, documents and small prompts behave
as before; a blended prompt stores no approximate KV under exact keys; a damaged span is
planned around."""

from __future__ import annotations

import pytest
import torch

from kvfuse.blend import BlendOptions
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.kv.keys import ChunkKind, prefix_keys
from kvfuse.reuse.auto_reuse import AutoReuse
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

CH = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = ids_of(20, 1)
P = [ids_of(90, 2), ids_of(70, 3), ids_of(110, 4)]  # three passages
Q1, Q2 = ids_of(9, 5), ids_of(11, 6)
FIRST = SYSTEM + P[0] + P[1] + P[2] + Q1  # stores the passages' chunks
# the same passages, other order, after another start
SECOND = ids_of(7, 7) + P[2] + P[0] + P[1] + Q2


def engine_with(model, store, auto="on", min_tokens=64, history=False, **blend) -> Engine:
    options = BlendOptions(
        **{
            "recompute_ratio": 0.2,
            "store_blended": False,
            "auto": auto,
            "auto_min_tokens": min_tokens,
            **blend,
        }
    )
    return Engine(model, store, EngineSettings.of(chunk_size=CH, history=history, blend=options))


def baseline(model, ids) -> list[int]:
    return Engine(model, None, EngineSettings.of(chunk_size=CH)).generate(ids, GREEDY).token_ids


def content_entries(store) -> int:
    return sum(1 for k in store.memory.keys() if k.kind is ChunkKind.CONTENT)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_passages_seen_in_another_order_are_reused_and_blended(family, tiny_loaded):
    model = tiny_loaded(family)
    store = TieredStore(MemoryTier(1 << 27))
    engine = engine_with(model, store)
    first = engine.generate(FIRST, GREEDY)
    engine.flush()
    assert (
        first.auto_reuse == "none_found"
        and first.span_reused_tokens == 0
        and content_entries(store) > 10
    )
    second = engine.generate(SECOND, GREEDY)
    passages = sum(map(len, P))
    assert second.auto_reuse == "blended" and second.blend is not None
    assert second.span_reused_tokens >= 0.6 * passages - second.recomputed_tokens
    assert second.recomputed_tokens > 0 and second.prefix_reused_tokens == 0
    assert second.cached_tokens == second.span_reused_tokens
    stats = engine.stats_snapshot()
    assert (
        stats["span_hits"] > 0
        and stats["span_misses"] > 0
        and stats["auto_requests"] == {"none_found": 1, "blended": 1}
    )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma3"])
def test_a_budget_of_one_answers_as_a_full_prefill(family, tiny_loaded):
    model = tiny_loaded(family)
    engine = engine_with(model, TieredStore(MemoryTier(1 << 27)), recompute_ratio=1.0)
    engine.generate(FIRST, GREEDY)
    engine.flush()
    got = engine.generate(SECOND, GREEDY)
    assert (
        got.auto_reuse == "blended" and got.span_reused_tokens == 0 and got.recomputed_tokens > 100
    )
    assert got.token_ids == baseline(model, SECOND)


def test_off_by_default_and_per_request(tiny_loaded):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 27))
    on = engine_with(model, store)
    on.generate(FIRST, GREEDY)
    on.flush()
    off = engine_with(model, store, auto="off")
    plain = off.generate(SECOND, GREEDY)
    assert (plain.auto_reuse, plain.span_reused_tokens, plain.cached_tokens) == ("off", 0, 0)
    assert plain.token_ids == baseline(model, SECOND)
    assert plain.cached_tokens == 0
    third = ids_of(5, 8) + P[1] + P[2] + P[0] + Q1  # SECOND is an exact prefix hit now
    asked = off.generate(third, GREEDY, cache=CacheOptions(auto_reuse=True))
    assert asked.auto_reuse == "blended" and asked.span_reused_tokens > 0
    refused = on.generate(
        ids_of(6, 9) + P[1] + P[0] + Q1, GREEDY, cache=CacheOptions(auto_reuse=False)
    )
    assert refused.auto_reuse == "off" and refused.span_reused_tokens == 0
    repeated = on.generate(SECOND, GREEDY)  # an exact prefix hit: nothing after it to look up
    assert repeated.auto_reuse == "none_found" and repeated.prefix_reused_tokens == len(SECOND) - 1


def test_a_prefix_profile_blends_nothing(tiny_loaded):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 27))
    engine_with(model, store).generate(FIRST, GREEDY)
    # what auto gives a model whose blends lose answers
    engine = engine_with(model, store, method="prefix")
    got = engine.generate(SECOND, GREEDY)
    assert (got.auto_reuse, got.span_reused_tokens, got.recomputed_tokens) == ("prefix", 0, 0)
    assert got.token_ids == baseline(model, SECOND)
    before = content_entries(store)
    engine.generate(SYSTEM + P[1] + ids_of(200, 9), GREEDY)
    engine.flush()
    assert content_entries(store) == before  # nothing stored for spans it will never use


def test_documents_and_short_prompts(tiny_loaded):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 27))
    engine = engine_with(model, store, min_tokens=400)
    short = engine.generate(FIRST, GREEDY)  # 299 tokens: looks up, stores no content chunks
    engine.flush()
    assert short.auto_reuse == "none_found" and content_entries(store) == 0
    docs = engine.generate(Prompt.of(SYSTEM, P, Q1), GREEDY)
    assert docs.auto_reuse == "skipped" and docs.span_reused_tokens == 0
    assert (
        AutoReuse(True).status(
            CacheOptions(enabled=False), BlendOptions(), cached=False, plain=True
        )
        == "skipped"
    )


@pytest.mark.parametrize("history", [False, True])
def test_a_blended_prompt_stores_no_approximate_kv_under_exact_keys(tiny_loaded, history):
    model = tiny_loaded("llama")
    store = TieredStore(MemoryTier(1 << 27))
    engine = engine_with(model, store, history=history)
    engine.generate(FIRST, GREEDY)
    engine.flush()
    records = engine.stats_snapshot().get("history_records", 0)
    second = engine.generate(SECOND, GREEDY)
    engine.flush()
    assert engine.stats_snapshot().get("history_records", 0) == records  # no history of blended KV
    chain = prefix_keys(SECOND, CH, engine.namespace())
    held = [store.memory.contains(k) for k in chain]
    assert held[0] and not any(held[1:])  # only the chunk before the first found span
    assert second.stored_chunks > 1  # the chunks between the found spans were stored as content
    again = engine.generate(SECOND, GREEDY)  # found again: every passage chunk
    assert again.auto_reuse == "blended" and again.span_reused_tokens > second.span_reused_tokens


def test_found_spans_on_disk_and_a_damaged_one(tiny_loaded, tmp_path):
    model = tiny_loaded("llama")
    warm = TieredStore(MemoryTier(1 << 27), [DiskTier(tmp_path, 1 << 28)])
    writer = engine_with(model, warm, recompute_ratio=1.0)
    writer.generate(FIRST, GREEDY)
    writer.flush()  # the saves are asynchronous: let them reach the store before it closes
    warm.close()
    files = sorted(tmp_path.rglob("*_3Ac_3A*.kvf"))
    assert len(files) > 10
    for path in files[:3]:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x20
        path.write_bytes(bytes(data))
    # a restart: chunks on disk only
    store = TieredStore(MemoryTier(1 << 27), [DiskTier(tmp_path, 1 << 28)])
    engine = engine_with(model, store, recompute_ratio=1.0)
    got = engine.generate(SECOND, GREEDY)
    assert got.auto_reuse == "blended" and set(got.hit_tiers) == {"disk"}
    assert got.token_ids == baseline(model, SECOND)
    assert store.stats()["store"]["unusable_entries"] >= 1
