"""The CacheGen codec: per-(layer, token) quantization with fewer bins in deeper layers, then rANS
coding of every (layer, K/V, channel) stream under its own probability model.

Levels (``LEVELS``) say how many bins K and V get in the early and the late layers; the early
group is derived from the model's layer count with the proportions of CacheGen's released
encoder for 32-layer models (K: layers 0-9, V: layers 0-1), so every family gets its own split.
Level 2 is the default; 1 is smaller, 3 and 4 are closer to lossless. Unlike CacheGen's table,
K gets more bins than V (see ``LEVELS``). Each layer's bytes carry
their own bin counts and stream models (``kvfuse/entropy/layer.py``): an entry decodes on any
machine without a per-model profile. (A per-model profile would save the two bytes per stream
the entry spends on its models, 0.06 bits per value at 256-token chunks, and cost every reader a
profile it must fetch and trust; measured in ``bench/codec.py``.)

CacheGen's token-group deltas (each token minus an anchor token of its group of 10) are not
used: measured on SmolLM2 and Gemma3 KV they made the symbols *less* compressible (~25% more
bits) at a *higher* error, because keys are stored rotated by RoPE, which destroys the
token-to-token locality the deltas rely on (``bench/codec.py --part deltas``).

K's outlier channels (``k_cap``, per model from its profile like the level): channels of a
layer's K whose abs-max over the chunk exceeds ``k_cap`` times the median channel's are divided
down to that ceiling before quantization and multiplied back after (``kvfuse/entropy/layer.py``).
Measured in docs/benchmarks.md (CacheGen, K's outlier channels): on Qwen2.5-0.5B it takes level 2
from +6.6% to -0.7% NLL for 9% more bytes; on Qwen2.5-1.5B it makes levels 1-2 worse, hence a
per-model choice (``kvfuse calibrate --part codec`` measures the levels with and without it).

Per model (``for_model``): in a model that mixes sliding-window and global attention (Gemma 3),
the global layers get twice the K bins of their group. Their keys are read by every later query
over the whole context, so their quantization error costs the most answer quality: measured on
Gemma 3 (LongChat, ``bench/codec.py --part allocation``) at level 2, see docs/benchmarks.md (CacheGen).
The level itself is per model too: a codec configured at level 0 takes the level ``kvfuse
calibrate`` chose for the model (its profile's ``codec`` field, ``kvfuse/calibration/codec_level.py``),
else ``DEFAULT_LEVEL``; a level set in the configuration always wins.

Encoding and decoding of a whole chunk run in worker processes, a group of layers each
(``kvfuse/entropy/pool.py``); a single layer (layer-wise loading) is decoded in-process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvfuse.codecs.base import Codec, CodecError, check_kv
from kvfuse.entropy import layer as coded_layer
from kvfuse.entropy.models import ModelsError
from kvfuse.entropy.pool import JobError, shared_pool


@dataclass(frozen=True)
class LevelBins:
    """Bins of K and V in the early layers and in the rest."""

    k_early: int
    k_late: int
    v_early: int
    v_late: int

    def k_early_layers(self, num_layers: int) -> int:
        return max(1, round(num_layers * 10 / 32))

    def v_early_layers(self, num_layers: int) -> int:
        return max(1, round(num_layers * 2 / 32))

    def of_layer(self, index: int, num_layers: int) -> tuple[int, int]:
        """(K bins, V bins) of layer ``index`` of ``num_layers``."""
        k = self.k_early if index < self.k_early_layers(num_layers) else self.k_late
        v = self.v_early if index < self.v_early_layers(num_layers) else self.v_late
        return k, v


# K gets more bins than V: measured on the LongChat dev prompts (bench/codec.py, docs/benchmarks.md), errors in
# K cost far more answer quality than errors in V (they are amplified by the softmax): with K raw
# and V at CacheGen's level-2 bins the NLL rose 1.2-1.5%, with V raw and K at those bins 3-25%.
# Moving bits from V to K gave SmolLM2 +0.7% NLL at 2.5 bits per value where CacheGen's split
# (K and V 32 -> 16) gave +4.2% at 2.6 bits.
LEVELS: dict[int, LevelBins] = {
    1: LevelBins(k_early=32, k_late=16, v_early=8, v_late=8),
    2: LevelBins(k_early=64, k_late=32, v_early=16, v_late=8),
    3: LevelBins(k_early=128, k_late=64, v_early=32, v_late=16),
    4: LevelBins(k_early=128, k_late=128, v_early=64, v_late=64),
}
DEFAULT_LEVEL = 2
MAX_BINS = 128
# The cap ``kvfuse calibrate --part codec`` tries for a model: K channels whose abs-max over a
# chunk exceeds this many times the median channel's divided down to that ceiling before
# quantization (``kvfuse/entropy/layer.py``); chosen on LongChat dev prompts (bench/codec.py
# --part allocation --allocations levels). Per model, from its profile: it helps some models'
# keys a lot and hurts others' (docs/benchmarks.md, CacheGen, K's outlier channels).
K_CAP = 4.0
POOL_MIN_VALUES = 1 << 18  # below this many values a chunk is coded in the calling process


def sensitive_layers(layer_types: Sequence[str]) -> frozenset[int]:
    """The layers whose K gets more bins: the global-attention ("full") layers of a model that
    mixes them with sliding-window ones; none in a model whose layers are all alike."""
    if len(set(layer_types)) < 2:
        return frozenset()
    return frozenset(i for i, t in enumerate(layer_types) if t == "full")


def dequantize(symbols: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Values ``(n, 2, tokens, channels)`` fp32 from symbols ``(n, 2, channels, tokens)``, scales
    ``(n, 2, tokens)`` and each part's largest magnitude ``c`` ``(n, 2)`` (``layer.dequantize``
    in torch, for all layers at once)."""
    step = scales / levels[..., None]
    return (symbols.transpose(2, 3).float() - levels[..., None, None]) * step[..., None]


class CacheGenCodec(Codec):
    """Lossy; see the module docstring. ``level`` 0 means the model's calibrated level
    (``model_level``, set by ``for_model``), else the default level."""

    name = "cachegen"
    codec_id = 3
    is_lossless = False

    def __init__(
        self,
        level: int = 0,
        boosted: frozenset[int] = frozenset(),
        model_level: int = 0,
        k_cap: float | None = None,
    ) -> None:
        for lv in (level, model_level):
            if lv != 0 and lv not in LEVELS:
                raise ValueError(
                    f"cachegen levels are {', '.join(map(str, LEVELS))} (0: the model's "
                    f"calibrated level, else {DEFAULT_LEVEL}); got {lv}"
                )
        # kept through for_model: 0 lets each model's calibration decide
        self.configured_level = level
        self.level = level or model_level or DEFAULT_LEVEL
        self.bins = LEVELS[self.level]
        self.boosted = frozenset(boosted)  # layers whose K gets twice its group's bins
        self.k_cap = k_cap  # None: K's channels all quantized as they are

    def for_model(
        self, layer_types: Sequence[str], level: int = 0, k_cap: float | None = None
    ) -> CacheGenCodec:
        """This codec with the model's sensitive layers boosted, its calibrated ``k_cap`` (a cap
        set on this codec wins) and, when it was configured at level 0, the model's calibrated
        ``level`` (0: none, the default level)."""
        boosted = sensitive_layers(layer_types)
        resolved = self.configured_level or level or DEFAULT_LEVEL
        cap = self.k_cap if self.k_cap is not None else k_cap
        if (boosted, resolved, cap) == (self.boosted, self.level, self.k_cap):
            return self
        return CacheGenCodec(self.configured_level, boosted, model_level=level, k_cap=cap)

    def layer_bins(self, num_layers: int) -> list[tuple[int, int]]:
        """(K bins, V bins) of every layer."""
        out = []
        for i in range(num_layers):
            k, v = self.bins.of_layer(i, num_layers)
            out.append((min(2 * k, MAX_BINS) if i in self.boosted else k, v))
        return out

    # -- encoding -------------------------------------------------------------------------------

    def encode(self, kv: torch.Tensor) -> tuple[bytes, list[int]]:
        kv = check_kv(kv)
        L, _, T, H, D = kv.shape
        values = kv.float().reshape(L, 2, T, H * D).numpy()
        if self.boosted and max(self.boosted) >= L:
            raise ValueError(f"cachegen was set up for a model with more than {L} layers")
        bins = self.layer_bins(L)
        try:
            parts = self._run(
                "encode",
                [(values[a:b], bins[a:b], self.k_cap) for a, b in self._groups(L, kv.numel())],
            )
        except (JobError, ModelsError) as e:
            raise ValueError(f"cachegen cannot encode this KV: {e}") from None
        blobs = [blob for group in parts for blob in group]
        return b"".join(blobs), [len(b) for b in blobs]

    def encode_layer(self, kv: torch.Tensor) -> bytes:
        """One layer on its own, with the early layers' bins (a one-layer model)."""
        kv = kv.detach().to("cpu").float()
        _, T, H, D = kv.shape
        return coded_layer.encode(
            kv.reshape(2, T, H * D).numpy(), *self.bins.of_layer(0, 1), k_cap=self.k_cap
        )

    # -- decoding -------------------------------------------------------------------------------

    def decode(
        self,
        data: memoryview,
        layer_sizes: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        if sum(layer_sizes) != len(data):
            raise CodecError(f"{len(data)} payload bytes for layers of {sum(layer_sizes)} bytes")
        _, T, H, D = shape
        n = len(layer_sizes)
        blobs, off = [], 0
        for size in layer_sizes:
            blobs.append(bytes(data[off : off + size]))
            off += size
        try:  # each layer says its own shape: checked before anything sized by the caller's shape
            for blob in blobs:
                coded_layer.check_head(blob, T, H * D)
        except coded_layer.LayerError as e:
            raise CodecError(str(e)) from None
        jobs = [(blobs[a:b], T, H * D) for a, b in self._groups(n, n * 2 * T * H * D)]
        try:
            parts = self._run("decode", jobs)
        except (JobError, coded_layer.LayerError, ModelsError) as e:
            raise CodecError(str(e)) from None
        symbols = torch.from_numpy(
            np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        )
        scales = torch.from_numpy(
            np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        )
        levels = torch.tensor(
            [[b // 2 - 1 for b in pair] for p in parts for pair in p[2]], dtype=torch.float32
        )
        divisors = torch.from_numpy(
            np.concatenate([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
        )
        values = dequantize(symbols, scales, levels)
        if (divisors != 1).any():  # K's outlier channels back to their size (a capped layer)
            values[:, 0] *= divisors[:, None, :]
        return values.view(n, 2, T, H, D).to(dtype)

    def decode_layer(
        self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        return self.decode(data, [len(data)], shape, dtype)[0]

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _groups(num_layers: int, num_values: int) -> list[tuple[int, int]]:
        """Contiguous layer ranges, one per worker (one range when the pool would not pay off)."""
        pool = shared_pool()
        n = min(pool.size, num_layers) if num_values >= POOL_MIN_VALUES else 1
        n = max(n, 1)
        bounds = [round(i * num_layers / n) for i in range(n + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [(0, 0)]

    @staticmethod
    def _run(op: str, jobs: list[tuple]) -> list:
        return shared_pool().run(op, jobs)
