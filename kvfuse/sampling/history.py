"""What the penalties of one sequence read: how often it generated each token, and which tokens
its prompt holds. Kept up to date one token at a time, so a step costs no recount of the
sequence; the arithmetic itself is ``processors``' pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import processors

# ``kvfuse.generation.SamplingParams``, by duck type: generation builds on this package, so this
# package does not import it (not even for type checking: the layout test forbids the cycle).
SamplingParams = Any


class TokenHistory:
    """The generated-token counts and the prompt's tokens of one sequence, for ``params``'
    logit bias and penalties (``adjust``). Vectors are sized by the first logits seen (the
    model's vocabulary, which can exceed the tokenizer's)."""

    def __init__(
        self, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int] = ()
    ):
        self.params = params
        self._prompt = list(prompt) if params.repetition_penalty != 1.0 else []
        self._pending = list(generated)  # accepted before the vectors exist
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def fork(self) -> TokenHistory:
        """A copy for another choice of the same prompt (before any of its own tokens)."""
        out = TokenHistory(self.params, [])
        out._prompt = self._prompt
        return out

    def _sized(self, vocab: int) -> None:
        if self.counts is None:
            self.counts = processors.token_counts(self._pending, vocab)
            self.seen = processors.token_counts(self._prompt, vocab) > 0
            self._pending = []

    def accept(self, token: int) -> None:
        """``token`` was generated."""
        if self.counts is None:
            self._pending.append(token)
        elif 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The raw ``logits`` with the bias and penalties applied (float32, a new tensor)."""
        p = self.params
        self._sized(logits.shape[-1])
        out = processors.logit_bias(logits.float().cpu(), p.logit_bias)
        if p.repetition_penalty != 1.0:
            out = processors.repetition_penalty(
                out, self.seen | (self.counts > 0), p.repetition_penalty
            )
        return processors.frequency_presence(
            out, self.counts, p.frequency_penalty, p.presence_penalty
        )
