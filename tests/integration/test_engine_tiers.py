"""SmolLM2 through the engine with hits from each tier (memory, disk, Redis) and with the int8 codec."""

from __future__ import annotations

import pytest
from kvfuse_helpers import load_builtin, long_text

from kvfuse.config import EngineSettings
from kvfuse.engine import Engine
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier, RedisTier

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin("smollm2")


@pytest.fixture(scope="module")
def prompt(smollm2) -> list[int]:
    ids = smollm2.tokenizer.encode(
        long_text() + "\n\nQuestion: Who built the lighthouse of Velmora?\nAnswer:"
    )
    assert 512 < len(ids) < 768, len(ids)  # two whole chunks of 256 and a tail
    return ids


@pytest.fixture(scope="module")
def expected(smollm2, prompt) -> list[int]:
    return Engine(smollm2, None).generate(prompt, GREEDY).token_ids


def test_hits_from_memory_and_disk_give_the_same_output(smollm2, prompt, expected, tmp_path):
    def store():
        return TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)])

    with store() as s:
        engine = Engine(smollm2, s, EngineSettings.of(history=False))
        first = engine.generate(prompt, GREEDY)
        assert (first.cached_tokens, first.stored_chunks) == (0, 2) and first.token_ids == expected
        hit = engine.generate(prompt, GREEDY)
        assert (hit.cached_tokens, hit.hit_tiers) == (512, ("memory", "memory"))
        assert hit.token_ids == expected
    with store() as s:  # a restart: empty memory, the same directory
        hit = Engine(smollm2, s, EngineSettings.of(history=False)).generate(prompt, GREEDY)
        assert (hit.cached_tokens, hit.hit_tiers) == (512, ("disk", "disk"))
        assert hit.token_ids == expected


def test_hits_from_redis_give_the_same_output(smollm2, prompt, expected, redis_server):
    # a memory tier too small for any chunk: every read has to come from Redis
    with TieredStore(MemoryTier(1), [RedisTier(redis_server.url, timeout_s=2.0)]) as s:
        engine = Engine(smollm2, s, EngineSettings.of(history=False))
        first = engine.generate(prompt, GREEDY)
        assert first.stored_chunks == 2 and first.token_ids == expected
        engine.flush()
        hit = engine.generate(prompt, GREEDY)
        assert (hit.cached_tokens, hit.hit_tiers) == (512, ("redis", "redis"))
        assert hit.token_ids == expected
    # a fresh engine with a roomy (empty) memory tier: Redis hits, then promoted into memory
    with TieredStore(MemoryTier(1 << 30), [RedisTier(redis_server.url, timeout_s=2.0)]) as s:
        engine = Engine(smollm2, s, EngineSettings.of(history=False))
        hit = engine.generate(prompt, GREEDY)
        assert hit.hit_tiers == ("redis", "redis") and hit.token_ids == expected
        again = engine.generate(prompt, GREEDY)
        assert again.hit_tiers == ("memory", "memory") and again.token_ids == expected


def test_int8_hits_run_and_their_output_is_reported(
    smollm2, prompt, expected, record_property, capsys
):
    with TieredStore(MemoryTier(1 << 30)) as s:
        engine = Engine(smollm2, s, EngineSettings.of(codec="int8", history=False))
        first = engine.generate(prompt, GREEDY)
        assert first.token_ids == expected  # no hit yet: a plain prefill
        hit = engine.generate(prompt, GREEDY)
    assert hit.cached_tokens == 512 and hit.hit_tiers == ("memory", "memory")
    assert (
        engine.stats_snapshot()["chunk_load_failures"] == 0
        and len(hit.token_ids) == GREEDY.max_tokens
    )
    same = hit.token_ids == expected
    record_property("int8_same_as_fp16", same)
    with capsys.disabled():
        print(
            f"\n[int8] no cache: {first.text!r}\n[int8] int8 hit: {hit.text!r} (identical: {same})"
        )
