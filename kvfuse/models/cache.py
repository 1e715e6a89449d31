"""The live KV cache of one sequence, as the model runner reads and writes it."""

from __future__ import annotations

import torch

from ..kv.chunk import KVChunk
from .config import ModelConfig


class KVCache:
    """KV buffers of one sequence: ``kv`` is ``(layers, 2, kv_heads, capacity, head_dim)``.

    Slots ``[0, length)`` are valid; ``positions[i]`` is the absolute position slot ``i`` was
    rotated at. Head-major storage keeps each head's keys contiguous for attention; chunks
    (``KVChunk``) use the token-major layout of the storage format, converted at the boundary.
    ``kv`` may be stored in a narrower dtype than the compute dtype (fp16 KV, fp32 compute): the
    runner always writes K/V here first and attends to what is stored, so a prefill and a cache
    hit see exactly the same numbers.
    """

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self.kv = self._alloc(max(capacity, 1))
        self.positions = torch.zeros(self.kv.shape[3], dtype=torch.int64, device=self.device)

    def _alloc(self, capacity: int) -> torch.Tensor:
        c = self.config
        return torch.empty(c.num_layers, 2, c.num_kv_heads, capacity, c.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def reserve(self, total: int) -> None:
        """Make room for ``total`` slots (grows geometrically; keeps the valid slots)."""
        if total <= self.capacity:
            return
        new_cap = max(total, 2 * self.capacity)
        kv = self._alloc(new_cap)
        kv[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        positions = torch.zeros(new_cap, dtype=torch.int64, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.kv, self.positions = kv, positions

    def keys_sorted(self, upto: int) -> bool:
        p = self.positions[:upto]
        return upto < 2 or bool((p[1:] >= p[:-1]).all())

    @property
    def next_position(self) -> int:
        """One past the highest position held (slots need not be in position order)."""
        return int(self.positions[: self.length].max()) + 1 if self.length else 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length

    def chunk(self, start: int, end: int) -> KVChunk:
        """A contiguous copy of slots ``[start, end)`` in the chunk layout, on the CPU."""
        if not 0 <= start < end <= self.length:
            raise ValueError(f"slots [{start}, {end}) are outside the valid range [0, {self.length})")
        kv = self.kv[:, :, :, start:end].transpose(2, 3).to("cpu", copy=True).contiguous()
        return KVChunk(kv=kv, positions=self.positions[start:end].to("cpu", copy=True))

    def write(self, start: int, kv: torch.Tensor, positions: torch.Tensor, first_layer: int = 0) -> None:
        """Put ``kv`` (chunk layout ``(layers, 2, tokens, kv_heads, head_dim)``, any device) into slots
        ``[start, start + tokens)`` of layers ``first_layer..``, at ``positions``; the valid slots
        grow to cover them. Keys are taken as they are: moving them is ``Transformer.move_keys``."""
        c = self.config
        n_layers, _, n, heads, dim = kv.shape
        if kv.dim() != 5 or kv.shape[1] != 2 or (heads, dim) != (c.num_kv_heads, c.head_dim) or \
                not 0 <= first_layer <= first_layer + n_layers <= c.num_layers:
            raise ValueError(f"KV of shape {tuple(kv.shape)} at layer {first_layer} does not fit this model's KV "
                             f"({c.num_layers} layers, {c.num_kv_heads} heads, dim {c.head_dim})")
        if positions.shape != (n,):
            raise ValueError(f"{n} tokens but positions of shape {tuple(positions.shape)}")
        if not 0 <= start <= self.length:
            raise ValueError(f"slot {start} would leave a gap after the {self.length} valid slots")
        end = start + n
        self.reserve(end)
        self.kv[first_layer : first_layer + n_layers, :, :, start:end] = kv.transpose(2, 3).to(self.device, self.dtype)
        self.positions[start:end] = positions.to(self.device)
        self.length = max(self.length, end)

    def write_layers(self, start: int, kv: torch.Tensor, first_layer: int) -> None:
        """Put the KV of layers ``first_layer..`` (chunk layout) into reserved slots ``start..``,
        leaving positions and the valid length alone: for loading layer by layer into slots whose
        positions were set once, while other layers are in use."""
        n = kv.shape[2]
        if start + n > self.capacity or first_layer + kv.shape[0] > self.config.num_layers:
            raise ValueError(f"layers {first_layer}.. of slots [{start}, {start + n}) are outside this cache")
        self.kv[first_layer : first_layer + kv.shape[0], :, :, start : start + n] = \
            kv.transpose(2, 3).to(self.device, self.dtype)

    def append_chunk(self, chunk: KVChunk) -> None:
        """Append a chunk's KV and positions after the valid slots."""
        c = self.config
        expected = (c.num_layers, 2, chunk.num_tokens, c.num_kv_heads, c.head_dim)
        if tuple(chunk.kv.shape) != expected:
            raise ValueError(f"chunk shape {tuple(chunk.kv.shape)} does not fit this model's KV {expected}")
        self.write(self.length, chunk.kv, chunk.positions)
