"""API keys and bearer tokens as written in the configuration: plain, or as SHA-256 digests.

``server.api_keys`` entries are ``KEY:TENANT`` or ``sha256:<64 hex digits>:TENANT``; the
``server.metrics_token`` is ``TOKEN`` or ``sha256:<64 hex digits>``. A digest lets a
configuration file (or a variable) name a key without holding it: ``kvfuse keys digest`` prints the
digest of a key. Everything here is pure; the server compares digests in constant time
(``kvfuse.server.auth``), so a plain key is hashed once at start-up and never compared as text.
"""

from __future__ import annotations

import hashlib
import re

DIGEST_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def key_digest(key: str) -> str:
    """``sha256:<hex>`` of ``key`` (its UTF-8 bytes): what to write in the configuration instead of the key."""
    return DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def is_digest(value: str) -> bool:
    """Whether ``value`` is written as a digest (``sha256:...``), well formed or not."""
    return value.startswith(DIGEST_PREFIX)


def digest_bytes(value: str) -> bytes:
    """The 32 bytes a configured key or token stands for: a ``sha256:<hex>`` digest as written, a
    plain value hashed. ValueError for a malformed digest."""
    if is_digest(value):
        hex_part = value[len(DIGEST_PREFIX) :]
        if not _HEX64.fullmatch(hex_part):
            raise ValueError(
                f"a digest must be sha256: followed by 64 lowercase hex digits, got {value!r} "
                "(kvfuse keys digest prints one)"
            )
        return bytes.fromhex(hex_part)
    return hashlib.sha256(value.encode("utf-8")).digest()


def split_entry(entry: str) -> tuple[str, str]:
    """``KEY:TENANT`` or ``sha256:<hex>:TENANT`` -> (key or digest, tenant); the tenant may hold
    colons. An entry without a tenant gives an empty tenant (``entry_problem`` reports it)."""
    if is_digest(entry):
        rest = entry[len(DIGEST_PREFIX) :]
        digest, _, tenant = rest.partition(":")
        return DIGEST_PREFIX + digest, tenant
    key, _, tenant = entry.partition(":")
    return key, tenant


def entry_problem(entry: str) -> str | None:
    """What is wrong with one ``server.api_keys`` entry, as a message naming the fix; None if nothing."""
    key, tenant = split_entry(entry)
    if is_digest(entry):
        try:
            digest_bytes(key)
        except ValueError:
            return (
                f"a digest entry must look like sha256:<64 hex digits>:TENANT, got {_masked(entry)!r}; "
                "print a key's digest with: kvfuse keys digest"
            )
    if not key or not tenant:
        return f"entries must look like KEY:TENANT or sha256:<64 hex digits>:TENANT, got {_masked(entry)!r}"
    return None


def _masked(entry: str) -> str:
    """An entry for an error message: a plain key is not repeated in full (it is a secret)."""
    key, tenant = split_entry(entry)
    if is_digest(entry) or len(key) <= 4:
        return entry
    return f"{key[:2]}...{key[-2:]}:{tenant}" if tenant else f"{key[:2]}...{key[-2:]}"
