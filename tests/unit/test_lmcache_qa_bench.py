"""The pure parts of bench/lmcache_qa.py: the quantile rule, the TTFT figures from the vendored
script's request rows, and the "met" of issue 48's multi-round QA targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lmcache_qa import SCRIPT, met, quantile, ttft_figures  # noqa: E402


@pytest.mark.parametrize(
    "values, q, want",
    [
        ([3.0], 0.95, 3.0),
        ([1.0, 2.0], 0.5, 1.5),
        ([4.0, 1.0, 3.0, 2.0], 0.5, 2.5),  # unsorted in
        ([0.0, 10.0, 20.0, 30.0, 40.0], 0.95, 38.0),  # numpy's linear rule
        ([5.0, 1.0], 0.0, 1.0),
        ([5.0, 1.0], 1.0, 5.0),
    ],
)
def test_quantile_interpolates_between_order_statistics(values, q, want):
    assert quantile(values, q) == pytest.approx(want)


def test_quantile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        quantile([], 0.5)


def _row(ttft: float, question: int, tokens: int = 64) -> dict:
    # as csv.DictReader gives them: strings
    return {"ttft": str(ttft), "question_id": str(question), "generation_tokens": str(tokens)}


def test_ttft_figures_split_the_first_round_from_the_later_ones():
    rows = [_row(2.0, 1), _row(4.0, 1), _row(0.5, 2), _row(0.3, 3), _row(9.0, 2, tokens=0)]
    f = ttft_figures(rows)
    assert f["requests"] == 4 and f["without_tokens"] == 1  # no first token: left out, counted
    assert f["mean"] == pytest.approx((2.0 + 4.0 + 0.5 + 0.3) / 4)
    assert f["first_round"] == pytest.approx(3.0)
    assert f["later_rounds"] == pytest.approx(0.4)
    assert f["p50"] == pytest.approx(1.25)


def test_ttft_figures_of_one_round_have_no_later_rounds():
    f = ttft_figures([_row(1.0, 1)])
    assert f["later_rounds"] is None and f["first_round"] == 1.0


def _server(mean, p95, first, later) -> dict:
    vals = {"mean": mean, "p95": p95, "first_round": first, "later_rounds": later}
    return {k: {"median_s": v} for k, v in vals.items()}


def test_met_follows_the_issue_targets():
    rows = {
        "kvfuse": _server(0.35, 1.0, 1.9, 0.21),
        "vllm": _server(0.70, 2.01, 1.94, 0.20),
        "llama.cpp": _server(8.0, 12.0, 9.0, 7.0),
    }
    assert met(rows) == {
        "mean_vs_vllm": True,  # 0.35 <= 0.5 x 0.70
        "p95_vs_vllm": True,  # 1.0 <= 1.005
        "mean_vs_llama.cpp": True,
        "p95_vs_llama.cpp": True,
        "first_round_vs_vllm": True,
        "later_rounds_vs_vllm": False,  # 0.21 > 0.20
    }


def test_met_leaves_out_peers_that_did_not_run():
    assert met({"kvfuse": _server(1, 1, 1, 1)}) == {}
    assert set(met({"kvfuse": _server(1, 1, 1, 1), "llama.cpp": _server(9, 9, 9, 9)})) == {
        "mean_vs_llama.cpp",
        "p95_vs_llama.cpp",
    }


def test_the_vendored_script_sends_ignore_eos_once():
    text = SCRIPT.read_text()
    assert text.count('extra_body={"ignore_eos": True}') == 1
    assert "def main():" in text and "from utils import AsyncLoopWrapper" in text
