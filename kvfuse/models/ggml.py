"""Weights held in a GGUF file's own quantization: what ``weights: auto`` runs on a CPU.

A GGUF file stores each projection in blocks of its type (Q4_1, Q4_K, Q6_K, Q8_0, ...: 4.5 to
8.5 bits per weight). Dequantized to float32 once at load, as kvfuse used to, a decode step reads
4-7x the bytes llama.cpp reads for the same file, and the model takes that much more memory.
``GGMLWeight`` keeps the file's bytes (read once into memory, no float32 copy) and multiplies
them with ``cpu/kernels/ggml.cpp``: float32 activations, each weight dequantized in registers or
in a buffer that stays in cache, so the products equal those of the dequantized float32 weight up
to float rounding (the file's own numbers, hence the same cache identity as ``weights: fp32``).
Long products (``packed.GEMM_ROWS`` rows and more: a long prefill pass) dequantize the weight a
slice of output channels at a time and take PyTorch's GEMM, as blocked weights do.

``read_gguf_tensors`` reads a GGUF file's tensors under their Hugging Face names, the projections
and the embedding as ``RawTensor`` (the blocks, un-permuted where llama.cpp permutes Llama's q/k
rows) and every other tensor as float32; ``projection`` turns one or more of them (the fused
q/k/v) into a weight: a ``GGMLWeight`` where the kernels read the type, else float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import packed

log = logging.getLogger(__name__)

#: GGML tensor types the kernels read in place (ggml.h's numbering), by name.
TYPES = {
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "BF16": 30,
}
NAMES = {v: k for k, v in TYPES.items()}
#: Values per block of each type (F16 and BF16 in the kernels' blocks of 32).
BLOCK = {1: 32, 2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 13: 256, 14: 256, 30: 32}
#: Floats of one slice of output channels dequantized for PyTorch's GEMM (a long product).
GEMM_SLICE = 1 << 22


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor as the file stores it: ``data`` (rows, row_bytes) uint8, its GGML ``type``
    and its (rows, cols) ``shape`` in values."""

    data: torch.Tensor
    type: int
    shape: tuple[int, int]

    def readable(self) -> bool:
        """Whether the kernels read this tensor in place (its type, whole blocks per row)."""
        return self.type in BLOCK and self.shape[1] % BLOCK[self.type] == 0


class GGMLWeight:
    """A ``(out, in)`` projection as one or more parts in GGML blocks, stacked along the output
    channels; ``linear(x, bias)`` as ``F.linear``, ``rows(ids)`` as an embedding lookup (one
    part). ``kernel``: the compiled kernel module."""

    __slots__ = ("parts", "types", "shape", "handle", "_kernel")

    def __init__(self, parts: list[RawTensor], kernel):
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("a GGML weight needs parts with the same number of input features")
        if not all(p.readable() for p in parts):
            raise ValueError("the kernels do not read every part of this weight in place")
        self.parts = [p.data for p in parts]
        self.types = [p.type for p in parts]
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.handle = kernel.Blocked.ggml(self.parts, self.types)  # for the fused layer halves
        self._kernel = kernel

    @property
    def fmt(self) -> str:
        """The types, e.g. ``q4_k`` or ``q4_k+q6_k``."""
        return "+".join(dict.fromkeys(NAMES[t].lower() for t in self.types))

    @property
    def nbytes(self) -> int:
        """Bytes a multiplication reads: the blocks, scales included."""
        return sum(p.numel() for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``(out, in)`` weight these blocks stand for."""
        k, n = self._kernel, self.shape[1]
        return torch.cat([k.ggml_dequantize(p, t, n) for p, t in zip(self.parts, self.types)])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 (an embedding lookup), any shape of ids."""
        if len(self.parts) != 1:
            raise ValueError("an embedding is one part")
        flat = ids.reshape(-1).to("cpu", torch.int64)
        out = self._kernel.ggml_rows(self.parts[0], self.types[0], self.shape[1], flat)
        return out.reshape(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.float()
        if x2.shape[0] >= packed.GEMM_ROWS:
            y = self._gemm(x2, bias)
        else:
            y = self._kernel.ggml_linear(x2, self.parts, self.types, bias)
        y = y.reshape(*lead, self.shape[0])
        return y if dtype == torch.float32 else y.to(dtype)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A long product through PyTorch's GEMM, the weight dequantized a slice of output
        channels at a time (a slice of at most ``GEMM_SLICE`` floats: never the whole weight in
        float32 at once)."""
        k, n = self._kernel, self.shape[1]
        step = max(16, GEMM_SLICE // n)
        pieces = []
        for part, t in zip(self.parts, self.types):
            for r0 in range(0, part.shape[0], step):
                pieces.append(F.linear(x, k.ggml_dequantize(part[r0 : r0 + step], t, n)))
        y = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        return y.add_(bias) if bias is not None else y

    def __repr__(self) -> str:
        return f"GGMLWeight(shape={self.shape}, fmt={self.fmt})"


def projection(parts: list, kernel):
    """One weight from the tensors ``parts`` (stacked along the output channels): a
    ``GGMLWeight`` where every part is a ``RawTensor`` the kernels read, else the float32 tensor
    (a part of another type is dequantized, logged once per weight)."""
    if kernel is not None and all(isinstance(p, RawTensor) and p.readable() for p in parts):
        return GGMLWeight(parts, kernel)
    floats = [dequantized(p) if isinstance(p, RawTensor) else p for p in parts]
    if any(isinstance(p, RawTensor) for p in parts):
        kinds = sorted({_type_name(p.type) for p in parts if isinstance(p, RawTensor)})
        log.info("a projection of GGML type %s runs dequantized to float32", "/".join(kinds))
    return torch.cat(floats) if len(floats) > 1 else floats[0]


def dequantized(t: RawTensor) -> torch.Tensor:
    """A raw tensor as float32 (gguf's reference dequantization)."""
    from gguf.quants import dequantize

    w = dequantize(t.data.numpy(), _gguf_type(t.type))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(t.shape))


def _gguf_type(type_id: int):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(type_id)


def _type_name(type_id: int) -> str:
    try:
        return _gguf_type(type_id).name
    except ValueError:
        return str(type_id)


def gguf_file(folder: Path) -> Path | None:
    """The GGUF file a converted folder keeps beside its float32 copy (None: it has none)."""
    path = Path(folder) / "model.gguf"
    return path if path.is_file() else None
