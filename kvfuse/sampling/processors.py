"""Logits processors: pure functions from a logits vector (and what the sequence has seen) to
the adjusted logits, each as vLLM and OpenAI define it. None changes its input in place.

In the order the engine applies them (vLLM's): ``logit_bias``, ``repetition_penalty``,
``frequency_presence`` on the raw logits; then, when sampling, ``temperature``, ``min_p``,
``top_k``, and ``top_p_filter`` on the probabilities. A removed token's logit is ``-inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: ``bias`` (token id, value in [-100, 100]) added to those tokens'
    logits. Ids outside the vector are ignored (the caller checked them against the vocabulary)."""
    if not bias:
        return logits
    n = logits.shape[-1]
    ids = torch.tensor([i for i, _ in bias if 0 <= i < n], dtype=torch.int64)
    values = torch.tensor([b for i, b in bias if 0 <= i < n], dtype=logits.dtype)
    return logits.index_add(-1, ids, values)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's / Hugging Face's ``repetition_penalty`` over the tokens ``seen`` (a bool mask over
    the vocabulary: in the prompt or generated): a positive logit is divided by ``penalty``, a
    negative one multiplied by it (> 1 discourages repeating, < 1 encourages it)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def frequency_presence(
    logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's penalties over the generated tokens: ``counts[j] * frequency + (counts[j] > 0) *
    presence`` subtracted from token ``j``'s logit (``counts``: how often each token was
    generated)."""
    if frequency == 0.0 and presence == 0.0:
        return logits
    c = counts.to(logits.dtype)
    return logits - c * frequency - (c > 0).to(logits.dtype) * presence


def temperature(logits: torch.Tensor, t: float) -> torch.Tensor:
    return logits / t


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """vLLM's ``min_p``: remove the tokens whose probability is below ``p`` times the most likely
    token's (a ratio of probabilities: ``exp(logit - max)``, so no softmax is needed)."""
    if p <= 0.0:
        return logits
    keep = (logits - logits.max()) >= torch.log(torch.tensor(p, dtype=logits.dtype))
    return logits.masked_fill(~keep, NEG_INF)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits (and any tied with the k-th); 0 or k >= vocabulary: all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)
    # mass of strictly more likely tokens
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = before >= top_p
    # the most likely token always stays (a top_p that rounds to 0 keeps just it)
    drop[..., 0] = False
    sorted_probs[drop] = 0.0
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum()


def token_counts(ids: Sequence[int], vocab: int) -> torch.Tensor:
    """How often each token of a ``vocab``-sized vocabulary occurs in ``ids`` (ids beyond it are
    left out)."""
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    t = t[(t >= 0) & (t < vocab)]
    return torch.bincount(t, minlength=vocab)
