"""Rotary position embeddings (RoPE), and re-rotation of cached keys to new positions.

Keys are cached *after* RoPE (as vLLM, SGLang and LMCache do) rather than before it. Why:

- decoding reads every cached key at every step; rotated keys are used as they are, un-rotated
  keys would have to be rotated again at every step, for every layer;
- a serving engine's paged KV (vLLM, SGLang) holds rotated keys, so chunks move between kvfuse
  and those engines without conversion;
- re-positioning (CacheBlend, truncated conversations) stays exact: rotations compose, so a key
  rotated at position p is moved to p' by one extra rotation by p' - p (``rerotate``).

Angles are computed in float64 (positions are exact integers) and only then rounded to the compute
dtype: a rotation by p' - p applied to a key rotated at p then matches a key rotated at p' to float
rounding of the products, at any position (fp32 angles lose ~1e-4 rad by position 4096).
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (float32, as the reference implementations compute them)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    freqs = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "linear":
        return freqs / rope.factor
    if rope.kind == "llama3":
        return _llama3_scale(freqs, rope)
    return freqs


def _llama3_scale(freqs: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / rope.factor, freqs)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(
    freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape ``(n, rot_dim // 2)`` for integer ``positions`` (any sign: deltas too)."""
    angles = (
        positions.to(torch.float64)[:, None]
        * freqs.to(device=positions.device, dtype=torch.float64)[None, :]
    )
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(n, heads, head_dim)`` in the "rotate half" layout of HF weights.

    Dimension ``i`` pairs with ``i + rot_dim / 2``. With partial rotary embeddings only the first
    ``rot_dim`` dims are rotated. Written as two fused multiply-adds per half, without the
    concatenations of the textbook form (this runs twice per layer on every token).
    """
    half = cos.shape[-1]
    rot = 2 * half
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:rot]
    out = torch.empty_like(x)
    lo, hi = out[..., :half], out[..., half:rot]
    torch.mul(x1, c, out=lo)
    lo.addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=hi)
    hi.addcmul_(x1, s)
    if rot != x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


def rerotate(
    keys: torch.Tensor,
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
    freqs: torch.Tensor,
) -> torch.Tensor:
    """Move keys rotated at ``from_positions`` to ``to_positions``: one rotation by the difference.

    ``keys`` is ``(n, heads, head_dim)``; the result has the keys' dtype (the rotation itself is
    computed in float32 at least, so fp16/bf16 keys lose nothing beyond their own rounding).
    """
    delta = to_positions.to(torch.int64) - from_positions.to(torch.int64)
    work = torch.promote_types(keys.dtype, torch.float32)
    cos, sin = cos_sin(freqs, delta, work)
    return apply(keys.to(work), cos, sin).to(keys.dtype)
