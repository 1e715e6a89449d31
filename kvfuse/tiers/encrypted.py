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

Keys (``kv/encryption.py``): 32 bytes each (64 hex digits a line in the key file, ``config/encryption.py``); the first
seals, all of them open (rotation: add the new key last everywhere, then move it first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from kvfuse.kv.encryption import BlobCipher
from kvfuse.kv.format import Entry
from kvfuse.kv.keys import ChunkKey
from kvfuse.tiers.base import Blob, Tier
from kvfuse.tiers.delegating import DelegatingTier

RECENT_S = 2.0  # how long an opened value serves range reads of the same key


def _plain(value: Blob):
    return value.join() if isinstance(value, Entry) else value


class EncryptedTier(DelegatingTier):
    """``inner`` with every value sealed on the way in and opened on the way out (see the module
    docstring). Shares ``inner``'s name, stats, clock and observer (``DelegatingTier``): to the
    store and the metrics it is that tier; ``inner`` is the wrapped tier (``events.hub.medium_of``
    looks through it). Every read opens (``read_with`` through ``get``, never ``inner``'s raw
    bytes); every write or removal drops the recent opened value it may have made stale."""

    holds_entries = False
    streams_reads = False
    read_with = Tier.read_with  # through self.get: opened, never inner's sealed bytes

    def __init__(self, inner: Tier, cipher: BlobCipher) -> None:
        if inner.holds_entries:
            raise ValueError("the memory tier is not encrypted: wrap the lower tiers only")
        super().__init__(inner)
        self.cipher = cipher
        self._recent: tuple[ChunkKey, float, bytes] | None = None
        self._recent_lock = threading.Lock()

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
        super().put_many(sealed, expires_at)
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

    # -- removals: inner's, and the recent opened value is dropped ------------------------------

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

    def close(self) -> None:
        self._forget()
        self.inner.close()

    def __repr__(self) -> str:
        return f"EncryptedTier({self.inner!r}, {self.cipher!r})"
