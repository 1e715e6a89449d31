"""Reading a key file named by the configuration: ``cache.signing_key_file`` (``signing.py``) and
``cache.encryption_key_file`` (``encryption.py``).

One reader for both so the two files are checked alike: the same errors (cannot read, not text,
a bad line, no key) name the setting, where it came from and the fix, and the same warning is
logged when the file can be read by other users than its owner. What a line must hold differs by
kind of key, so the caller passes its parser. No message shows a key or a line of the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .sections import ConfigError

log = logging.getLogger(__name__)

GENERATE = "openssl rand -hex 32"

K = TypeVar("K")


def read_key_file(
    setting: str,
    path: Path,
    source: str,
    parse: Callable[[str], list[K]],
    line_format: str = "",
) -> list[K]:
    """The keys ``parse`` finds in the file ``path`` (named by ``setting``, set by ``source``).

    ConfigError naming ``setting``, ``path``, ``source`` and the fix when the file cannot be read,
    is not UTF-8, has a line ``parse`` refuses (its ValueError names the line, never its content)
    or holds no key. ``line_format`` (e.g. ``", 64 hex digits"``) is what a line must hold, for
    those messages. A file other users may read is logged as a warning with the fix (chmod 600),
    not refused."""
    fix = f"write a key into it ({GENERATE} > {path}; chmod 600 {path}) or unset {setting}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"{setting}: cannot read {path}: {e.strerror or e} (from {source}); {fix}"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{setting}: {path} is not UTF-8 text (from {source}); one key per line"
            f"{line_format}, e.g. from {GENERATE}"
        ) from None
    try:
        keys = parse(text)
    except ValueError as e:
        raise ConfigError(
            f"{setting}: {path}: {e} (from {source}); each line holds one key{line_format} "
            f"({GENERATE})"
        ) from None
    if not keys:
        raise ConfigError(f"{setting}: {path} holds no key (from {source}); {fix}")
    if os.name == "posix" and path.stat().st_mode & 0o077:
        log.warning("%s %s can be read by other users than its owner: chmod 600 it", setting, path)
    return keys
