"""AES-256-GCM sealing of stored values (``BlobCipher``) and the key file's format
(``parse_hex_keys``): the cipher of encryption at rest (issue 39 item 12). Here, beside the entry
signer (``kv/signing.py``), because both the configuration (``config/encryption.py``, which reads
the key file) and the tiers (``tiers/encrypted.py``, which seal and open values) use it, and the
configuration must not import the tiers.

Sealed value: ``MAGIC (8) | key id (8: SHA-256 prefix of the key) | nonce (12) | ciphertext+tag``,
with the magic, the key id and the storage key string as associated data.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"KVFENC1\x00"
KEY_BYTES = 32  # AES-256
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES  # a sealed value is this many bytes longer


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
