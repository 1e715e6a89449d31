"""Deterministic chunk keys: a namespace digest, a hash chain over full chunks, document keys.

Everything here is a pure function of its inputs and of an explicit byte encoding (length-prefixed
UTF-8 strings, little-endian integers, SHA-256), so keys are identical across processes, machines
and Python versions. Builtin ``hash()`` is never used: it is salted per process.

Encoding (``u32``/``u64`` little-endian, ``str`` = ``u32 byte length + UTF-8``)::

    namespace  = SHA256(b"kvfuse.ns\\0" str(model_fingerprint) str(kv_dtype) str(kv_layout)
                        str(codec) u32(codec_level) u32(format_version) str(tenant) str(salt))
    tenant_tag = SHA256(b"kvfuse.tenant\\0" str(tenant)), first 8 hex chars
    h_root     = SHA256(b"kvfuse.root.v1\\0" namespace)
    h_i        = SHA256(b"kvfuse.prefix\\0" h_{i-1} u32(len_i) tokens_i as u32...)
    document   = SHA256(b"kvfuse.doc\\0" namespace u64(len) tokens as u32...)

Storage keys print as ``<tenant_tag 8 hex><namespace 16 hex>:<p|d>:<digest 64 hex>``: prefix and
document keys use distinct domain tags (``:p:`` / ``:d:``), so a document key can never equal a
prefix key, and every entry of one tenant (whatever its model, codec or salt) shares the readable
prefix ``tenant_tag``, so a tenant's entries can be deleted by prefix.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvfuse.kv.format import FORMAT_VERSION

_NS_TAG = b"kvfuse.ns\x00"
_TENANT_TAG = b"kvfuse.tenant\x00"
_ROOT_TAG = b"kvfuse.root.v1\x00"
_PREFIX_TAG = b"kvfuse.prefix\x00"
_DOC_TAG = b"kvfuse.doc\x00"

_U32_MAX = 2**32 - 1
_KEY_RE = re.compile(r"^([0-9a-f]{24}):([dp]):([0-9a-f]{64})$")

Tokens = Sequence[int] | np.ndarray | torch.Tensor


def layout_of(num_layers: int, kv_heads: int, head_dim: int) -> str:
    """The ``kv_layout`` string of a model's KV cache, e.g. ``layout_of(30, 3, 64) == "L30xH3xD64"``."""
    for name, value in (("num_layers", num_layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"layout_of: {name} must be a positive int, got {value!r}")
    return f"L{num_layers}xH{kv_heads}xD{head_dim}"


def _str_field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for a cached chunk to be valid: model, KV shape/dtype, codec,
    format version, the tenant (an API key's owner; "" = anonymous) and a salt (a namespace inside
    the tenant: the deployment's salt and a request's ``cache_salt``)."""

    model_fingerprint: str
    kv_dtype: str
    kv_layout: str
    codec: str
    codec_level: int = 0
    format_version: int = FORMAT_VERSION
    salt: str = ""
    tenant: str = ""

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "kv_dtype", "kv_layout", "codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Namespace.{name} must be a non-empty string, got {value!r}")
        for name in ("salt", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Namespace.{name} must be a string (use '' for none), got {getattr(self, name)!r}")
        for name in ("codec_level", "format_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _U32_MAX:
                raise ValueError(f"Namespace.{name} must be an int in [0, 2**32), got {value!r}")

    def encode(self) -> bytes:
        """The unambiguous byte encoding the digest is computed over."""
        return b"".join(
            (
                _NS_TAG,
                _str_field(self.model_fingerprint),
                _str_field(self.kv_dtype),
                _str_field(self.kv_layout),
                _str_field(self.codec),
                struct.pack("<II", self.codec_level, self.format_version),
                _str_field(self.tenant),
                _str_field(self.salt),
            )
        )

    def digest(self) -> bytes:
        """32-byte SHA-256 of :meth:`encode`."""
        return hashlib.sha256(self.encode()).digest()

    def short_id(self) -> str:
        """The tenant tag + the first 16 hex chars of the digest: the prefix of every storage key
        of this namespace."""
        return tenant_tag(self.tenant) + self.digest().hex()[:16]  # digest() is cheap: a few dozen bytes

    def key_prefix(self) -> str:
        """The storage-key prefix shared by all keys of this namespace (for ``delete_prefix``)."""
        return self.short_id() + ":"


def tenant_tag(tenant: str) -> str:
    """8 hex chars shared by the storage keys of every namespace of ``tenant`` (``delete_prefix``)."""
    return hashlib.sha256(_TENANT_TAG + _str_field(tenant)).hexdigest()[:8]


@dataclass(frozen=True)
class ChunkKey:
    """A chunk's identity. ``str(key)`` is the storage key in every tier (file names, Redis keys)."""

    namespace_id: str
    digest: bytes
    position_independent: bool

    def __post_init__(self) -> None:
        if not isinstance(self.namespace_id, str) or not re.fullmatch(r"[0-9a-f]{24}", self.namespace_id):
            raise ValueError(f"ChunkKey.namespace_id must be 24 lowercase hex chars, got {self.namespace_id!r}")
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError(f"ChunkKey.digest must be 32 bytes, got {self.digest!r}")

    def __str__(self) -> str:
        return f"{self.namespace_id}:{'d' if self.position_independent else 'p'}:{self.digest.hex()}"

    @classmethod
    def parse(cls, s: str) -> ChunkKey:
        """Inverse of ``str(key)``; raises ValueError on anything not in exactly that form."""
        m = _KEY_RE.match(s) if isinstance(s, str) else None
        if m is None:
            raise ValueError(f"not a chunk key (expected '<24 hex>:<d|p>:<64 hex>'): {s!r}")
        return cls(m.group(1), bytes.fromhex(m.group(3)), m.group(2) == "d")


def _token_bytes(tokens: Tokens) -> np.ndarray:
    """Validate tokens and return them as a contiguous little-endian uint32 array."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"tokens must be a 1-D sequence of ints in [0, 2**32): {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers in [0, 2**32), got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise ValueError(f"tokens must be in [0, 2**32), got min {int(arr.min())} max {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_spans(n_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every full chunk of a prompt of ``n_tokens`` (the tail gets none)."""
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
    return [(i * chunk_size, (i + 1) * chunk_size) for i in range(n_tokens // chunk_size)]


def prefix_keys(tokens: Tokens, chunk_size: int, namespace: Namespace) -> list[ChunkKey]:
    """Keys of the full chunks of ``tokens``; key i depends on every token of chunks 0..i.

    The first k keys of a longer prompt equal the keys of its first k chunks.
    """
    arr = _token_bytes(tokens)
    spans = chunk_spans(len(arr), chunk_size)
    ns_digest = namespace.digest()
    ns_id = namespace.short_id()
    h = hashlib.sha256(_ROOT_TAG + ns_digest).digest()
    length = struct.pack("<I", chunk_size)
    keys = []
    for start, end in spans:
        h = hashlib.sha256(b"".join((_PREFIX_TAG, h, length, arr[start:end].tobytes()))).digest()
        keys.append(ChunkKey(ns_id, h, position_independent=False))
    return keys


def document_key(tokens: Tokens, namespace: Namespace) -> ChunkKey:
    """Position-independent key of a document's own tokens (CacheBlend), whatever precedes it."""
    arr = _token_bytes(tokens)
    if len(arr) == 0:
        raise ValueError("document_key: the document has no tokens")
    ns_digest = namespace.digest()
    h = hashlib.sha256(b"".join((_DOC_TAG, ns_digest, struct.pack("<Q", len(arr)), arr.tobytes()))).digest()
    return ChunkKey(namespace.short_id(), h, position_independent=True)
