"""Per-model calibration: choosing the budget (table-tested), profiles on disk, ``auto`` resolved
by the engine, documents not blended when the profile says so, and the measurement itself on a
tiny model (ratio 1 is a full prefill: same answers, no KL)."""

from __future__ import annotations

import json
import logging

import pytest

from kvfuse.calibration import calibrate, fictional_qa, sources
from kvfuse.calibration.choose import Measurement, Targets, choose
from kvfuse.calibration.forms import FormSpace
from kvfuse.calibration.interval import Kept
from kvfuse.calibration.measure import configurations, correct, measure
from kvfuse.config import BlendOptions, EngineSettings
from kvfuse.config import profiles as profile
from kvfuse.engine import Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def m(method, ratio, kept, kl, ttft=0.3, n=200, **extra):
    return Measurement(method, ratio, Kept(kept, n), kl, ttft, tuple(extra.items()))


@pytest.mark.parametrize(
    "rows,expected",
    [
        # the smallest budget meeting both targets (lower bounds at n=200: 190 -> 0.918,
        # 197 -> 0.963, 200 -> 0.987)
        (
            [m("hkvd", 0.05, 190, 0.6), m("hkvd", 0.15, 197, 0.45), m("hkvd", 0.3, 200, 0.2)],
            ("hkvd", 0.15),
        ),
        # answers alone are not enough: KL must be at most half of full reuse's
        ([m("hkvd", 0.15, 200, 0.55), m("hkvd", 0.3, 197, 0.5)], ("hkvd", 0.3)),
        # among methods at the same budget: the lower KL
        ([m("hkvd", 0.15, 197, 0.4), m("sinks+hkvd", 0.15, 197, 0.3)], ("sinks+hkvd", 0.15)),
        # the smaller budget wins even with a worse KL
        ([m("sinks+hkvd", 0.3, 200, 0.1), m("hkvd", 0.1, 197, 0.5)], ("hkvd", 0.1)),
        # a point estimate of 0.975 whose lower bound is 0.9495: not kept
        ([m("hkvd", 0.15, 195, 0.3), m("hkvd", 0.6, 190, 0.3)], ("prefix", 1.0)),
        # 20 kept of 20 is a point estimate of 1 but a lower bound of 0.88: rejected
        ([m("hkvd", 0.6, 20, 0.1, n=20)], ("prefix", 1.0)),
        # 51/51 (lower 0.9496) is rejected, 52/52 (0.9505) is not
        ([m("hkvd", 0.3, 51, 0.1, n=51), m("hkvd", 0.6, 52, 0.1, n=52)], ("hkvd", 0.6)),
        # nothing full prefill got right: nothing to keep, no blend
        ([m("hkvd", 0.3, 0, 0.1, n=0)], ("prefix", 1.0)),
        # keeps the answers, but not 1.2x faster than a prefill: no blending
        ([m("hkvd", 0.6, 200, 0.2, ttft=0.9)], ("prefix", 1.0)),
        # a large budget that keeps the answers and is 1.33x faster: blending still pays
        ([m("hkvd", 0.3, 190, 0.3), m("hkvd", 0.6, 200, 0.3, ttft=0.75)], ("hkvd", 0.6)),
        ([], ("prefix", 1.0)),
    ],
)
def test_choose_on_the_lower_bound(rows, expected):
    c = choose(rows)
    assert (c.method, c.ratio) == expected
    assert c.reason
    assert c.blends == (expected[0] != "prefix")


def test_the_confidence_moves_the_bound():
    row = m("hkvd", 0.3, 60, 0.1, n=60)  # lower 0.957 at 0.95, 0.941 at 0.99
    assert choose([row]).blends
    assert not choose([row], Targets(confidence=0.99)).blends


def test_choose_says_why_it_does_not_blend():
    c = choose([m("hkvd", 0.6, 20, 0.3, n=20)])
    assert "no measured budget" in c.reason and "hkvd at 0.6" in c.reason
    assert "kept 20/20" in c.reason and "[0.88, 1.00]" in c.reason
    slow = choose([m("hkvd", 0.6, 200, 0.2, ttft=0.8)], Targets(min_speedup=2.0))
    assert "not 2x faster" in slow.reason and slow.row is not None


@pytest.mark.parametrize(
    "answer,gold,ok",
    [
        ("The goat is called Lusa.", "Lusa", True),
        ("lusa", "Lusa", True),
        ("Lusan", "Lusa", False),
        ("the Copper Heron", "Copper Heron", True),
        ("Heron Copper", "Copper Heron", False),
    ],
)
def test_correct(answer, gold, ok):
    assert correct(answer, gold) is ok


def a_profile(fingerprint="f" * 32, **blend) -> profile.BlendProfile:
    return profile.BlendProfile(
        "tiny",
        fingerprint,
        {"method": "hkvd", "recompute_ratio": 0.3, **blend},
        "measured",
        "kvfuse calibrate tiny",
    )


def test_profiles_round_trip_and_are_found_by_fingerprint(tmp_path):
    p = a_profile(check_layer=2)
    path = profile.save(p, tmp_path)
    assert path == tmp_path / f"{'f' * 32}.json"
    assert profile.load(path) == p
    assert profile.find("f" * 32, tmp_path) == p
    assert profile.find("0" * 32, tmp_path) is None  # another model: not its profile


def test_profiles_with_intervals_round_trip_and_old_ones_still_load(tmp_path):
    """The new record (items, forms, intervals, holdout) lives in ``meta`` and the rows: a
    profile written before it loads unchanged, and one with it round-trips."""
    for shipped in sorted(profile.SHIPPED.glob("*.json")):
        old = profile.load(shipped)
        assert "holdout" not in old.meta and "kept" not in old.measured[0]
        assert profile.BlendProfile.from_json(json.loads(json.dumps(old.to_json()))) == old
    meta = {
        "sources": {"fictional": sources.SPLITS["fictional"]},
        "forms": FormSpace().describe(),
        "choice": {"items": 30},
        "holdout_part": {"items": 20},
        "confidence": 0.95,
        "holdout": {"config": "hkvd 0.3", **Kept(18, 19, 1).as_dict()},
    }
    row = {"config": "hkvd 0.3", **Kept(20, 20).as_dict(), "kl": 0.1, "ttft_ms": 5.0}
    new = profile.BlendProfile(
        "tiny", "f" * 32, {"method": "hkvd", "recompute_ratio": 0.3}, "why", "cmd", [row], meta
    )
    path = profile.save(new, tmp_path)
    assert profile.load(path) == new and profile.load(path).meta["holdout"]["lower"] < 0.95


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": 99}),
        json.dumps({"format": 1}),
        json.dumps({**a_profile().to_json(), "blend": {"method": "magic"}}),
    ],
)
def test_an_unusable_profile_is_ignored_with_a_warning(tmp_path, caplog, content):
    (tmp_path / f"{'f' * 32}.json").write_text(content)
    with caplog.at_level(logging.WARNING):
        assert profile.find("f" * 32, tmp_path) is None
    assert "ignored" in caplog.text


def test_auto_resolves_to_the_profile_or_a_conservative_budget(caplog):
    auto = BlendOptions(store_blended=False)
    got = profile.resolve(auto, a_profile(check_layer=2, document_context="none"), "tiny")
    assert (got.method, got.recompute_ratio, got.check_layer, got.document_context, got.source) == (
        "hkvd",
        0.3,
        2,
        "none",
        "profile",
    )
    assert got.store_blended is False  # what the profile does not tune stays as configured
    with caplog.at_level(logging.WARNING):
        fallback = profile.resolve(auto, None, "tiny")
    assert (fallback.recompute_ratio, fallback.source) == (
        profile.CONSERVATIVE["recompute_ratio"],
        "default",
    )
    assert "kvfuse calibrate tiny" in caplog.text
    fixed = BlendOptions(recompute_ratio=0.2)
    # a configured budget is not overridden
    assert profile.resolve(fixed, a_profile(), "tiny") is fixed


PREFIX, SUFFIX = [5, 6, 7, 8], [40, 41, 42]
DOCS = [list(range(100, 130)), list(range(200, 221))]


def engine_for(model, tmp_path, blend: BlendOptions, prof: dict | None = None) -> Engine:
    if prof is not None:
        profile.save(
            profile.BlendProfile(model.name, model.fingerprint, prof, "test", "test"), tmp_path
        )
    return Engine(
        model,
        TieredStore(MemoryTier(1 << 26)),
        EngineSettings.of(chunk_size=16, blend=blend, profiles_path=str(tmp_path)),
    )


def test_the_engine_blends_with_the_profile_and_reports_it(tiny_loaded, tmp_path):
    model = tiny_loaded("llama")
    engine = engine_for(
        model,
        tmp_path,
        BlendOptions(store_blended=False),
        {"method": "hkvd", "recompute_ratio": 1.0},
    )
    assert (engine.cache.blend.recompute_ratio, engine.cache.blend.source) == (1.0, "profile")
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    expected = (
        Engine(model, None, EngineSettings.of(chunk_size=16)).generate(prompt.ids, GREEDY).token_ids
    )
    result = engine.generate(prompt, GREEDY)
    assert result.token_ids == expected  # ratio 1.0: every document token recomputed
    assert (result.blend.method, result.blend.recompute_ratio, result.blend.source) == (
        "hkvd",
        1.0,
        "profile",
    )
    request_budget = engine.generate(prompt, GREEDY, blend=engine.cache.blend.with_ratio(0.0))
    assert (request_budget.blend.recompute_ratio, request_budget.blend.source) == (0.0, "request")
    assert request_budget.recomputed_tokens == 0
    assert engine.generate(PREFIX + SUFFIX, GREEDY).blend is None  # no documents: nothing to report
    assert engine.stats_snapshot()["blends"] == {"hkvd:1:profile": 1, "hkvd:0:request": 1}


def test_a_profile_that_does_not_blend_reuses_documents_as_a_prefix(tiny_loaded, tmp_path):
    model = tiny_loaded("qwen2")
    engine = engine_for(
        model, tmp_path, BlendOptions(), {"method": "prefix", "recompute_ratio": 1.0}
    )
    prompt = Prompt.of(PREFIX, DOCS, SUFFIX)
    expected = (
        Engine(model, None, EngineSettings.of(chunk_size=16)).generate(prompt.ids, GREEDY).token_ids
    )
    first, again = engine.generate(prompt, GREEDY), engine.generate(prompt, GREEDY)
    assert first.token_ids == expected and again.token_ids == expected
    assert (first.cached_tokens, first.recomputed_tokens) == (0, 0)
    assert again.cached_tokens == len(prompt) - 1  # the same prompt again: an exact prefix hit
    assert (again.blend.method, again.blend.source) == ("prefix", "profile")
    # documents elsewhere: not reused
    other = engine.generate(Prompt.of(PREFIX, DOCS[::-1], SUFFIX), GREEDY)
    assert other.cached_tokens == 0


def test_without_a_profile_auto_is_conservative_and_says_so(tiny_loaded, tmp_path, caplog):
    model = tiny_loaded("llama")
    with caplog.at_level(logging.WARNING):
        engine = engine_for(model, tmp_path, BlendOptions())
    assert (engine.cache.blend.recompute_ratio, engine.cache.blend.source) == (
        profile.CONSERVATIVE["recompute_ratio"],
        "default",
    )
    assert "no blend profile" in caplog.text
    result = engine.generate(Prompt.of(PREFIX, DOCS, SUFFIX), GREEDY)
    assert result.blend.source == "default"
    assert result.recomputed_tokens == round(0.5 * sum(map(len, DOCS)))


def test_measure_and_calibrate_on_a_tiny_model(tiny_loaded):
    """At ratio 1 a blend is a full prefill: the same correct answers and no KL; the profile
    carries the model's fingerprint and the command that made it."""
    model = tiny_loaded("llama")
    engine = Engine(model, TieredStore(MemoryTier(1 << 27)), EngineSettings.of(chunk_size=16))
    items = fictional_qa.items("dev", 2, 3)
    configs = configurations(["hkvd"], [1.0], BlendOptions(recompute_ratio=0.15))
    report = measure(engine, items, configs, max_tokens=3)
    assert set(report.tallies) == {"full prefill", "full reuse", "hkvd 1"}
    full, one = report.tallies["full prefill"], report.tallies["hkvd 1"]
    assert one.correct == full.correct and max(one.kl) < 1e-3
    assert all(len(t.ttft_s) == 2 for t in report.tallies.values())
    (row,) = report.measurements()
    assert (row.method, row.ratio) == ("hkvd", 1.0) and row.kl < 1e-2
    # one example chosen on, one held out; targets any blend meets, so the holdout is measured
    prof, _ = calibrate.calibrate(
        engine,
        "kvfuse calibrate tiny",
        items=2,
        space=FormSpace(documents=(4,)),
        fraction=0.5,
        methods=["hkvd"],
        ratios=[1.0],
        targets=Targets(accuracy=0.0, min_speedup=0.01),
    )
    assert prof.fingerprint == model.fingerprint and prof.command == "kvfuse calibrate tiny"
    assert prof.blend == {"method": "hkvd", "recompute_ratio": 1.0}
    assert "on the held-out items it kept" in prof.reason
    meta = prof.meta
    assert meta["split"] == "dev" and meta["items"] == 2 and meta["confidence"] == 0.95
    assert meta["choice"]["items"] == 1 and meta["holdout_part"]["items"] == 1
    assert meta["sources"] == {"fictional": sources.SPLITS["fictional"]}
    assert meta["holdout"]["config"] == "hkvd 1" and "lower" in meta["holdout"]
    assert [r["config"] for r in prof.measured] == ["full prefill", "full reuse", "hkvd 1"]
    assert all({"kept", "full_correct", "lower", "upper"} <= set(r) for r in prof.measured)
    # the default targets: no blend from one item, and then no holdout is measured
    prof, _ = calibrate.calibrate(
        engine, "t", items=2, space=FormSpace(documents=(4,)), methods=["hkvd"], ratios=[1.0]
    )
    assert prof.blend["method"] == "prefix" and prof.meta["holdout"]["measured"] is False
    # three items cannot hold the 52 answers the default target needs: every setting is
    # eliminated after the first, measuring stops, and the choice is the full grid's
    grid = {"items": 3, "space": FormSpace(documents=(4,)), "fraction": 0.0, "methods": ["hkvd"]}
    fast, report = calibrate.calibrate(engine, "t", ratios=[0.5, 1.0], **grid)
    whole, _ = calibrate.calibrate(engine, "t", ratios=[0.5, 1.0], eliminate=False, **grid)
    assert fast.blend == whole.blend == {"method": "prefix", "recompute_ratio": 1.0}
    assert report.stopped_after == 1 and report.planned == 3
    assert "measuring the choice part stopped after 1 of 3 items" in fast.reason
    assert fast.meta["elimination"]["on"] and fast.meta["elimination"]["stopped_after"] == 1
    assert (fast.meta["elimination"]["runs"], fast.meta["elimination"]["grid_runs"]) == (3, 9)
    assert whole.meta["elimination"] == {"on": False, "runs": 9, "grid_runs": 9}
    rows = {r["config"]: r for r in fast.measured}
    assert rows["hkvd 0.5"]["eliminated_after"] == 1 and rows["full reuse"]["items"] == 1
    assert all(r["items"] == 3 and "eliminated_after" not in r for r in whole.measured)


def test_shipped_profiles_blend_only_where_their_rows_reach_the_lower_bound():
    """A shipped profile that blends must hold enough full-prefill-correct items for the
    lower-bound rule to allow a blend at all (``interval.needed_items``)."""
    from kvfuse.calibration.interval import needed_items

    for shipped in sorted(profile.SHIPPED.glob("*.json")):
        p = profile.load(shipped)
        full = next(r for r in p.measured if r["config"] == "full prefill")
        if p.blend["method"] != "prefix":
            assert full["correct"] >= needed_items(0.95), shipped.name
