"""The encryption keys of a configuration: ``cache.encryption_key_file``, turned into the
``BlobCipher`` the lower tiers are wrapped with (``tiers/encrypted.py``).

Apart from ``config/signing.py`` because the keys differ in kind: AES-256 keys are exactly 32
random bytes, written as 64 hex digits (``openssl rand -hex 32``), where signing keys are any
string of at least 32 bytes. Only a file: a key in YAML or a process environment is read by more
people than a mode-600 file (the file's path may come from ``KVFUSE_CACHE_ENCRYPTION_KEY_FILE``).
The file is read and checked by ``key_files.read_key_file``, as the signing key file is.
``validate`` calls ``cipher_of`` so a bad key file is a ConfigError when the configuration is
loaded; ``runtime.open_store`` calls it again to build the cipher. No message shows a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .key_files import read_key_file
from .sections import CacheConfig

SETTING = "cache.encryption_key_file"


def cipher_of(cache: CacheConfig, sources: Mapping[str, str] | None = None):
    """The cipher of ``cache.encryption_key_file``'s keys, or None when encryption is off (no
    file set); ConfigError naming the setting, where it came from and the fix: a file that cannot
    be read, is not text, holds no key, or a line that is not 64 hex digits."""
    if not cache.encryption_key_file:
        return None
    from kvfuse.kv.encryption import BlobCipher, parse_hex_keys  # cryptography: on use only

    path = Path(cache.encryption_key_file).expanduser()
    source = (sources or {}).get(SETTING, "the configuration")
    keys = read_key_file(SETTING, path, source, parse_hex_keys, ", 64 hex digits")
    return BlobCipher(keys)
