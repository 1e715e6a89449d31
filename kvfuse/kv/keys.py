"""Deterministic chunk keys: a namespace digest, a hash chain over full chunks, document and tail keys.

Everything here is a pure function of its inputs and of an explicit byte encoding (length-prefixed
UTF-8 strings, little-endian integers, SHA-256), so keys are identical across processes, machines
and Python versions. Builtin ``hash()`` is never used: it is salted per process.

Encoding (``u32``/``u64`` little-endian, ``str`` = ``u32 byte length + UTF-8``)::

    namespace  = SHA256(b"kvfuse.ns.v3\\0" str(model_fingerprint) str(kv_dtype) str(kv_layout)
                        u32(format_version) str(tenant) str(salt) str(cache_salt))
    tenant_tag = SHA256(b"kvfuse.tenant\\0" str(tenant)), first 16 hex chars
    salt_tag   = SHA256(b"kvfuse.salt\\0" str(tenant) str(cache_salt)), first 16 hex chars
    h_root     = SHA256(b"kvfuse.root.v1\\0" namespace)
    h_i        = SHA256(b"kvfuse.prefix\\0" h_{i-1} u32(len_i) tokens_i as u32...)
    document   = SHA256(b"kvfuse.doc\\0" namespace u64(len ctx) ctx as u32... u64(len) tokens as u32...)
    tail       = SHA256(b"kvfuse.tail\\0" h_parent u64(len) tokens as u32...)   (h_parent: h_root or a prefix h_i)
    content    = SHA256(b"kvfuse.content\\0" namespace u64(len) tokens as u32...)

A key names a chunk's *content*, not its encoding: the codec and its level are not in the
namespace. The entry header says how an entry is encoded (``kv/format.py``), a lookup accepts any
registered codec, and one chunk may be stored at several levels (CacheGen) under one key. What
must match for KV to be valid (the model, the KV dtype and layout, the format version, the
tenant and salt) is in the namespace, so a different model or format is a different key: a miss.

Storage keys print as ``<tenant_tag 16 hex><salt_tag 16 hex><namespace 16 hex>:<kind>:<digest 64
hex>`` with kind
``p`` (prefix), ``d`` (document), ``t`` (tail) or ``c`` (content chunk), and for an extra encoding of the same chunk
(CacheGen's streaming levels) a ``@<codec>.<level>`` suffix: the *variant*. Lookups and plans use
the plain key (the chunk's primary copy, in whatever codec its tier writes); only the streaming
loader asks for a variant, and falls back to the primary. Kinds: distinct domain tags make the kinds' digests
disjoint, and every entry of one tenant (whatever its model or salt) shares the readable prefix
``tenant_tag``, so a tenant's entries can be deleted by prefix. Every namespace derived from a
request's ``cache_salt`` (its plain prompts, its blended prompts, its conversations continued after
dropped turns) carries that salt's ``salt_tag`` after the tenant's, whatever else its salt holds
(the deployment's salt, the blend settings, the history it was derived from), so ``tenant_tag +
salt_tag`` (``salt_prefix``) deletes all of them, for every model, and nothing of another salt.
Both tags are 64 bits: a delete or a quota can no more meet another tenant's (or salt's) entries by
a tag collision than a key can collide. Key version 3 (``ns.v3``, 48 hex chars of namespace): the
keys of earlier versions (24) do not parse, so their entries are never read as this version's.
"""

from __future__ import annotations

import enum
import hashlib
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvfuse.kv.version import FORMAT_VERSION

_NS_TAG = b"kvfuse.ns.v3\x00"
_TENANT_TAG = b"kvfuse.tenant\x00"
_SALT_TAG = b"kvfuse.salt\x00"
_ROOT_TAG = b"kvfuse.root.v1\x00"
_PREFIX_TAG = b"kvfuse.prefix\x00"
_DOC_TAG = b"kvfuse.doc\x00"
_TAIL_TAG = b"kvfuse.tail\x00"
_CONTENT_TAG = b"kvfuse.content\x00"

_U32_MAX = 2**32 - 1
TAG_LEN = 16  # hex chars of a tenant tag, and of a salt tag after it
NS_ID_LEN = 3 * TAG_LEN  # a namespace id: tenant tag, salt tag, the namespace's own 16
_KEY_RE = re.compile(r"^([0-9a-f]{48}):([dptc]):([0-9a-f]{64})(?:@([a-z0-9]+\.[0-9]+))?$")
_VARIANT_RE = re.compile(r"[a-z0-9]+\.[0-9]+")

Tokens = Sequence[int] | np.ndarray | torch.Tensor


class ChunkKind(enum.Enum):
    """What a key names: a chunk of a prompt's prefix (its key chains over every earlier chunk), a
    document cached on its own (reusable at any position), the partial last chunk after a prefix
    chain (a conversation's tail), or a content-defined chunk of a prompt (``kv/content.py``:
    keyed by its own tokens only, its KV computed in the context of the prompt that stored it,
    reusable at any position of another prompt, blended like a document)."""

    PREFIX = "p"
    DOCUMENT = "d"
    TAIL = "t"
    CONTENT = "c"


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
    """Everything that must match for a cached chunk to be valid: the model, the KV shape and dtype,
    the format version, the tenant (an API key's owner; "" = anonymous) and a salt (a namespace
    inside the tenant: the deployment's salt and a request's ``cache_salt``, and for derived
    namespaces the blend settings or the history they come from). ``cache_salt`` is the request's
    own salt alone: its tag is in every key's prefix, so deleting it covers every namespace derived
    from it (``salt_prefix``)."""

    model_fingerprint: str
    kv_dtype: str
    kv_layout: str
    format_version: int = FORMAT_VERSION
    salt: str = ""
    tenant: str = ""
    cache_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "kv_dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Namespace.{name} must be a non-empty string, got {value!r}")
        for name in ("salt", "tenant", "cache_salt"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"Namespace.{name} must be a string (use '' for none), got {getattr(self, name)!r}"
                )
        v = self.format_version
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _U32_MAX:
            raise ValueError(f"Namespace.format_version must be an int in [0, 2**32), got {v!r}")

    def encode(self) -> bytes:
        """The unambiguous byte encoding the digest is computed over."""
        return b"".join(
            (
                _NS_TAG,
                _str_field(self.model_fingerprint),
                _str_field(self.kv_dtype),
                _str_field(self.kv_layout),
                struct.pack("<I", self.format_version),
                _str_field(self.tenant),
                _str_field(self.salt),
                _str_field(self.cache_salt),
            )
        )

    def digest(self) -> bytes:
        """32-byte SHA-256 of :meth:`encode`."""
        return hashlib.sha256(self.encode()).digest()

    def short_id(self) -> str:
        """The tenant tag, the cache salt's tag and the first 16 hex chars of the digest: the prefix
        of every storage key of this namespace."""
        # digest() is cheap: a few dozen bytes
        return salt_prefix(self.tenant, self.cache_salt) + self.digest().hex()[:TAG_LEN]

    def key_prefix(self) -> str:
        """The storage-key prefix shared by all keys of this namespace (for ``delete_prefix``)."""
        return self.short_id() + ":"


def tenant_tag(tenant: str) -> str:
    """16 hex chars shared by the storage keys of every namespace of ``tenant`` (``delete_prefix``,
    per-tenant quotas): 64 bits, so two tenants' tags collide no more than two keys do."""
    return hashlib.sha256(_TENANT_TAG + _str_field(tenant)).hexdigest()[:TAG_LEN]


def salt_prefix(tenant: str, cache_salt: str) -> str:
    """The storage-key prefix of every namespace of ``tenant`` derived from ``cache_salt`` (plain,
    blended, history-derived; every model): the tenant tag, then 16 hex chars of the salt within
    the tenant. ``DELETE /v1/kv?cache_salt=`` deletes by it."""
    digest = hashlib.sha256(_SALT_TAG + _str_field(tenant) + _str_field(cache_salt)).hexdigest()
    return tenant_tag(tenant) + digest[:TAG_LEN]


@dataclass(frozen=True, slots=True, eq=False)
class ChunkKey:
    """A chunk's identity, passed unchanged from the planner down to the tiers. ``str(key)`` is
    the storage key in every tier (file names, Redis keys) and inside every entry's header.

    Keys are dictionary keys in every index (tiers, the saver, the scheduler): the hash is
    computed once (the generated dataclass hash, through ``Enum.__hash__``, cost ~400 ns per
    call, most of a lookup) and equality compares it first. The cached hash is this process's
    (str and bytes hashes are salted per process), so pickling sends the fields only.

    ``group`` is what many keys share, ``<namespace_id>:<kind>:<variant>``, as one interned string
    (one object per group, so a key pays only its pointer): the tiers' compact index
    (``tiers/key_index``) keeps each group once and finds it by this string in one dict lookup."""

    namespace_id: str
    digest: bytes
    kind: ChunkKind
    variant: str = ""  # "" for the chunk itself; "<codec>.<level>" for an extra encoding of it
    _hash: int = field(default=0, init=False, repr=False)
    group: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace_id, str) or not re.fullmatch(
            r"[0-9a-f]{48}", self.namespace_id
        ):
            raise ValueError(
                f"ChunkKey.namespace_id must be 48 lowercase hex chars, got {self.namespace_id!r}"
            )
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError(f"ChunkKey.digest must be 32 bytes, got {self.digest!r}")
        if not isinstance(self.kind, ChunkKind):
            raise ValueError(f"ChunkKey.kind must be a ChunkKind, got {self.kind!r}")
        if self.variant and not _VARIANT_RE.fullmatch(self.variant):
            raise ValueError(f"ChunkKey.variant must look like 'cachegen.1', got {self.variant!r}")
        object.__setattr__(
            self, "_hash", hash((self.namespace_id, self.digest, self.kind.value, self.variant))
        )
        object.__setattr__(
            self, "group", sys.intern(f"{self.namespace_id}:{self.kind.value}:{self.variant}")
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if other.__class__ is not ChunkKey:
            return NotImplemented
        return (
            self._hash == other._hash
            and self.digest == other.digest
            and self.kind is other.kind
            and self.namespace_id == other.namespace_id
            and self.variant == other.variant
        )

    def __reduce__(self):
        return ChunkKey, (self.namespace_id, self.digest, self.kind, self.variant)

    def __str__(self) -> str:
        base = f"{self.namespace_id}:{self.kind.value}:{self.digest.hex()}"
        return f"{base}@{self.variant}" if self.variant else base

    def __repr__(self) -> str:
        at = f" @{self.variant}" if self.variant else ""
        return f"ChunkKey({self.kind.name.lower()} {self.namespace_id}:{self.digest.hex()[:12]}...{at})"

    def encoded_as(self, codec: str, level: int) -> ChunkKey:
        """The key of this chunk's extra copy encoded by ``codec`` at ``level``."""
        return ChunkKey(self.namespace_id, self.digest, self.kind, f"{codec}.{level}")

    @property
    def base(self) -> ChunkKey:
        """The chunk's own key (without a variant)."""
        return ChunkKey(self.namespace_id, self.digest, self.kind) if self.variant else self

    @classmethod
    def parse(cls, s: str) -> ChunkKey:
        """Inverse of ``str(key)``; raises ValueError on anything not in exactly that form."""
        m = _KEY_RE.match(s) if isinstance(s, str) else None
        if m is None:
            raise ValueError(
                f"not a chunk key (expected '<48 hex>:<p|d|t|c>:<64 hex>[@codec.level]'): {s!r}"
            )
        return cls(m.group(1), bytes.fromhex(m.group(3)), ChunkKind(m.group(2)), m.group(4) or "")


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
        raise ValueError(
            f"tokens must be in [0, 2**32), got min {int(arr.min())} max {int(arr.max())}"
        )
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_spans(n_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every full chunk of a prompt of ``n_tokens`` (the tail gets none)."""
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(n_tokens, int) or n_tokens < 0:
        raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
    return [(i * chunk_size, (i + 1) * chunk_size) for i in range(n_tokens // chunk_size)]


def _root(namespace: Namespace) -> bytes:
    return hashlib.sha256(_ROOT_TAG + namespace.digest()).digest()


def prefix_keys(tokens: Tokens, chunk_size: int, namespace: Namespace) -> list[ChunkKey]:
    """Keys of the full chunks of ``tokens``; key i depends on every token of chunks 0..i.

    The first k keys of a longer prompt equal the keys of its first k chunks.
    """
    arr = _token_bytes(tokens)
    spans = chunk_spans(len(arr), chunk_size)
    ns_id = namespace.short_id()
    h = _root(namespace)
    length = struct.pack("<I", chunk_size)
    keys = []
    for start, end in spans:
        h = hashlib.sha256(b"".join((_PREFIX_TAG, h, length, arr[start:end].tobytes()))).digest()
        keys.append(ChunkKey(ns_id, h, ChunkKind.PREFIX))
    return keys


def document_key(tokens: Tokens, namespace: Namespace, context: Tokens = ()) -> ChunkKey:
    """Position-independent key of a document's own tokens (CacheBlend), reusable wherever it
    appears in a prompt. ``context`` is what its KV was computed behind (e.g. ``[BOS]``): part of
    the key, since the KV depends on it, but not part of the entry."""
    arr, ctx = _token_bytes(tokens), _token_bytes(context)
    if len(arr) == 0:
        raise ValueError("document_key: the document has no tokens")
    h = hashlib.sha256(
        b"".join(
            (
                _DOC_TAG,
                namespace.digest(),
                struct.pack("<Q", len(ctx)),
                ctx.tobytes(),
                struct.pack("<Q", len(arr)),
                arr.tobytes(),
            )
        )
    ).digest()
    return ChunkKey(namespace.short_id(), h, ChunkKind.DOCUMENT)


def tail_key(parent: ChunkKey | None, tokens: Tokens, namespace: Namespace) -> ChunkKey:
    """Key of the partial chunk ``tokens`` that follows the prefix chunk ``parent`` (None: the
    tail is the whole prompt). Like a prefix key it depends on every earlier token, through the
    parent's chain; its own tokens are length-prefixed, so no tail equals another's extension."""
    arr = _token_bytes(tokens)
    if len(arr) == 0:
        raise ValueError("tail_key: the tail has no tokens")
    if parent is not None and (
        parent.kind is not ChunkKind.PREFIX or parent.namespace_id != namespace.short_id()
    ):
        raise ValueError("tail_key: the parent must be a prefix key of the same namespace")
    h = _root(namespace) if parent is None else parent.digest
    digest = hashlib.sha256(
        b"".join((_TAIL_TAG, h, struct.pack("<Q", len(arr)), arr.tobytes()))
    ).digest()
    return ChunkKey(namespace.short_id(), digest, ChunkKind.TAIL)


def follows(parent: ChunkKey, child: ChunkKey, tokens: Tokens, chunk_size: int) -> bool:
    """Whether ``child`` is the key of the chunk ``tokens`` right after the prefix chunk ``parent``
    (a prefix key as ``prefix_keys`` chains it, or a tail as ``tail_key``). Lets a reader that
    finds entries without their prompt (a disk tier at start-up) recover their chain: an entry
    records its key and tokens, not its parent's key."""
    if parent.kind is not ChunkKind.PREFIX or parent.namespace_id != child.namespace_id:
        return False
    arr = _token_bytes(tokens)
    if child.kind is ChunkKind.PREFIX:
        head = (_PREFIX_TAG, parent.digest, struct.pack("<I", chunk_size))
    elif child.kind is ChunkKind.TAIL:
        head = (_TAIL_TAG, parent.digest, struct.pack("<Q", len(arr)))
    else:
        return False
    return hashlib.sha256(b"".join((*head, arr.tobytes()))).digest() == child.digest


def content_keys(
    tokens: Tokens, spans: Sequence[tuple[int, int]], namespace: Namespace
) -> list[ChunkKey]:
    """Position-independent keys of the content-defined chunks ``spans`` (``[start, end)`` into
    ``tokens``, none empty): each names the chunk's own tokens in ``namespace``, whatever precedes
    it, so the same passage has the same keys wherever it appears (``kv/content.py``)."""
    arr = _token_bytes(tokens)
    ns_digest, ns_id = namespace.digest(), namespace.short_id()
    keys = []
    for start, end in spans:
        if not 0 <= start < end <= len(arr):
            raise ValueError(
                f"content_keys: span [{start}, {end}) is empty or outside the {len(arr)} tokens"
            )
        h = hashlib.sha256(
            b"".join(
                (_CONTENT_TAG, ns_digest, struct.pack("<Q", end - start), arr[start:end].tobytes())
            )
        ).digest()
        keys.append(ChunkKey(ns_id, h, ChunkKind.CONTENT))
    return keys
