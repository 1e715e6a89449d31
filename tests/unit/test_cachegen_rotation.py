"""The Hadamard rotation (``kvfuse/codecs/rotation.py``) and the ``cachegen-rot`` codec."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import xxhash

from kvfuse import codecs
from kvfuse.codecs import CacheGenCodec, get_codec, get_codec_by_id
from kvfuse.codecs.cachegen_rot import (
    DEFAULT_VARIANT,
    HADAMARD,
    HADAMARD_SIGNS,
    SIGN_SEED,
    CacheGenRotCodec,
    header_level,
    parse_level,
)
from kvfuse.codecs.rotation import (
    block_fwht,
    fwht,
    power_blocks,
    rotate,
    signs,
    splitmix64,
    unrotate,
)
from kvfuse.entropy import layer
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import FormatError, encode_entry, open_entry

_CODEC_ID_AT, _LEVEL_AT = 10, 12  # "<4sHIHH...": magic, version, header length, codec id, level


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _kv(layers=3, tokens=9, heads=2, dim=16, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, heads, dim, generator=g)
    x[..., 1] *= 30  # an outlier channel in every token, as keys have
    return x.to(dtype)


# -- the transform ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, blocks",
    [(1, [1]), (2, [2]), (64, [64]), (80, [64, 16]), (96, [64, 32]), (7, [4, 2, 1]), (256, [256])],
)
def test_power_blocks(n, blocks):
    assert power_blocks(n) == blocks


def test_power_blocks_refuses_an_empty_head():
    with pytest.raises(ValueError):
        power_blocks(0)


@pytest.mark.parametrize(
    "x, expected",
    [
        ([1.0], [1.0]),
        ([1.0, 0.0], [1 / math.sqrt(2), 1 / math.sqrt(2)]),
        ([1.0, 1.0], [math.sqrt(2), 0.0]),
        ([1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]),
        ([1.0, -1.0, 1.0, -1.0], [0.0, 2.0, 0.0, 0.0]),
        ([1.0, 1.0, -1.0, -1.0], [0.0, 0.0, 2.0, 0.0]),
    ],
)
def test_fwht_of_known_vectors(x, expected):
    assert torch.allclose(fwht(torch.tensor(x)), torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize("n", [2, 8, 64, 256])
def test_fwht_is_the_normalized_sylvester_matrix(n):
    x = torch.randn(5, n, dtype=torch.float64)
    assert torch.allclose(fwht(x).double(), x @ _sylvester(n).double() / math.sqrt(n), atol=1e-5)


def test_fwht_refuses_a_length_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(3, 80))


@pytest.mark.parametrize("n", [1, 2, 16, 64, 80, 96, 256])
@pytest.mark.parametrize("signed", [False, True])
def test_rotation_is_orthonormal(n, signed):
    """Rotate then unrotate is the identity (float rounding), and every head keeps its norm."""
    s = signs(n, SIGN_SEED) if signed else None
    x = torch.randn(4, 2, 7, 3, n) * 5
    y = rotate(x, s)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.allclose(unrotate(y, s), x, atol=1e-4)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_rotation_spreads_an_outlier_channel_over_the_head():
    x = torch.zeros(64)
    x[5] = 8.0
    assert torch.allclose(rotate(x).abs(), torch.full((64,), 1.0))
    # with blocks (80 = 64 + 16) a channel spreads over its block only
    y = torch.zeros(80)
    y[70] = 4.0
    out = block_fwht(y)
    assert torch.equal(out[:64], torch.zeros(64)) and torch.allclose(out[64:].abs(), torch.ones(16))


def test_signs_are_fixed_by_the_seed():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's published first output
    s = signs(16, SIGN_SEED)
    assert s.tolist() == [1, 1, -1, -1, 1, 1, -1, 1, 1, -1, 1, 1, -1, 1, 1, -1]
    assert torch.equal(signs(256, SIGN_SEED)[:16], s)
    assert set(signs(256, SIGN_SEED).tolist()) == {-1.0, 1.0}
    assert not torch.equal(signs(64, SIGN_SEED), signs(64, SIGN_SEED + 1))


# -- levels in the header -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, parsed",
    [
        (0, (0, DEFAULT_VARIANT)),
        (3, (3, DEFAULT_VARIANT)),
        (header_level(2, HADAMARD), (2, HADAMARD)),
        (header_level(4, HADAMARD_SIGNS), (4, HADAMARD_SIGNS)),
    ],
)
def test_parse_level(value, parsed):
    assert parse_level(value) == parsed


@pytest.mark.parametrize(
    "value, message",
    [
        (header_level(2, 3), "variant 3"),
        (header_level(2, 255), "variant 255"),
        (header_level(9, HADAMARD), "levels are"),
        (header_level(0, HADAMARD), "name its bins level"),
        (5, "levels are"),
        (-1, "u16"),
        (1 << 16, "u16"),
    ],
)
def test_parse_level_refuses(value, message):
    with pytest.raises(ValueError, match=message):
        parse_level(value)


def test_codec_levels_and_for_model():
    c = get_codec("cachegen-rot", 3)
    assert (c.bins_level, c.variant, c.level) == (3, HADAMARD_SIGNS, 3 | HADAMARD_SIGNS << 8)
    assert get_codec_by_id(CacheGenRotCodec.codec_id, c.level).bins_level == 3
    # level 0 takes the model's calibrated level; a configured level wins; variants are kept
    m = CacheGenRotCodec(0, variant=HADAMARD).for_model(["sliding", "full"], level=1)
    assert (m.bins_level, m.variant, m.boosted) == (1, HADAMARD, frozenset({1}))
    assert get_codec("cachegen-rot", 4).for_model(["full"], level=1).bins_level == 4


# -- entries ------------------------------------------------------------------------------------


def _reference(kv: torch.Tensor, codec: CacheGenRotCodec) -> torch.Tensor:
    """Rotate, quantize and dequantize with the NumPy reference, unrotate."""
    sign = signs(kv.shape[-1], SIGN_SEED) if codec.variant == HADAMARD_SIGNS else None
    r = rotate(kv, sign)
    L, _, T, H, D = kv.shape
    for i, bins in enumerate(codec.layer_bins(L)):
        for part in range(2):
            sym, sc = layer.quantize(r[i, part].reshape(T, H * D).numpy(), bins[part])
            r[i, part] = torch.from_numpy(layer.dequantize(sym, sc, bins[part])).view(T, H, D)
    return unrotate(r, sign)


@pytest.mark.parametrize("variant", [HADAMARD, HADAMARD_SIGNS])
@pytest.mark.parametrize("dim", [16, 80])
def test_rotated_entry_round_trips(variant, dim):
    kv = _kv(dim=dim, seed=dim)
    codec = CacheGenRotCodec(2, variant=variant)
    blob = encode_entry(KVChunk(kv=kv, positions=torch.arange(9)), "k", codec).join()
    level = struct.unpack_from("<HH", blob, _CODEC_ID_AT)
    assert level == (CacheGenRotCodec.codec_id, header_level(2, variant))  # the header says so
    entry = open_entry(blob, "k")
    assert entry.codec.name == "cachegen-rot" and entry.codec.variant == variant
    out = entry.decode()
    assert out.dtype == torch.float16 and out.shape == kv.shape
    assert torch.allclose(out.float(), _reference(kv, codec).half().float(), atol=2e-3)
    assert torch.equal(entry.decode(1, 2), out[1:2])  # layer by layer, as layer-wise loading


def test_rotation_lowers_the_error_of_kv_with_outlier_channels():
    kv = _kv(tokens=64, dim=64, dtype=torch.float32)
    errors = {}
    # plain CacheGen as it was before K's channel divisors, which take on K's outliers too
    codecs_ = {"plain": CacheGenCodec(2, k_cap=None), "cachegen-rot": get_codec("cachegen-rot", 2)}
    for name, codec in codecs_.items():
        payload, sizes = codec.encode(kv)
        out = codec.decode(memoryview(payload), sizes, tuple(kv.shape[1:]), torch.float32)
        errors[name] = float((out - kv).pow(2).mean())
    assert errors["cachegen-rot"] < errors["plain"] / 3


def _reseal(blob: bytes, offset: int, value: int) -> bytes:
    """A header u16 changed and the header checksum recomputed: only the field's meaning differs."""
    b = bytearray(blob)
    struct.pack_into("<H", b, offset, value)
    hl = struct.unpack_from("<I", b, 6)[0]
    struct.pack_into("<Q", b, hl - 8, xxhash.xxh3_64_intdigest(bytes(b[: hl - 8])))
    return bytes(b)


def _blob() -> bytes:
    kv = _kv()
    return encode_entry(
        KVChunk(kv=kv, positions=torch.arange(9)), "k", get_codec("cachegen-rot", 2)
    ).join()


def test_a_reader_without_the_rotation_misses(monkeypatch):
    """A build that does not know codec id 4 (every build before it) refuses the entry."""
    monkeypatch.delitem(codecs._BY_ID, CacheGenRotCodec.codec_id)
    with pytest.raises(FormatError, match="unknown codec id 4"):
        open_entry(_blob(), "k")


@pytest.mark.parametrize(
    "level", [header_level(2, 3), header_level(2, 0xFF), header_level(0, HADAMARD), 7]
)
def test_an_unknown_rotation_variant_or_level_in_the_header_misses(level):
    with pytest.raises(FormatError):
        open_entry(_reseal(_blob(), _LEVEL_AT, level), "k")


def _plain_blob() -> bytes:
    kv = _kv()
    return encode_entry(
        KVChunk(kv=kv, positions=torch.arange(9)), "k", get_codec("cachegen", 2)
    ).join()


@pytest.mark.parametrize(
    "what",
    ["rotated relabelled plain", "plain relabelled rotated", "rotated relabelled other variant"],
)
def test_a_relabelled_header_does_not_decode(what):
    """Intact entries whose header names the other codec (or variant): each layer's mark refuses
    them when loaded, instead of values in the wrong basis."""
    rot_id, plain_id = CacheGenRotCodec.codec_id, get_codec("cachegen").codec_id
    blob = {
        "rotated relabelled plain": lambda: _reseal(
            _reseal(_blob(), _CODEC_ID_AT, plain_id), _LEVEL_AT, 2
        ),
        "plain relabelled rotated": lambda: _reseal(
            _reseal(_plain_blob(), _CODEC_ID_AT, rot_id), _LEVEL_AT, header_level(2, 2)
        ),
        "rotated relabelled other variant": lambda: _reseal(
            _blob(), _LEVEL_AT, header_level(2, HADAMARD)
        ),
    }[what]()
    entry = open_entry(blob, "k")  # intact as an entry
    with pytest.raises(FormatError, match="does not decode"):
        entry.decode()


def test_layer_sizes_include_the_mark():
    codec = get_codec("cachegen-rot", 2)
    kv = _kv()
    payload, sizes = codec.encode(kv)
    plain, plain_sizes = get_codec("cachegen", 2).encode(rotate(kv, signs(16, SIGN_SEED)))
    assert [s - 2 for s in sizes] == plain_sizes and len(payload) == len(plain) + 2 * len(sizes)
    one = codec.encode_layer(kv[0])
    assert one[:2] == bytes((0xD7, HADAMARD_SIGNS))
    out = codec.decode_layer(memoryview(one), tuple(kv.shape[1:]), torch.float32)
    assert out.shape == kv.shape[1:]


def test_an_engine_configured_with_cachegen_rot_writes_and_reuses_rotated_entries(
    tiny_loaded, tmp_path
):
    """``cache.codec: cachegen-rot`` end to end on a tiny Gemma 3 (global layers boosted): the
    stored entries say so in their header and a second request loads them."""
    from kvfuse.config import EngineSettings
    from kvfuse.config import profiles as profile
    from kvfuse.engine import Engine
    from kvfuse.generation import SamplingParams
    from kvfuse.kv.format import read_header
    from kvfuse.store import TieredStore
    from kvfuse.tiers import MemoryTier

    model = tiny_loaded("gemma3")
    profile.save(
        profile.BlendProfile(
            model.name,
            model.fingerprint,
            {"method": "hkvd", "recompute_ratio": 0.3},
            "test",
            "test",
            codec={"cachegen_level": 3},
        ),
        tmp_path / "profiles",
    )
    store = TieredStore(MemoryTier(1 << 26))
    settings = EngineSettings.of(
        chunk_size=16,
        codec="cachegen-rot",
        history=False,
        async_save=False,
        profiles_path=str(tmp_path / "profiles"),
    )
    engine = Engine(model, store, settings)
    try:
        codec = engine.cache.parts.codec
        assert codec.name == "cachegen-rot" and codec.bins_level == 3 and codec.boosted
        ids = list(range(5, 60))
        first = engine.generate(ids, SamplingParams(max_tokens=3, temperature=0))
        keys = list(store.memory.keys_lru())
        assert keys
        for key in keys:
            header = read_header(bytes(store.memory.get(key).join()))
            assert (header.codec, header.level) == (
                "cachegen-rot",
                header_level(3, DEFAULT_VARIANT),
            )
        again = engine.generate(ids, SamplingParams(max_tokens=3, temperature=0))
        assert again.cached_tokens >= 48 and first.cached_tokens == 0
    finally:
        engine.close()
