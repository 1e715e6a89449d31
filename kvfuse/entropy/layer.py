"""One layer's KV <-> bytes: CacheGen's quantization and entropy coding (NumPy, ``constriction``).

Quantization: symmetric, one scale per (K/V, token) row: ``q = rint(x / s * c)`` with
``c = bins // 2 - 1`` (so ``q`` is in ``[-c, c]``, ``bins - 1`` symbols) and ``s`` the row's
abs-max rounded *up* to bfloat16 (two bytes, fp32's range, ``|x| / s <= 1``). A value's error is
at most ``s / (2c)``: half a quantization step.

Coding: each (K/V, channel) stream, the ``tokens`` symbols of one channel, is coded with rANS
(``constriction``'s ``AnsCoder``) under its own model from ``models.py``; all streams of a layer
go into one coder (channels in order, so the decoder reads them in order).

K's outlier channels (``k_cap``): in some models a few K channels are an order of magnitude
larger than the rest in every token (Qwen2's keys, whose k_proj carries a bias: in Qwen2.5-0.5B's
first layers one channel reaches ~145 where the median channel's abs-max is ~9), so a token's
scale is spent on them and the other channels fall into the few middle bins. With ``k_cap`` a
layer's K channels whose abs-max over the chunk exceeds ``k_cap`` times the median channel's are
divided by a per-channel divisor first (bringing them down to that ceiling; bf16, rounded up)
and multiplied back on decoding; the other channels are untouched. A layer with no such channel
is written exactly as without it. Measured with ``bench/codec.py --part allocation --allocations
levels`` (docs/benchmarks.md, CacheGen): it helps some models' keys and hurts others', so the
codec applies it per model, from the model's profile (``CacheGenCodec.for_model``).

Bytes of a layer (little-endian)::

    u8 version (1), u8 K bins, u8 V bins, u8 flags, u32 tokens, u32 channels
    if flags & K_DIVISORS: channels x u16 bf16 divisors of K's channels (each >= 1)
    for K, then V:  tokens x u16 bf16 scales, channels x u8 centres, channels x u8 widths,
                    u32 number of words, the coder's u32 words
    u64 xxh3_64 of every byte above, then of the symbols (K then V, channel-major, one byte each)

``flags`` was a zero byte before K's divisors existed, and a build that does not know a flag
refuses the layer (a miss, never K read without its divisors).

The layer carries its own bin counts, so it decodes without knowing its level or layer index.
Every field is checked on decode, the coder must end exactly empty, and the bytes and the decoded
symbols must match the checksum (so a changed scale, or probability tables that differ on the
reading machine, are caught): anything else is a ``LayerError``, never a wrong tensor.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from kvfuse.entropy.models import ALPHABETS, NUM_SCALES, coder_models, fit

VERSION = 1
K_DIVISORS = 1  # flags: K's channels carry divisors
KNOWN_FLAGS = K_DIVISORS
BINS = tuple(a + 1 for a in ALPHABETS)  # 8, 16, 32, 64, 128
_HEAD = struct.Struct("<BBBBII")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class LayerError(ValueError):
    """Bytes that are not a valid coded layer of the expected shape."""


def levels_of(bins: int) -> int:
    """``c``: the largest quantized magnitude for ``bins`` bins."""
    if bins not in BINS:
        raise ValueError(f"bins must be one of {BINS}, got {bins}")
    return bins // 2 - 1


def bf16_scales_up(absmax: np.ndarray) -> np.ndarray:
    """Each non-negative fp32 value rounded up to bfloat16, as its 16 high bits (uint16)."""
    bits = np.ascontiguousarray(absmax, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0xFFFF) >> 16).astype(np.uint16)


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def quantize(x: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``x`` ``(tokens, channels)`` to symbols ``(channels, tokens)`` uint8 in
    ``[0, bins - 2]`` and the rows' bf16 scales (uint16). ValueError on inf/NaN."""
    c = levels_of(bins)
    x = np.asarray(x, dtype=np.float32)
    absmax = np.abs(x).max(axis=1) if x.size else np.zeros(x.shape[0], np.float32)
    if not np.isfinite(absmax).all():
        raise ValueError("cachegen: the KV tensor contains inf or NaN; it cannot be quantized")
    scales = bf16_scales_up(absmax)
    s = bf16_to_f32(scales)
    if not np.isfinite(s).all():
        raise ValueError("cachegen: a KV value is too large for a bfloat16 scale")
    div = np.where(s > 0, s, 1.0).astype(np.float32)
    q = np.rint(x * (c / div)[:, None])
    np.clip(q, -c, c, out=q)
    return np.ascontiguousarray((q + c).astype(np.uint8).T), scales


def channel_divisors(x: np.ndarray, cap: float) -> np.ndarray | None:
    """bf16 divisors (uint16 words, each >= 1.0) of the channels of ``x`` ``(tokens, channels)``
    whose abs-max exceeds ``cap`` times the median channel's, bringing each down to that ceiling
    (1.0 for the others); None when no channel exceeds it."""
    if x.size == 0:
        return None
    absmax = np.abs(np.asarray(x, dtype=np.float32)).max(axis=0)
    # the lower median: no mean of two values that could overflow near fp32's largest
    ceiling = np.float32(cap) * np.quantile(absmax, 0.5, method="lower")
    if not np.isfinite(absmax).all() or ceiling <= 0 or not (absmax > ceiling).any():
        return None
    ratio = np.where(absmax > ceiling, absmax / ceiling, np.float32(1.0)).astype(np.float32)
    return bf16_scales_up(ratio)


def dequantize(
    symbols: np.ndarray, scales: np.ndarray, bins: int, from_bf16: bool = True
) -> np.ndarray:
    """Symbols ``(channels, tokens)`` and scales (bf16 words, or fp32 with ``from_bf16=False``)
    back to values ``(tokens, channels)`` fp32."""
    c = levels_of(bins)
    step = (bf16_to_f32(scales) if from_bf16 else scales) / np.float32(c)
    return (symbols.T.astype(np.float32) - np.float32(c)) * step[:, None]


def _encode_part(x: np.ndarray, bins: int, out: list, symbol_parts: list) -> None:
    import constriction

    alphabet = bins - 1
    symbols, scales = quantize(x, bins)
    centre, width = (
        fit(symbols, alphabet)
        if symbols.shape[1]
        else (np.zeros(symbols.shape[0], np.uint8), np.zeros(symbols.shape[0], np.uint8))
    )
    models = coder_models(alphabet)
    coder = constriction.stream.stack.AnsCoder()
    stream = symbols.astype(np.int32)
    for ch in range(symbols.shape[0] - 1, -1, -1):  # a stack: the last stream pushed is read first
        coder.encode_reverse(stream[ch], models[width[ch]][centre[ch]])
    words = coder.get_compressed().astype("<u4")
    out += [
        scales.astype("<u2").tobytes(),
        centre.tobytes(),
        width.tobytes(),
        _U32.pack(len(words)),
        words.tobytes(),
    ]
    symbol_parts.append(symbols)


def encode(kv: np.ndarray, bins_k: int, bins_v: int, k_cap: float | None = None) -> bytes:
    """The bytes of one layer ``kv`` ``(2, tokens, channels)`` (any float dtype); ``k_cap``: K's
    outlier channels divided down first (module docstring)."""
    if kv.ndim != 3 or kv.shape[0] != 2:
        raise ValueError(f"a layer's KV must be (2, tokens, channels), got {kv.shape}")
    levels_of(bins_k), levels_of(bins_v)
    _, tokens, channels = kv.shape
    k = np.asarray(kv[0], dtype=np.float32)
    divisors = channel_divisors(k, k_cap) if k_cap else None
    flags = 0 if divisors is None else K_DIVISORS
    out = [_HEAD.pack(VERSION, bins_k, bins_v, flags, tokens, channels)]
    if divisors is not None:
        out.append(divisors.astype("<u2").tobytes())
        k = k / bf16_to_f32(divisors)
    symbols: list[np.ndarray] = []
    _encode_part(k, bins_k, out, symbols)
    _encode_part(kv[1], bins_v, out, symbols)
    body = b"".join(out)
    sums = xxhash.xxh3_64(body)
    for part in symbols:
        sums.update(part)
    return body + _U64.pack(sums.intdigest())


class _Reader:
    def __init__(self, data: memoryview):
        self.data, self.off = data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.off + n > len(self.data):
            raise LayerError(
                f"truncated layer: {n} bytes needed at offset {self.off} of {len(self.data)}"
            )
        v = self.data[self.off : self.off + n]
        self.off += n
        return v


def _decode_part(
    r: _Reader, bins: int, tokens: int, channels: int, symbols: np.ndarray
) -> np.ndarray:
    """Decode one K or V part into ``symbols`` ``(channels, tokens)``; its fp32 scales."""
    import constriction

    alphabet = bins - 1
    scales = bf16_to_f32(np.frombuffer(r.take(2 * tokens), dtype="<u2"))
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise LayerError("invalid scales")
    centre = np.frombuffer(r.take(channels), dtype=np.uint8)
    width = np.frombuffer(r.take(channels), dtype=np.uint8)
    if (centre >= alphabet).any() or (width >= NUM_SCALES).any():
        raise LayerError("invalid stream models")
    (n_words,) = _U32.unpack(r.take(4))
    words = np.frombuffer(r.take(4 * n_words), dtype="<u4").astype(np.uint32)
    models = coder_models(alphabet)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        decode = coder.decode
        for ch, (w, c) in enumerate(zip(width.tolist(), centre.tolist())):
            symbols[ch] = decode(models[w][c], tokens)
        ended = coder.is_empty()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # constriction reports bad input as ValueError or a Rust panic
        raise LayerError(f"the coded stream does not decode ({type(e).__name__}: {e})") from None
    if not ended:
        raise LayerError("the coded stream has data left over")
    return scales


def min_size(tokens: int, channels: int) -> int:
    """The fewest bytes a layer of ``tokens`` x ``channels`` can take (head, scales, models, word
    counts, checksum; an empty coded stream)."""
    return _HEAD.size + 2 * (2 * tokens + 2 * channels + _U32.size) + _U64.size


def check_head(data: bytes | bytearray | memoryview, tokens: int, channels: int) -> tuple[int, int]:
    """The (K, V) bins of a layer whose head says it is a layer of this version and shape and that
    is at least as long as one; LayerError otherwise. Cheap: a decoder checks every layer's head
    before it allocates anything sized by ``tokens`` x ``channels``."""
    data = memoryview(data).cast("B")
    if len(data) < _HEAD.size:
        raise LayerError(f"truncated layer: {len(data)} bytes")
    version, bins_k, bins_v, flags, t, c = _HEAD.unpack_from(data)
    if version != VERSION:
        raise LayerError(f"unknown cachegen layer version {version}")
    if flags & ~KNOWN_FLAGS:
        raise LayerError(f"unknown cachegen layer flags {flags:#04x}")
    if bins_k not in BINS or bins_v not in BINS:
        raise LayerError(f"invalid bins {bins_k}/{bins_v}")
    if (t, c) != (tokens, channels):
        raise LayerError(f"layer holds {t} tokens x {c} channels, expected {tokens} x {channels}")
    if len(data) < min_size(tokens, channels):
        raise LayerError(
            f"truncated layer: {len(data)} bytes, a layer of {t} x {c} takes at least "
            f"{min_size(tokens, channels)}"
        )
    return bins_k, bins_v


def _read_divisors(r: _Reader, flags: int, channels: int) -> np.ndarray | None:
    if not flags & K_DIVISORS:
        return None
    divisors = bf16_to_f32(np.frombuffer(r.take(2 * channels), dtype="<u2"))
    if not (np.isfinite(divisors).all() and (divisors >= 1).all()):
        raise LayerError("invalid K channel divisors")
    return divisors


def decode_symbols(
    data: bytes | bytearray | memoryview,
    tokens: int,
    channels: int,
    symbols: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, tuple[int, int], np.ndarray | None]:
    """A layer's checked symbols ``(2, channels, tokens)`` uint8 (into ``symbols`` when given),
    scales ``(2, tokens)`` fp32, (K, V) bins and K's channel divisors (fp32, None: all 1);
    LayerError if the bytes are not exactly a valid layer of that shape. ``dequantize`` turns
    them into values (K's then multiplied by its divisors)."""
    bins_k, bins_v = check_head(data, tokens, channels)
    r = _Reader(memoryview(data).cast("B"))
    r.take(_HEAD.size)
    divisors = _read_divisors(r, r.data[3], channels)  # byte 3 of the head: its flags
    if symbols is None:
        symbols = np.empty((2, channels, tokens), dtype=np.uint8)
    scales = np.empty((2, tokens), dtype=np.float32)
    scales[0] = _decode_part(r, bins_k, tokens, channels, symbols[0])
    scales[1] = _decode_part(r, bins_v, tokens, channels, symbols[1])
    body = r.off
    (expected,) = _U64.unpack(r.take(8))
    if r.off != len(r.data):
        raise LayerError(f"{len(r.data) - r.off} trailing bytes after the layer")
    sums = xxhash.xxh3_64(r.data[:body])
    sums.update(symbols)
    if sums.intdigest() != expected:
        raise LayerError("the layer's bytes or decoded symbols do not match its checksum")
    return symbols, scales, (bins_k, bins_v), divisors


def decode(data: bytes | bytearray | memoryview, tokens: int, channels: int) -> np.ndarray:
    """One layer's values ``(2, tokens, channels)`` fp32 from its bytes; LayerError if they are not
    exactly a valid layer of that shape."""
    symbols, scales, bins, divisors = decode_symbols(data, tokens, channels)
    out = np.stack([dequantize(symbols[i], scales[i], bins[i], from_bf16=False) for i in range(2)])
    if divisors is not None:
        out[0] *= divisors
    return out
