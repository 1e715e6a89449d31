"""The pure parts of bench/lib: interleaved rounds and their median / min / max, the result
writer, the shared flags, the client's percentile and request body, the metrics helpers."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lib import results  # noqa: E402
from bench.lib.cli import add_common, csv, parser  # noqa: E402
from bench.lib.client import percentile, request_extra  # noqa: E402
from bench.lib.metrics import delta, first_total, metric_total  # noqa: E402
from bench.lib.rounds import feature_cost, interleaved, order, spread, summarize  # noqa: E402


def test_every_candidate_runs_once_per_round_in_order():
    calls = []
    samples = interleaved(
        {"a": lambda r: calls.append(("a", r)) or r, "b": lambda r: calls.append(("b", r)) or -r},
        3,
    )
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert samples == {"a": [0, 1, 2], "b": [0, -1, -2]}


def test_alternate_and_rotate_change_who_goes_first():
    seen = []
    interleaved({k: (lambda r, k=k: seen.append(k)) for k in "xy"}, 4, alternate=True)
    assert seen == list("xyyxxyyx")
    seen.clear()
    interleaved({k: (lambda r, k=k: seen.append(k)) for k in "abc"}, 3, rotate=True)
    assert seen == list("abcbcacab")
    assert order([1, 2, 3], 4, rotate=True) == [2, 3, 1]
    assert order([1, 2], 3, alternate=True) == [2, 1]
    assert order([], 1, rotate=True) == []


def _passes(flag, rows):
    return [{flag: on, "req_s": r, "out_tok_s": t} for on, r, t in rows]


@pytest.mark.parametrize(
    "rows, names, expected",
    [
        (  # odd count: the middle value; cost 1 - on / off of the medians
            [(False, 2.0, 100.0), (False, 4.0, 120.0), (False, 3.0, 110.0),
             (True, 3.0, 99.0), (True, 2.0, 80.0), (True, 1.0, 120.0)],
            ("off", "on"),
            {"off": {"req_s": 3.0, "out_tok_s": 110.0}, "on": {"req_s": 2.0, "out_tok_s": 99.0},
             "off_min_max": {"req_s": (2.0, 4.0), "out_tok_s": (100.0, 120.0)},
             "on_min_max": {"req_s": (1.0, 3.0), "out_tok_s": (80.0, 120.0)},
             "cost": {"req_s": 0.3333, "out_tok_s": 0.1}},
        ),
        (  # even count: the mean of the middle two; faster with the feature: a negative cost
            [(True, 5.0, 50.0), (False, 4.0, 40.0), (False, 2.0, 60.0), (True, 3.0, 70.0)],
            ("free", "constrained"),
            {"free": {"req_s": 3.0, "out_tok_s": 50.0},
             "constrained": {"req_s": 4.0, "out_tok_s": 60.0},
             "free_min_max": {"req_s": (2.0, 4.0), "out_tok_s": (40.0, 60.0)},
             "constrained_min_max": {"req_s": (3.0, 5.0), "out_tok_s": (50.0, 70.0)},
             "cost": {"req_s": -0.3333, "out_tok_s": -0.2}},
        ),
    ],
)  # fmt: skip
def test_feature_cost(rows, names, expected):
    assert feature_cost(_passes("flag", rows), "flag", names) == expected


def test_feature_cost_needs_both_modes():
    with pytest.raises(statistics.StatisticsError):
        feature_cost(_passes("flag", [(False, 1.0, 1.0)]), "flag")


def test_hooks_see_rounds_and_samples():
    events = []
    interleaved(
        {"a": lambda r: r * 10},
        2,
        before_round=lambda r: events.append(("before", r)),
        after_each=lambda name, s: events.append((name, s)),
        after_round=lambda r, samples: events.append(("after", r, list(samples["a"]))),
    )
    assert events == [
        ("before", 0),
        ("a", 0),
        ("after", 0, [0]),
        ("before", 1),
        ("a", 10),
        ("after", 1, [0, 10]),
    ]


def test_spread_is_median_min_max_with_names():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert spread([4, 1, 9], "_tok_s") == {"median_tok_s": 4, "min_tok_s": 1, "max_tok_s": 9}
    assert spread([5], prefix="ttft_") == {"ttft_median": 5, "ttft_min": 5, "ttft_max": 5}
    assert summarize({"x": [1, 2, 3]}, "_ms") == {"x": {"median_ms": 2, "min_ms": 1, "max_ms": 3}}
    with pytest.raises(ValueError):
        spread([])


def test_write_json_adds_the_environment_once(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "OUT", tmp_path / "bench")
    path = results.write_json("demo", {"a": 1})
    assert path == tmp_path / "bench" / "demo.json"
    data = json.loads(path.read_text())
    assert list(data) == ["environment", "a"] and data["a"] == 1
    assert {"date", "python", "cpu_count", "command"} <= set(data["environment"])
    own = results.write_json(tmp_path / "x" / "r.json", {"environment": {"mine": 1}, "b": [1]})
    assert own == tmp_path / "x" / "r.json"
    assert json.loads(own.read_text()) == {"environment": {"mine": 1}, "b": [1]}
    bare = results.write_json(tmp_path / "y" / "s", {"c": 2}, add_environment=False, indent=1)
    assert bare == tmp_path / "y" / "s.json" and json.loads(bare.read_text()) == {"c": 2}


def test_result_names_and_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "OUT", tmp_path)
    assert results.stem("serve") == tmp_path / "serve"
    assert results.stem(Path("/a/b/serve.png")) == Path("/a/b/serve")
    assert results.stem("/a/b/c.v2") == Path("/a/b/c.v2")
    assert results.plot_path("p") == tmp_path / "p.png"
    assert results.output_name("serve") == "serve"
    assert results.output_name("serve", "t1") == "serve-t1"
    assert results.output_name("serve", None, quick=True) == "serve-quick"
    assert results.output_name("serve", "t1", quick=True) == "serve-t1"
    # a dotted tag keeps every part (with_suffix would have cut ".5b")
    assert results.plot_path("agents-qwen2.5-1.5b") == tmp_path / "agents-qwen2.5-1.5b.png"
    dotted = results.write_json("agents-qwen2.5-1.5b", {}, add_environment=False)
    assert dotted == tmp_path / "agents-qwen2.5-1.5b.json"


def test_common_flags_keep_each_scripts_names_and_defaults():
    p = parser("doc", "model", ("runs", {"default": 3}), "clients", "tag")
    add_common(p, ("out", {"type": Path}))
    a = p.parse_args(["--concurrency", "1", "4", "--tag", "x", "--out", "/tmp/o"])
    assert (a.model, a.runs, a.clients, a.tag, a.out) == ("smollm2", 3, [1, 4], "x", Path("/tmp/o"))
    assert csv(" a, b,,c ") == ["a", "b", "c"]


def test_percentile_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert percentile([float(i) for i in range(1, 21)], 0.95) == 19.0


def test_request_extra():
    assert request_extra(True, "s", False) == {"cache_salt": "s"}
    assert request_extra(False, "s", True) == {"cache": False, "ignore_eos": True}
    assert request_extra(True, "s", True, "u1") == {
        "cache_salt": "s",
        "ignore_eos": True,
        "prompt_cache_key": "s/u1",
    }


def test_metric_helpers():
    samples = [
        ("a_total", {"tier": "disk"}, 2.0),
        ("a_total", {"tier": "memory"}, 3.0),
        ("b", {}, 7.0),
    ]
    assert metric_total(samples, "a_total") == 5.0
    assert metric_total(samples, "a_total", tier="disk") == 2.0
    assert first_total(samples, "missing", "b") == 7.0
    assert first_total(samples, "missing") == 0.0
    assert delta(
        {"x": 5.0, "kv_memory_peak_bytes": 9.0}, {"x": 2.0, "kv_memory_peak_bytes": 4.0}
    ) == {
        "x": 3.0,
        "kv_memory_peak_bytes": 9.0,
    }
