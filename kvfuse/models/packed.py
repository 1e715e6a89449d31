"""float32 projections prepacked for oneDNN on the CPU: what ``weights: auto`` runs on a CPU.

``F.linear`` hands a plain row-major weight to MKL, which re-blocks it on every call; a batched
decode step (16 rows) then cost ~3.5x one row at SmolLM2's shapes, and the vocabulary projection
(49152 x 576) ~5x. oneDNN's linear with the weight reordered once, at load, into its blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile`` does on CPUs when
it freezes weights) computes the same products (float32 accumulation; results equal up to
rounding, ~3e-6 relative): on the 2-core development machine ~1.4-1.6x faster at 16 rows for the
layer projections, ~3x for the vocabulary, and the same at one row (microbenchmark in
``bench/decode.py``'s notes). The pack is laid out for ``ROWS_HINT`` rows and serves any number.

Only float32 on the CPU with PyTorch's oneDNN backend; anything else keeps plain tensors.
``KVFUSE_KERNELS=off`` keeps plain tensors too (the plain PyTorch path, for measurements).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import kernels

log = logging.getLogger(__name__)

ROWS_HINT = 16  # a batched decode step's rows: the case packing is for


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections on ``device`` in ``dtype`` can be packed here."""
    return (device.type == "cpu" and dtype == torch.float32 and kernels.enabled()
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedWeight:
    """A ``(out, in)`` float32 weight reordered for oneDNN; ``linear(x, bias)`` as ``F.linear``."""

    __slots__ = ("packed", "shape")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"packing needs a 2-d float32 weight, got {tuple(weight.shape)} {weight.dtype}")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)
        self.shape = tuple(weight.shape)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"a packed float32 weight needs float32 inputs, got {x.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def __repr__(self) -> str:
        return f"PackedWeight(shape={self.shape})"


def pack_weights(weights):
    """A copy of ``weights`` (``transformer.Weights``) whose projections are ``PackedWeight``s; the
    embedding table stays a plain tensor (lookups), a tied vocabulary projection gets its own pack.
    Returns ``weights`` unchanged if oneDNN refuses (logged)."""
    try:
        layers = [
            dataclasses.replace(lw, wqkv=PackedWeight(lw.wqkv), wo=PackedWeight(lw.wo), w_gate=PackedWeight(lw.w_gate),
                                w_up=PackedWeight(lw.w_up), w_down=PackedWeight(lw.w_down))
            for lw in weights.layers
        ]
        return dataclasses.replace(weights, layers=layers, lm_head=PackedWeight(weights.lm_head))
    except (RuntimeError, ValueError) as exc:
        log.warning("keeping plain float32 weights: oneDNN packing failed (%s)", exc)
        return weights
