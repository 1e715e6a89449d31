"""The engine end to end on a CUDA GPU, as a server runs it (``device: cuda``, the default compute
dtype there: bfloat16; KV float16): a repeated prompt is a prefix hit from memory, then from disk
after a restart, with the answer of the first run; KV computed by the CPU engine serves the GPU
engine; and the configuration path (``runtime.open_engine``) puts the model on the device.
Tolerances: ``cuda_helpers``."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import DEVICE, assert_same_or_near_tie, greedy, tie_gap
from kvfuse_helpers import long_text, model_home

from kvfuse.config import EngineSettings, load_config
from kvfuse.engine import CacheOptions, Engine
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier

CH = 256
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def served(smollm2_cpu, device):
    """SmolLM2 loaded as ``kvfuse serve --device cuda`` loads it (``load_model``, dtype auto)."""
    from kvfuse.models import load_model

    model = load_model("smollm2", home=model_home(), device=str(device))
    assert model.runner.device.type == DEVICE.type
    assert model.runner.dtype == (torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    # one namespace: CPU and GPU engines share entries
    assert model.fingerprint == smollm2_cpu.fingerprint
    return model


def chat(model, question: str, paragraphs: int = 7) -> list[int]:
    return model.tokenizer.encode_chat(
        [{"role": "user", "content": long_text(paragraphs) + "\n\n" + question}]
    )


def test_a_repeated_prompt_is_a_prefix_hit_with_the_same_answer(served, tmp_path):
    ids = chat(served, "Who built the lighthouse?")
    assert len(ids) > 2 * CH
    whole = len(ids) // CH * CH
    settings = EngineSettings.of(chunk_size=CH, history=False)
    engine = Engine(
        served, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )
    first = engine.generate(ids, PARAMS)
    again = engine.generate(ids, PARAMS)
    engine.close()
    assert first.cached_tokens == 0 and first.stored_chunks == whole // CH
    assert again.cached_tokens == whole and set(again.hit_tiers) == {"memory"}
    engine = Engine(
        served, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )  # a restart
    cold = engine.generate(ids, PARAMS)
    engine.close()
    assert cold.cached_tokens == whole and set(cold.hit_tiers) == {"disk"}
    # the same numbers loaded as computed: the same answer, unless the suffix's smaller matmuls
    # round a near-tie the other way
    ref, gaps = greedy(served.runner, ids, PARAMS.max_tokens)
    limit = tie_gap(served.runner.dtype, served.runner.forward(ids, served.runner.new_cache()))
    assert_same_or_near_tie(first.token_ids, ref, gaps, limit, "first run vs a plain greedy run")
    assert_same_or_near_tie(
        again.token_ids, first.token_ids, gaps, limit, "memory hit vs first run"
    )
    assert_same_or_near_tie(cold.token_ids, first.token_ids, gaps, limit, "disk hit vs first run")
    assert cold.token_ids == again.token_ids  # the same entries loaded the same way


def test_kv_computed_by_the_cpu_engine_serves_the_gpu_engine(smollm2_cpu, served, tmp_path):
    ids = chat(served, "What happens every spring?")
    whole = len(ids) // CH * CH
    settings = EngineSettings.of(chunk_size=CH, history=False)
    cpu = Engine(
        smollm2_cpu, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )
    cpu.generate(ids, SamplingParams(max_tokens=1))
    cpu.close()
    engine = Engine(
        served, TieredStore(MemoryTier(1 << 30), [DiskTier(tmp_path, 1 << 30)]), settings
    )
    hit = engine.generate(ids, PARAMS)
    plain = engine.generate(ids, PARAMS, cache=CacheOptions(enabled=False))
    engine.close()
    assert hit.cached_tokens == whole and set(hit.hit_tiers) == {"disk"}
    ref, gaps = greedy(served.runner, ids, PARAMS.max_tokens)
    limit = tie_gap(served.runner.dtype, served.runner.forward(ids, served.runner.new_cache()))
    assert_same_or_near_tie(plain.token_ids, ref, gaps, limit, "GPU full prefill")
    assert_same_or_near_tie(
        hit.token_ids, plain.token_ids, gaps, limit, "GPU over the CPU's KV vs GPU full prefill"
    )


def test_the_configuration_path_runs_the_model_on_the_device(served, tmp_path):
    from kvfuse.runtime import open_engine

    config = load_config(
        overrides={
            "home": str(model_home()),
            "model": "smollm2",
            "device": str(DEVICE),
            "cache.disk": False,
            "cache.history": False,
        }
    )
    engine = open_engine(config, model=None)
    try:
        assert engine.model.runner.device.type == DEVICE.type
        ids = engine.model.tokenizer.encode_chat(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        r = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0))
        assert "Paris" in r.text
    finally:
        engine.close()
