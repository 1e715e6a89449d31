"""What kvfuse announces for a chunk: its blocks, their hashes and their parent (pure functions).

A chunk (``cache.chunk_size`` tokens, 256 by default) is announced as the whole blocks of
``server.kv_events_block_size`` tokens (16 by default, vLLM's block size) it holds: a full prefix
chunk as chunk_size / block_size blocks, a tail (the partial last chunk of a conversation) as its
whole blocks only (the rest is never announced, as vLLM never announces a partial block).
Document and content chunks are not announced: they are reusable at any position, which a
prefix-matching router cannot express.

Hashes. Consumers match blocks by their tokens (vllm-router hashes each block's token ids; llm-d
by the chain of them) and use ``block_hashes`` as opaque ids: to chain a ``BlockStored`` to its
``parent_block_hash`` and to find the blocks a ``BlockRemoved`` names. So one token path must get
one hash whatever announced it, and the hash must depend on everything before the block, like
vLLM's. kvfuse's prefix keys already are such a chain, at chunk granularity (``kv/keys.py``); the
blocks inside a chunk continue it::

    c_-1 = digest of the parent prefix key (the chunk before), or for the first chunk
           SHA256(b"kvfuse.block.root\\0" namespace_id)
    c_j  = SHA256(b"kvfuse.block\\0" c_{j-1} tokens of block j as u32 little-endian)
    hash_j = the first 8 bytes of c_j, big-endian, top bit cleared (a non-negative int64)

except that the last block of a full prefix chunk is the chunk key's own digest (so the next
chunk's ``parent_block_hash``, derived from its parent key, is that block's hash). A tail and the
prefix chunk that later covers the same tokens therefore announce the same hashes for the blocks
they share, and tenants (and ``cache_salt`` namespaces, and models) never share one: the namespace
seeds every chain.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfuse.kv.keys import ChunkKey, ChunkKind, Namespace, prefix_keys

_ROOT = b"kvfuse.block.root\x00"
_BLOCK = b"kvfuse.block\x00"
_MASK = (1 << 63) - 1
ANNOUNCED = (ChunkKind.PREFIX, ChunkKind.TAIL)


def hash_int(digest: bytes) -> int:
    """A digest as a block hash: its first 8 bytes big-endian, top bit cleared (every consumer
    takes it as a non-negative integer: msgpack's, Rust's u64, Go's int64)."""
    return int.from_bytes(digest[:8], "big") & _MASK


def root_seed(namespace_id: str) -> bytes:
    """The chain value before a namespace's first block (``ChunkKey.namespace_id``)."""
    return hashlib.sha256(_ROOT + namespace_id.encode("ascii")).digest()


@dataclass(frozen=True)
class Blocks:
    """A chunk's announced blocks: their hashes, the hash of the block before the first (None for
    a chunk at position 0) and how many of its tokens they cover."""

    hashes: tuple[int, ...]
    parent: int | None

    @property
    def count(self) -> int:
        return len(self.hashes)


def chunk_blocks(
    key: ChunkKey,
    parent: ChunkKey | None,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    chunk_size: int,
) -> Blocks:
    """The blocks of the chunk ``key`` whose ``tokens`` follow the prefix chunk ``parent`` (None:
    the chunk starts the prompt). Only whole blocks; a full prefix chunk's last block hash is its
    key's digest (see the module docstring)."""
    if block_size < 1 or chunk_size % block_size:
        raise ValueError(f"block_size {block_size} must divide chunk_size {chunk_size}")
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).astype("<u4"))
    n = len(arr) // block_size
    c = root_seed(key.namespace_id) if parent is None else parent.digest
    hashes = []
    for j in range(n):
        block = arr[j * block_size : (j + 1) * block_size].tobytes()
        c = hashlib.sha256(b"".join((_BLOCK, c, block))).digest()
        hashes.append(hash_int(c))
    if key.kind is ChunkKind.PREFIX and len(arr) == chunk_size and hashes:
        hashes[-1] = hash_int(key.digest)
    return Blocks(tuple(hashes), None if parent is None else hash_int(parent.digest))


@dataclass(frozen=True)
class Span:
    """A chunk of a request's KV: its key and its tokens' slots ``[start, end)``."""

    key: ChunkKey
    start: int
    end: int


def announced(spans: Sequence[Span], chunk_size: int) -> list[Span]:
    """The spans a router can be told of: prefix and tail chunks starting on a chunk boundary
    (the positions their keys chain from)."""
    return [
        s
        for s in spans
        if s.key.kind in ANNOUNCED and not s.key.variant and s.start % chunk_size == 0
    ]


def parents(
    ids: Sequence[int], spans: Sequence[Span], chunk_size: int, namespace: Namespace
) -> list[ChunkKey | None]:
    """Each span's parent: the prefix key of the chunk just before it (None at position 0),
    computed from the request's token ids ``ids`` (every slot from 0) in ``namespace``."""
    last = max((s.start for s in spans), default=0)
    chain = prefix_keys(ids[:last], chunk_size, namespace) if last else []
    return [chain[s.start // chunk_size - 1] if s.start else None for s in spans]


def block_tokens(tokens: Sequence[int], count: int, block_size: int) -> list[int]:
    """The token ids a ``BlockStored`` of ``count`` blocks carries: exactly those blocks' tokens."""
    head = tokens[: count * block_size]
    return head.tolist() if hasattr(head, "tolist") else [int(t) for t in head]


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Hashes kept compactly (8 bytes each) for a chunk's later removal event."""
    return struct.pack(f">{len(hashes)}Q", *hashes)


def unpack_hashes(packed: bytes) -> list[int]:
    return list(struct.unpack(f">{len(packed) // 8}Q", packed))


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids kept compactly (4 bytes each) for a chunk's later ``BlockStored`` events."""
    return np.asarray(tokens, dtype="<u4").tobytes()


def unpack_tokens(packed: bytes) -> list[int]:
    return np.frombuffer(packed, dtype="<u4").tolist()
