"""The CacheGen codec: lossless entropy coding of the quantized KV, the error bound, every level,
odd shapes and every family's KV layout, worker processes, and damaged streams (CodecError)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfuse.codecs import CacheGenCodec, get_codec, get_codec_by_id
from kvfuse.codecs.base import CodecError
from kvfuse.codecs.cachegen import DEFAULT_LEVEL, LEVELS, LevelBins, sensitive_layers
from kvfuse.entropy import layer, models, pool
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import FormatError, encode_entry, open_entry

# (layers, kv_heads, head_dim) of the families' KV: SmolLM2-135M, Gemma3-270M, Qwen2.5-0.5B,
# Qwen3-0.6B, Llama-3.2-1B (fewer layers where the count does not matter, to keep this quick).
FAMILY_SHAPES = {
    "smollm2": (30, 3, 64),
    "gemma3": (18, 1, 256),
    "qwen2": (6, 2, 64),
    "qwen3": (4, 8, 128),
    "llama3": (4, 8, 64),
}


def _kv(layers, tokens, heads, dim, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Channels with their own offsets and spreads (like real keys), and a few outlier channels.
    x = torch.randn(layers, 2, tokens, heads, dim, generator=g)
    x = x * (0.2 + 2 * torch.rand(layers, 2, 1, heads, dim, generator=g)) + torch.randn(
        layers, 2, 1, heads, dim, generator=g
    )
    return x.to(dtype)


def _divisors(x: np.ndarray, codec: CacheGenCodec, part: int) -> np.ndarray:
    """K's channel divisors as the codec chooses them (1 where none)."""
    words = layer.channel_divisors(x, codec.k_cap) if part == 0 and codec.k_cap else None
    return np.ones(x.shape[1], np.float32) if words is None else layer.bf16_to_f32(words)


def _reference(kv: torch.Tensor, codec: CacheGenCodec) -> torch.Tensor:
    """Quantize and dequantize each layer with the NumPy reference: what decoding must give exactly."""
    L, _, T, H, D = kv.shape
    out = torch.empty(kv.shape, dtype=torch.float32)
    for i in range(L):
        bins = codec.layer_bins(L)[i]
        for part in range(2):
            x = kv[i, part].float().reshape(T, H * D).numpy()
            d = _divisors(x, codec, part)
            sym, scales = layer.quantize(x / d, bins[part])
            rec = layer.dequantize(sym, scales, bins[part]) * d
            out[i, part] = torch.from_numpy(rec).view(T, H, D)
    return out.to(kv.dtype)


@pytest.fixture(params=[0, 2], ids=["in-process", "2-workers"])
def workers(request):
    """Run the test with coding in the calling process, then with two worker processes."""
    p = pool.set_shared_pool(request.param)
    yield p
    pool.set_shared_pool(pool.default_size())


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_round_trip_equals_the_quantized_kv_at_every_level(level, tokens, workers):
    kv = _kv(5, tokens, 2, 16, seed=level * 10 + tokens)
    codec = get_codec("cachegen", level)
    payload, sizes = codec.encode(kv)
    assert sum(sizes) == len(payload)
    out = codec.decode(memoryview(payload), sizes, tuple(kv.shape[1:]), kv.dtype)
    assert out.dtype == kv.dtype and out.shape == kv.shape
    assert torch.equal(out, _reference(kv, codec))


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_every_family_layout_round_trips_within_half_a_step(family, workers):
    L, H, D = FAMILY_SHAPES[family]
    kv = _kv(L, 33, H, D, dtype=torch.float32, seed=len(family))
    codec = get_codec("cachegen")
    payload, sizes = codec.encode(kv)
    out = codec.decode(memoryview(payload), sizes, (2, 33, H, D), torch.float32)
    assert torch.equal(out, _reference(kv, codec))
    # The error of each value is at most half a quantization step of its (layer, K/V, token) row
    # (the row's abs-max, rounded up to bfloat16, over c = bins/2 - 1), times its channel's
    # divisor (K's outlier channels), plus fp32 rounding.
    for i in range(L):
        for part, bins in enumerate(codec.bins.of_layer(i, L)):
            x = kv[i, part].reshape(33, H * D)
            d = torch.from_numpy(_divisors(x.numpy(), codec, part))
            c = bins // 2 - 1
            scale = torch.from_numpy(
                layer.bf16_to_f32(layer.bf16_scales_up((x / d).abs().amax(1).numpy()))
            )
            err = (out[i, part].reshape(33, H * D) - x).abs()
            assert (err <= (scale / (2 * c))[:, None] * d * (1 + 1e-5) + 1e-6).all()
    # Much smaller than raw fp16 (random data compresses less than real KV; see bench/codec.py).
    assert len(payload) < kv.numel() * 2 / 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_entries_decode_in_their_dtype_and_layer_by_layer(dtype):
    kv = _kv(4, 9, 2, 8, dtype=dtype, seed=2)
    entry = open_entry(
        encode_entry(
            KVChunk(kv=kv, positions=torch.arange(9)), "k", get_codec("cachegen", 3)
        ).join()
    )
    assert entry.codec.name == "cachegen" and entry.codec.level == 3
    whole = entry.decode()
    assert whole.dtype == dtype and torch.equal(whole, _reference(kv, entry.codec))
    assert torch.equal(entry.decode(1, 3), whole[1:3])


def test_levels_bins_fall_with_depth_and_with_the_level():
    for level, bins in LEVELS.items():
        assert bins.k_early >= bins.k_late and bins.v_early >= bins.v_late
        # K is the sensitive part
        assert bins.k_early >= bins.v_early and bins.k_late >= bins.v_late
        if level > 1:
            lower = LEVELS[level - 1]
            assert bins.k_late >= lower.k_late and bins.v_late >= lower.v_late
            assert bins.k_early + bins.k_late + bins.v_early + bins.v_late > (
                lower.k_early + lower.k_late + lower.v_early + lower.v_late
            )
    b = LevelBins(k_early=32, k_late=16, v_early=64, v_late=8)
    # The early groups follow the layer count (CacheGen's 10 of 32 K layers, 2 of 32 V layers).
    assert [b.of_layer(i, 32) for i in (0, 1, 2, 9, 10, 31)] == [
        (32, 64),
        (32, 64),
        (32, 8),
        (32, 8),
        (16, 8),
        (16, 8),
    ]
    assert b.k_early_layers(18) == 6 and b.v_early_layers(18) == 1
    assert b.k_early_layers(1) == 1 and b.of_layer(0, 1) == (32, 64)
    assert get_codec("cachegen").level == DEFAULT_LEVEL == get_codec("cachegen", 0).level
    with pytest.raises(ValueError, match="cachegen levels are 1, 2, 3, 4"):
        get_codec("cachegen", 9)
    assert get_codec_by_id(CacheGenCodec.codec_id, 1).name == "cachegen"


def test_coded_size_is_close_to_the_models_bound():
    """rANS spends within a fraction of a percent of what the stream models promise."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, 96)) * rng.uniform(0.2, 3, 96) + rng.normal(0, 1, 96)).astype(
        np.float32
    )
    for bins in layer.BINS:
        sym, _ = layer.quantize(x, bins)
        centre, width = models.fit(sym, bins - 1)
        bound_bytes = models.ideal_bits(sym, centre, width, bins - 1) / 8
        blob = layer.encode(np.stack([x, x]), bins, bins)
        stream_bytes = (len(blob) - 12 - 8) / 2 - 512 * 2 - 2 * 96 - 4
        assert bound_bytes <= stream_bytes <= bound_bytes * 1.01 + 8


def test_all_zero_rows_and_extreme_values():
    kv = torch.zeros(2, 2, 5, 1, 8)
    kv[1, 0, 2] = 3.0e38  # too large for fp16, fine for a bf16 scale
    codec = get_codec("cachegen", 4)
    payload, sizes = codec.encode(kv)
    out = codec.decode(memoryview(payload), sizes, (2, 5, 1, 8), torch.float32)
    assert torch.equal(out[0], torch.zeros(2, 5, 1, 8))
    assert torch.isfinite(out).all() and out[1, 0, 2].min() > 2.9e38
    with pytest.raises(ValueError, match="inf or NaN"):
        codec.encode(torch.full((1, 2, 3, 1, 4), float("nan")))


# -- damaged data: CodecError, never a crash and never a wrong tensor ------------------------------


def _one_layer(seed=0, tokens=16):
    kv = _kv(1, tokens, 2, 8, seed=seed)
    payload, sizes = get_codec("cachegen", 2).encode(kv)
    return bytes(payload), sizes


def test_truncated_trailing_and_corrupted_streams_raise_codec_error():
    codec = get_codec("cachegen")
    payload, sizes = _one_layer()
    shape = (2, 16, 2, 8)
    for bad in (payload[:-1], payload[: len(payload) // 2], payload[:5], payload + b"\0"):
        with pytest.raises(CodecError):
            codec.decode(memoryview(bad), [len(bad)], shape, torch.float16)
    with pytest.raises(CodecError):  # the shape the caller expects is not the one stored
        codec.decode(memoryview(payload), sizes, (2, 15, 2, 8), torch.float16)
    rng = np.random.default_rng(1)
    for _ in range(200):
        bad = bytearray(payload)
        bad[int(rng.integers(len(bad)))] ^= 1 << int(rng.integers(8))
        with pytest.raises(CodecError):
            codec.decode(memoryview(bytes(bad)), [len(bad)], shape, torch.float16)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_layers_decode_or_raise_layer_error(data):
    payload, _ = _one_layer(seed=3, tokens=8)
    blob = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if not blob:
            break
        i = data.draw(st.integers(0, len(blob) - 1))
        if op == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            blob[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del blob[i:]
        else:
            blob[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    try:
        out = layer.decode(bytes(blob), 8, 16)
    except layer.LayerError:
        return
    assert bytes(blob) == payload and out.shape == (2, 8, 16)  # only the intact layer decodes


def test_an_intact_entry_whose_payload_does_not_decode_is_a_format_error():
    """Checksums prove the bytes are the writer's; the codec still checks what they say."""
    kv = _kv(2, 8, 2, 8)
    codec = get_codec("cachegen")
    payload, sizes = codec.encode(kv)
    bad = bytearray(payload)
    bad[sizes[0] + 20] ^= 0xFF  # inside layer 1's scales or stream
    entry = encode_entry(KVChunk(kv=kv, positions=torch.arange(8)), "k", codec)
    from kvfuse.kv.format import Entry

    forged = Entry(
        "k", codec, entry.shape, entry.dtype, entry.positions, memoryview(bad), entry.layer_sizes
    )
    reopened = open_entry(forged.join(), "k")  # fresh checksums: the format cannot tell
    assert torch.equal(
        reopened.decode(0, 1),
        codec.decode(memoryview(payload)[: sizes[0]], sizes[:1], (2, 8, 2, 8), torch.float16),
    )
    with pytest.raises(FormatError, match="cachegen payload does not decode"):
        reopened.decode()


def test_tables_that_differ_on_a_machine_refuse_to_code(monkeypatch):
    """A machine whose tables differ writes nothing and reads nothing (misses, never wrong KV)."""
    kv = _kv(3, 4, 1, 8)
    codec = get_codec("cachegen", 1)
    payload, sizes = codec.encode(kv)
    pool.set_shared_pool(0)  # the tables below are this process's
    try:
        monkeypatch.setattr(models, "_tables", {})
        monkeypatch.setattr(models, "_models", {})
        monkeypatch.setitem(models._EXPECTED_TABLE_HASH, 15, 1234)
        monkeypatch.setitem(models._EXPECTED_TABLE_HASH, 7, 1234)
        with pytest.raises(models.ModelsError, match="differ on this machine"):
            models.table(15)
        with pytest.raises(ValueError, match="cachegen cannot encode"):
            codec.encode(kv)
        with pytest.raises(CodecError, match="differ on this machine"):
            codec.decode(memoryview(payload), sizes, (2, 4, 1, 8), torch.float16)
    finally:
        pool.set_shared_pool(pool.default_size())


def test_tables_match_the_written_hashes():
    for alphabet in models.ALPHABETS:
        t = models.table(alphabet)
        assert (t >= 1).all() and (t.sum(axis=-1) == models.FREQ_TOTAL).all()
        assert models.table_hash(alphabet) == models._EXPECTED_TABLE_HASH[alphabet]


# -- K's outlier channels ------------------------------------------------------------------------


def test_k_outlier_channels_are_divided_down_and_the_others_quantized_finer():
    g = np.random.default_rng(3)
    kv = g.standard_normal((2, 64, 32)).astype(np.float32)
    kv[0, :, 4] = 80 + g.standard_normal(64)  # a channel ~40x the others' abs-max, every token
    plain = layer.encode(kv, 32, 16)
    capped = layer.encode(kv, 32, 16, k_cap=4.0)
    assert plain[3] == 0 and capped[3] == layer.K_DIVISORS  # the flags byte
    _, _, _, divisors = layer.decode_symbols(capped, 64, 32)
    assert divisors[4] > 5 and (np.delete(divisors, 4) == 1).all()
    err_plain = np.abs(layer.decode(plain, 64, 32)[0] - kv[0])
    err_capped = np.abs(layer.decode(capped, 64, 32)[0] - kv[0])
    others = np.delete(np.arange(32), 4)
    assert err_capped[:, others].mean() < err_plain[:, others].mean() / 4
    # V is never divided; a layer without an outlier channel is written as without the cap
    assert np.array_equal(layer.decode(capped, 64, 32)[1], layer.decode(plain, 64, 32)[1])
    assert layer.encode(kv[:, :, others], 32, 16, k_cap=4.0) == layer.encode(
        kv[:, :, others], 32, 16
    )


def test_a_layer_with_unknown_flags_or_bad_divisors_is_refused():
    kv = np.random.default_rng(4).standard_normal((2, 16, 8)).astype(np.float32)
    kv[0, :, 2] *= 50
    blob = bytearray(layer.encode(kv, 32, 16, k_cap=4.0))
    unknown = bytearray(blob)
    unknown[3] |= 0x80
    with pytest.raises(layer.LayerError, match="flags"):
        layer.decode(bytes(unknown), 16, 8)
    head = layer._HEAD.size
    for word in (0x3F00, 0x7FC0):  # a divisor of 0.5, a NaN
        bad = bytearray(blob)
        bad[head + 4 : head + 6] = word.to_bytes(2, "little")
        with pytest.raises(layer.LayerError, match="divisors"):
            layer.decode(bytes(bad), 16, 8)
    flipped = bytearray(blob)  # a divisor changed to another valid one: the checksum
    flipped[head + 4 : head + 6] = (0x4000).to_bytes(2, "little")
    with pytest.raises(layer.LayerError, match="checksum"):
        layer.decode(bytes(flipped), 16, 8)


# -- worker processes -------------------------------------------------------------------------------


def test_worker_pool_matches_in_process_and_survives_a_dead_worker():
    p = pool.WorkerPool(2)
    try:
        kv = _kv(6, 40, 2, 16).float().reshape(6, 2, 40, 32).numpy()
        kv[1, 0, :, 5] *= 60  # an outlier K channel in one layer of each job: divisors
        kv[4, 0, :, 9] *= 60
        bins = [(32, 16)] * 6
        jobs = [(kv[:3], bins[:3], 4.0), (kv[3:], bins[3:], 4.0)]
        blobs = [b for part in p.run("encode", jobs) for b in part]
        assert blobs == [layer.encode(kv[i], *bins[i], k_cap=4.0) for i in range(6)]
        got = p.run("decode", [(blobs[:3], 40, 32), (blobs[3:], 40, 32)])
        for (sym, scales, b, div), first in zip(got, (0, 3)):
            for j in range(3):
                ref_sym, ref_scales, ref_bins, ref_div = layer.decode_symbols(
                    blobs[first + j], 40, 32
                )
                assert np.array_equal(sym[j], ref_sym) and np.array_equal(scales[j], ref_scales)
                assert tuple(b[j]) == ref_bins
                assert (ref_div is None) == (first + j not in (1, 4))
                assert np.array_equal(div[j], np.ones(32) if ref_div is None else ref_div)
        with pytest.raises(pool.JobError):  # a rejected job is an error, the worker carries on
            p.run("decode", [([blobs[0][:-3]], 40, 32), (blobs[3:4], 40, 32)])
        p._workers[0].proc.kill()
        p._workers[0].proc.wait()
        # one job in-process, then a restart
        again = p.run("decode", [(blobs[:3], 40, 32), (blobs[3:], 40, 32)])
        assert all(np.array_equal(a[0], b[0]) for a, b in zip(again, got))
        assert p.run("decode", [(blobs[:3], 40, 32), (blobs[3:], 40, 32)])[0][0].shape == (
            3,
            2,
            32,
            40,
        )
    finally:
        p.close()


@pytest.mark.parametrize(
    "layer_types,expected",
    [
        (("full",) * 4, frozenset()),  # every layer alike: nothing is special
        (("sliding",) * 3, frozenset()),
        (
            ("sliding", "sliding", "full", "sliding", "sliding", "full"),
            frozenset({2, 5}),
        ),  # Gemma 3's pattern
        (("full", "sliding"), frozenset({0})),
    ],
)
def test_sensitive_layers(layer_types, expected):
    assert sensitive_layers(layer_types) == expected


def test_a_model_with_global_layers_gets_more_k_bins_there(workers):
    """Gemma-like layers: the global ones get twice the K bins (capped), the rest as the level says;
    the entry decodes with any cachegen codec (each layer carries its bins), closer to the KV there."""
    types = ("sliding", "sliding", "full", "sliding", "sliding", "full")
    plain = get_codec("cachegen", 2)
    codec = plain.for_model(types)
    assert plain.for_model(("full",) * 6) is plain
    assert codec.boosted == {2, 5} and codec.level == 2
    expected = [(2 * k if i in (2, 5) else k, v) for i, (k, v) in enumerate(plain.layer_bins(6))]
    assert codec.layer_bins(6) == expected
    # the most a layer may have
    assert get_codec("cachegen", 4).for_model(types).layer_bins(6)[2][0] == 128
    kv = _kv(6, 64, 2, 16, seed=3)
    payload, sizes = codec.encode(kv)
    out = plain.decode(memoryview(payload), sizes, tuple(kv.shape[1:]), kv.dtype)
    assert torch.equal(out, _reference(kv, codec))
    err = (out.float() - kv.float()).pow(2).mean(dim=(1, 2, 3, 4))
    plain_payload, plain_sizes = plain.encode(kv)
    plain_err = (
        (
            plain.decode(
                memoryview(plain_payload), plain_sizes, tuple(kv.shape[1:]), kv.dtype
            ).float()
            - kv.float()
        )
        .pow(2)
        .mean(dim=(1, 2, 3, 4))
    )
    assert all(err[i] < plain_err[i] for i in (2, 5)) and all(
        err[i] == plain_err[i] for i in (0, 1, 3, 4)
    )
    assert sum(sizes) > sum(plain_sizes)
    with pytest.raises(ValueError, match="more than"):
        codec.encode(_kv(4, 8, 2, 16))  # a codec set up for a deeper model
