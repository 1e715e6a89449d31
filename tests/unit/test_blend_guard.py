"""The online blend guard (``blend.verify_rate``, ``kvfuse.reuse.guard``): the pure comparison and
window rules, and an engine whose blend budget is deliberately wrong falling back to exact prefix
reuse within 50 sampled requests, while an exact budget never does."""

from __future__ import annotations

import pytest
import torch

from kvfuse.blend import BlendOptions
from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.reuse.guard import BlendGuard, Window, compare
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

CH = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits_for(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Rows whose argmax is each of ``tokens``."""
    out = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        out[i, t] = 5.0
    return out


@pytest.mark.parametrize(
    "full,blended,tokens,agree",
    [
        ([1, 2, 3], [1, 2, 3], 3, True),
        ([1, 2, 3], [1, 2, 4], 3, False),
        ([1, 2, 3], [1, 2, 4], 2, True),  # only the first two compared
        ([1, 2, 3], [5, 2, 3], 1, False),
        ([1], [1, 7], 8, True),  # the shorter of the two bounds the comparison
    ],
)
def test_compare_is_argmax_agreement_over_the_first_tokens(full, blended, tokens, agree):
    got, kl = compare(logits_for(full), logits_for(blended), tokens)
    assert got is agree
    assert kl == pytest.approx(0.0, abs=1e-6) if full[0] == blended[0] else kl > 0.1


@pytest.mark.parametrize(
    "outcomes,size,minimum,target,below",
    [
        ([False] * 4, 10, 5, 0.9, False),  # too few to decide
        ([False] * 5, 10, 5, 0.9, True),
        ([True] * 9 + [False], 10, 5, 0.9, False),  # 0.9 is not below 0.9
        ([True] * 8 + [False] * 2, 10, 5, 0.9, True),
        ([False] * 10 + [True] * 10, 10, 5, 0.9, False),  # the old failures rolled out
    ],
)
def test_window_decides_on_the_last_outcomes(outcomes, size, minimum, target, below):
    w = Window(size, minimum, target)
    for o in outcomes:
        w.add(o)
    assert w.below() is below


def test_the_guard_falls_back_and_recovers_and_never_overrides_a_request():
    guard = BlendGuard(BlendOptions(verify_rate=1.0, verify_min=3, verify_window=4), "m")
    config = BlendOptions(recompute_ratio=0.2)
    for _ in range(3):
        guard.record(False, 1.0)
    assert guard.fallback and guard.apply(config).method == "prefix"
    assert guard.apply(config).source == "guard"
    request = config.with_ratio(0.3)  # a client's own budget
    assert guard.apply(request) is request
    for _ in range(4):
        guard.record(True, 0.0)
    assert not guard.fallback and guard.apply(config) is config
    assert guard.counters()["blend_fallbacks"] == 1


def guarded_engine(model, ratio: float) -> Engine:
    blend = BlendOptions(
        recompute_ratio=ratio,
        store_blended=False,
        verify_rate=1.0,
        verify_tokens=4,
        verify_min=8,
        verify_window=16,
        verify_target=0.9,
    )
    return Engine(
        model, TieredStore(MemoryTier(1 << 27)), EngineSettings.of(chunk_size=CH, blend=blend)
    )


def serve_and_verify(engine: Engine, prompts: list[Prompt]) -> int:
    """Answer each prompt, then let the guard check it (the engine is idle in between); the
    number of requests served until the guard fell back (len + 1 if it never did)."""
    for i, prompt in enumerate(prompts, 1):
        engine.generate(prompt, GREEDY)
        while engine.idle_work():
            pass
        if engine.stats_snapshot()["blend_fallback"]:
            return i
    return len(prompts) + 1


def prompts(n: int) -> list[Prompt]:
    docs = [ids_of(24, 100 + i) for i in range(6)]
    return [
        Prompt.of(ids_of(12, 7), [docs[i % 6], docs[(i + 2) % 6], docs[(i + 4) % 6]], ids_of(6, i))
        for i in range(n)
    ]


def test_a_wrong_budget_falls_back_within_50_requests_and_an_exact_one_never(tiny_loaded):
    model = tiny_loaded("llama")
    wrong = guarded_engine(model, 0.0)  # the documents' KV reused as stored: not a full prefill
    served = serve_and_verify(wrong, prompts(50))
    assert served <= 50, wrong.stats_snapshot()
    s = wrong.stats_snapshot()
    assert s["blend_verify_agreement"] < 0.9 and s["blend_fallbacks"] == 1
    after = wrong.generate(prompts(51)[-1], GREEDY)  # blending is off: exact prefix reuse
    assert after.recomputed_tokens == 0 and after.blend.method == "prefix"
    assert after.blend.source == "guard"
    exact = guarded_engine(model, 1.0)  # every token recomputed: a full prefill's answers
    assert serve_and_verify(exact, prompts(12)) == 13
    s = exact.stats_snapshot()
    assert s["blend_verified"] == 12 and s["blend_verify_agreement"] == 1.0
    wrong.close()
    exact.close()
