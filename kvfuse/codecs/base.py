"""The codec interface: a KV tensor <-> the payload bytes of one serialized entry, layer by layer.

A payload is every layer's bytes back to back; the entry's layer table (``kv/format.py``) records
each layer's size, so a reader can decode one layer, or a range of layers, without the rest. A
codec therefore encodes and decodes layers independently; ``encode``/``decode`` of a whole
tensor are the loop over them, which codecs override where they can do better (the raw codec:
one zero-copy view both ways).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from kvfuse import dtypes

# Payloads are little-endian; raw tensor bytes are written as they lie in memory.
assert sys.byteorder == "little", "kvfuse codecs assume a little-endian host"

Buffer = bytes | bytearray | memoryview


class CodecError(ValueError):
    """A payload a codec cannot decode (wrong size, bad values). The format turns it into a FormatError."""


class Codec(ABC):
    """Encodes a KV tensor ``(layers, 2, tokens, kv_heads, head_dim)`` to bytes and back.

    ``codec_id`` is written in every entry header and must never change for a given codec;
    ``level`` is the codec's quality level (0 for codecs without levels).
    """

    name: str
    codec_id: int
    is_lossless: bool

    def __init__(self, level: int = 0) -> None:
        if level != 0:
            raise ValueError(f"codec {self.name!r} has no levels: use level=0, got {level}")
        self.level = level

    def for_model(
        self, layer_types: Sequence[str], level: int = 0, k_cap: float | None = None
    ) -> Codec:
        """This codec as it should encode the KV of a model whose layers are ``layer_types``
        ("full", "sliding", ...) and whose calibrated level is ``level`` (0: none; used only by a
        codec with levels configured at level 0), with the model's calibrated ``k_cap`` (CacheGen's
        K outlier channels; None: none). Most codecs treat every layer alike and have no levels:
        themselves. Readers need nothing of this: an entry's bytes say how they were encoded."""
        return self

    @abstractmethod
    def encode_layer(self, kv: torch.Tensor) -> Buffer:
        """The bytes of one layer's KV ``(2, tokens, kv_heads, head_dim)``, contiguous on the CPU."""

    @abstractmethod
    def decode_layer(
        self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """One layer's KV of ``shape`` ``(2, tokens, kv_heads, head_dim)`` and ``dtype`` (the chunk's
        original dtype). Raises CodecError on bytes it cannot decode."""

    def encode(self, kv: torch.Tensor) -> tuple[Buffer, list[int]]:
        """The payload of ``kv`` (fp16/bf16/fp32) and the size of each layer's part. The payload may
        be a view of ``kv``'s memory: use it before ``kv`` changes."""
        kv = check_kv(kv)
        parts = [memoryview(self.encode_layer(kv[i])).cast("B") for i in range(kv.shape[0])]
        return b"".join(parts), [len(p) for p in parts]

    def decode(
        self,
        data: memoryview,
        layer_sizes: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The KV of consecutive layers whose bytes are ``data`` (sizes ``layer_sizes``), each of
        ``shape`` ``(2, tokens, kv_heads, head_dim)``: a tensor ``(len(layer_sizes), *shape)``.
        May share memory with ``data`` when the buffer is writable."""
        if sum(layer_sizes) != len(data):
            raise CodecError(f"{len(data)} payload bytes for layers of {sum(layer_sizes)} bytes")
        out = torch.empty((len(layer_sizes), *shape), dtype=dtype)
        off = 0
        for i, size in enumerate(layer_sizes):
            out[i] = self.decode_layer(data[off : off + size], shape, dtype)
            off += size
        return out

    def layer_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        """Exact bytes of one layer of ``shape`` ``(2, tokens, kv_heads, head_dim)``, or None when it
        depends on the data."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level})"


def check_kv(kv: torch.Tensor) -> torch.Tensor:
    """Validate a KV tensor for encoding and return it contiguous on the CPU."""
    # ValueError for a dtype the table (and the entry format) does not hold
    dtypes.name_of(kv.dtype)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(
            f"KV must be (layers, 2, tokens, kv_heads, head_dim), got {tuple(kv.shape)}"
        )
    return kv.detach().to("cpu").contiguous()


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
