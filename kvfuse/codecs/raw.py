"""The raw codec: the tensor's bytes as they are (lossless, zero-copy both ways where possible)."""

from __future__ import annotations

import torch

from kvfuse.codecs.base import Codec, CodecError, check_kv, numel


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class RawCodec(Codec):
    """Payload = the little-endian bytes of the contiguous tensor; bf16 is carried as its 16-bit words."""

    name = "raw"
    codec_id = 1
    is_lossless = True

    def encode(self, kv: torch.Tensor) -> memoryview:
        kv = check_kv(kv)
        # A byte view of the tensor's own memory: no copy here, the format's join copies once.
        return memoryview(kv.reshape(-1).view(torch.uint8).numpy())

    def decode(self, payload: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        expected = self.payload_size(shape, dtype)
        if len(payload) != expected:
            raise CodecError(f"raw payload is {len(payload)} bytes, shape {shape} {dtype} needs {expected}")
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        if payload.readonly:
            # torch.frombuffer over read-only memory would alias bytes Python considers immutable
            # (and warns); one copy into a private buffer keeps the returned tensor safe to write.
            payload = memoryview(bytearray(payload))
        return torch.frombuffer(payload, dtype=dtype).view(shape)

    def payload_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return numel(shape) * _element_size(dtype)
