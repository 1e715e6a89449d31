"""Where things are: the repository, the data sets, the results, the baselines' venvs and builds."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("KVFUSE_DATA", REPO.parent / "shared" / "data"))
# Where results go: docs/bench, or $KVFUSE_BENCH_OUT (scripts/gpu_check.sh: $OUT or docs/bench/gpu).
OUT = Path(os.environ.get("KVFUSE_BENCH_OUT") or REPO / "docs" / "bench")
# The baselines live outside kvfuse's environment (bench/setup_*.sh): git-ignored, per checkout.
BASELINES = REPO / ".baselines"

MUSIQUE_DEV = range(0, 50)  # examples 50-149 are the test split: final numbers only


def default_home() -> Path:
    """kvfuse's home as the CLI resolves it: ``$KVFUSE_HOME`` or ``~/.cache/kvfuse``."""
    return Path(os.environ.get("KVFUSE_HOME") or Path.home() / ".cache" / "kvfuse")


def model_folder(home: str | Path | None = None, model: str = "smollm2") -> Path:
    """The HF-style folder kvfuse converted ``model`` into (``<home>/models/<model>``): the very same
    weights, tokenizer and chat template kvfuse serves (vLLM serves it too)."""
    return Path(home or default_home()) / "models" / model
