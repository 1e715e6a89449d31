"""Encryption at rest of the lower tiers' entries: ``EncryptedTier(inner, cipher)`` seals every
value it puts into ``inner`` (a disk, Redis or S3 tier) with AES-256-GCM and opens what it reads.

Why: an entry holds the token ids of its chunk (a prompt can be re-read from them with the
tokenizer) and its KV; whoever can read the disk folder, the Redis keyspace or the bucket can read
the prompts (issue 39 item 12). Signing (``kv/signing.py``) protects integrity, not
confidentiality. With ``cache.encryption_key_file`` set, the whole stored value (header and
payload: token ids and KV both) is sealed as::

    MAGIC (8) | key id (8: the first 8 bytes of SHA-256 of the key) | nonce (12) | ciphertext+tag

with the magic, the key id and the storage key string as associated data, so a sealed value moved
under another key, altered, sealed with a key not configured here, not sealed at all (written
before encryption was turned on) or read by a server without encryption, fails. A value that fails
to open is a **miss** (None), counted in the tier's ``decrypt_failures`` (and as a miss, not a
hit), never an error in a request; it is not deleted, since in a shared tier it may be another
server's entry under a key list out of step (rotation), and the recomputed entry overwrites it.

A wrapper rather than code in each tier: one seam for three tiers, and the store above (signing,
codecs, checks) keeps seeing plaintext: sign then encrypt. The memory tier stays plaintext (it
never leaves the process). Layer-range reads (``read_range``, per-layer streaming and header
peeks): GCM authenticates the whole value, so a range read opens the whole value and slices it
(correct, slower); the last opened value is kept for ``RECENT_S`` seconds so that the layer
reads of one entry open it once, dropped on any write or delete of that key. ``streams_reads`` is
off for the same reason (the store reads whole values and checks them afterwards).

Keys: 32 bytes each (64 hex digits a line in the key file, ``config/encryption.py``); the first
seals, all of them open (rotation: add the new key last everywhere, then move it first).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvfuse.kv.format import Entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier

MAGIC = b"KVFENC1\x00"
KEY_BYTES = 32  # AES-256
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES  # a sealed value is this many bytes longer
RECENT_S = 2.0  # how long an opened value serves range reads of the same key


def key_id(key: bytes) -> bytes:
    """The id a sealed value names its key by: not secret (a hash prefix), only a lookup."""
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES]


def parse_hex_keys(text: str) -> list[bytes]:
    """The keys of a key file's text: one per line, 64 hex digits (32 bytes), blanks stripped,
    empty and ``#`` lines skipped; ValueError naming the line (never its content) otherwise."""
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            raise ValueError(f"line {n} is not hexadecimal") from None
        if len(key) != KEY_BYTES:
            raise ValueError(
                f"line {n} holds {len(key)} bytes; a key is {KEY_BYTES} bytes ({2 * KEY_BYTES} hex digits)"
            )
        keys.append(key)
    return keys


class BlobCipher:
    """AES-256-GCM sealing with ``keys[0]``, opening with any of ``keys`` (by key id). ``repr``
    shows how many keys there are, never a key."""

    __slots__ = ("_seal_id", "_aeads")

    def __init__(self, keys: Sequence[bytes]) -> None:
        keys = [bytes(k) for k in keys]
        if not keys:
            raise ValueError("a BlobCipher needs at least one key")
        bad = [i + 1 for i, k in enumerate(keys) if len(k) != KEY_BYTES]
        if bad:
            raise ValueError(f"encryption key(s) number {bad} are not {KEY_BYTES} bytes")
        self._seal_id = key_id(keys[0])
        self._aeads = {key_id(k): AESGCM(k) for k in reversed(keys)}  # the first wins a clash

    @property
    def key_count(self) -> int:
        return len(self._aeads)

    def seal(self, storage_key: str, plaintext) -> bytes:
        """``plaintext`` (any buffer) sealed under the first key, bound to ``storage_key``."""
        head = MAGIC + self._seal_id + os.urandom(NONCE_BYTES)
        aad = head[: len(MAGIC) + KEY_ID_BYTES] + storage_key.encode("utf-8")
        return head + self._aeads[self._seal_id].encrypt(head[-NONCE_BYTES:], plaintext, aad)

    def open(self, storage_key: str, sealed) -> bytes | None:
        """The plaintext of ``sealed``, or None when it is not a value sealed under
        ``storage_key`` by one of the keys (short, no magic, unknown key id, failed tag)."""
        data = memoryview(sealed).cast("B")
        if len(data) < OVERHEAD or data[: len(MAGIC)] != MAGIC:
            return None
        kid = bytes(data[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES])
        aead = self._aeads.get(kid)
        if aead is None:
            return None
        aad = bytes(data[: len(MAGIC) + KEY_ID_BYTES]) + storage_key.encode("utf-8")
        try:
            return aead.decrypt(
                bytes(data[len(MAGIC) + KEY_ID_BYTES : HEADER_BYTES]), data[HEADER_BYTES:], aad
            )
        except InvalidTag:
            return None

    def __repr__(self) -> str:
        return f"BlobCipher({self.key_count} key{'s' if self.key_count != 1 else ''})"


def _plain(value: Blob):
    return value.join() if isinstance(value, Entry) else value


class EncryptedTier(Tier):
    """``inner`` with every value sealed on the way in and opened on the way out (see the module
    docstring). Shares ``inner``'s name, stats, clock and observer: to the store and the metrics
    it is that tier; ``inner`` is the wrapped tier (``events.hub.medium_of`` looks through it)."""

    holds_entries = False
    streams_reads = False

    def __init__(self, inner: Tier, cipher: BlobCipher) -> None:
        if inner.holds_entries:
            raise ValueError("the memory tier is not encrypted: wrap the lower tiers only")
        self.inner = inner
        self.cipher = cipher
        self.name = inner.name
        self.stats = inner.stats
        self.batch_reads = inner.batch_reads
        self.capacity_bytes = inner.capacity_bytes
        self.reports_puts = inner.reports_puts
        self._recent: tuple[ChunkKey, float, bytes] | None = None
        self._recent_lock = threading.Lock()

    # the store sets these on every tier: they belong to the inner one
    @property
    def clock(self):
        return self.inner.clock

    @clock.setter
    def clock(self, value) -> None:
        self.inner.clock = value

    @property
    def observer(self):
        return self.inner.observer

    @observer.setter
    def observer(self, value) -> None:
        self.inner.observer = value

    # -- sealing and opening ---------------------------------------------------------------------

    def _open(self, key: ChunkKey, sealed) -> bytes | None:
        """The plaintext of what ``inner`` returned, or None (a miss, counted) when it fails."""
        if sealed is None:
            return None
        plain = self.cipher.open(str(key), sealed)
        if plain is None:
            # inner counted a hit for bytes the store cannot use: a miss for everyone above
            self.stats.add(hits=-1, misses=1, decrypt_failures=1)
        return plain

    def _forget(self, key: ChunkKey | None = None) -> None:
        with self._recent_lock:
            if self._recent is not None and (key is None or self._recent[0] == key):
                self._recent = None

    def get(self, key: ChunkKey) -> bytes | None:
        return self._open(key, self.inner.get(key))

    def get_many(self, keys: Iterable[ChunkKey]) -> list[bytes | None]:
        keys = list(keys)
        return [self._open(k, v) for k, v in zip(keys, self.inner.get_many(keys))]

    def put(self, key: ChunkKey, value: Blob, expires_at: float | None = None) -> None:
        self.inner.put(key, self.cipher.seal(str(key), _plain(value)), expires_at)
        self._forget(key)  # after the write: a range read meanwhile cannot keep the old value

    def put_many(
        self, items: Iterable[tuple[ChunkKey, Blob]], expires_at: float | None = None
    ) -> None:
        sealed = [(key, self.cipher.seal(str(key), _plain(value))) for key, value in items]
        if expires_at is None:
            self.inner.put_many(sealed)
        else:
            self.inner.put_many(sealed, expires_at=expires_at)
        for key, _ in sealed:
            self._forget(key)

    def read_range(self, key: ChunkKey, start: int, stop: int) -> memoryview | None:
        """Bytes ``[start, stop)`` of the plaintext: the whole value is read and opened (GCM
        authenticates it whole), or taken from the last one opened within ``RECENT_S``."""
        now = time.monotonic()
        with self._recent_lock:
            recent = self._recent
        if recent is not None and recent[0] == key and now - recent[1] < RECENT_S:
            return memoryview(recent[2])[start:stop]
        plain = self.get(key)
        if plain is None:
            return None
        with self._recent_lock:
            self._recent = (key, now, plain)
        return memoryview(plain)[start:stop]

    # -- everything else is the inner tier's ---------------------------------------------------

    def contains(self, key: ChunkKey) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: Iterable[ChunkKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def expiry(self, key: ChunkKey) -> float | None:
        return self.inner.expiry(key)

    def expiries(self, keys: Iterable[ChunkKey]) -> list[float | None]:
        return self.inner.expiries(keys)

    def extend(self, key: ChunkKey, expires_at: float) -> bool:
        return self.inner.extend(key, expires_at)

    def extend_many(self, keys: Iterable[ChunkKey], expires_at: float) -> list[bool]:
        return self.inner.extend_many(keys, expires_at)

    def expire(self) -> int:
        self._forget()
        return self.inner.expire()

    def delete(self, key: ChunkKey) -> bool:
        removed = self.inner.delete(key)
        self._forget(key)
        return removed

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        self._forget()
        return self.inner.delete_many(keys)

    def delete_prefix(self, prefix: str) -> int:
        self._forget()
        return self.inner.delete_prefix(prefix)

    def clear(self) -> int:
        self._forget()
        return self.inner.clear()

    def keys(self, limit: int | None = None) -> list[ChunkKey]:
        return self.inner.keys(limit)

    def entries(self) -> int | None:
        return self.inner.entries()

    def used_bytes(self) -> int | None:
        return self.inner.used_bytes()

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        return self.inner.tenant_usage()

    def close(self) -> None:
        self._forget()
        self.inner.close()

    def __repr__(self) -> str:
        return f"EncryptedTier({self.inner!r}, {self.cipher!r})"
