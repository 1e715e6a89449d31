"""Reduced-precision weights: one ``linear`` for every projection of the runner.

A weight is either a plain tensor (``F.linear``) or a packed object with a ``linear(x, bias)``
method (quantized weights); the runner calls ``linear`` and does not care which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for a plain weight tensor or a packed (quantized) weight."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w.linear(x, b)
