"""Log-probabilities of tokens under the model's raw distribution (the log-softmax of the logits
before penalties, bias, constraints and temperature: vLLM's default ``raw_logprobs``), each with
the most likely alternatives, as the APIs report them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """``token``'s log-probability and the ``top`` most likely tokens ``(id, logprob)``, most
    likely first (the chosen token may or may not be among them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities, in float32 whatever the logits' dtype (last dimension)."""
    return torch.log_softmax(logits.float(), dim=-1)


def entry(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The entry of ``token`` from one row of log-probabilities, with ``top`` alternatives."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry under the distribution of one raw logits vector."""
    return entry(log_softmax(logits), token, top)


def rows_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per row of ``logits`` ``(n, vocab)``: row ``i`` scored at ``tokens[i]``."""
    lp = log_softmax(logits)
    return [entry(lp[i], t, top) for i, t in enumerate(tokens)]
