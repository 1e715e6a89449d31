"""Projection weights prepacked for the CPU: what ``weights: auto`` (float32) and ``weights: int8``
run on a CPU.

``F.linear`` hands a plain row-major weight to MKL, which re-blocks it on every call. Two packed
forms replace it:

- ``BlockedWeight`` (the default where kvfuse's CPU kernels build): the weight in blocks of 16
  output channels, ``(ceil(out/16), in, 16)``, multiplied by ``cpu/kernels/linear.cpp``. A decode step
  is memory-bound: one contiguous stream per block, read once whatever the number of rows, with
  the rows' products kept in registers. Measured on the 2-core development machine against
  oneDNN's packed linear (the previous default) over SmolLM2's projections with the weights
  streamed from memory (``bench/batch_step.py`` measures the whole step): 1.96x faster at one
  row, 1.51x at 16, 1.27x at 32, 0.8-1.2x for 128-2048 rows (prefill chunks; from
  ``GEMM_ROWS`` rows a product goes to MKL's GEMM on the unpacked weight instead). The same
  layout holds int8 weights (one float32 scale per output channel, widened in registers): a quarter
  of the bytes and float32 activations, so int8 no longer rounds the activations at all.
- ``PackedWeight``: oneDNN's linear with the weight reordered once, at load, into its blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile`` does on CPUs when
  it freezes weights): what ``weights: auto`` runs when the kernels cannot be built.

Both compute the same products as ``F.linear`` (float32 accumulation; equal up to rounding).
Which form a model gets is ``cpu.backend``'s choice (``kernels: off`` keeps plain tensors: the
plain PyTorch path, for measurements); this module only makes them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .cpu import kernels

#: Rows from which a blocked product goes to PyTorch's GEMM (MKL) on the weight unpacked for the
#: call (``BlockedWeight.linear``; the fused layer halves step aside from there, ``cpu.backend``):
#: the blocked kernel is built for a decode step's few rows, and MKL's GEMM is faster over a long
#: prefill pass by more than the unpacking costs (docs/benchmarks.md "Cold prompts").
GEMM_ROWS = 1024
ROWS_HINT = 16  # oneDNN's pack is laid out for a batched decode step's rows and serves any number


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections on ``device`` in ``dtype`` can be packed on this machine, by either
    form (what this machine can do, for tests and benchmarks; whether a model's projections are
    packed is ``cpu.backend``'s choice)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and (kernels.get() is not None or onednn_available())
    )


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (``PackedWeight``)."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class BlockedWeight:
    """A ``(out, in)`` weight in blocks of 16 output channels, float32 or int8 (``fmt``);
    ``linear(x, bias)`` as ``F.linear``. int8 is symmetric per output channel (scale = abs-max /
    127, round to nearest), the quantization ``weights: int8`` has always used; inputs stay
    float32. ``kernel``: the compiled kernel module (default: built now, ``cpu.kernels.get``)."""

    __slots__ = ("blocks", "scales", "shape", "fmt", "handle", "_kernel")

    def __init__(self, weight: torch.Tensor, fmt: str = "float32", kernel=None):
        if weight.dim() != 2:
            raise ValueError(
                f"a blocked weight must be 2-d (out, in), got shape {tuple(weight.shape)}"
            )
        if fmt not in ("float32", "int8"):
            raise ValueError(f"blocked weights are float32 or int8, not {fmt!r}")
        kernel = kernel if kernel is not None else kernels.get()
        if kernel is None:
            raise RuntimeError(
                "blocked weights need kvfuse's CPU kernels (python -m kvfuse.models.cpu.kernels)"
            )
        w = weight.detach().to("cpu", torch.float32)
        if fmt == "int8":
            self.blocks, self.scales = kernel.pack_linear_int8(w)
        else:
            self.blocks, self.scales = kernel.pack_linear(w), None
        self.shape = tuple(w.shape)
        self.fmt = fmt
        self.handle = kernel.Blocked(
            self.blocks, self.shape[0], self.scales
        )  # for the fused layer halves
        self._kernel = kernel

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: the values (int8 or float32) and int8's per-channel scales."""
        out, inp = self.shape
        return out * inp * (1 if self.fmt == "int8" else 4) + (
            4 * out if self.scales is not None else 0
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 ``(out, in)`` weight these blocks stand for (for tests and measurements)."""
        w = self.blocks.transpose(1, 2).reshape(-1, self.shape[1])[: self.shape[0]].float()
        return w * self.scales.unsqueeze(1) if self.scales is not None else w

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        if x2.shape[0] >= GEMM_ROWS:
            y = F.linear(x2, self.dequantize(), bias)
        else:
            y = self._kernel.blocked_linear(x2, self.blocks, self.shape[0], self.scales, bias)
        y = y.reshape(*lead, self.shape[0])
        return y if dtype == torch.float32 else y.to(dtype)

    def __repr__(self) -> str:
        return f"BlockedWeight(shape={self.shape}, fmt={self.fmt})"


class PackedWeight:
    """A ``(out, in)`` float32 weight reordered for oneDNN; ``linear(x, bias)`` as ``F.linear``."""

    __slots__ = ("packed", "shape")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(
                f"packing needs a 2-d float32 weight, got {tuple(weight.shape)} {weight.dtype}"
            )
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


def map_projections(weights, pack):
    """A copy of ``weights`` (``transformer.Weights``) with ``pack`` applied to every projection
    (q/k/v, o, gate, up, down, vocabulary). The embedding table stays a plain tensor (lookups); a
    tied vocabulary projection gets its own packed copy. Norms and biases stay as they are."""
    layers = [
        dataclasses.replace(
            lw,
            wqkv=pack(lw.wqkv),
            wo=pack(lw.wo),
            w_gate=pack(lw.w_gate),
            w_up=pack(lw.w_up),
            w_down=pack(lw.w_down),
        )
        for lw in weights.layers
    ]
    return dataclasses.replace(weights, layers=layers, lm_head=pack(weights.lm_head))


def to_blocked(weights, kernel):
    """A copy of ``weights`` whose float32 projections are ``BlockedWeight``s (``kernel``: the
    compiled kernel module)."""
    return map_projections(  # packed weights (blocks, a GGUF file's own blocks) stay as they are
        weights,
        lambda w: BlockedWeight(w, kernel=kernel) if isinstance(w, torch.Tensor) else w,
    )


def to_onednn(weights):
    """A copy of ``weights`` whose float32 projections are ``PackedWeight``s."""
    return map_projections(weights, lambda w: w if isinstance(w, PackedWeight) else PackedWeight(w))
