"""The pure parts of bench/multiround.py: the seeded workload, the percentile rule behind the
early stop, and the score (the largest load whose p95 TTFT stays within the bound)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.multiround import (  # noqa: E402
    build_workload,
    comparison,
    opening,
    p95_cannot_pass,
    passes,
    percentile,
    score,
    split_conversation,
    system_prompt,
)


def conversations(n: int = 12, turns: int = 6) -> list[tuple[str, list[tuple[str, str]]]]:
    return [
        (
            f"c{i}",
            [
                (f"question {i}.{t} " + "x" * (40 * (t + 1)), f"answer {i}.{t} " + "y" * 300)
                for t in range(turns)
            ],
        )
        for i in range(n)
    ]


def test_workload_is_deterministic_for_a_seed():
    convs = conversations()
    a = build_workload(convs, "SYS", 4, 3, 64, 4.0, 1.0, 600, 500, seed=7)
    b = build_workload(convs, "SYS", 4, 3, 64, 4.0, 1.0, 600, 500, seed=7)
    c = build_workload(convs, "SYS", 4, 3, 64, 4.0, 1.0, 600, 500, seed=8)
    assert a == b
    assert a != c
    assert a.load == 12
    assert [u.start_s for u in a.users] == [0.0, 1.0, 2.0, 3.0]
    for u in a.users:
        assert len(u.questions) == 3 and len(u.think_s) == 2
        assert all(0 <= t <= 12.0 for t in u.think_s)  # capped at 3x the mean


def test_larger_loads_contain_the_smaller_ones():
    convs = conversations()
    small = build_workload(convs, "SYS", 2, 3, 64, 4.0, 1.0, 600, 500, seed=0)
    large = build_workload(convs, "SYS", 6, 3, 64, 4.0, 1.0, 600, 500, seed=0)
    assert large.users[:2] == small.users


def test_split_conversation_prior_then_questions():
    pairs = [("q0", "a" * 100), ("q1", "b" * 100), ("q2", "c"), ("q3", "d"), ("q4", "e")]
    prior, qs = split_conversation(
        pairs, rounds=2, prior_chars=150, message_chars=2000, question_chars=600
    )
    assert prior == (("q0", "a" * 100), ("q1", "b" * 100))  # added while under 150 characters
    assert qs == ("q2", "q3")
    assert (
        split_conversation(pairs, rounds=4, prior_chars=150, message_chars=2000, question_chars=600)
        is None
    )
    prior, qs = split_conversation(
        pairs, rounds=2, prior_chars=0, message_chars=2000, question_chars=600
    )
    assert prior == () and qs == ("q0", "q1")


def test_opening_is_system_then_earlier_exchanges():
    wl = build_workload(conversations(), "SYS", 1, 2, 16, 0.0, 0.0, 600, 100, seed=0)
    msgs = opening(wl, wl.users[0])
    assert msgs[0] == {"role": "system", "content": "SYS"}
    assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * len(wl.users[0].prior)
    assert wl.users[0].think_s == (0.0,)


def test_too_few_conversations_is_an_error():
    with pytest.raises(ValueError):
        build_workload(conversations(n=3), "SYS", 4, 3, 64, 4.0, 1.0, 600, 500, seed=0)


def test_system_prompt_from_documents():
    examples = [{"ctxs": [{"text": "one two three"}, {"text": "four five"}]}]
    assert system_prompt(4, examples).endswith("one two three four")
    with pytest.raises(ValueError):
        system_prompt(10, examples)


def test_percentile_and_the_early_stop_rule():
    # 20 values: p95 is the value at index round(0.95 * 19) = 18
    xs = [float(i) for i in range(1, 21)]
    assert percentile(xs, 0.95) == 19.0
    assert percentile(xs, 0.5) == 11.0  # index round(9.5) = 10 (banker's rounding)
    # p95 of 20 requests passes with one request over the bound, not two
    assert not p95_cannot_pass(1, 20)
    assert p95_cannot_pass(2, 20)
    assert p95_cannot_pass(1, 8)  # 8 requests: p95 is the maximum
    for n in range(1, 60):
        for over in range(n + 1):
            values = [1.0] * (n - over) + [5.0] * over
            assert p95_cannot_pass(over, n) == (percentile(values, 0.95) > 2.0)


def point(
    series: str, users: int, p95: float | None, rounds: int = 4, requests: int | None = None
) -> dict:
    planned = users * rounds
    return {
        "series": series,
        "users": users,
        "rounds": rounds,
        "load": planned,
        "planned": planned,
        "requests": planned if requests is None else requests,
        "errors": 0,
        "ttft_p95_s": p95,
    }


def test_score_is_the_largest_load_with_every_smaller_one_passing():
    pts = [point("x", 2, 0.5), point("x", 4, 1.2), point("x", 8, 2.5), point("x", 16, 1.0)]
    s = score(pts, 2.0)
    assert (s["load"], s["users"], s["rounds"], s["first_fail"]) == (16, 4, 4, 32)
    assert score([point("x", 2, 2.5)], 2.0)["load"] is None
    assert score([point("x", 2, 2.0)], 2.0)["load"] == 8  # the bound itself passes
    # a run that did not serve every planned request fails whatever its p95
    assert not passes(point("x", 4, 0.5, requests=15), 2.0)
    # a load measured twice passes on its majority; a tie fails
    assert score([point("x", 2, 0.5), point("x", 4, 1.0), point("x", 4, 3.0)], 2.0)["load"] == 8


def test_comparison_at_vllms_largest_passing_load():
    series = {
        "kvfuse-on": [
            point("kvfuse-on", 2, 0.2),
            point("kvfuse-on", 4, 0.3),
            point("kvfuse-on", 8, 0.6),
        ],
        "vllm": [point("vllm", 2, 0.4), point("vllm", 4, 1.5), point("vllm", 8, 4.0)],
    }
    c = comparison(series, 2.0)
    assert c["scores"]["kvfuse-on"]["load"] == 32 and c["scores"]["vllm"]["load"] == 16
    assert c["reference_load"] == 16
    assert c["p95_at_reference_s"] == {"kvfuse-on": 0.3, "vllm": 1.5}
    assert c["vllm_over_kvfuse_p95"] == 5.0
    assert c["target"] == {"kvfuse_serves_more": True, "p95_3x_lower": True, "met": True}
    # vLLM passing nothing: compared at its smallest load
    c = comparison(
        {"kvfuse-on": [point("kvfuse-on", 2, 1.0)], "vllm": [point("vllm", 2, 2.5)]}, 2.0
    )
    assert c["reference_load"] == 8 and c["vllm_over_kvfuse_p95"] == 2.5
    assert c["target"]["kvfuse_serves_more"] and not c["target"]["met"]
