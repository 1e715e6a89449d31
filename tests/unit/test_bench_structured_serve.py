"""The pure parts of bench/structured_serve.py: the strict schema it constrains to, which answers
count as the schema's form (cut at max_tokens or finished), and the cost of constraining."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.structured_serve import cost, json_prefix, schema  # noqa: E402


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"answer": "Paris is', True),  # cut at max_tokens, the string still open
        ('  {"answer": "x', True),
        ('{ "answer": "x', True),
        ('{"answer": "done", "topics": []}', True),  # finished: a valid object
        ('{"topics": [], "answer": "late"}', True),
        ('{"topics": ["a"]', False),  # not the schema's order, and unfinished
        ("Paris is the capital", False),
        ('{"answer": 3}', False),
        ("[1, 2]", False),
    ],
)
def test_json_prefix(text, ok):
    assert json_prefix(text) is ok


def test_schema_is_strict_and_forces_a_long_answer():
    fmt = schema(500)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    body = fmt["json_schema"]["schema"]
    assert body["properties"]["answer"]["minLength"] == 500
    assert body["additionalProperties"] is False and body["required"] == ["answer", "topics"]


def test_cost_is_one_minus_the_ratio_of_medians():
    passes = [
        {"constrained": False, "req_s": 2.0, "out_tok_s": 100.0},
        {"constrained": False, "req_s": 4.0, "out_tok_s": 120.0},
        {"constrained": False, "req_s": 3.0, "out_tok_s": 110.0},
        {"constrained": True, "req_s": 3.0, "out_tok_s": 99.0},
        {"constrained": True, "req_s": 2.0, "out_tok_s": 80.0},
        {"constrained": True, "req_s": 1.0, "out_tok_s": 120.0},
    ]
    c = cost(passes)
    assert c["free"] == {"req_s": 3.0, "out_tok_s": 110.0}
    assert c["constrained"] == {"req_s": 2.0, "out_tok_s": 99.0}
    assert c["cost"] == {"req_s": round(1 - 2 / 3, 4), "out_tok_s": 0.1}
    assert c["constrained_min_max"]["out_tok_s"] == (80.0, 120.0)
