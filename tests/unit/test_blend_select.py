"""Blend token selection, as pure functions with tables of cases: budgets and their rounding, ties,
at least one token, sinks, the suffix always included, gradual schedules."""

from __future__ import annotations

import pytest
import torch

from kvfuse.blend import select as sel
from kvfuse.blend.options import BlendOptions


def t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


@pytest.mark.parametrize(
    "n,ratio,expected",
    [
        (100, 0.15, 15),
        (10, 0.15, 2),  # 1.5 rounds half up
        (10, 0.14, 1),
        (10, 0.05, 1),  # 0.5 -> 1, and a positive ratio never rounds to nothing
        (7, 0.01, 1),
        (3, 0.0, 0),
        (0, 0.5, 0),
        (10, 1.0, 10),
        (10, 0.999, 10),
        (33, 0.3, 10),
        (33, 0.31, 10),
        (33, 0.32, 11),
    ],
)
def test_budget_rounding(n, ratio, expected):
    assert sel.budget(n, ratio) == expected


@pytest.mark.parametrize(
    "scores,k,expected",
    [
        (t(1, 5, 3, 5, 2), 2, [1, 3]),
        (t(1, 5, 3, 5, 2), 1, [1]),  # a tie goes to the earlier token
        (t(2, 2, 2, 2), 2, [0, 1]),
        (t(0, 0, 9), 3, [0, 1, 2]),
        (t(3, 1), 0, []),
        (t(), 2, []),
    ],
)
def test_top_k_is_deterministic_and_sorted(scores, k, expected):
    assert sel.top_k(scores, k).tolist() == expected


SPANS = [(0, 4), (4, 7), (7, 12)]  # three documents: 4 + 3 + 5 tokens
DEV = t(9, 1, 1, 1, 8, 1, 1, 7, 6, 1, 1, 1)


@pytest.mark.parametrize(
    "method,ratio,expected",
    [
        ("hkvd", 0.25, [0, 4, 7]),  # 12 * 0.25 = 3: the three largest deviations
        ("hkvd", 0.0, []),
        ("hkvd", 0.01, [0]),  # at least one
        ("hkvd", 1.0, list(range(12))),
        ("sinks", 0.25, [0, 4, 7]),  # the first token of each document
        ("sinks", 0.5, [0, 1, 4, 5, 7, 8]),  # then the second of each
        (
            "sinks",
            0.75,
            [0, 1, 2, 4, 5, 6, 7, 8, 9],
        ),  # the 3-token document runs out: the others go on
        ("sinks+hkvd", 0.5, [0, 1, 4, 5, 7, 8]),  # 2 sinks per document fill the budget of 6 ...
        (
            "sinks+hkvd",
            0.75,
            [0, 1, 2, 3, 4, 5, 6, 7, 8],
        ),  # ... the rest by deviation (all 1s: the earliest)
    ],
)
def test_methods(method, ratio, expected):
    assert sel.select(method, DEV, SPANS, ratio, sink_tokens=2).tolist() == expected


def test_sinks_plus_hkvd_with_more_sinks_than_budget_keeps_the_budget():
    assert sel.select("sinks+hkvd", DEV, SPANS, 0.25, sink_tokens=4).tolist() == [0, 1, 2]


def test_per_head_scores_scale_each_head_to_its_mean():
    # head 0 deviates by 100s, head 1 by 1s: summing would only ever look at head 0
    per_head = torch.tensor([[100.0, 1.0], [200.0, 1.0], [100.0, 9.0], [100.0, 1.0]])
    assert sel.select("hkvd", per_head.sum(dim=1), [(0, 4)], 0.25).tolist() == [1]
    # 9 / 3 beats 200 / 125
    assert sel.select("hkvd-head", per_head, [(0, 4)], 0.25).tolist() == [2]


def test_the_suffix_is_always_included():
    assert sel.with_suffix(torch.tensor([1, 5]), 8, 3).tolist() == [1, 5, 8, 9, 10]
    assert sel.with_suffix(torch.zeros(0, dtype=torch.int64), 4, 2).tolist() == [4, 5]


def test_bad_inputs():
    with pytest.raises(ValueError, match="spans cover"):
        sel.select("hkvd", DEV, [(0, 4)], 0.5)
    with pytest.raises(ValueError, match="unknown"):
        sel.select("random", DEV, SPANS, 0.5)


def test_gradual_schedule_shrinks_to_the_budget():
    assert sel.gradual_ratios(0.15) == pytest.approx([0.3, 0.25, 0.2, 0.15])
    assert sel.gradual_ratios(0.6) == pytest.approx([1.0, 0.8666667, 0.7333333, 0.6])


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": -0.1}, "recompute_ratio"),
        ({"recompute_ratio": True}, "recompute_ratio"),
        ({"method": "random"}, "method"),
        ({"deviation": "q"}, "deviation"),
        ({"document_context": "suffix"}, "document_context"),
        ({"recompute_ratio": "half"}, "recompute_ratio"),
        ({"source": "guess"}, "source"),
        ({"check_layer": -1}, "check_layer"),
        ({"sink_tokens": 1.5}, "sink_tokens"),
    ],
)
def test_options_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        BlendOptions(**bad)


def test_the_identity_names_what_changes_the_kv():
    def opts(**kw) -> BlendOptions:
        return BlendOptions(**{"recompute_ratio": 0.15, **kw})

    a = opts()
    assert a.identity() == opts().identity()
    changed = [
        opts(recompute_ratio=0.3),
        opts(method="sinks"),
        opts(check_layer=2),
        opts(deviation="k"),
        opts(gradual=True),
        opts(sink_tokens=8),
        opts(document_context="none"),
        opts(document_context="prefix"),
        opts(document_context="eos"),
    ]
    assert len({a.identity()} | {b.identity() for b in changed}) == 1 + len(changed)
    assert opts(store_blended=False).identity() == a.identity()  # storing does not change the KV
    assert opts(source="profile").identity() == a.identity()  # nor what decided the budget
    assert (
        BlendOptions(recompute_ratio=0, method="sinks").identity()
        == BlendOptions(recompute_ratio=0).identity()
    )


def test_auto_is_resolved_before_it_names_a_namespace():
    auto = BlendOptions()
    assert auto.auto_budget and not auto.full_reuse and auto.recompute_ratio == "auto"
    with pytest.raises(ValueError, match="resolve"):
        auto.identity()
    assert BlendOptions(recompute_ratio=0.2).with_ratio("auto").auto_budget


def test_a_request_budget_asks_for_a_blend():
    """A number from a request overrides the budget and says so; over a model that does not
    blend (``prefix``), it turns blending back on with the default method."""
    b = BlendOptions(recompute_ratio=0.3, method="sinks", source="profile").with_ratio(0.1)
    assert (b.recompute_ratio, b.method, b.source) == (0.1, "sinks", "request")
    off = BlendOptions(recompute_ratio=1.0, method="prefix", source="profile")
    assert not off.blends
    on = off.with_ratio(0.2)
    assert on.blends and on.method == "hkvd" and on.source == "request"
    assert off.with_ratio(None) is off
