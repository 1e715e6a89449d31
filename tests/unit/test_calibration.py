"""Per-model calibration: choosing the budget (table-tested), profiles on disk, ``auto`` resolved
by the engine, documents not blended when the profile says so, and the measurement itself on a
tiny model (ratio 1 is a full prefill: same answers, no KL)."""

from __future__ import annotations

import json
import logging

import pytest

from kvfuse.calibration import calibrate, fictional_qa
from kvfuse.calibration.choose import Measurement, Targets, choose
from kvfuse.calibration.measure import configurations, correct, measure
from kvfuse.config import BlendOptions, EngineSettings
from kvfuse.config import profiles as profile
from kvfuse.engine import Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def m(method, ratio, acc, kl, ttft=0.3, **extra):
    return Measurement(method, ratio, acc, kl, ttft, tuple(extra.items()))


@pytest.mark.parametrize(
    "rows,expected",
    [
        # the smallest budget meeting both targets
        (
            [m("hkvd", 0.05, 0.9, 0.6), m("hkvd", 0.15, 0.96, 0.45), m("hkvd", 0.3, 1.0, 0.2)],
            ("hkvd", 0.15),
        ),
        # accuracy alone is not enough: KL must be at most half of full reuse's
        ([m("hkvd", 0.15, 1.0, 0.55), m("hkvd", 0.3, 0.97, 0.5)], ("hkvd", 0.3)),
        # among methods at the same budget: the lower KL
        ([m("hkvd", 0.15, 0.96, 0.4), m("sinks+hkvd", 0.15, 0.96, 0.3)], ("sinks+hkvd", 0.15)),
        # the smaller budget wins even with a worse KL
        ([m("sinks+hkvd", 0.3, 1.0, 0.1), m("hkvd", 0.1, 0.95, 0.5)], ("hkvd", 0.1)),
        # nothing keeps the answers: no blending
        ([m("hkvd", 0.15, 0.8, 0.6), m("hkvd", 0.6, 0.94, 0.3)], ("prefix", 1.0)),
        # keeps the answers, but not 1.2x faster than a prefill: no blending
        ([m("hkvd", 0.6, 0.98, 0.2, ttft=0.9)], ("prefix", 1.0)),
        # a large budget that keeps the answers and is 1.33x faster: blending still pays
        ([m("hkvd", 0.3, 0.9, 0.3), m("hkvd", 0.6, 1.0, 0.3, ttft=0.75)], ("hkvd", 0.6)),
        ([], ("prefix", 1.0)),
    ],
)
def test_choose(rows, expected):
    c = choose(rows)
    assert (c.method, c.ratio) == expected
    assert c.reason
    assert c.blends == (expected[0] != "prefix")


def test_choose_says_why_it_does_not_blend():
    c = choose([m("hkvd", 0.6, 0.94, 0.3)])
    assert "no measured budget" in c.reason and "hkvd at 0.6" in c.reason
    slow = choose([m("hkvd", 0.6, 0.98, 0.2, ttft=0.8)], Targets(min_speedup=2.0))
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
    prof, _ = calibrate.calibrate(
        engine, "kvfuse calibrate tiny", items=2, documents=3, methods=["hkvd"], ratios=[1.0]
    )
    assert prof.fingerprint == model.fingerprint and prof.command == "kvfuse calibrate tiny"
    assert prof.blend in (
        {"method": "prefix", "recompute_ratio": 1.0},
        {"method": "hkvd", "recompute_ratio": 1.0},
    )
    assert prof.reason and prof.meta["split"] == "dev" and prof.meta["items"] == 2
    assert [r["config"] for r in prof.measured] == ["full prefill", "full reuse", "hkvd 1"]
