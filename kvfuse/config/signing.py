"""The signing keys of a configuration: ``cache.signing_key``, ``cache.signing_keys`` or
``cache.signing_key_file``, turned into the ``EntrySigner`` the store signs and checks with.

A module of its own because it holds secrets: the rules that keep keys out of error messages
(``SECRET_SETTINGS``: ``load`` never echoes their values) live here. The key file is read and
checked by ``key_files.read_key_file``, as the encryption key file is.
``validate`` calls ``signer_of`` so that a bad key is a ConfigError when the configuration is
loaded; ``runtime.open_store`` calls it again to build the signer it hands the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvfuse.kv.signing import MIN_KEY_BYTES, EntrySigner, parse_key_lines

from .key_files import GENERATE, read_key_file
from .sections import CacheConfig, ConfigError

SECRET_SETTINGS = frozenset({"cache.signing_key", "cache.signing_keys"})


def signer_of(cache: CacheConfig, sources: Mapping[str, str] | None = None) -> EntrySigner | None:
    """The signer of ``cache``'s keys, or None when signing is off (no key given); ConfigError
    naming the setting, where it came from and the fix: several ways at once, a key file that is
    missing or holds no key, a key shorter than ``MIN_KEY_BYTES``. No message shows a key."""
    sources = sources or {}
    given = [
        name
        for name, value in (
            ("cache.signing_key", cache.signing_key),
            ("cache.signing_keys", cache.signing_keys),
            ("cache.signing_key_file", cache.signing_key_file),
        )
        if value
    ]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)}: give the signing keys one way, not several "
            f"(set by {', '.join(_source(sources, n) for n in given)}); a list or a key file holds "
            f"several keys (the first signs)"
        )
    name = given[0]
    if name == "cache.signing_key_file":
        path = Path(cache.signing_key_file).expanduser()
        keys = read_key_file(name, path, _source(sources, name), parse_key_lines)
    else:
        keys = [cache.signing_key] if name == "cache.signing_key" else list(cache.signing_keys)
    encoded = [k.encode("utf-8") for k in keys]
    for i, k in enumerate(encoded):
        if len(k) < MIN_KEY_BYTES:
            which = "the key" if len(encoded) == 1 else f"key number {i + 1}"
            raise ConfigError(
                f"{name}: {which} is {len(k)} bytes; a signing key needs at least {MIN_KEY_BYTES} "
                f"(from {_source(sources, name)}); generate one with: {GENERATE}"
            )
    return EntrySigner(encoded)


def _source(sources: Mapping[str, str], name: str) -> str:
    return sources.get(name, "the configuration")
