"""``cachegen-rot``: CacheGen's levels and entropy coding over Hadamard-rotated K and V.

Each head's K (after RoPE, as the cache holds it) and V are rotated by a normalized
Walsh-Hadamard transform (``kvfuse/codecs/rotation.py``) before CacheGen's per-(layer, token)
quantization and rANS coding, and rotated back after decoding. K keeps more bins than V, as in
every CacheGen level (``LEVELS``). Measured against int8, fp8 and the plain levels in
``bench/codec.py --part rotation`` (docs/benchmarks.md, CacheGen).

A codec of its own (name ``cachegen-rot``, id 4), not a flag of ``cachegen``: a build that does
not know the rotation finds an unknown codec id in the entry header, and the entry is a miss
(``kv/format.py``), never rotated KV read as plain. The header's u16 level holds the bins level
in its low byte and the rotation variant in its high byte (``header_level``):

- variant 1: the Hadamard transform alone;
- variant 2 (the default): a fixed sign flip first, +-1 per channel from seed ``SIGN_SEED``
  (QuaRot, TurboQuant), the same on every machine.

A header whose variant or bins level this build does not know is a ValueError when the codec is
looked up, so a miss too. A configured level (``codec_level``, 0-4) takes the default variant.
Each layer's bytes start with a two-byte mark (``LAYER_MARK``, the variant) before CacheGen's
layer bytes: an entry whose header was relabelled between the two codecs, or between variants,
does not decode (a ``CodecError``: the entry is dropped), where it would otherwise decode to
values in the wrong basis.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfuse.codecs.base import CodecError, check_kv
from kvfuse.codecs.cachegen import DEFAULT_LEVEL, LEVELS, CacheGenCodec, sensitive_layers
from kvfuse.codecs.rotation import rotate, signs, unrotate

HADAMARD = 1
HADAMARD_SIGNS = 2
VARIANTS = (HADAMARD, HADAMARD_SIGNS)
DEFAULT_VARIANT = HADAMARD_SIGNS
SIGN_SEED = 0x5EED  # part of the format of variant 2: never change it
LAYER_MARK = 0xD7  # first byte of every rotated layer (CacheGen's layers start with their version)


def header_level(level: int, variant: int) -> int:
    """The u16 the entry header records for bins ``level`` rotated by ``variant``."""
    return level | variant << 8


def parse_level(value: int) -> tuple[int, int]:
    """(bins level, variant) of a configured level (below 256: the default variant; 0: the
    model's) or of a header's u16; ValueError on a variant or level this build does not know."""
    if not 0 <= value < 1 << 16:
        raise ValueError(f"cachegen-rot level must be a u16, got {value}")
    level, variant = value & 0xFF, value >> 8 or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"unknown cachegen-rot rotation variant {variant}")
    if level != 0 and level not in LEVELS:
        raise ValueError(
            f"cachegen-rot levels are {', '.join(map(str, LEVELS))} (0: the model's calibrated "
            f"level, else {DEFAULT_LEVEL}); got {level}"
        )
    if value >> 8 and level == 0:
        raise ValueError("a cachegen-rot header must name its bins level")
    return level, variant


class CacheGenRotCodec(CacheGenCodec):
    """CacheGen over rotated heads; ``level`` as in ``parse_level`` (``variant``, when given, wins
    over the one it names). ``self.level`` is the header value (``header_level``),
    ``self.bins_level`` the CacheGen level it quantizes at."""

    name = "cachegen-rot"
    codec_id = 4
    is_lossless = False

    def __init__(
        self,
        level: int = 0,
        boosted: frozenset[int] = frozenset(),
        model_level: int = 0,
        variant: int = 0,
    ) -> None:
        bins_level, parsed = parse_level(level)
        if variant and variant not in VARIANTS:
            raise ValueError(f"unknown cachegen-rot rotation variant {variant}")
        # no K channel divisors: the rotation already spreads an outlier channel over its head
        super().__init__(bins_level, boosted, model_level, k_cap=None)
        self.variant = variant or parsed
        self.bins_level = self.level
        self.level = header_level(self.bins_level, self.variant)
        self._signs: dict[int, torch.Tensor] = {}

    def for_model(
        self, layer_types: Sequence[str], level: int = 0, k_cap: float | None = None
    ) -> CacheGenRotCodec:
        """As ``CacheGenCodec.for_model``, keeping the rotation variant (no ``k_cap``: the
        rotation spreads an outlier channel over its head already)."""
        boosted = sensitive_layers(layer_types)
        resolved = self.configured_level or level or DEFAULT_LEVEL
        if (boosted, resolved) == (self.boosted, self.bins_level):
            return self
        return CacheGenRotCodec(self.configured_level, boosted, level, self.variant)

    def _sign(self, head_dim: int) -> torch.Tensor | None:
        if self.variant == HADAMARD:
            return None
        if head_dim not in self._signs:
            self._signs[head_dim] = signs(head_dim, SIGN_SEED)
        return self._signs[head_dim]

    def encode(self, kv: torch.Tensor) -> tuple[bytes, list[int]]:
        kv = check_kv(kv)
        payload, sizes = super().encode(rotate(kv, self._sign(kv.shape[-1])))
        return self._marked(payload, sizes)

    def encode_layer(self, kv: torch.Tensor) -> bytes:
        kv = kv.detach().to("cpu")
        return self._mark() + super().encode_layer(rotate(kv, self._sign(kv.shape[-1])))

    def decode(
        self,
        data: memoryview,
        layer_sizes: Sequence[int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        data, layer_sizes = self._unmarked(data, layer_sizes)
        rotated = super().decode(data, layer_sizes, shape, torch.float32)
        out = unrotate(rotated, self._sign(shape[-1])).to(dtype)
        if not torch.isfinite(out).all():  # scales no encoder writes: beyond the dtype's range
            raise CodecError(f"cachegen-rot payload decodes to values beyond the {dtype} range")
        return out

    # -- the layer mark ---------------------------------------------------------------------------

    def _mark(self) -> bytes:
        return bytes((LAYER_MARK, self.variant))

    def _marked(self, payload: bytes, sizes: Sequence[int]) -> tuple[bytes, list[int]]:
        """Every layer's bytes behind the mark: CacheGen's layer bytes start with their format
        version (1), so a plain reader given a rotated layer, or this one a plain layer (a header
        relabelled either way), refuses it instead of decoding values in the wrong basis."""
        mv, off, parts = memoryview(payload), 0, []
        for size in sizes:
            parts += [self._mark(), mv[off : off + size]]
            off += size
        return b"".join(parts), [size + len(self._mark()) for size in sizes]

    def _unmarked(self, data: memoryview, sizes: Sequence[int]) -> tuple[bytes, list[int]]:
        if sum(sizes) != len(data):
            raise CodecError(f"{len(data)} payload bytes for layers of {sum(sizes)} bytes")
        mark, off, parts = self._mark(), 0, []
        for size in sizes:
            if bytes(data[off : off + len(mark)]) != mark:
                raise CodecError(
                    f"a cachegen-rot layer must start with {mark.hex()} (variant {self.variant})"
                )
            parts.append(data[off + len(mark) : off + size])
            off += size
        return b"".join(parts), [size - len(mark) for size in sizes]
