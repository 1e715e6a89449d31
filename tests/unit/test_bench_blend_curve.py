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


def test_series_groups_configurations_by_name_and_sorts_by_budget():
    from bench.blend_curve import series

    rows = {
        "full prefill": {"x": 0},
        "full reuse": {"x": 1},
        "hkvd 0.3": {"x": 3},
        "hkvd 0.06": {"x": 2},
        "sinks method=sinks document_context=eos 0.15": {"x": 5},
        "sinks method=sinks document_context=eos 0.06": {"x": 4},
        "auto": {"x": 9},
    }
    got = series(rows)
    assert list(got) == ["hkvd", "sinks method=sinks document_context=eos"]
    assert got["hkvd"] == [(0.06, {"x": 2}), (0.3, {"x": 3})]
    assert [b for b, _ in got["sinks method=sinks document_context=eos"]] == [0.06, 0.15]
