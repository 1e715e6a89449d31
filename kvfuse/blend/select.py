"""Which document tokens a blend recomputes: pure functions of deviations and document spans.

All indices are relative to the start of the documents; spans are ``[start, end)`` of each
document. A selection is a sorted ``int64`` tensor without duplicates. Ties are broken by
position (the earlier token first), so a selection is deterministic for any input.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Spans = Sequence[tuple[int, int]]


def budget(n: int, ratio: float) -> int:
    """Tokens to recompute out of ``n`` at ``ratio``: rounded half up, at least one when the ratio
    is above 0 (a budget that rounds to nothing would silently be full reuse), at most ``n``."""
    if n <= 0 or ratio <= 0:
        return 0
    return min(n, max(1, math.floor(ratio * n + 0.5)))


def top_k(scores: torch.Tensor, k: int, among: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` highest-scoring indices (of ``among``, default all), sorted; ties go to the lower index."""
    idx = torch.arange(scores.shape[0]) if among is None else among
    if k <= 0 or idx.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    order = torch.sort(-scores[idx].float(), stable=True).indices[:k]
    return torch.sort(idx[order]).values


def head_scores(deviation: torch.Tensor) -> torch.Tensor:
    """One score per token from per-head deviations ``(n, heads)``: each head scaled to its mean
    (heads differ in scale), then the largest."""
    mean = deviation.float().mean(dim=0, keepdim=True).clamp_min(1e-12)
    return (deviation.float() / mean).amax(dim=1)


def first_tokens(spans: Spans, k: int) -> list[int]:
    """The first ``k`` tokens of every span (fewer for a shorter span)."""
    return [i for s, e in spans for i in range(s, min(e, s + k))]


def round_robin_firsts(spans: Spans, n: int) -> list[int]:
    """``n`` tokens taken as the first of every span, then the second of every span, ...: each
    document's leading tokens (its attention sinks) share the budget evenly."""
    out, depth = [], 0
    longest = max((e - s for s, e in spans), default=0)
    while len(out) < n and depth < longest:
        for s, e in spans:
            if s + depth < e and len(out) < n:
                out.append(s + depth)
        depth += 1
    return out


def select(
    method: str, deviation: torch.Tensor, spans: Spans, ratio: float, sink_tokens: int = 4
) -> torch.Tensor:
    """The document tokens to recompute (see ``BlendOptions.method``). ``deviation`` is ``(n,)``
    (or ``(n, heads)`` for ``hkvd-head``), one row per document token, on any device; the
    selection (a CPU tensor) is computed on the CPU: a CUDA deviation would otherwise index the
    CPU candidate list with CUDA indices, which PyTorch refuses."""
    deviation = deviation.detach().cpu()
    n = deviation.shape[0]
    if sum(e - s for s, e in spans) != n:
        raise ValueError(f"spans cover {sum(e - s for s, e in spans)} tokens, deviation has {n}")
    k = budget(n, ratio)
    if method in (
        "hkvd",
        "attn",
        "hkvd-attn",
    ):  # the scores are the deviation, or what the blend combined
        return top_k(deviation, k)
    if method == "attn+hkvd":  # bench-only: (n, 2) columns, deviation then attention
        return half_each(deviation[:, 1], deviation[:, 0], k)
    if method == "hkvd-head":
        return top_k(head_scores(deviation) if deviation.dim() == 2 else deviation, k)
    if method == "sinks":
        return torch.tensor(sorted(round_robin_firsts(spans, k)), dtype=torch.int64)
    if method == "sinks+hkvd":
        sinks = first_tokens(spans, sink_tokens)[:k] if k else []
        rest = torch.ones(n, dtype=torch.bool)
        rest[sinks] = False
        extra = top_k(deviation, k - len(sinks), among=torch.nonzero(rest).flatten())
        return torch.sort(torch.cat([torch.tensor(sinks, dtype=torch.int64), extra])).values
    raise ValueError(f"unknown selection method {method!r}")


# Selections the bench measures that are not (yet) a ``blend.method`` of the configuration:
# ``blend_prefill(..., selection=...)`` takes them (see ``docs/blend.md`` for what they measured).
BENCH_METHODS = ("attn+hkvd",)


def half_each(first: torch.Tensor, second: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` indices: the ``k // 2`` (rounded up) best by ``first``, then the best of the rest by
    ``second``, sorted. Query-aware selection combined with HKVD: the question's attention picks
    the tokens it reads, which deviation ranking crowds out (ProphetKV), and deviation the rest."""
    n = first.shape[0]
    a = top_k(first, (k + 1) // 2)
    rest = torch.ones(n, dtype=torch.bool)
    rest[a] = False
    b = top_k(second, k - a.numel(), among=torch.nonzero(rest).flatten())
    return torch.sort(torch.cat([a, b])).values


def with_suffix(selected: torch.Tensor, n_docs: int, n_suffix: int) -> torch.Tensor:
    """Row indices over ``[documents][suffix]``: the selected document tokens, then every suffix
    token (the suffix has no cached KV: it is always computed)."""
    return torch.cat([selected.to(torch.int64), torch.arange(n_docs, n_docs + n_suffix)])


def gradual_ratios(ratio: float, steps: int = 3, start: float = 2.0) -> list[float]:
    """Recompute ratios for the check layer and the ``steps`` layers after it: ``start`` times the
    budget first, shrinking linearly to the budget (capped at 1)."""
    first = min(1.0, ratio * start)
    return [first + (ratio - first) * i / steps for i in range(steps + 1)]
