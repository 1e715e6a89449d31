"""An orthonormal per-head Hadamard rotation of KV, applied before quantization and undone after.

Why: CacheGen quantizes each (layer, K/V, token) row with one scale, its abs-max over every
channel. Keys have a few outlier channels (large in every token, after RoPE as before it), so the
abs-max is set by them and the other channels get few of the bins. A normalized Walsh-Hadamard
transform of each head's ``head_dim`` vector spreads every channel over all of them (QuaRot,
llama.cpp's KV rotation, vLLM's TurboQuant): the row's abs-max falls towards its RMS and the
same bins quantize the small channels finer. The transform is orthonormal, so the quantization
error of the rotated values has the same L2 norm after the inverse: nothing is lost but rounding.

The Sylvester Hadamard matrix ``H_n`` (``n`` a power of two) is symmetric with
``H_n @ H_n = n * I``, so ``H_n / sqrt(n)`` is its own inverse; it is applied in ``log2(n)``
butterfly passes (``fwht``). A ``head_dim`` that is not a power of two is split into its binary
decomposition (80 = 64 + 16): a block-diagonal matrix of Hadamard blocks, still orthonormal, with
less mixing across the blocks; no padding, so the stored tensor keeps its shape.

Optional sign flips (QuaRot, TurboQuant): ``x -> H (s * x)`` with a fixed +-1 vector ``s`` drawn
from a seeded generator, so that a channel pattern aligned with a Hadamard row is not left in one
output channel. The signs depend only on ``head_dim`` and the seed (``splitmix64``, not a
library's generator): every reader recomputes them.
"""

from __future__ import annotations

import math

import torch


def power_blocks(n: int) -> list[int]:
    """The sizes of the Hadamard blocks of an ``n``-channel head: the powers of two of ``n``'s
    binary form, largest first (64 -> [64]; 80 -> [64, 16]; 1 -> [1])."""
    if n < 1:
        raise ValueError(f"head_dim must be positive, got {n}")
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


def fwht(x: torch.Tensor) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of ``x`` along its last dimension (a power of two):
    ``x @ H_n / sqrt(n)`` in fp32, a new tensor. Its own inverse."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(*lead, n) / math.sqrt(n)).contiguous()


def block_fwht(x: torch.Tensor) -> torch.Tensor:
    """``fwht`` of each block of ``power_blocks`` along the last dimension (the whole dimension
    when it is a power of two). Its own inverse."""
    blocks = power_blocks(x.shape[-1])
    if len(blocks) == 1:
        return fwht(x)
    return torch.cat([fwht(part) for part in torch.split(x, blocks, dim=-1)], dim=-1)


_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64's output for state ``x`` (Steele et al.): a fixed, documented mixing function, so
    that the signs are part of the format and not of a library's random generator."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def signs(n: int, seed: int) -> torch.Tensor:
    """The fixed +-1 vector (fp32, length ``n``) of ``seed``: channel ``i`` is -1 when the top bit
    of ``splitmix64(seed * 2**32 + i)`` is set. The same on every machine and every version."""
    bits = [splitmix64((seed << 32) + i) >> 63 for i in range(n)]
    return 1.0 - 2.0 * torch.tensor(bits, dtype=torch.float32)


def rotate(x: torch.Tensor, sign: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (..., head_dim) rotated per head: ``block_fwht(sign * x)`` in fp32."""
    return block_fwht(x.float() * sign if sign is not None else x)


def unrotate(y: torch.Tensor, sign: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``rotate`` with the same ``sign``: ``sign * block_fwht(y)`` in fp32."""
    x = block_fwht(y)
    return x * sign if sign is not None else x
