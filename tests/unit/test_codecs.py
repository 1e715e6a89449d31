"""Codecs: exact raw round trips, the int8 error bound, layer-by-layer decoding, the registry."""

from __future__ import annotations

import pytest
import torch

from kvfuse.codecs import Codec, RawCodec, codec_names, get_codec, get_codec_by_id, register_codec
from kvfuse.codecs.base import CodecError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _kv(dtype, shape=(3, 2, 7, 2, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _decode(codec, payload, sizes, kv_shape, dtype):
    return codec.decode(memoryview(payload), sizes, tuple(kv_shape[1:]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_round_trip_is_bit_exact(dtype):
    kv = _kv(dtype)
    codec = get_codec("raw")
    payload, sizes = codec.encode(kv)
    assert len(payload) == kv.numel() * kv.element_size() == sum(sizes)
    assert sizes == [codec.layer_size(tuple(kv.shape[1:]), dtype)] * kv.shape[0]
    out = _decode(codec, bytes(payload), sizes, kv.shape, dtype)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_raw_encode_is_zero_copy_and_decode_aliases_writable_buffers():
    kv = _kv(torch.float16)
    payload, sizes = get_codec("raw").encode(kv)
    kv[0, 0, 0, 0, 0] = 123.0  # the payload is a view of kv's memory
    assert torch.frombuffer(bytearray(payload), dtype=torch.float16)[0] == 123.0
    buf = bytearray(bytes(payload))
    out = _decode(get_codec("raw"), buf, sizes, kv.shape, torch.float16)
    out[0, 0, 0, 0, 0] = 7.0
    assert torch.frombuffer(buf, dtype=torch.float16)[0] == 7.0  # shares memory: no copy was made


def test_raw_decode_of_readonly_bytes_copies_without_warning(recwarn):
    kv = _kv(torch.bfloat16)
    payload, sizes = get_codec("raw").encode(kv)
    blob = bytes(payload)
    out = _decode(get_codec("raw"), blob, sizes, kv.shape, torch.bfloat16)
    out.zero_()  # must not write into the immutable bytes
    assert bytes(get_codec("raw").encode(kv)[0]) == blob
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_raw_rejects_wrong_payload_size():
    with pytest.raises(CodecError):
        get_codec("raw").decode(memoryview(b"\0" * 10), [10], (2, 1, 1, 4), torch.float16)
    with pytest.raises(CodecError):  # right total, wrong split
        get_codec("raw").decode(memoryview(b"\0" * 32), [8, 24], (2, 1, 1, 4), torch.float16)


@pytest.mark.parametrize("name", ["raw", "int8"])
def test_layers_decode_on_their_own(name):
    codec = get_codec(name)
    kv = _kv(torch.float16, shape=(4, 2, 5, 2, 8), seed=3)
    payload, sizes = codec.encode(kv)
    whole = _decode(codec, payload, sizes, kv.shape, torch.float16)
    off = sum(sizes[:2])
    layer2 = codec.decode_layer(
        memoryview(payload)[off : off + sizes[2]], tuple(kv.shape[1:]), torch.float16
    )
    assert torch.equal(layer2, whole[2])
    middle = codec.decode(
        memoryview(payload)[sizes[0] : sum(sizes[:3])],
        sizes[1:3],
        tuple(kv.shape[1:]),
        torch.float16,
    )
    assert torch.equal(middle, whole[1:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_bound(dtype):
    """Measured: every value is within absmax/254 of its (layer, K/V, token) row after int8 rounding,
    plus the output dtype's own rounding (bf16: 2^-8 relative, fp16: 2^-11)."""
    kv = _kv(dtype, shape=(4, 2, 33, 4, 16), seed=1)
    kv[1, 0, 5] = 0  # an all-zero row
    codec = get_codec("int8")
    payload, sizes = codec.encode(kv)
    assert (
        len(payload)
        == 4 * codec.layer_size(tuple(kv.shape[1:]), dtype)
        == 4 * 2 * 33 * (4 + 4 * 16)
    )
    out = _decode(codec, payload, sizes, kv.shape, dtype)
    assert out.dtype == dtype and out.shape == kv.shape
    x = kv.float()
    absmax = x.abs().amax(dim=(3, 4), keepdim=True).clamp_min(1e-30)
    rel = ((out.float() - x).abs() / absmax).max().item()
    dtype_eps = {torch.float32: 1e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    assert rel <= 0.5 / 127 + dtype_eps
    assert rel > 0.5 / 127 / 10  # it is lossy: a test that cannot see any error would be vacuous
    assert torch.equal(out[1, 0, 5], torch.zeros_like(out[1, 0, 5]))
    assert not codec.is_lossless and get_codec("raw").is_lossless


def test_int8_rejects_non_finite_and_bad_scales():
    kv = _kv(torch.float32)
    kv[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        get_codec("int8").encode(kv)
    payload, sizes = get_codec("int8").encode(_kv(torch.float32))
    good = bytearray(payload)
    good[0:4] = b"\x00\x00\xc0\x7f"  # a NaN scale
    with pytest.raises(CodecError):
        _decode(get_codec("int8"), good, sizes, (3, 2, 7, 2, 8), torch.float32)


def test_encode_rejects_bad_tensors():
    with pytest.raises(ValueError, match="dtype"):
        get_codec("raw").encode(torch.zeros(1, 2, 1, 1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="layers, 2"):
        get_codec("raw").encode(torch.zeros(1, 3, 1, 1, 1, dtype=torch.float16))


def test_registry():
    assert {"raw", "int8"} <= set(codec_names())
    assert get_codec_by_id(1).name == "raw" and get_codec_by_id(2).name == "int8"
    with pytest.raises(ValueError, match="known codecs: .*int8.*raw"):
        get_codec("zstd")
    with pytest.raises(ValueError):
        get_codec_by_id(999)
    with pytest.raises(ValueError, match="no levels"):
        get_codec("raw", level=2)
    with pytest.raises(ValueError, match="already registered"):
        register_codec("raw", 77, RawCodec)
    with pytest.raises(ValueError, match="already registered"):
        register_codec("other", 1, RawCodec)


def test_register_a_new_codec():
    class Negated(RawCodec):
        name = "test-negated"
        codec_id = 0x7F01

        def encode(self, kv):
            return super().encode(-kv)

        def decode(self, data, layer_sizes, shape, dtype):
            return -super().decode(data, layer_sizes, shape, dtype)

    register_codec(Negated.name, Negated.codec_id, Negated)
    codec = get_codec("test-negated")
    assert isinstance(codec, Codec)
    kv = _kv(torch.float32)
    payload, sizes = codec.encode(kv)
    assert torch.equal(_decode(codec, bytes(payload), sizes, kv.shape, kv.dtype), kv)
