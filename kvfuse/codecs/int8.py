"""The int8 codec: symmetric abs-max quantization, one scale per (layer, K/V, token).

This is the CacheGen paper's 8-bit baseline ("per (layer, token)" quantization): for each
``[l, kv, t]`` the ``kv_heads x head_dim`` values share one fp32 scale ``absmax / 127``.
A layer's bytes = its ``2*T`` fp32 scales (little-endian), then its ``2*T*H*D`` int8 values.
The rounding error of a value is at most ``absmax / 254`` of its (layer, K/V, token) row, i.e.
0.39% of the row's abs-max (plus the output dtype's own rounding when decoding to fp16/bf16).
"""

from __future__ import annotations

import numpy as np
import torch

from kvfuse.codecs.base import Codec, CodecError, numel


class Int8Codec(Codec):
    """About 2x smaller than fp16 raw, lossy (see the module docstring for the error bound)."""

    name = "int8"
    codec_id = 2
    is_lossless = False

    def encode_layer(self, kv: torch.Tensor) -> bytes:
        x = kv.float()
        absmax = x.abs().amax(dim=(2, 3)) if x.numel() else torch.zeros(x.shape[:2])
        if not torch.isfinite(absmax).all():
            raise ValueError(
                "int8 codec: the KV tensor contains inf or NaN; it cannot be quantized"
            )
        # An all-zero row gets scale 1 (its values quantize to 0 either way) to avoid dividing by 0.
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        q = torch.round(x / scale[..., None, None]).clamp_(-127, 127).to(torch.int8)
        return scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def decode_layer(
        self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        expected = self.layer_size(shape, dtype)
        if len(data) != expected:
            raise CodecError(f"int8 layer is {len(data)} bytes, shape {shape} needs {expected}")
        n_scales = numel(shape[:2])
        scale = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=n_scales).copy()).view(
            shape[:2]
        )
        if not torch.isfinite(scale).all() or (scale < 0).any():
            raise CodecError("int8 payload has invalid scales")
        q = torch.from_numpy(np.frombuffer(data, dtype=np.int8, offset=n_scales * 4).copy()).view(
            shape
        )
        out = (q.float() * scale[..., None, None]).to(dtype)
        if not torch.isfinite(out).all():  # scales no encoder writes: KV beyond the dtype's range
            raise CodecError(f"int8 payload decodes to values beyond the {dtype} range")
        return out

    def layer_size(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return numel(shape[:2]) * 4 + numel(shape)
