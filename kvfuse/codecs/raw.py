"""The raw codec: the tensor's bytes as they are (lossless, zero-copy both ways where possible)."""

from __future__ import annotations

from typing import Sequence

import torch

from kvfuse import dtypes
from kvfuse.codecs.base import Codec, CodecError, check_kv, numel


class RawCodec(Codec):
    """Payload = the little-endian bytes of the contiguous tensor; bf16 is carried as its 16-bit words.

    Layers are consecutive in a contiguous ``(layers, 2, tokens, heads, dim)`` tensor, so the whole
    payload is one view of the tensor and any layer range decodes as one view of the bytes.
    """

    name = "raw"
    codec_id = 1
    is_lossless = True

    def encode(self, kv: torch.Tensor) -> tuple[memoryview, list[int]]:
        kv = check_kv(kv)
        # A byte view of the tensor's own memory: no copy here, the format's join copies once.
        return memoryview(kv.reshape(-1).view(torch.uint8).numpy()), [
            self.layer_size(tuple(kv.shape[1:]), kv.dtype)
        ] * kv.shape[0]

    def encode_layer(self, kv: torch.Tensor) -> memoryview:
        return memoryview(kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())

    def decode_layer(
        self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return self.decode(data, [len(data)], shape, dtype)[0]

    def decode(
        self,
        data: memoryview,
        layer_sizes: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        size = self.layer_size(shape, dtype)
        full = (len(layer_sizes), *shape)
        if len(data) != size * len(layer_sizes) or list(layer_sizes).count(size) != len(
            layer_sizes
        ):
            raise CodecError(
                f"raw payload is {len(data)} bytes, {len(layer_sizes)} layers of {shape} {dtype} "
                f"need {size} each"
            )
        if len(data) == 0:
            return torch.empty(full, dtype=dtype)
        if data.readonly:
            # torch.frombuffer over read-only memory would alias bytes Python considers immutable
            # (and warns); one copy into a private buffer keeps the returned tensor safe to write.
            data = memoryview(bytearray(data))
        return torch.frombuffer(data, dtype=dtype).view(full)

    def layer_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return numel(shape) * dtypes.element_size(dtype)
