"""Shared by the benchmark scripts: data loading (respecting dev/test splits), tables, result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("KVFUSE_DATA", REPO.parent / "shared" / "data"))
# Where results go: docs/bench, or $KVFUSE_BENCH_OUT (scripts/gpu_check.sh: $OUT or docs/bench/gpu).
OUT = Path(os.environ.get("KVFUSE_BENCH_OUT") or REPO / "docs" / "bench")

MUSIQUE_DEV = range(0, 50)  # examples 50-149 are the test split: final numbers only


def drop_page_cache() -> str | None:
    """Drop the page cache (root only); None on success, else why it was not possible."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def musique(split: str = "dev") -> list[dict]:
    """MuSiQue examples of one split (``dev`` = 0-49, ``test`` = 50-149)."""
    rows = json.loads((DATA / "musique_s.json").read_text())
    return rows[:50] if split == "dev" else rows[50:]


def dev_text_tokens(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` token ids of real text: MuSiQue dev documents, concatenated in order."""
    ids: list[int] = []
    for ex in musique("dev"):
        for ctx in ex["ctxs"]:
            ids += tokenizer.encode(ctx["text"] + "\n\n", add_special_tokens=not ids)
            if len(ids) >= n_tokens:
                return ids[:n_tokens]
    raise ValueError(f"the dev split holds fewer than {n_tokens} tokens")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def environment() -> dict:
    import torch

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


def write_json(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path


def plot_path(name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT / f"{name}.png"
