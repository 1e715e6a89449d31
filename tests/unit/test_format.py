"""The entry format: round trips, and every kind of damage or mismatch is a FormatError, never a wrong tensor."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfuse.codecs import get_codec
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import (
    FORMAT_VERSION,
    EntrySpec,
    FormatError,
    decode_chunk,
    encode_chunk,
    read_entry,
    read_header,
    verify,
)
from kvfuse.kv.keys import Namespace, prefix_keys

NS = Namespace("m", "float16", "L2xH2xD8")
KEY = str(prefix_keys(range(4), 4, NS)[0])
OTHER_KEY = str(prefix_keys(range(1, 5), 4, NS)[0])

# Offsets of the fixed header fields ("<4sHIHHBB5IIHQ").
VERSION, HEADER_LEN, CODEC_ID, DTYPE, FLAGS, SHAPE, KEY_LEN, PAYLOAD_LEN = (
    4,
    6,
    10,
    14,
    15,
    16,
    40,
    42,
)
FIXED = 50


def _chunk(dtype=torch.float16, tokens=5, contiguous=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, tokens, 2, 8), generator=g).to(dtype)
    pos = (
        torch.arange(100, 100 + tokens)
        if contiguous
        else torch.tensor([3, 9, 4, 2**40, -1][:tokens])
    )
    return KVChunk(kv=kv, positions=pos)


def _same(a: KVChunk, b: KVChunk) -> bool:
    return (
        a.kv.dtype == b.kv.dtype
        and torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
        and torch.equal(a.positions, b.positions)
    )


def _header_len(blob: bytes) -> int:
    return struct.unpack_from("<I", blob, HEADER_LEN)[0]


def _patch(blob: bytes, offset: int, fmt: str, value) -> bytes:
    """Change a header field and re-seal the header checksum, so only the field's meaning is tested."""
    b = bytearray(blob)
    struct.pack_into(fmt, b, offset, value)
    hl = _header_len(b)
    struct.pack_into("<Q", b, hl - 8, xxhash.xxh3_64_intdigest(bytes(b[: hl - 8])))
    return bytes(b)


class _Stream:
    """``readinto`` over ``blob`` as a file gives it: at most ``step`` bytes a call (short reads),
    the bytes handed out counted."""

    def __init__(self, blob: bytes, step: int | None = None):
        self.data, self.step, self.pos = memoryview(bytes(blob)), step, 0

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), len(self.data) - self.pos, self.step or len(view))
        view[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def _streamed(blob: bytes, key=None, step: int | None = None, size: int | None = None, spec=None):
    """The chunk ``read_entry`` makes of ``blob`` read as a stream (of ``size`` bytes, as a file's
    size said when it was opened; default: all of them)."""
    return read_entry(
        _Stream(blob, step).readinto, len(blob) if size is None else size, key, spec
    ).chunk()


def _flip(blob: bytes, i: int) -> bytes:
    b = bytearray(blob)
    b[i] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_round_trip(dtype, codec, contiguous):
    chunk = _chunk(dtype, contiguous=contiguous)
    blob = encode_chunk(chunk, KEY, get_codec(codec))
    assert verify(blob) and verify(blob, KEY)
    out = decode_chunk(blob, KEY)
    assert torch.equal(out.positions, chunk.positions) and out.kv.dtype == dtype
    if codec == "raw":
        assert _same(out, chunk)
    else:
        assert (out.kv.float() - chunk.kv.float()).abs().max() <= chunk.kv.float().abs().max() / 100
    h = read_header(blob)
    assert (h.key, h.codec, h.dtype, h.shape, h.num_positions) == (
        KEY,
        codec,
        str(dtype)[6:],
        (2, 2, 5, 2, 8),
        5,
    )
    assert h.positions_contiguous == contiguous and h.payload_ok
    assert h.header_size % 64 == 0 and h.header_size + h.payload_size == len(blob)


def test_zero_token_chunk_round_trips():
    chunk = _chunk(tokens=0)
    assert _same(decode_chunk(encode_chunk(chunk, KEY, get_codec("raw"))), chunk)


def test_raw_decode_is_zero_copy_over_a_writable_buffer():
    chunk = _chunk()
    buf = bytearray(encode_chunk(chunk, KEY, get_codec("raw")))
    out = decode_chunk(buf, KEY)
    out.kv.zero_()
    assert not verify(buf)  # the tensor was a view of buf
    out2 = decode_chunk(encode_chunk(chunk, KEY, get_codec("raw")))
    out2.kv.zero_()  # a bytes blob is copied: writing is safe


def test_key_mismatch_is_an_error():
    blob = encode_chunk(_chunk(), KEY, get_codec("raw"))
    with pytest.raises(FormatError, match="expected"):
        decode_chunk(blob, OTHER_KEY)
    assert not verify(blob, OTHER_KEY)
    # a ChunkKey works too
    assert _same(decode_chunk(blob, prefix_keys(range(4), 4, NS)[0]), decode_chunk(blob))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:40], "truncated"),
        (lambda b: b[: _header_len(b) - 3], "truncated"),
        (lambda b: b"", "magic"),
        (lambda b: b + b"\0", "trailing"),
        (lambda b: b"KVFX" + b[4:], "magic"),
        (lambda b: _patch(b, VERSION, "<H", FORMAT_VERSION + 1), f"version {FORMAT_VERSION + 1}"),
        (
            lambda b: _patch(b, VERSION, "<H", 2),
            f"version 2; this build reads version {FORMAT_VERSION}",
        ),
        (lambda b: _patch(b, VERSION, "<H", 0), "version 0"),
        (lambda b: _patch(b, CODEC_ID, "<H", 999), "unknown codec"),
        (lambda b: _patch(b, DTYPE, "<B", 77), "unknown dtype"),
        (lambda b: _patch(b, FLAGS, "<B", 0x81), "flags|header length"),
        (lambda b: _patch(b, SHAPE + 4, "<I", 3), "shape"),
        # fewer layers: a shorter layer table, caught by the header's length unless its padding
        # absorbs the difference (it depends on the key's length), else by the payload's
        (lambda b: _patch(b, SHAPE, "<I", 3), "payload length|inconsistent header length"),
        (lambda b: _patch(b, PAYLOAD_LEN, "<Q", 10), "payload length|trailing"),
        (lambda b: _patch(b, KEY_LEN, "<H", 3), "header length"),
        (lambda b: _patch(b, HEADER_LEN, "<I", 128), "header length"),
    ],
)
def test_damaged_or_foreign_entries_are_format_errors(mutate, match):
    blob = encode_chunk(_chunk(contiguous=False), KEY, get_codec("raw"))
    bad = mutate(blob)
    with pytest.raises(FormatError, match=match):
        decode_chunk(bad)
    assert not verify(bad)
    with pytest.raises(FormatError, match=match):  # the streamed form of the same checks
        _streamed(bad, step=1000)


def test_flipped_byte_anywhere_is_detected():
    """One flipped bit in each region: fixed header, key, positions, layer table + padding, header
    checksum, payload."""
    blob = encode_chunk(_chunk(contiguous=False), KEY, get_codec("raw"))
    hl = _header_len(blob)
    regions = {
        "fixed": range(0, FIXED),
        "key": range(FIXED, FIXED + len(KEY)),
        "positions": range(FIXED + len(KEY), FIXED + len(KEY) + 40),
        "layer table, padding": range(FIXED + len(KEY) + 40, hl - 8),
        "header checksum": range(hl - 8, hl),
        "payload": range(hl, len(blob)),
    }
    for name, region in regions.items():
        assert len(region) > 0, name
        for i in region:
            with pytest.raises(FormatError):
                decode_chunk(_flip(blob, i))
            assert not verify(_flip(blob, i)), (name, i)
            with pytest.raises(FormatError):
                _streamed(_flip(blob, i))


def test_other_format_version_message_names_both_versions():
    blob = _patch(encode_chunk(_chunk(), KEY, get_codec("raw")), VERSION, "<H", 7)
    with pytest.raises(FormatError, match=f"version 7; this build reads version {FORMAT_VERSION}"):
        read_header(blob)


def test_read_header_reports_a_bad_payload_without_failing():
    blob = encode_chunk(_chunk(), KEY, get_codec("int8"))
    assert not read_header(_flip(blob, len(blob) - 1)).payload_ok
    assert not read_header(blob[:-1]).payload_ok
    h = read_header(blob)
    assert h.payload_ok and h.first_position == 100 and h.last_position == 104


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_a_layer_range_is_read_and_checked_without_the_rest(codec):
    from kvfuse.kv.format import header_length, parse_header

    chunk = KVChunk(
        torch.randn((5, 2, 7, 2, 8), generator=torch.Generator().manual_seed(4)).half(),
        torch.arange(7),
    )
    blob = bytes(encode_chunk(chunk, KEY, get_codec(codec)))
    full = decode_chunk(blob, KEY).kv
    need = header_length(blob[:FIXED])  # the fixed part says how much header to read
    h = parse_header(blob[:need])  # the header alone: no payload byte needed
    assert h.layer_sizes == read_header(blob).layer_sizes and len(h.layer_sizes) == 5
    start, stop = h.layer_span(1, 4)
    part = h.decode_layers(memoryview(blob)[start:stop], 1, 4)
    assert torch.equal(part, full[1:4])
    assert torch.equal(
        decode_chunk(blob).kv[2:3],
        h.decode_layers(memoryview(blob)[slice(*h.layer_span(2, 3))], 2, 3),
    )
    damaged = bytearray(blob)
    damaged[stop - 1] ^= 1  # in layer 3
    with pytest.raises(FormatError, match="layer 3"):
        h.decode_layers(memoryview(damaged)[start:stop], 1, 4)
    assert torch.equal(
        h.decode_layers(memoryview(damaged)[slice(*h.layer_span(0, 3))], 0, 3), full[:3]
    )
    with pytest.raises(FormatError, match="truncated"):
        h.decode_layers(memoryview(blob)[start : stop - 1], 1, 4)
    with pytest.raises(FormatError, match="truncated"):
        parse_header(blob[: need - 1])


def test_key_is_stored_as_given():
    blob = encode_chunk(_chunk(), "any:key/ü", get_codec("raw"))
    assert read_header(blob).key == "any:key/ü" and verify(blob, "any:key/ü")


_BLOBS = {
    (codec, contiguous): encode_chunk(
        _chunk(torch.bfloat16, contiguous=contiguous, seed=3), KEY, get_codec(codec)
    )
    for codec in ("raw", "int8")
    for contiguous in (True, False)
}


@st.composite
def _mutation(draw):
    blob = _BLOBS[(draw(st.sampled_from(["raw", "int8"])), draw(st.booleans()))]
    b = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "flip", "truncate", "insert", "delete", "append"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if kind == "set" and b:
            b[i] = draw(st.integers(0, 255))
        elif kind == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        else:
            b += draw(st.binary(min_size=1, max_size=8))
    return blob, bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutation())
def test_fuzz_mutations_never_decode_to_a_wrong_tensor(case):
    original, mutated = case
    try:
        out = decode_chunk(mutated, KEY)
    except FormatError:
        assert not verify(mutated, KEY)
        with pytest.raises(FormatError):  # the streamed form agrees
            _streamed(mutated, KEY, step=37)
        return
    assert verify(mutated, KEY)
    assert _same(out, decode_chunk(original, KEY))
    assert _same(_streamed(mutated, KEY, step=37), out)


def test_an_entry_is_the_same_bytes_as_the_joined_form_without_copying_the_payload():
    from kvfuse.kv.format import Entry, encode_entry

    chunk = _chunk(torch.float16, seed=3)
    entry = encode_entry(chunk, KEY, get_codec("raw"))
    assert isinstance(entry, Entry) and entry == encode_chunk(chunk, KEY, get_codec("raw"))
    assert len(entry) == len(entry.join()) == entry.header_size + chunk.nbytes
    # the raw payload is the tensor's own memory: encoding copied nothing, decoding neither
    assert np.shares_memory(np.asarray(entry.payload), chunk.kv.numpy())
    out = decode_chunk(entry, KEY)
    assert np.shares_memory(out.kv.numpy(), chunk.kv.numpy()) and torch.equal(
        out.positions, chunk.positions
    )
    assert verify(entry, KEY) and read_header(entry).payload_ok
    with pytest.raises(FormatError, match="expected"):
        decode_chunk(entry, OTHER_KEY)
    # non-contiguous positions and the int8 codec take the same path
    scattered = _chunk(torch.float32, contiguous=False, seed=5)
    for codec in (get_codec("raw"), get_codec("int8")):
        e = encode_entry(scattered, KEY, codec)
        assert e == encode_chunk(scattered, KEY, codec) and len(e) == len(e.join())
        assert _same(decode_chunk(e, KEY), decode_chunk(e.join(), KEY))


def test_an_entry_from_a_verified_blob_shares_its_memory_and_keeps_its_header():
    from kvfuse.kv.format import open_entry

    blob = encode_chunk(_chunk(torch.bfloat16, seed=6), KEY, get_codec("raw"))
    entry = open_entry(blob)
    assert entry.join() == blob and entry.header == bytes(blob[: entry.header_size])
    assert np.shares_memory(np.asarray(entry.payload), np.frombuffer(blob, dtype=np.uint8))
    damaged = bytearray(blob)
    damaged[3] ^= 0xFF
    with pytest.raises(FormatError):
        open_entry(damaged)


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("step", [None, 1, 7, 4096, 70_000])
@pytest.mark.parametrize("layers", [1, 5])
def test_a_streamed_read_gives_what_the_blob_gives(codec, step, layers):
    """Whatever pieces the reads come in, ``read_entry`` gives the entry ``decode_chunk`` gives,
    in a writable buffer of its own (the raw codec then decodes without a copy)."""
    g = torch.Generator().manual_seed(layers)
    chunk = KVChunk(
        torch.randn((layers, 2, 300, 2, 64), generator=g).half(), torch.tensor(range(7, 307))
    )
    blob = bytes(encode_chunk(chunk, KEY, get_codec(codec)))
    entry = read_entry(_Stream(blob, step).readinto, len(blob), KEY)
    got = entry.chunk()
    assert _same(got, decode_chunk(blob, KEY))
    if codec == "raw":
        assert not entry.payload.readonly
        assert got.kv.data_ptr() == np.frombuffer(entry.payload, dtype=np.uint8).ctypes.data


def test_a_streamed_read_stops_at_the_header_when_the_key_or_spec_differs():
    chunk = KVChunk(torch.randn((3, 2, 100, 2, 8)).half(), torch.arange(100))
    blob = bytes(encode_chunk(chunk, KEY, get_codec("raw")))
    assert len(blob) > 4 * 4096  # the header is read in a first 4 KiB read; the payload is more
    for key, spec, match in [
        (OTHER_KEY, None, "expected"),
        (KEY, EntrySpec(torch.float32, 3, 2, 8), "dtype"),
        (KEY, EntrySpec(torch.float16, 4, 2, 8), "layout"),
        (KEY, EntrySpec(torch.float16, 3, 2, 8, first_position=5), "positions"),
    ]:
        stream = _Stream(blob)
        with pytest.raises(FormatError, match=match):
            read_entry(stream.readinto, len(blob), key, spec)
        assert stream.pos == 4096, match  # no payload byte read after the first read
    spec = EntrySpec(torch.float16, 3, 2, 8, tokens=100, first_position=0)
    assert _same(_streamed(blob, KEY, spec=spec), chunk)


def test_a_file_that_changes_size_while_read_is_a_format_error():
    blob = bytes(encode_chunk(_chunk(tokens=5), KEY, get_codec("raw")))
    with pytest.raises(FormatError, match="truncated entry"):  # shrank after its size was taken
        _streamed(blob[:-10], size=len(blob))
    # grew: the size taken is longer than the entry
    with pytest.raises(FormatError, match="trailing"):
        _streamed(blob + b"\0" * 64, size=len(blob) + 64)
    with pytest.raises(FormatError, match="truncated header"):
        _streamed(blob[:FIXED], size=FIXED)
