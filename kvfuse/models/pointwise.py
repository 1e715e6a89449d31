"""The runner's small per-row operations, each one call of ``cpu/kernels/pointwise.cpp`` where the
CPU kernels are in use (``ops``: the kernel module, or None: ``CpuBackend.ops``, the backend's
choice) and PyTorch's expression otherwise.

Why: in a decode step these run on one row (or a few) per layer, where PyTorch's fixed cost per
operator dominates: ``F.rms_norm`` alone was ~44 us for a 576-wide row on the development machine
(several operators inside), 61 of them per SmolLM2 step. The kernel runs only on float32 rows
with a contiguous last dimension; anything else (GPUs, bf16, odd layouts) takes the PyTorch path,
which computes the same numbers up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import rope as rope_math

ACTS = {"silu": 0, "gelu_tanh": 1}  # ModelConfig.hidden_act -> the kernel's code


def _fits(x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and x.dim() in (2, 3)
        and x.stride(-1) == 1
        and x.device.type == "cpu"
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops=None) -> torch.Tensor:
    """RMSNorm in float32 (weights of gemma-style norms already include the +1), in ``x``'s dtype."""
    if ops is not None and _fits(x) and weight.dtype == torch.float32:
        return ops.rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, ops=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: ``(h + delta, rms_norm(h + delta))``."""
    if (
        ops is not None
        and _fits(h)
        and _fits(delta)
        and h.dim() == 2
        and weight.dtype == torch.float32
    ):
        s, y = ops.add_rms_norm(h, delta, weight, eps)
        return s, y
    s = h + delta
    return s, rms_norm(s, weight, eps)


def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str, ops=None) -> torch.Tensor:
    """``act(gate) * up``: ``silu``, or ``gelu_tanh`` (gelu's tanh approximation, Gemma's)."""
    if ops is not None and act in ACTS and _fits(gate) and _fits(up) and gate.dim() == 2:
        return ops.gated_act(gate, up, ACTS[act])
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return a.mul_(up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops=None) -> torch.Tensor:
    """``rope.apply``: the rotary embedding of ``x`` ``(n, heads, head_dim)``."""
    if (
        ops is not None
        and _fits(x)
        and x.dim() == 3
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return ops.rope(x, cos, sin)
    return rope_math.apply(x, cos, sin)
