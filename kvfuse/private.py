"""Files and folders only their owner can read: what kvfuse writes at rest.

Why: entries carry token ids (a prompt, re-tokenized), history records hold conversations' ids
and the Responses SQLite their text; a file created 0644 in a folder created 0755 lets every
local user read them. Everything kvfuse creates under its folders (the disk tier, the history
records, the Responses store, profiles) is made 0600, every folder 0700 (docs/deploy.md, "What is
stored at rest").

Modes are given at creation (``os.open(..., 0o600)``, ``mkdir(0o700)``): a umask can only take
bits away from them, never add some, so a permissive umask does not widen them. A folder made
here is ``chmod``-ed to exactly 0700 after ``mkdir`` (a strict umask such as 0o277 would leave
one its owner cannot enter). Existing files and folders are left as they are: a deployment that
shares a folder between users on purpose keeps doing so.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_dirs(path: str | os.PathLike) -> None:
    """``mkdir -p`` with every folder it creates 0700 (existing ones are not touched)."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            continue
        os.chmod(folder, DIR_MODE)


def touch(path: str | os.PathLike) -> None:
    """Create ``path`` empty and 0600 if it does not exist yet (e.g. an SQLite database and its
    ``-wal``/``-shm`` files, before SQLite creates them with its own 0644 default)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    except FileExistsError:
        pass


def write_new(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` into the new file ``path`` (0600; FileExistsError if it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
