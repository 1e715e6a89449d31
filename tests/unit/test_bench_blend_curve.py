"""bench/blend_curve.py's progress line reads ``measure``'s progress as it is passed now (a
``Progress``): the bench had kept the callback's earlier three-argument form and failed after
its first item."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.blend_curve import progress_line  # noqa: E402
from kvfuse.calibration.measure import Progress  # noqa: E402


def test_progress_line_reads_a_progress(capsys):
    progress_line("qwen2.5-0.5b")(Progress(3, 16, 42.4, 5, 6))
    assert capsys.readouterr().out == "  qwen2.5-0.5b: 3/16 items (42s)\n"
