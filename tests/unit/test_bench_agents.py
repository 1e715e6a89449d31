"""bench/agents.py's pure parts: per-turn TTFT, cache shares, run summaries, the targets, the
per-turn tool-call checks, and the agent's inputs (bench/lib/agent_setup.py), on synthetic data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lib import agent_setup as setup  # noqa: E402


def load_agents():
    spec = importlib.util.spec_from_file_location("bench_agents", REPO / "bench" / "agents.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


agents = load_agents()


def call(turn, ttft, prompt, cached, out=10, dur=1.0, user=0, kind="text"):
    return {
        "turn": turn,
        "user": user,
        "kind": kind,
        "ttft_s": ttft,
        "duration_s": dur,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": out,
    }


CALLS = [
    call(1, 1.0, 3000, 0),
    call(1, 0.2, 3400, 3000),
    call(2, 0.1, 3600, 3500, kind="tool"),
    call(2, 0.3, 4000, 3500),
    call(3, None, 4200, 4100),  # no streamed token: no TTFT sample
]


def test_ttft_by_turn_pools_users_and_skips_missing_samples():
    got = agents.ttft_by_turn(CALLS)
    assert sorted(got) == [1, 2]
    assert got[1]["n"] == 2 and got[1]["p95"] == pytest.approx(1000.0)
    assert got[2]["p50"] in (pytest.approx(100.0), pytest.approx(300.0))


@pytest.mark.parametrize(
    "from_turn, expected",
    [(2, (3500 + 3500 + 4100) / (3600 + 4000 + 4200)), (1, 14100 / 18200), (4, None)],
)
def test_cache_share(from_turn, expected):
    got = agents.cache_share(CALLS, from_turn)
    assert got == (None if expected is None else pytest.approx(expected))


def test_cache_share_ignores_calls_without_usage():
    assert agents.cache_share([call(2, 0.1, None, 0), call(2, 0.1, 100, 50)]) == 0.5


def run(calls, turns=None, errors=()):
    return {"calls": calls, "turns": turns or [], "errors": list(errors), "wall_s": 1.0}


def test_run_summary():
    turns = [
        {"turn": 1, "user": 0, "tool_calls": 1, "valid_calls": 1, "answered": True},
        {"turn": 2, "user": 0, "tool_calls": 2, "valid_calls": 1, "answered": False},
    ]
    s = agents.run_summary(run(CALLS, turns, ["user 0 turn 3: boom"]))
    assert s["tool_calls"] == 3 and s["valid_calls"] == 2
    assert s["answered_turns"] == 1 and s["turns"] == 3 and s["errors"] == 1
    assert s["tokens_per_s"] == pytest.approx(50 / 5.0)
    assert s["ttft_p50_ms_turn1"] in (pytest.approx(200.0), pytest.approx(1000.0))
    assert "ttft_p50_ms_turn3" not in s
    assert s["ttft_p50_ms_from_turn2"] in (pytest.approx(100.0), pytest.approx(300.0))
    assert s["ttft_p50_ms_tool_calls_from_turn2"] == pytest.approx(100.0)
    assert s["ttft_p50_ms_answers_from_turn2"] == pytest.approx(300.0)


def test_run_summary_of_a_failed_run_has_no_rates():
    s = agents.run_summary(run([], [], ["user 0 turn 1: HTTP 400"]))
    assert s["tokens_per_s"] is None and s["cache_share_from_turn2"] is None
    assert s["turns"] == 1 and s["answered_turns"] == 0


def test_aggregate_is_median_min_max_over_rounds():
    agg = agents.aggregate([{"x": 1.0, "y": None}, {"x": 5.0}, {"x": 2.0, "y": 7.0}])
    assert agg["x"] == {"median": 2.0, "min": 1.0, "max": 5.0}
    assert agg["y"] == {"median": 7.0, "min": 7.0, "max": 7.0}


def summary(share, ttft):
    return {
        "cache_share_from_turn2": {"median": share, "min": share, "max": share},
        "ttft_p50_ms_from_turn2": {"median": ttft, "min": ttft, "max": ttft},
    }


@pytest.mark.parametrize(
    "on, off, met",
    [
        ((0.95, 100.0), (0.0, 600.0), [True, True]),
        ((0.95, 100.0), (0.0, 450.0), [True, False]),  # 4.5x: not enough
        ((0.85, 100.0), (0.0, 900.0), [False, True]),
        ((0.90, 100.0), (0.0, 500.0), [True, True]),  # both goals inclusive
    ],
)
def test_targets(on, off, met):
    checks = agents.targets({"kvfuse-on": summary(*on), "kvfuse-off": summary(*off)})
    assert [c["met"] for c in checks] == met
    assert checks[1]["value"] == pytest.approx(off[1] / on[1])


def test_targets_not_measured_are_none_and_anthropic_is_checked():
    checks = agents.targets({"kvfuse-on": summary(0.99, 50.0), "kvfuse-anthropic": {}})
    assert [c["met"] for c in checks] == [True, None, None]


def test_targets_with_nothing_measured():
    assert [c["met"] for c in agents.targets({})] == [None]


def messages(*specs):
    from langchain_core.messages import AIMessage, ToolMessage

    out = []
    for kind, payload in specs:
        if kind == "call":
            name, args, i = payload
            out.append(AIMessage("", tool_calls=[{"name": name, "args": args, "id": i}]))
        elif kind == "result":
            i, status = payload
            out.append(ToolMessage("r", tool_call_id=i, status=status))
        else:
            out.append(AIMessage(payload))
    return out


@pytest.mark.parametrize(
    "specs, calls, valid, answered",
    [
        (
            [("call", ("search_documents", {"query": "x"}, "a")), ("result", ("a", "success"))]
            + [("text", "Paris.")],
            1,
            1,
            True,
        ),
        (  # unknown key: invalid against the schema, but run and answered
            [("call", ("search_documents", {"q": "x"}, "a")), ("result", ("a", "success"))]
            + [("text", "Paris.")],
            1,
            0,
            True,
        ),
        (  # a tool error: not answered
            [("call", ("calculator", {"expression": "1+"}, "a")), ("result", ("a", "error"))]
            + [("text", "Sorry.")],
            1,
            1,
            False,
        ),
        ([("text", "Paris.")], 0, 0, False),  # no tool call at all
        (  # the turn ended on a tool call
            [("call", ("list_notes", {}, "a")), ("result", ("a", "success"))]
            + [("call", ("no_such_tool", {}, "b"))],
            2,
            1,
            False,
        ),
    ],
)
def test_check_turn(specs, calls, valid, answered):
    got = agents.check_turn(messages(*specs), setup.SCHEMAS)
    assert (got["tool_calls"], got["valid_calls"], got["answered"]) == (calls, valid, answered)


def test_call_record_reads_langchain_usage():
    usage = {"input_tokens": 3000, "output_tokens": 12, "input_token_details": {"cache_read": 2900}}
    r = agents.call_record({"turn": 2, "user": 1, "t0": 10.0, "first": 10.25}, 11.0, usage, "tool")
    assert r["kind"] == "tool"
    assert r["ttft_s"] == pytest.approx(0.25) and r["duration_s"] == pytest.approx(1.0)
    assert (r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"]) == (3000, 2900, 12)
    assert agents.call_record({"turn": 1, "user": 0, "t0": 0.0}, 1.0, None)["ttft_s"] is None


def test_system_prompt_is_long_and_names_every_tool():
    text = setup.system_prompt("Session s")
    assert text.startswith("Session s")
    assert len(text.split()) >= 1500  # ~2,100 Qwen2.5 tokens
    assert all(name in text for name, *_ in setup.TOOL_SPECS)
    assert len(setup.TOOL_SPECS) == 10


def test_retrieve_ranks_by_shared_words_and_clamps_k():
    passages = [{"text": "apples are red"}, {"text": "paris is the capital of france"}]
    assert setup.retrieve(passages, "capital of France", k=1).startswith("[passage 1] paris")
    assert setup.retrieve(passages, "x", k=9).count("[passage") == 2


@pytest.mark.parametrize(
    "expr, out",
    [("(1969 - 1901) * 2", "136"), ("2 ** 10", "1024"), ("1/0", "error"), ("__import__", "error")],
)
def test_calculate_is_arithmetic_only(expr, out):
    assert setup.calculate(expr).startswith(out)


def test_convert_and_users():
    assert setup.convert(1.0, "mi", "km") == "1.609 km"
    assert setup.convert(1.0, "kg", "km").startswith("error")
    examples = [{"question": f"q{i}"} for i in range(5)]
    assert setup.user_questions(examples, 2, 3) == [["q0", "q1", "q2"], ["q3", "q4", "q0"]]
