"""Signing cache entries: HMAC-SHA256 with a list of accepted keys (the first one signs).

Why: an entry's checksums (xxh3) and token ids are consistency checks. Whoever can write a shared
tier (the Redis keyspace, the S3 bucket, the disk folder) can write an entry that passes them all
under the key a request looks up, with other KV, and steer every tenant's answers. With signing,
only a holder of a configured key can write an entry that kvfuse loads.

What is signed (``kv/format.py`` lays it out): a signed entry's header holds the id of a digest
algorithm, the digest of each layer's payload bytes with it (BLAKE3; SHA-256 in entries signed
before the id existed: ``kv/digests.py``) and, after them, an HMAC-SHA256 tag over every header
byte before the tag: the fixed fields (format version, codec, dtype, shape, flags), the storage
key, the positions, the token ids, the layer table, the digest id and the digests. The tag
therefore covers the header and, through the digests, the payload. Digests per layer, rather than
one MAC over the payload, because readers also load one layer range without the rest (layer-wise
loading): the tag is checked on the header, then only the digests of the layers read. The tag
stays HMAC-SHA256: it is over the header only (a few KB), where the hash's speed does not matter.

Rotation: ``EntrySigner(keys)`` signs with ``keys[0]`` and accepts a tag of any of them, so a
new key is added to every process's list first (accepted everywhere), then moved to the front
(signing), and the old one removed once its entries have aged out (docs/deploy.md).

Pure functions over bytes; no configuration, files or tiers here (``config/signing.py`` reads the
keys, ``store/core.py`` hands the signer to its read and write seams).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

TAG_SIZE = 32  # HMAC-SHA256
MIN_KEY_BYTES = 32  # a shorter key is refused: HMAC's strength is the key's entropy


class EntrySigner:
    """HMAC-SHA256 tags with ``keys[0]``, checked against every key of ``keys``.

    Keys are bytes (a configured string's UTF-8). ``repr`` shows how many keys there are and never
    the keys, so a signer in a log line or a traceback's locals gives nothing away."""

    __slots__ = ("_macs",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        keys = [bytes(k) for k in keys]
        if not keys:
            raise ValueError("an EntrySigner needs at least one key")
        short = [i for i, k in enumerate(keys) if len(k) < MIN_KEY_BYTES]
        if short:
            raise ValueError(
                f"signing key(s) number {[i + 1 for i in short]} are shorter than {MIN_KEY_BYTES} bytes"
            )
        # The keyed state is set up once per key; each tag copies it (HMAC's key padding is not redone).
        self._macs = tuple(hmac.new(k, digestmod=hashlib.sha256) for k in keys)

    @property
    def key_count(self) -> int:
        return len(self._macs)

    def sign(self, data) -> bytes:
        """The tag of ``data`` (any buffer) under the signing key, the first one."""
        return _tag(self._macs[0], data)

    def verify(self, data, tag) -> bool:
        """Whether ``tag`` is ``data``'s tag under any accepted key (compared in constant time; every
        key is tried, so the time does not say which one matched)."""
        tag = bytes(tag)
        ok = False
        for mac in self._macs:
            ok |= hmac.compare_digest(_tag(mac, data), tag)
        return ok

    def __repr__(self) -> str:
        return f"EntrySigner({self.key_count} key{'s' if self.key_count != 1 else ''})"


def _tag(mac, data) -> bytes:
    m = mac.copy()
    m.update(data)
    return m.digest()


def parse_key_lines(text: str) -> list[str]:
    """The keys of a key file's text: one per line, surrounding blanks stripped; empty lines and
    lines starting with ``#`` skipped. The first key signs."""
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
