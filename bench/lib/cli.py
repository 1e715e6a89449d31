"""The flags most benchmark scripts share, defined once: ``add_common(p, "model", "home", ...)``.

Each script keeps its own flag names and defaults (``--runs`` or ``--rounds``, a tag that is a
suffix or a ``-TAG``), which scripts/gpu_check.sh and docs/benchmarks.md rely on; a spec is a
name from ``FLAGS`` or ``(name, {overrides})`` for another default or help text."""

from __future__ import annotations

import argparse
import os
from typing import Any

FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "model": (("--model",), {"default": "smollm2", "help": "built-in model (default smollm2)"}),
    "models": (("--models",), {"default": "smollm2", "help": "built-in models, comma-separated"}),
    "home": (
        ("--home",),
        {"default": None, "help": "kvfuse home (default: $KVFUSE_HOME or ~/.cache/kvfuse)"},
    ),
    "rounds": (("--rounds",), {"type": int, "default": 5, "help": "interleaved rounds"}),
    "runs": (("--runs",), {"type": int, "default": 5, "help": "interleaved rounds"}),
    "repeats": (("--repeats",), {"type": int, "default": 5, "help": "repetitions (medians)"}),
    "clients": (
        ("--clients", "--concurrency"),
        {"dest": "clients", "type": int, "nargs": "+", "help": "concurrent client counts"},
    ),
    "threads": (("--threads",), {"type": int, "default": 2, "help": "CPU threads"}),
    "split": (
        ("--split",),
        {"choices": ("dev", "test"), "default": "dev", "help": "data split (test: final numbers)"},
    ),
    "device": (("--device",), {"default": "cpu", "help": "cpu, or cuda / cuda:N"}),
    "quick": (("--quick",), {"action": "store_true", "help": "smoke run of the plumbing"}),
    "tag": (("--tag",), {"default": None, "help": "output name NAME-TAG.{json,png}"}),
    "out": (("--out",), {"default": None, "help": "output path without suffix"}),
}


def add_common(p: argparse.ArgumentParser, *specs: str | tuple[str, dict[str, Any]]) -> None:
    """Add the named common flags to ``p``, each with the overrides given beside its name."""
    for spec in specs:
        name, over = (spec, {}) if isinstance(spec, str) else spec
        flags, kw = FLAGS[name]
        p.add_argument(*flags, **{**kw, **over})


def parser(doc: str | None, *specs: str | tuple[str, dict[str, Any]]) -> argparse.ArgumentParser:
    """A parser whose description is the script's docstring (kept verbatim), with common flags."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(p, *specs)
    return p


def csv(text: str) -> list[str]:
    """A comma-separated flag value as a list, blanks dropped."""
    return [s.strip() for s in text.split(",") if s.strip()]


def cores() -> int:
    return os.cpu_count() or 1
