"""The encryption keys of a configuration: ``cache.encryption_key_file``, turned into the
``BlobCipher`` the lower tiers are wrapped with (``tiers/encrypted.py``).

Apart from ``config/signing.py`` because the keys differ in kind: AES-256 keys are exactly 32
random bytes, written as 64 hex digits (``openssl rand -hex 32``), where signing keys are any
string of at least 32 bytes. Only a file: a key in YAML or a process environment is read by more
people than a mode-600 file (the file's path may come from ``KVFUSE_CACHE_ENCRYPTION_KEY_FILE``).
``validate`` calls ``cipher_of`` so a bad key file is a ConfigError when the configuration is
loaded; ``runtime.open_store`` calls it again to build the cipher. No message shows a key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from .sections import CacheConfig, ConfigError

log = logging.getLogger(__name__)

SETTING = "cache.encryption_key_file"
_GENERATE = "openssl rand -hex 32"


def cipher_of(cache: CacheConfig, sources: Mapping[str, str] | None = None):
    """The cipher of ``cache.encryption_key_file``'s keys, or None when encryption is off (no
    file set); ConfigError naming the setting, where it came from and the fix: a file that cannot
    be read, is not text, holds no key, or a line that is not 64 hex digits."""
    if not cache.encryption_key_file:
        return None
    from kvfuse.kv.encryption import BlobCipher, parse_hex_keys  # cryptography: on use only

    path = Path(cache.encryption_key_file).expanduser()
    source = (sources or {}).get(SETTING, "the configuration")
    fix = f"write a key into it ({_GENERATE} > {path}; chmod 600 {path}) or unset {SETTING}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"{SETTING}: cannot read {path}: {e.strerror or e} (from {source}); {fix}"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{SETTING}: {path} is not UTF-8 text (from {source}); one key per line, 64 hex "
            f"digits, e.g. from {_GENERATE}"
        ) from None
    try:
        keys = parse_hex_keys(text)
    except ValueError as e:
        raise ConfigError(
            f"{SETTING}: {path}: {e} (from {source}); each line holds one key, 64 hex digits "
            f"({_GENERATE})"
        ) from None
    if not keys:
        raise ConfigError(f"{SETTING}: {path} holds no key (from {source}); {fix}")
    if os.name == "posix" and path.stat().st_mode & 0o077:
        log.warning("%s %s can be read by other users than its owner: chmod 600 it", SETTING, path)
    return BlobCipher(keys)
