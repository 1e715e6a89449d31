"""The codec interface: a KV tensor <-> the payload bytes of one serialized entry."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod

import torch

# dtypes a KV chunk may have; the entry format stores them by a small code (kvfuse.kv.format).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Payloads are little-endian; raw tensor bytes are written as they lie in memory.
assert sys.byteorder == "little", "kvfuse codecs assume a little-endian host"


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

    @abstractmethod
    def encode(self, kv: torch.Tensor) -> bytes | memoryview:
        """The payload of ``kv`` (fp16/bf16/fp32). May be a view of ``kv``'s memory: use it before
        ``kv`` changes."""

    @abstractmethod
    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (the chunk's original dtype). May share memory with
        ``payload`` when the buffer is writable. Raises CodecError on a payload it cannot decode."""

    def payload_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        """Exact payload size for ``shape``/``dtype``, or None when it depends on the data."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(level={self.level})"


def check_kv(kv: torch.Tensor) -> torch.Tensor:
    """Validate a KV tensor for encoding and return it contiguous on the CPU."""
    if kv.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"KV dtype {kv.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV must be (layers, 2, tokens, kv_heads, head_dim), got {tuple(kv.shape)}")
    return kv.detach().to("cpu").contiguous()


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
