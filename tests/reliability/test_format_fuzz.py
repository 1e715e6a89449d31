"""Fuzzing the entry format's readers and the codecs' decoders with random and mutated inputs.

Targets: ``open_entry`` (with and without the expected key and an ``EntrySpec``), ``read_header``,
``parse_header``, ``header_length``, the decode of whatever ``open_entry`` accepts, and the raw,
int8 and CacheGen decoders on their own. Inputs: valid entries of every codec, dtype and kind of
header (contiguous positions or not, token ids or not), mutated by bit flips, truncations,
insertions, deletions and overwrites, and by *structured* changes that keep every checksum valid
(a fixed-header field, a layer-table entry or a payload byte changed, then resealed: what a buggy
or hostile writer produces); plus random bytes, with and without a valid magic.

Each call runs under a time limit (``HARD_LIMIT_S``, a SIGALRM; and a process-killing watchdog
beyond it for a hang in native code). The property: a call raises the module's documented error
type (``FormatError`` for the format, ``CodecError`` for a codec) or returns a valid result:

- an input changed only by unstructured mutations is accepted only if it *is* the original, and
  then decodes to the original KV;
- a resealed input may be accepted (its checksums are right), but only as a self-consistent
  entry: re-serialized from its parsed fields it parses to the same fields, and it decodes to a
  tensor of its declared shape and dtype or raises ``FormatError``;
- a codec returns a tensor of the shape and dtype asked for; CacheGen (whose layers carry a
  checksum of bytes and decoded symbols) only the original's values, int8 only finite values;
- signed entries (some bases are signed, with BLAKE3 or, as before digest ids, SHA-256 digests):
  a reader given the signer (``open_entry``, ``read_entry``, ``parse_header``, ``read_header``)
  accepts a mutated input only if it *is* the original signed entry (for a header read: only if
  the header bytes are the original's), however the change was resealed; an unsigned base and
  random bytes are never accepted with a signer.

The default run is small (``FAST``: a few hundred examples per target, derandomized so CI is
reproducible); ``-m slow`` runs ``SLOW`` examples per target (10000, or ``$KVFUSE_FUZZ_EXAMPLES``)
with fresh randomness.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import struct
import sys
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfuse.codecs import get_codec
from kvfuse.codecs.base import CodecError
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.digests import BLAKE3, SHA256
from kvfuse.kv.format import (
    MAGIC,
    Entry,
    EntrySpec,
    FormatError,
    encode_entry,
    header_length,
    open_entry,
    parse_header,
    read_entry,
    read_header,
)
from kvfuse.kv.keys import Namespace, prefix_keys
from kvfuse.kv.signing import EntrySigner

HARD_LIMIT_S = 20.0  # one call; the watchdog kills the process at 3x this (a hang in native code)
FAST = settings(
    max_examples=300,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(
    max_examples=int(os.environ.get("KVFUSE_FUZZ_EXAMPLES", "10000")),
    deadline=timedelta(seconds=5),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ------------------------------------------------------------------------------ time limit


class Hang(BaseException):
    """A call ran past its time limit (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float = HARD_LIMIT_S):
    def on_alarm(signum, frame):
        raise Hang(f"the call ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(3 * seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def attempt(fn, allowed: type[BaseException], *args):
    """``(result, None)`` or ``(None, error)`` for an error of type ``allowed``; anything else
    (another exception, a hang) propagates and fails the example."""
    with time_limit():
        try:
            return fn(*args), None
        except allowed as e:
            return None, e


# ------------------------------------------------------------------------------ valid inputs

NS = Namespace("fuzz-model", "float16", "L3xH2xD8")
SIGNER = EntrySigner([b"the fuzzer's signing key, 32 bytes+"])


@dataclass(frozen=True)
class Base:
    blob: bytes
    key: str
    spec: EntrySpec
    kv: torch.Tensor  # what the entry decodes to
    table: int  # offset of the layer table
    layer_starts: tuple[int, ...]
    layer_sizes: tuple[int, ...]
    header_len: int
    signed: bool = False


def _base(
    codec: str,
    level: int,
    dtype: torch.dtype,
    layers: int,
    tokens: int,
    contiguous: bool,
    with_ids: bool,
    seed: int,
    signed: bool = False,
    algorithm: int = BLAKE3,
) -> Base:
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn((layers, 2, tokens, 2, 8), generator=g) * 3).to(dtype)
    positions = (
        torch.arange(7, 7 + tokens) if contiguous else torch.randperm(tokens, generator=g) * 3
    ).to(torch.int64)
    ids = torch.randint(0, 50000, (tokens,), generator=g) if with_ids else None
    key = str(prefix_keys(list(range(max(tokens, 1))), max(tokens, 1), NS)[0])
    entry = encode_entry(KVChunk(kv, positions, ids), key, get_codec(codec, level))
    blob = bytes((entry.signed(SIGNER, algorithm) if signed else entry).join())
    h = parse_header(blob)
    key_len = len(key.encode())
    table = 50 + key_len + (8 if contiguous else 8 * tokens) + (4 * tokens if with_ids else 0)
    starts, off = [], h.header_len
    for size in h.layer_sizes:
        starts.append(off)
        off += size
    spec = EntrySpec(
        dtype,
        layers,
        2,
        8,
        tokens=tokens,
        first_position=7 if contiguous else None,
        token_ids=tuple(ids.tolist()) if with_ids else None,
    )
    decoded = open_entry(bytearray(blob)).decode().clone()
    return Base(
        blob, key, spec, decoded, table, tuple(starts), tuple(h.layer_sizes), h.header_len, signed
    )


BASES = [
    _base("raw", 0, torch.float16, 3, 5, True, True, 0),
    _base("raw", 0, torch.bfloat16, 1, 4, False, True, 1),
    _base("raw", 0, torch.float32, 2, 3, True, False, 2),
    _base("raw", 0, torch.float16, 1, 0, True, False, 3),  # zero tokens: a valid, empty entry
    _base("int8", 0, torch.float16, 3, 6, True, True, 4),
    _base("int8", 0, torch.bfloat16, 2, 4, False, False, 5),
    _base("int8", 0, torch.float32, 1, 3, True, True, 6),
    _base("cachegen", 1, torch.float16, 3, 6, True, True, 7),
    _base("cachegen", 2, torch.bfloat16, 2, 5, False, True, 8),
    _base("cachegen", 3, torch.float32, 1, 4, True, False, 9),
    _base("cachegen", 4, torch.float16, 2, 3, True, True, 10),
    # signed (the layer table is where it was; the digest id, a BLAKE3 digest per layer and the tag
    # follow it), and signed as before digest ids (SHA-256 digests, no id)
    _base("raw", 0, torch.float16, 3, 5, True, True, 11, signed=True),
    _base("raw", 0, torch.bfloat16, 1, 4, False, False, 12, signed=True),
    _base("int8", 0, torch.float16, 2, 6, True, True, 13, signed=True),
    _base("cachegen", 2, torch.float16, 2, 5, True, True, 14, signed=True),
    _base("raw", 0, torch.float16, 3, 5, True, True, 15, signed=True, algorithm=SHA256),
    _base("int8", 0, torch.bfloat16, 2, 4, False, True, 16, signed=True, algorithm=SHA256),
]

# Fixed-header fields ("<4sHIHHBB5IIHQ"): (offset, struct format).
FIELDS = [
    (0, "<I"),
    (4, "<H"),
    (6, "<I"),
    (10, "<H"),
    (12, "<H"),
    (14, "<B"),
    (15, "<B"),
    (16, "<I"),
    (20, "<I"),
    (24, "<I"),
    (28, "<I"),
    (32, "<I"),
    (36, "<I"),
    (40, "<H"),
    (42, "<Q"),
]
_MASK = {"<B": 0xFF, "<H": 0xFFFF, "<I": 0xFFFFFFFF, "<Q": 0xFFFFFFFFFFFFFFFF}


# ------------------------------------------------------------------------------ mutations


def _reseal_header(b: bytearray) -> None:
    """Recompute the header checksum where the (possibly changed) header length says it is."""
    if len(b) < 10:
        return
    (hl,) = struct.unpack_from("<I", b, 6)
    if 8 <= hl <= len(b):
        struct.pack_into("<Q", b, hl - 8, xxhash.xxh3_64_intdigest(bytes(b[: hl - 8])))


def mutate(base: Base, ops) -> tuple[bytes, bool]:
    """``base``'s bytes after ``ops``; and whether any op resealed the checksums."""
    b = bytearray(base.blob)
    resealed = False
    for op in ops:
        kind = op[0]
        n = len(b)
        if kind == "flip" and n:
            b[op[1] % n] ^= 1 << op[2]
        elif kind == "truncate":
            del b[op[1] % (n + 1) :]
        elif kind == "insert":
            i = op[1] % (n + 1)
            b[i:i] = op[2]
        elif kind == "delete" and n:
            i = op[1] % n
            del b[i : i + op[2]]
        elif kind == "overwrite" and n:
            i = op[1] % n
            b[i : i + len(op[2])] = op[2][: n - i]
        elif kind == "field" and n >= 50:
            offset, fmt = op[1]
            struct.pack_into(fmt, b, offset, op[2] & _MASK[fmt])
            _reseal_header(b)
            resealed = True
        elif kind == "count" and n >= 50:
            # tokens and positions together (they must agree), the header length made to match:
            # what gets past the consistency checks to whatever is sized by the token count
            _, _, flags = struct.unpack_from("<HBB", b, 12)
            layers, tokens, key_len = (
                struct.unpack_from("<I", b, 16)[0],
                op[1] & _MASK["<I"],
                struct.unpack_from("<H", b, 40)[0],
            )
            struct.pack_into("<I", b, 24, tokens)
            struct.pack_into("<I", b, 36, tokens)
            unpadded = (
                50
                + key_len
                + (8 if flags & 1 else 8 * tokens)
                + (4 * tokens if flags & 2 else 0)
                + 16 * layers
                + 8
            )
            struct.pack_into("<I", b, 6, min(-(-unpadded // 64) * 64, _MASK["<I"]))
            _reseal_header(b)
            resealed = True
        elif kind == "table" and base.layer_sizes and n >= base.header_len:
            layer = op[1] % len(base.layer_sizes)
            struct.pack_into(
                "<Q", b, base.table + 16 * layer + 8 * (op[2] & 1), op[3] & _MASK["<Q"]
            )
            _reseal_header(b)
            resealed = True
        elif (
            kind == "layer"
            and base.layer_sizes
            and len(b) == len(base.blob)
            and sum(base.layer_sizes)
        ):
            sized = [i for i, s in enumerate(base.layer_sizes) if s]
            layer = sized[op[1] % len(sized)]
            start, size = base.layer_starts[layer], base.layer_sizes[layer]
            b[start + op[2] % size] = op[3]
            digest = xxhash.xxh3_64_intdigest(bytes(b[start : start + size]))
            struct.pack_into("<Q", b, base.table + 16 * layer + 8, digest)
            _reseal_header(b)
            resealed = True
    return bytes(b), resealed


_POS = st.integers(0, 2**31)
_VALUE = st.one_of(
    st.integers(0, 8),
    st.integers(0, 2**64 - 1),
    st.sampled_from([2**16 - 1, 2**32 - 1, 2**32, 2**63]),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), _POS, st.integers(0, 7)),
        st.tuples(st.just("truncate"), _POS),
        st.tuples(st.just("insert"), _POS, st.binary(min_size=1, max_size=24)),
        st.tuples(st.just("delete"), _POS, st.integers(1, 64)),
        st.tuples(st.just("overwrite"), _POS, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("field"), st.sampled_from(FIELDS), _VALUE),
        st.tuples(st.just("count"), _VALUE),
        st.tuples(st.just("table"), _POS, st.integers(0, 1), _VALUE),
        st.tuples(st.just("layer"), _POS, _POS, st.integers(0, 255)),
    ),
    min_size=1,
    max_size=4,
)
MUTATED = st.tuples(st.sampled_from(range(len(BASES))), OPS)
RANDOM = st.one_of(
    st.binary(max_size=600),
    st.binary(max_size=600).map(lambda b: MAGIC + b),
    st.tuples(st.integers(0, 8), st.binary(max_size=600)).map(
        lambda t: MAGIC + struct.pack("<H", t[0]) + t[1]
    ),
)


# ------------------------------------------------------------------------------ properties


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check_accepted(entry: Entry) -> None:
    """An accepted entry is self-consistent: its fields survive re-serialization, and it decodes to
    its declared shape and dtype or raises FormatError."""
    rebuilt = Entry(
        entry.key,
        entry.codec,
        entry.shape,
        entry.dtype,
        entry.positions,
        entry.payload,
        entry.layer_sizes,
        token_ids=entry.token_ids,
    )
    again, err = attempt(open_entry, FormatError, rebuilt.join())
    assert err is None, f"an accepted entry does not survive re-serialization: {err}"
    assert (
        again.key,
        again.codec.codec_id,
        again.codec.level,
        again.shape,
        again.dtype,
        again.layer_sizes,
    ) == (
        entry.key,
        entry.codec.codec_id,
        entry.codec.level,
        entry.shape,
        entry.dtype,
        entry.layer_sizes,
    )
    assert torch.equal(again.positions, entry.positions)
    assert (again.token_ids is None) == (entry.token_ids is None)
    assert entry.token_ids is None or torch.equal(again.token_ids, entry.token_ids)
    kv, err = attempt(entry.decode, FormatError)
    if err is None:
        assert tuple(kv.shape) == entry.shape and kv.dtype == entry.dtype


def check_blob(blob: bytes, resealed: bool, base: Base | None) -> None:
    original = base is not None and blob == base.blob
    for kw in ({}, {"expected_key": base.key, "spec": base.spec} if base is not None else {}):
        entry, err = attempt(lambda: open_entry(bytearray(blob), **kw), FormatError)
        if err is not None:
            assert not original, f"the original entry was rejected: {err}"
            continue
        assert resealed or original, "an entry damaged without resealing its checksums was accepted"
        check_accepted(entry)
        if original:
            assert same_bits(entry.decode(), base.kv)
    header, err = attempt(read_header, FormatError, blob)
    if err is None:
        assert header.payload_ok in (True, False) and len(header.layer_sizes) == header.shape[0]
        assert not original or header.payload_ok
    h, err = attempt(parse_header, FormatError, blob)
    assert err is None or not original
    for cut in (6, 50, 64, 4096, len(blob)):
        n, err = attempt(header_length, FormatError, blob[:cut])
        assert err is not None or (isinstance(n, int) and n >= 0)


def _streamed(blob: bytes, **kw) -> Entry:
    """``read_entry`` over ``blob`` in pieces of at most 97 bytes (short reads, as a file gives)."""
    pos = 0

    def readinto(view: memoryview) -> int:
        nonlocal pos
        n = min(len(view), len(blob) - pos, 97)
        view[:n] = blob[pos : pos + n]
        pos += n
        return n

    return read_entry(readinto, len(blob), **kw)


def check_signed(blob: bytes, base: Base | None) -> None:
    """With the signer, nothing but the original signed entry is accepted (see the module docstring)."""
    original = base is not None and base.signed and blob == base.blob
    for kw in ({}, {"expected_key": base.key, "spec": base.spec} if base is not None else {}):
        for read in (
            lambda: open_entry(bytearray(blob), signer=SIGNER, **kw),
            lambda: _streamed(blob, signer=SIGNER, **kw),
        ):
            entry, err = attempt(read, FormatError)
            assert (err is None) == original, (
                f"signed read: {'accepted a changed entry' if err is None else err}"
            )
            if original:
                assert same_bits(entry.decode(), base.kv)
    same_header = (
        base is not None and base.signed and blob[: base.header_len] == base.blob[: base.header_len]
    )
    h, err = attempt(parse_header, FormatError, blob, SIGNER)
    assert err is None or not original
    assert err is not None or same_header, "a changed header was accepted as signed"
    header, err = attempt(read_header, FormatError, blob, SIGNER)
    assert err is not None or header.signature != "valid" or same_header


def check_mutated(case) -> None:
    index, ops = case
    base = BASES[index]
    blob, resealed = mutate(base, ops)
    check_blob(blob, resealed, base)
    check_signed(blob, base)


def check_random(blob: bytes) -> None:
    check_blob(blob, resealed=True, base=None)  # random bytes may be a (resealed) entry by design
    check_signed(blob, None)  # ... but never a signed one


# -- codecs on their own


@dataclass(frozen=True)
class CodecBase:
    codec: object
    payload: bytes
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    kv: torch.Tensor


def _codec_base(
    name: str, level: int, dtype: torch.dtype, layers: int, tokens: int, seed: int
) -> CodecBase:
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn((layers, 2, tokens, 2, 8), generator=g) * 2).to(dtype)
    codec = get_codec(name, level)
    payload, sizes = codec.encode(kv)
    payload = bytes(payload)
    decoded = codec.decode(memoryview(bytearray(payload)), sizes, (2, tokens, 2, 8), dtype).clone()
    return CodecBase(codec, payload, tuple(sizes), (2, tokens, 2, 8), dtype, decoded)


CODEC_BASES = [
    _codec_base("raw", 0, torch.float16, 2, 5, 0),
    _codec_base("raw", 0, torch.bfloat16, 1, 3, 1),
    _codec_base("int8", 0, torch.float16, 2, 5, 2),
    _codec_base("int8", 0, torch.bfloat16, 1, 4, 3),
    _codec_base("int8", 0, torch.float32, 2, 3, 4),
    _codec_base("cachegen", 1, torch.float16, 2, 6, 5),
    _codec_base("cachegen", 2, torch.float32, 1, 4, 6),
    _codec_base("cachegen", 4, torch.bfloat16, 2, 3, 7),
]

CODEC_CASES = st.tuples(
    st.sampled_from(range(len(CODEC_BASES))),
    st.lists(
        st.one_of(
            st.tuples(st.just("flip"), _POS, st.integers(0, 7)),
            st.tuples(st.just("truncate"), _POS),
            st.tuples(st.just("insert"), _POS, st.binary(min_size=1, max_size=16)),
            st.tuples(st.just("overwrite"), _POS, st.binary(min_size=1, max_size=8)),
        ),
        max_size=3,
    ),
    st.one_of(st.none(), st.binary(max_size=400)),  # random bytes instead of the payload
    st.sampled_from(["same", "whole", "split"]),  # the layer sizes the caller says
)


def check_codec(case) -> None:
    index, ops, random_bytes, sizing = case
    base = CODEC_BASES[index]
    data = bytearray(base.payload if random_bytes is None else random_bytes)
    for op in ops:
        n = len(data)
        if op[0] == "flip" and n:
            data[op[1] % n] ^= 1 << op[2]
        elif op[0] == "truncate":
            del data[op[1] % (n + 1) :]
        elif op[0] == "insert":
            i = op[1] % (n + 1)
            data[i:i] = op[2]
        elif op[0] == "overwrite" and n:
            i = op[1] % n
            data[i : i + len(op[2])] = op[2][: n - i]
    n = len(data)
    if sizing == "same" and sum(base.sizes) == n:
        sizes = list(base.sizes)
    else:
        sizes = [n // 2, n - n // 2] if sizing == "split" else [n]
    unchanged = bytes(data) == base.payload and tuple(sizes) == base.sizes
    out, err = attempt(
        base.codec.decode, CodecError, memoryview(data), sizes, base.shape, base.dtype
    )
    if err is not None:
        assert not unchanged, f"{base.codec.name} rejected its own payload: {err}"
        return
    assert tuple(out.shape) == (len(sizes), *base.shape) and out.dtype == base.dtype
    if unchanged or base.codec.name == "cachegen":
        assert same_bits(out, base.kv), f"{base.codec.name} decoded damaged bytes to other values"
    if base.codec.name == "int8":
        assert torch.isfinite(out).all(), "int8 decoded to inf or NaN"
    if len(sizes) == 1:
        one, err = attempt(
            base.codec.decode_layer, CodecError, memoryview(data), base.shape, base.dtype
        )
        assert err is not None or (tuple(one.shape) == base.shape and one.dtype == base.dtype)


# ------------------------------------------------------------------------------ the tests


def _fuzz(strategy, check, profile):
    @profile
    @given(strategy)
    def test(case):
        check(case)

    return test


def test_every_base_input_is_valid():
    """The fuzzers' starting points decode to what was encoded (else mutations prove nothing)."""
    for base in BASES:
        check_blob(base.blob, False, base)
        check_signed(base.blob, base)
        assert open_entry(bytearray(base.blob), base.key, base.spec).shape == tuple(base.kv.shape)
        assert read_header(base.blob, SIGNER).signature == ("valid" if base.signed else "unsigned")
    for base in CODEC_BASES:
        check_codec((CODEC_BASES.index(base), [], None, "same"))


test_mutated_entries = _fuzz(MUTATED, check_mutated, FAST)
test_random_bytes = _fuzz(RANDOM, check_random, FAST)
test_codec_decoders = _fuzz(CODEC_CASES, check_codec, FAST)
test_mutated_entries_many = pytest.mark.slow(_fuzz(MUTATED, check_mutated, SLOW))
test_random_bytes_many = pytest.mark.slow(_fuzz(RANDOM, check_random, SLOW))
test_codec_decoders_many = pytest.mark.slow(_fuzz(CODEC_CASES, check_codec, SLOW))


def test_a_header_claiming_a_huge_token_count_is_rejected_before_any_allocation():
    """What the slow fuzzer finds without ``MAX_TOKENS``: a resealed header whose token and position
    counts agree on 2**32-1 (contiguous positions, so the header stays small) made ``parse_header``
    allocate 2**32 positions (32 GiB) before any other check could fail."""
    for base in BASES:
        for tokens in (2**32 - 1, 2**21):
            blob, _ = mutate(base, [("count", tokens)])
            with time_limit(5.0), pytest.raises(FormatError):
                parse_header(blob)


def test_a_cachegen_entry_claiming_a_huge_head_dim_is_rejected_before_any_allocation():
    """Found by the slow fuzzer: a resealed header claiming 2**30 channels made the CacheGen decoder
    allocate its symbols (tens of GiB, a MemoryError, or a coding worker killed) before reading the
    layers' own heads, which say how many channels they hold."""
    base = next(b for b in BASES if read_header(b.blob).codec == "cachegen")
    blob, resealed = mutate(base, [("field", (32, "<I"), 2**30)])  # head_dim
    entry = open_entry(bytearray(blob))  # the header is consistent (CacheGen sizes vary) ...
    assert resealed and entry.shape[4] == 2**30
    with time_limit(5.0), pytest.raises(FormatError, match="channels"):  # ... the decode is not
        entry.decode()


def test_an_int8_entry_whose_scales_overflow_its_dtype_is_rejected():
    """Found by the slow fuzzer: a flipped exponent bit in an int8 scale decoded to inf in fp16."""
    base = next(b for b in CODEC_BASES if b.codec.name == "int8" and b.dtype == torch.float16)
    data = bytearray(base.payload)
    data[3] ^= 0x40  # the high byte of the first fp32 scale: 2**128 times larger
    with time_limit(5.0), pytest.raises(CodecError, match="range"):
        base.codec.decode(memoryview(data), base.sizes, base.shape, base.dtype)
