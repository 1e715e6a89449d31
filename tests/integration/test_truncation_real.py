"""Truncation with the real models' chat templates and tokenizers: the cut found with O(log turns)
renders keeps the same turns and ids as the reference scan over every cut."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvfuse.models import Tokenizer
from kvfuse.models.registry import pull
from kvfuse.prompts import PromptBuilder
from kvfuse.prompts.truncate import drop_oldest_turns

pytestmark = pytest.mark.integration

WORDS = "the harbour town of Velmora sits where the river meets 42 sea 🚀 ünï".split()


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def tokenizer(request, kvfuse_home):
    return Tokenizer(pull(request.param, kvfuse_home))


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(rng: random.Random) -> list[dict]:
    """Alternating turns (what every template accepts), with or without a system prompt."""
    out = [{"role": "system", "content": text(rng, 5)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 12)):
        out.append({"role": "user", "content": text(rng, rng.randint(1, 30))})
        out.append({"role": "assistant", "content": text(rng, rng.randint(1, 40))})
    out.append({"role": "user", "content": text(rng, rng.randint(1, 30))})
    return out


def test_truncation_matches_the_reference_with_real_templates(tokenizer):
    rng = random.Random(7)
    model = SimpleNamespace(
        tokenizer=tokenizer, config=SimpleNamespace(vocab_size=1 << 20, max_position_embeddings=0)
    )
    for trial in range(40):
        messages = conversation(rng)
        window, reserve = rng.randint(30, 500), rng.randint(0, 32)
        got = PromptBuilder(model, window).encode_chat(messages, reserve)
        ids = tokenizer.encode_chat(messages)
        want = (ids, 0)
        if len(ids) + reserve > window:
            kept = drop_oldest_turns(
                messages, lambda m: len(tokenizer.encode_chat(m)) + reserve <= window
            )
            if kept is not None:
                want = (tokenizer.encode_chat(kept), len(messages) - len(kept))
        assert got == want, trial
