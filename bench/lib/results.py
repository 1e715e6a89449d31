"""Result files and tables: one way to write a run's JSON (with the machine it ran on) and its PNG
under ``docs/bench`` (or ``$KVFUSE_BENCH_OUT``), so that every script's results carry the same
``environment`` record and land where docs/benchmarks.md says."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

from .paths import OUT


def environment() -> dict:
    """Where and when a result was measured: date, versions, cores, threads, the command."""
    import torch

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; None elsewhere): this VM's CPU varies between
    sessions, and a result says which one it ran on."""
    from kvfuse.models.cpu import kernels

    return kernels.cpu_model()


def cpu_features() -> list[str]:
    """The instruction sets that decide which of kvfuse's kernels run and how fast PyTorch's GEMMs
    go (``kernels.LISTED``) that this CPU has."""
    from kvfuse.models.cpu import kernels

    return kernels.listed_features()


def stem(target: str | Path) -> Path:
    """A result's path without its suffix: a name (``"decode"``) lies under ``docs/bench``; a
    path (``Path("/tmp/x/serve")`` or ``"/tmp/x/serve.json"``) is taken as it is, suffix dropped."""
    if isinstance(target, str) and "/" not in target:
        return OUT / target
    p = Path(target)
    return p.with_suffix("") if p.suffix in (".json", ".png") else p


def _with_ext(path: Path, ext: str) -> Path:
    """``path`` with ``ext`` appended: ``with_suffix`` would eat a dotted tag's last part
    (``agents-qwen2.5-1.5b`` -> ``agents-qwen2.5-1.json``)."""
    return path.with_name(path.name + ext)


def output_name(base: str, tag: str | None = None, quick: bool = False) -> str:
    """``base``, ``base-TAG`` with a tag, ``base-quick`` for a smoke run."""
    return f"{base}-{tag}" if tag else f"{base}-quick" if quick else base


def write_json(
    target: str | Path,
    payload: dict,
    *,
    add_environment: bool = True,
    indent: int = 2,
    default=None,
) -> Path:
    """Write ``payload`` to ``<target>.json`` (see ``stem``), with an ``environment`` record first
    unless the payload has one or ``add_environment`` is off; returns the path."""
    path = _with_ext(stem(target), ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if add_environment and "environment" not in payload:
        payload = {"environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=indent, default=default))
    return path


def plot_path(target: str | Path) -> Path:
    """``<target>.png`` (see ``stem``), its folder created."""
    path = _with_ext(stem(target), ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, target: str | Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure to ``<target>.png`` and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = plot_path(target)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
