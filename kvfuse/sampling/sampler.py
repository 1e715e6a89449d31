"""``Sampler``: the next token from one logits vector, already adjusted by the bias and penalties
(``history``) and masked by any constraint: argmax when greedy, else temperature, min-p, top-k,
top-p and a draw from the sequence's own seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import processors

# ``kvfuse.generation.SamplingParams``, by duck type: generation builds on this package, so this
# package does not import it (not even for type checking: the layout test forbids the cycle).
SamplingParams = Any


@dataclass
class Sampler:
    """Picks the next token; ``seed`` is this choice's (``seeds.choice_seed``; None: the params'
    seed, and without one a random seed)."""

    params: SamplingParams
    seed: int | None = None
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        seed = self.seed if self.seed is not None else self.params.seed
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = processors.temperature(logits.float().cpu(), p.temperature)
        logits = processors.min_p(logits, p.min_p)
        logits = processors.top_k(logits, p.top_k)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            probs = processors.top_p_filter(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))
