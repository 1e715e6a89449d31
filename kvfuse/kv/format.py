"""The serialized form of one cache entry (a KV chunk), the same bytes in every tier.

Layout (all integers little-endian)::

    fixed header  "<4sHIHHBB5IIHQQ" (58 bytes):
                  magic b"KVFZ", format version u16, header length u32 (= payload offset),
                  codec id u16, codec level u16, dtype code u8, flags u8,
                  shape: 5 x u32 (layers, 2, tokens, kv_heads, head_dim), number of positions u32,
                  key length u16, payload length u64, payload checksum u64 (xxh3_64)
    key           the storage key, UTF-8 (a reader given an expected key rejects any other key)
    positions     flags & 1 (contiguous): one i64, the first position (positions = first + arange(n));
                  otherwise n x i64
    padding       zero bytes, so that the payload starts at a multiple of 64 (aligned tensor views)
    checksum      u64 xxh3_64 of every header byte before it
    payload       the codec's bytes, exactly ``payload length`` of them, nothing after

xxh3 is an integrity check (torn writes, bit rot, truncation), not an authentication: tiers are
trusted storage. Any byte the reader does not fully understand makes the entry a ``FormatError``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from kvfuse.kv.chunk import KVChunk

if TYPE_CHECKING:
    from kvfuse.codecs.base import Codec
    from kvfuse.kv.keys import ChunkKey

FORMAT_VERSION = 1
MAGIC = b"KVFZ"

_FIXED = struct.Struct("<4sHIHHBB5IIHQQ")
_CHECKSUM = struct.Struct("<Q")
_ALIGN = 64
_FLAG_CONTIGUOUS = 1
_KNOWN_FLAGS = _FLAG_CONTIGUOUS

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class Entry:
    """An encoded entry kept in parts: the chunk's metadata, the codec's payload, and a header that
    is built only when the entry is serialized (for the disk tier or Redis).

    For the raw codec the payload is a view of the chunk tensor's own memory: creating an entry
    copies and hashes nothing, and decoding one from the memory tier is a view again. The payload
    checksum is computed with the header, in the store's background writer for the lower tiers.
    An ``Entry`` is an in-process object: the tiered store trusts it (there is no storage between
    its creation and its use to corrupt it) and verifies every serialized blob instead. Whoever
    stores an ``Entry`` owns the chunk's memory from then on: it must not be modified.
    """

    __slots__ = ("key", "codec", "shape", "dtype", "positions", "payload", "header_size", "_header")

    def __init__(self, key: str, codec: Codec, shape: tuple[int, ...], dtype: torch.dtype, positions: torch.Tensor,
                 payload: memoryview, header: bytes | None = None):
        self.key, self.codec, self.shape, self.dtype = key, codec, tuple(shape), dtype
        self.positions, self.payload, self._header = positions, payload, header
        self.header_size = len(header) if header is not None else _padded_header_len(
            len(key.encode("utf-8")), len(_position_bytes(positions)[1]))

    @classmethod
    def from_blob(cls, blob: bytes | bytearray | memoryview) -> Entry:
        """The entry of a verified one-buffer blob, sharing its memory; FormatError if malformed."""
        p, payload = _parse(blob)
        return cls(p.key, _codec_of(p), p.shape, p.dtype, p.positions, payload, bytes(_as_view(blob)[: p.header_len]))

    @property
    def header(self) -> bytes:
        if self._header is None:
            self._header = _build_header(self)
        return self._header

    def __len__(self) -> int:
        return self.header_size + self.payload.nbytes

    @property
    def nbytes(self) -> int:
        return len(self)

    def parts(self) -> tuple[bytes, memoryview]:
        return self.header, self.payload

    def join(self) -> bytearray:
        """The serialized entry as one contiguous buffer (one copy)."""
        out = bytearray(len(self))
        out[: self.header_size] = self.header
        out[self.header_size :] = self.payload
        return out

    def chunk(self) -> KVChunk:
        """The KV chunk (for the raw codec a view of the payload: do not modify it)."""
        return KVChunk(kv=self.codec.decode(self.payload, self.shape, self.dtype), positions=self.positions)

    def __eq__(self, other) -> bool:
        other = other.join() if isinstance(other, Entry) else other
        try:
            return self.join() == other
        except TypeError:
            return NotImplemented

    __hash__ = None  # mutable memory underneath, like bytearray


Blob = bytes | bytearray | memoryview | Entry


class FormatError(ValueError):
    """An entry that is not exactly a valid entry of this format version (a cache miss, never used)."""


@dataclass(frozen=True)
class EntryHeader:
    """What ``kvfuse cache inspect`` shows about an entry, read without decoding the tensor."""

    key: str
    codec: str
    codec_id: int
    level: int
    dtype: str
    shape: tuple[int, ...]
    num_positions: int
    first_position: int | None
    last_position: int | None
    positions_contiguous: bool
    header_size: int
    payload_size: int
    payload_ok: bool  # payload present at its declared length, checksum matches, no trailing bytes


@dataclass(frozen=True)
class _Parsed:
    key: str
    codec_id: int
    level: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    positions: torch.Tensor
    contiguous: bool
    header_len: int
    payload_len: int
    payload_checksum: int


def _padded_header_len(key_len: int, positions_len: int) -> int:
    unpadded = _FIXED.size + key_len + positions_len + _CHECKSUM.size
    return -(-unpadded // _ALIGN) * _ALIGN


def encode_entry(chunk: KVChunk, key: ChunkKey | str, codec: Codec) -> Entry:
    """Encode ``chunk`` under storage key ``key`` with ``codec``; copies nothing for the raw codec
    and defers the header (and its payload checksum) until the entry is serialized."""
    if chunk.dtype not in _DTYPE_CODES:
        raise ValueError(f"KV dtype {chunk.dtype} is not supported; use one of {list(_DTYPE_CODES)}")
    key = str(key)
    if len(key.encode("utf-8")) > 0xFFFF:
        raise ValueError(f"storage key is {len(key.encode('utf-8'))} bytes; at most 65535 fit in an entry")
    payload = _as_view(codec.encode(chunk.kv))
    return Entry(key, codec, tuple(chunk.kv.shape), chunk.dtype, chunk.positions.detach().cpu(), payload)


def _position_bytes(pos: torch.Tensor) -> tuple[bool, bytes]:
    """(contiguous?, the header's positions field): one i64 start for first + arange(n)."""
    n = pos.shape[0]
    start = int(pos[0]) if n else 0
    if n == 0 or torch.equal(pos, torch.arange(start, start + n, dtype=torch.int64)):
        return True, struct.pack("<q", start)
    return False, pos.numpy().astype("<i8").tobytes()


def _build_header(e: Entry) -> bytes:
    key_bytes = e.key.encode("utf-8")
    contiguous, pos_bytes = _position_bytes(e.positions)
    header_len = _padded_header_len(len(key_bytes), len(pos_bytes))
    padding = bytes(header_len - _FIXED.size - len(key_bytes) - len(pos_bytes) - _CHECKSUM.size)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        header_len,
        e.codec.codec_id,
        e.codec.level,
        _DTYPE_CODES[e.dtype],
        _FLAG_CONTIGUOUS if contiguous else 0,
        *e.shape,
        e.positions.shape[0],
        len(key_bytes),
        e.payload.nbytes,
        xxhash.xxh3_64_intdigest(e.payload),
    )
    head = b"".join((fixed, key_bytes, pos_bytes, padding))
    return head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))


def encode_chunk(chunk: KVChunk, key: ChunkKey | str, codec: Codec) -> bytearray:
    """``encode_entry`` as one contiguous, writable buffer (what a file or a Redis value holds)."""
    return encode_entry(chunk, key, codec).join()


def _parse_header(mv: memoryview) -> _Parsed:
    """Parse and check everything up to the payload; raises FormatError."""
    if len(mv) < 6 or bytes(mv[:4]) != MAGIC:
        raise FormatError("not a kvfuse entry (bad magic)")
    (version,) = struct.unpack_from("<H", mv, 4)
    if version != FORMAT_VERSION:
        raise FormatError(f"entry format version {version}; this build reads version {FORMAT_VERSION}")
    if len(mv) < _FIXED.size:
        raise FormatError(f"truncated header ({len(mv)} bytes)")
    (_, _, header_len, codec_id, level, dtype_code, flags, *rest) = _FIXED.unpack_from(mv)
    shape, (n_pos, key_len, payload_len, payload_checksum) = tuple(rest[:5]), rest[5:]
    contiguous = bool(flags & _FLAG_CONTIGUOUS)
    pos_len = 8 if contiguous else 8 * n_pos
    if header_len != _padded_header_len(key_len, pos_len):
        raise FormatError(f"inconsistent header length {header_len}")
    if len(mv) < header_len:
        raise FormatError(f"truncated header ({len(mv)} of {header_len} bytes)")
    (stored_checksum,) = _CHECKSUM.unpack_from(mv, header_len - _CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(mv[: header_len - _CHECKSUM.size]) != stored_checksum:
        raise FormatError("header checksum mismatch")
    # The checksum only proves the bytes are the writer's; now check the writer spoke our dialect.
    if flags & ~_KNOWN_FLAGS:
        raise FormatError(f"unknown header flags {flags:#x}")
    if dtype_code not in _CODE_DTYPES:
        raise FormatError(f"unknown dtype code {dtype_code}")
    if shape[1] != 2 or n_pos != shape[2]:
        raise FormatError(f"inconsistent shape {shape} / {n_pos} positions")
    off = _FIXED.size
    try:
        key = bytes(mv[off : off + key_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError("storage key is not valid UTF-8") from None
    off += key_len
    if contiguous:
        (start,) = struct.unpack_from("<q", mv, off)
        if start > 2**63 - 1 - n_pos:
            raise FormatError(f"positions overflow int64 (first {start}, {n_pos} positions)")
        positions = torch.arange(start, start + n_pos, dtype=torch.int64)
    else:
        positions = torch.from_numpy(np.frombuffer(mv, dtype="<i8", count=n_pos, offset=off).astype(np.int64))
    if any(mv[off + pos_len : header_len - _CHECKSUM.size]):
        raise FormatError("non-zero header padding")
    return _Parsed(
        key, codec_id, level, _CODE_DTYPES[dtype_code], shape, positions, contiguous, header_len, payload_len,
        payload_checksum,
    )


def _parse(blob: Blob) -> tuple[_Parsed, memoryview]:
    """The parsed header and the payload view of a one-buffer blob or an ``Entry``; checks lengths."""
    if isinstance(blob, Entry):
        head = _as_view(blob.header)
        p = _parse_header(head)
        if len(head) != p.header_len:
            raise FormatError(f"entry header is {len(head)} bytes, it says {p.header_len}")
        payload = _as_view(blob.payload)
    else:
        mv = _as_view(blob)
        p = _parse_header(mv)
        payload = mv[p.header_len :]
    if len(payload) != p.payload_len:
        kind = "truncated" if len(payload) < p.payload_len else "trailing bytes after"
        raise FormatError(f"{kind} payload ({len(payload)} bytes, header says {p.payload_len})")
    return p, payload


def _check_payload(payload: memoryview, p: _Parsed) -> None:
    if xxhash.xxh3_64_intdigest(payload) != p.payload_checksum:
        raise FormatError("payload checksum mismatch")


def _codec_of(p: _Parsed) -> Codec:
    from kvfuse.codecs import get_codec_by_id  # imported here: codecs -> format is the other direction

    try:
        codec = get_codec_by_id(p.codec_id, p.level)
    except ValueError as e:
        raise FormatError(str(e)) from None
    expected = codec.payload_size(p.shape, p.dtype)
    if expected is not None and expected != p.payload_len:
        raise FormatError(f"payload length {p.payload_len} does not match {codec.name} {p.shape} ({expected})")
    return codec


def _check_key(p: _Parsed, expected_key: ChunkKey | str | None) -> None:
    if expected_key is not None and p.key != str(expected_key):
        raise FormatError(f"entry holds key {p.key!r}, expected {str(expected_key)!r}")


def _as_view(blob: bytes | bytearray | memoryview) -> memoryview:
    mv = memoryview(blob)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def decode_chunk(blob: Blob, expected_key: ChunkKey | str | None = None, *, check_payload: bool = True) -> KVChunk:
    """Decode an entry; FormatError on anything not fully understood or not intact.

    For the raw codec the returned tensor shares memory with ``blob`` when its payload is writable
    (an ``Entry`` from the memory tier, the disk tier's fresh read buffer: zero-copy); a read-only
    ``bytes`` blob is copied once. Do not modify a decoded tensor: it may be the cached entry.
    ``check_payload=False`` skips only the payload checksum, for a blob that was just checked by
    :func:`verify` (``TieredStore.get`` returns verified entries): the payload is hashed once.
    """
    if isinstance(blob, Entry):  # an in-process entry: nothing was stored, nothing to check
        if expected_key is not None and blob.key != str(expected_key):
            raise FormatError(f"entry holds key {blob.key!r}, expected {str(expected_key)!r}")
        return blob.chunk()
    p, payload = _parse(blob)
    _check_key(p, expected_key)
    codec = _codec_of(p)
    if check_payload:
        _check_payload(payload, p)
    try:
        kv = codec.decode(payload, p.shape, p.dtype)
        return KVChunk(kv=kv, positions=p.positions)
    except ValueError as e:
        raise FormatError(f"{codec.name} payload does not decode: {e}") from None


def open_entry(blob: Blob, expected_key: ChunkKey | str | None = None) -> Entry | None:
    """The ``Entry`` of a serialized blob after a full check (as ``verify``), sharing its memory;
    None when the blob is not an intact entry. One parse serves the check and every later use."""
    if isinstance(blob, Entry):
        return blob if verify(blob, expected_key) else None
    try:
        p, payload = _parse(blob)
        _check_key(p, expected_key)
        codec = _codec_of(p)
        _check_payload(payload, p)
    except (FormatError, TypeError):
        return None
    return Entry(p.key, codec, p.shape, p.dtype, p.positions, payload, bytes(_as_view(blob)[: p.header_len]))


def verify(blob: Blob, expected_key: ChunkKey | str | None = None) -> bool:
    """True when ``blob`` is an intact entry (both checksums, lengths, known codec/dtype, key);
    no tensor is decoded. The tiers' validator."""
    try:
        p, payload = _parse(blob)
        _check_key(p, expected_key)
        _codec_of(p)
        _check_payload(payload, p)
    except (FormatError, TypeError):
        return False
    return True


def read_header(blob: Blob) -> EntryHeader:
    """The header of an entry, for inspection; FormatError if the header itself is not intact.
    A damaged or missing payload is reported as ``payload_ok=False``."""
    p = _parse_header(_as_view(blob.header if isinstance(blob, Entry) else blob))
    codec = _codec_of(p)
    try:
        _check_payload(_parse(blob)[1], p)
        payload_ok = True
    except FormatError:
        payload_ok = False
    n = p.positions.shape[0]
    return EntryHeader(
        key=p.key,
        codec=codec.name,
        codec_id=p.codec_id,
        level=p.level,
        dtype=str(p.dtype).removeprefix("torch."),
        shape=p.shape,
        num_positions=n,
        first_position=int(p.positions[0]) if n else None,
        last_position=int(p.positions[-1]) if n else None,
        positions_contiguous=p.contiguous,
        header_size=p.header_len,
        payload_size=p.payload_len,
        payload_ok=payload_ok,
    )
