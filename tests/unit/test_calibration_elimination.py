"""Early elimination in ``kvfuse calibrate``: a setting that can no longer reach the answers
target stops running, and measuring stops when none is left, without changing the choice; and
the progress lines shown when stderr is not a terminal. Pure: ``measure``'s model calls are
replaced by a table of outcomes, no model is loaded."""

from __future__ import annotations

import io
import itertools
import random
import re

import pytest

from kvfuse.calibration import measure as measure_mod
from kvfuse.calibration import options
from kvfuse.calibration.choose import Targets, choose
from kvfuse.calibration.interval import Kept, best_lower, can_reach, needed_items, wilson
from kvfuse.calibration.measure import Progress, Tally, configurations, eliminate, measure


@pytest.mark.parametrize(
    "kept,n,left,target,reach",
    [
        (0, 0, 51, 0.95, False),  # 51 items at most, all kept: 0.9496 < 0.95
        (0, 0, 52, 0.95, True),  # needed_items(0.95) = 52
        (10, 10, 42, 0.95, True),
        (10, 10, 41, 0.95, False),
        (9, 10, 144, 0.95, True),  # one lost: 153 of 154 reaches 0.971
        (7, 10, 144, 0.95, True),  # three lost: 151 of 154 reaches 0.952
        (6, 10, 144, 0.95, False),  # four lost: 150 of 154 at best, 0.943
        (7, 10, 137, 0.95, True),  # three lost need 147 full-prefill-correct items in all
        (7, 10, 136, 0.95, False),
        (6, 10, 1000, 0.95, True),  # with enough items left, four losses can still pass
        (17, 24, 0, 0.5, True),  # nothing left: the bound as it stands (0.541)
        (17, 24, 0, 0.6, False),
        (5, 5, 0, 0.0, True),  # a target of 0 is always reached
    ],
)
def test_can_reach(kept, n, left, target, reach):
    assert can_reach(kept, n, left, target) is reach


def test_needed_items_is_where_an_empty_tally_can_reach():
    for target in (0.8, 0.9, 0.95, 0.98):
        need = needed_items(target)
        assert can_reach(0, 0, need, target) and not can_reach(0, 0, need - 1, target)


def test_can_reach_matches_every_ending():
    """Exact: a tally can reach the target iff some ending (``a`` of ``b`` more full-prefill-correct
    items kept, ``a <= b <= left``) gives a lower bound >= the target."""
    for kept, lost, left in itertools.product(range(6), range(4), range(12)):
        n = kept + lost
        endings = [wilson(kept + a, n + b)[0] for b in range(left + 1) for a in range(b + 1)]
        for target in (0.3, 0.5, 0.7, 0.8):
            assert can_reach(kept, n, left, target) is (max(endings) >= target)
            assert best_lower(kept, n, left) == pytest.approx(max(endings))


def test_can_reach_refuses_a_negative_count():
    with pytest.raises(ValueError):
        can_reach(1, 2, -1, 0.9)


def test_eliminate_marks_settings_that_cannot_reach():
    tallies = {
        "full prefill": Tally(hits=[True, True, True, False]),
        "a": Tally(hits=[True, True, True, False]),  # kept 3 of 3
        "b": Tally(hits=[False, False, True, True]),  # kept 1 of 3 (one gained, not counted)
        "c": Tally(hits=[False, False, False, False], eliminated_after=2),  # already out
    }
    assert eliminate(tallies, ["a", "b", "c"], 10, 0.8, 0.95) == ["b"]
    assert tallies["b"].eliminated_after == 4 and tallies["a"].eliminated_after is None
    assert tallies["c"].eliminated_after == 2


class _Outcomes:
    """``measure``'s model calls replaced by a table: per item, full prefill's correctness and
    each setting's; counts the setting runs."""

    def __init__(self, full: list[bool], settings: dict[str, list[bool]], kl: dict[str, float]):
        self.full, self.settings, self.kl, self.runs = full, settings, kl, 0

    def reference(self, engine, prompt, params, it, tally):
        measure_mod._record(tally, self.full[it], 1.0)
        tally.nll.append(0.5)
        return "", [1], None

    def setting(self, engine, prompt, params, it, opts, reference, tally):
        self.runs += 1
        name = next(k for k, o in engine.items() if o == opts)
        measure_mod._record(tally, self.settings.get(name, [True] * len(self.full))[it], 0.5)
        tally.kl.append(self.kl.get(name, 1.0))
        tally.nll.append(0.6)


@pytest.fixture
def outcomes(monkeypatch):
    """Install a ``_Outcomes`` table into ``measure`` (items are the indexes 0..n-1)."""

    def install(full, settings, kl):
        table = _Outcomes(full, settings, kl)
        monkeypatch.setattr(measure_mod, "_reference", table.reference)
        monkeypatch.setattr(measure_mod, "_setting", table.setting)
        monkeypatch.setattr(measure_mod, "item_prompt", lambda prompts, it, chat: it)
        monkeypatch.setattr(measure_mod.PromptBuilder, "for_model", staticmethod(lambda m: None))
        return table

    return install


class _Engine(dict):
    """The configurations as the fake engine (``_Outcomes.setting`` finds a setting's name)."""

    model = None


def _grid():
    return configurations(["hkvd"], [0.1, 0.3, 0.6])


def test_elimination_gives_the_full_runs_choice(outcomes):
    """On random outcome tables, the choice with elimination is the full run's, with the same
    row; surviving settings and full reuse have every item's figures; less work is done."""
    rng, grid, targets = random.Random(7), _grid(), Targets(accuracy=0.8)
    saved = 0
    for _ in range(150):
        items = rng.randint(1, 40)
        full = [rng.random() < 0.7 for _ in range(items)]
        keep = {n: rng.choice((0.8, 0.95, 1.0)) for n in grid}
        settings = {n: [rng.random() < keep[n] for _ in range(items)] for n in grid}
        kl = {n: rng.choice((0.1, 0.4, 0.7)) for n in grid}
        reports = []
        for target in (None, targets.accuracy):
            table = outcomes(full, settings, kl)
            reports.append(
                (measure(_Engine(grid), list(range(items)), grid, chat=False, target=target), table)
            )
        (whole, all_runs), (fast, runs) = reports
        a, b = choose(whole.measurements(), targets), choose(fast.measurements(), targets)
        assert (a.method, a.ratio, a.row) == (b.method, b.ratio, b.row)
        for name, t in fast.tallies.items():
            if t.eliminated_after is None:
                assert t.hits == whole.tallies[name].hits[: fast.items]
            else:
                assert len(t.hits) == t.eliminated_after >= 1
        assert len(fast.tallies["full reuse"].hits) == fast.items
        if fast.stopped_after is None:
            assert fast.items == items
        assert runs.runs <= all_runs.runs
        saved += all_runs.runs - runs.runs
    assert saved > 0


def test_measuring_stops_when_every_setting_is_eliminated(outcomes):
    grid = _grid()
    full = [True] * 30
    lose_early = {n: [False] * 30 for n in grid if n != "full reuse"}
    table = outcomes(full, lose_early, {})
    seen = []
    report = measure(
        _Engine(grid), list(range(30)), grid, chat=False, progress=seen.append, target=0.8
    )
    # 0 of 2 kept, 28 left: 28 of 30 at best, 0.817 >= 0.8; 0 of 3: 27 of 30 at best, 0.774
    assert (report.items, report.planned, report.stopped_after) == (3, 30, 3)
    assert all(report.tallies[n].eliminated_after == 3 for n in lose_early)
    assert table.runs == 3 * len(grid) and report.runs() == (3 * len(grid), 30 * len(grid))
    assert seen[-1] == Progress(3, 30, seen[-1].elapsed_s, 0, 3)
    rows = {r["config"]: r for r in report.rows()}
    assert rows["hkvd 0.1"]["items"] == 3 and rows["hkvd 0.1"]["eliminated_after"] == 3
    assert "eliminated_after" not in rows["full reuse"] and rows["full prefill"]["items"] == 3
    # without a target, every item
    outcomes(full, lose_early, {})
    assert measure(_Engine(grid), list(range(30)), grid, chat=False).stopped_after is None


def test_an_eliminated_setting_is_measured_against_the_same_items(outcomes):
    """Its KL fraction and TTFT use full reuse's and full prefill's figures over its own items."""
    grid = configurations(["hkvd"], [0.3])
    full = [True] * 60
    outcomes(full, {"hkvd 0.3": [False] * 60}, {"hkvd 0.3": 0.4})
    report = measure(_Engine(grid), list(range(60)), grid, chat=False, target=0.95)
    (row,) = report.measurements()
    assert row.kept == Kept(0, report.tallies["hkvd 0.3"].eliminated_after)
    assert row.kl == pytest.approx(0.4) and row.ttft == pytest.approx(0.5)


@pytest.mark.parametrize(
    "done,total,elapsed,last_done,last_s,alive,due",
    [
        (1, 100, 30.0, 0, 0.0, 5, True),  # the first item
        (3, 100, 40.0, 1, 30.0, 5, False),
        (6, 100, 50.0, 1, 30.0, 5, True),  # 5 items since the last line
        (3, 100, 95.0, 1, 30.0, 5, True),  # 60 s since the last line
        (4, 100, 60.0, 1, 30.0, 0, True),  # nothing left running: the last line
        (100, 100, 61.0, 99, 60.0, 5, True),  # the last item
    ],
)
def test_progress_due(done, total, elapsed, last_done, last_s, alive, due):
    assert options.progress_due(done, total, elapsed, last_done, last_s, alive) is due


def test_progress_lines_when_not_a_terminal():
    stream = io.StringIO()
    log = options.ProgressLog(stream)
    for done in range(1, 12):
        log("choice part", Progress(done, 156, 10.0 * done, 13 - done // 3, 13))
    log("holdout", Progress(1, 104, 3.0, 1, 1))
    lines = stream.getvalue().splitlines()
    assert lines[0] == (
        "kvfuse calibrate: choice part 1/156 items (1%), 10 s, 13 of 13 blend settings running"
    )
    counts = [re.search(r"(\d+/\d+) items", line).group(1) for line in lines]
    assert counts == ["1/156", "6/156", "11/156", "1/104"]
    assert "holdout" in lines[-1] and "1 of 1 blend settings" in lines[-1]


def test_the_table_shows_eliminated_settings_and_the_stop():
    meta = {
        "choice": {"items": 156},
        "elimination": {"on": True, "runs": 40, "grid_runs": 320}
        | {"stopped_after": 20, "stopped": "measuring stopped after 20"},
        "holdout": {"measured": False, "why": "no blend chosen (prefix is exact)"},
    }
    rows = [
        {"config": "hkvd 0.1", **Kept(5, 8).as_dict(), "kl": 0.3, "ttft_ms": 9.0, "items": 12}
        | {"eliminated_after": 12},
        {"config": "hkvd 0.6", **Kept(8, 8).as_dict(), "kl": 0.1, "ttft_ms": 9.0, "items": 20},
    ]
    lines = options.table(rows, meta)
    assert lines[2].endswith("eliminated after 12 items") and "eliminated" not in lines[3]
    assert (
        lines[4] == "  early elimination: 40 of 320 setting runs on an item (12% of the full grid)"
    )
    assert lines[5] == "  measuring stopped after 20" and "not measured" in lines[6]
