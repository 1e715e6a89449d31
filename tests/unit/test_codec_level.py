"""The per-model default CacheGen level: choosing it (table-tested), storing it in the profile
(old profiles without it still load), which level a codec writes (a configured level wins, level
0 takes the model's calibrated one), the engine and the tiers using it, and the measurement on a
tiny model."""

from __future__ import annotations

import json
import math

import pytest

from kvfuse.calibration import codec_level, fictional_qa
from kvfuse.codecs import get_codec
from kvfuse.codecs.cachegen import DEFAULT_LEVEL, CacheGenCodec
from kvfuse.config import EngineSettings
from kvfuse.config import profiles as profile
from kvfuse.engine import Engine
from kvfuse.store import TieredStore
from kvfuse.store.results import StoreCounters
from kvfuse.store.transcode import Transcoder
from kvfuse.tiers import DiskTier, MemoryTier

GEMMA_LIKE = ("sliding", "sliding", "full", "sliding", "sliding", "full")


# ----------------------------------------------------------------------------------- choosing


@pytest.mark.parametrize(
    "rows, level",
    [
        (
            [(1, 0.010, 6.0), (2, 0.005, 4.5), (3, 0.001, 3.0), (4, 0.0, 2.0)],
            1,
        ),  # the smallest that keeps the NLL
        ([(1, 0.080, 6.0), (2, 0.015, 4.5), (3, 0.004, 3.0), (4, 0.0, 2.0)], 2),
        (
            [(1, 0.080, 6.0), (2, 0.020, 4.5), (3, 0.004, 3.0), (4, 0.0, 2.0)],
            2,
        ),  # exactly at the bound: kept
        ([(4, 0.0, 2.0), (3, 0.004, 3.0), (2, 0.05, 4.5), (1, 0.1, 6.0)], 3),  # in any order
        ([(1, -0.01, 6.0), (2, 0.03, 4.5)], 1),  # a lossy level may even score better (noise)
        (
            [(1, 0.3, 6.0), (2, 0.2, 4.5), (3, 0.1, 3.0), (4, 0.05, 2.0)],
            4,
        ),  # none keeps it: the highest
        ([(1, 0.3, 6.0), (2, 0.2, 4.5)], 4),  # none measured keeps it: the highest, unmeasured
        ([], 4),
    ],
)
def test_choose_level(rows, level):
    assert codec_level.choose_level(rows).level == level


@pytest.mark.parametrize(
    "rows, chosen",
    [
        # the cap keeps a level the plain codec loses: the capped level 2 beats plain level 3
        ([(2, 0.06, 3.5, None), (2, 0.01, 3.2, 4.0), (3, 0.01, 2.4, None)], (2, 4.0)),
        # both keep it: the smaller (here without the cap, which costs bytes)
        ([(2, 0.01, 3.5, None), (2, 0.00, 3.2, 4.0)], (2, None)),
        # a capped level 1 smaller than plain level 2, both kept: the capped level 1
        ([(1, 0.015, 4.0, 4.0), (2, 0.01, 3.6, None), (1, 0.05, 4.3, None)], (1, 4.0)),
        # the cap hurts (as on Qwen2.5-1.5B): plain level 2
        ([(2, 0.01, 3.6, None), (2, 0.12, 3.2, 4.0), (3, 0.0, 2.3, 4.0)], (2, None)),
        # equal sizes: the lower level, then no cap
        ([(2, 0.0, 3.0, 4.0), (3, 0.0, 3.0, None), (2, 0.0, 3.0, None)], (2, None)),
        # none kept: the highest level, of its rows the closer to lossless
        ([(4, 0.05, 2.0, None), (4, 0.03, 1.9, 4.0), (1, 0.3, 6.0, None)], (4, 4.0)),
    ],
)
def test_choose_level_and_cap(rows, chosen):
    choice = codec_level.choose_level(rows)
    assert (choice.level, choice.k_cap) == chosen
    assert ("capped at 4x" in choice.reason) == (chosen[1] is not None) or "no measured" in (
        choice.reason
    )


def test_choose_level_says_why():
    ok = codec_level.choose_level([(1, 0.05, 6.0), (2, 0.01, 3.4)])
    assert (
        ok.row == (2, 0.01, 3.4, None)
        and ok.k_cap is None
        and "level 2" in ok.reason
        and "+1.00%" in ok.reason
        and "3.40x" in ok.reason
    )
    assert "short of" not in ok.reason
    assert "short of the 3x target" in codec_level.choose_level([(3, 0.0, 2.5)]).reason
    none = codec_level.choose_level([(1, 0.3, 6.0), (4, 0.05, 2.0)])
    assert (
        none.row == (4, 0.05, 2.0, None)
        and "no measured level" in none.reason
        and "level 4 at +5.00%" in none.reason
    )
    assert codec_level.choose_level([(1, 0.3, 6.0)]).row is None  # level 4 was not measured
    loose = codec_level.choose_level([(1, 0.05, 6.0)], max_nll_increase=0.1)
    assert loose.level == 1 and "10%" in loose.reason


def test_choose_level_takes_measured_rows():
    rows = [
        {
            "level": 1,
            "nll": 2.5,
            "nll_increase": 0.04,
            "kl": 0.02,
            "ratio_vs_int8": 5.0,
            "bytes_per_token": 900,
        },
        {
            "level": 2,
            "nll": 2.42,
            "nll_increase": 0.008,
            "kl": 0.01,
            "ratio_vs_int8": 3.6,
            "bytes_per_token": 1200,
        },
    ]
    assert codec_level.choose_level(rows).level == 2


# ----------------------------------------------------------------------------------- the profile


def a_profile(codec=None) -> profile.BlendProfile:
    return profile.BlendProfile(
        "tiny", "f" * 32, {"method": "hkvd", "recompute_ratio": 0.3}, "test", "test", codec=codec
    )


def test_profiles_round_trip_with_and_without_a_codec_level(tmp_path):
    plain = a_profile()
    assert "codec" not in plain.to_json() and profile.codec_level(plain) == 0
    assert profile.load(profile.save(plain, tmp_path)) == plain
    codec = {
        "cachegen_level": 3,
        "reason": "measured",
        "measured": [{"level": 3, "nll_increase": 0.01}],
    }
    leveled = a_profile(codec)
    assert profile.load(profile.save(leveled, tmp_path)) == leveled
    assert profile.codec_level(profile.find("f" * 32, tmp_path)) == 3
    assert profile.codec_level(None) == 0
    # no k_cap (a profile measured before it): K's channels as they are
    assert profile.codec_k_cap(leveled) is None and profile.codec_k_cap(None) is None
    capped = a_profile({**codec, "k_cap": 4.0})
    assert profile.codec_k_cap(profile.load(profile.save(capped, tmp_path))) == 4.0


@pytest.mark.parametrize("cap", [1, 0.5, "4", True, -3])
def test_a_profile_with_an_invalid_k_cap_is_refused(cap):
    data = {**a_profile().to_json(), "codec": {"cachegen_level": 2, "k_cap": cap}}
    with pytest.raises(profile.ProfileError, match="k_cap"):
        profile.BlendProfile.from_json(json.loads(json.dumps(data)))


@pytest.mark.parametrize("level", [0, 5, "2", None, True])
def test_a_profile_with_an_invalid_codec_level_is_refused(tmp_path, level):
    data = {**a_profile().to_json(), "codec": {"cachegen_level": level}}
    with pytest.raises(profile.ProfileError, match="cachegen_level"):
        profile.BlendProfile.from_json(json.loads(json.dumps(data)))


def test_shipped_profiles_load_and_without_a_codec_level_leave_the_default():
    shipped = sorted(profile.SHIPPED.glob("*.json"))
    assert shipped
    for path in shipped:
        p = profile.load(path)
        assert profile.codec_level(p) == (p.codec["cachegen_level"] if p.codec else 0)


# ----------------------------------------------------------------------------------- the codec


def test_a_configured_level_wins_and_level_0_takes_the_models():
    assert get_codec("cachegen", 3).for_model(GEMMA_LIKE, 1).level == 3  # explicit: kept
    calibrated = get_codec("cachegen").for_model(GEMMA_LIKE, 1)
    assert (calibrated.level, calibrated.boosted) == (1, frozenset({2, 5}))  # boosted layers kept
    # no calibration: the default
    assert get_codec("cachegen").for_model(GEMMA_LIKE).level == DEFAULT_LEVEL
    # the codec remembers it was configured at 0: another model's level replaces the first's
    again = calibrated.for_model(("full",) * 4, 4)
    assert (again.level, again.boosted, again.configured_level) == (4, frozenset(), 0)
    assert calibrated.for_model(GEMMA_LIKE, 1) is calibrated
    assert get_codec("cachegen", 2).for_model(GEMMA_LIKE, 4).bins == get_codec("cachegen", 2).bins
    for name in ("raw", "int8"):  # codecs without levels ignore it
        codec = get_codec(name)
        assert codec.for_model(GEMMA_LIKE, 3) is codec
    with pytest.raises(ValueError, match="levels are 1, 2, 3, 4"):
        CacheGenCodec(0, model_level=7)


def test_the_models_k_cap_reaches_every_cachegen_codec_and_a_set_one_wins():
    assert get_codec("cachegen").k_cap is None  # none unless the model's profile has one
    capped = get_codec("cachegen").for_model(GEMMA_LIKE, 1, 4.0)
    assert (capped.k_cap, capped.level) == (4.0, 1)
    assert capped.for_model(GEMMA_LIKE, 1, 4.0) is capped
    assert CacheGenCodec(2, k_cap=8.0).for_model(GEMMA_LIKE, 0, 4.0).k_cap == 8.0
    assert get_codec("cachegen-rot").for_model(GEMMA_LIKE, 1, 4.0).k_cap is None
    t = Transcoder({"disk": get_codec("cachegen")}, [1], StoreCounters())
    t.use_model(GEMMA_LIKE, 3, 4.0)
    assert t.codecs["disk"].k_cap == 4.0 and [c.k_cap for c in t.stream_codecs] == [4.0]


def test_tiers_take_the_models_level_but_keep_the_stream_levels():
    codecs = {
        "disk": get_codec("cachegen"),
        "redis": get_codec("cachegen", 4),
        "s3": get_codec("int8"),
    }
    t = Transcoder(codecs, [1, 3], StoreCounters())
    t.use_model(GEMMA_LIKE, 3)
    assert {n: c.level for n, c in t.codecs.items()} == {"disk": 3, "redis": 4, "s3": 0}
    assert [c.level for c in t.stream_codecs] == [1, 3] and all(c.boosted for c in t.stream_codecs)
    assert t.encodings() == ["cachegen.1", "cachegen.3"]


@pytest.mark.parametrize("configured, expected", [(0, 3), (1, 1)])
def test_the_engine_writes_the_profiles_level(tiny_loaded, tmp_path, configured, expected):
    model = tiny_loaded("gemma3")
    profile.save(
        profile.BlendProfile(
            model.name,
            model.fingerprint,
            {"method": "hkvd", "recompute_ratio": 0.3},
            "test",
            "test",
            codec={"cachegen_level": 3, "k_cap": 4.0},
        ),
        tmp_path / "profiles",
    )
    store = TieredStore(
        MemoryTier(1 << 26),
        [DiskTier(tmp_path / "kv", 1 << 30)],
        codecs={"disk": get_codec("cachegen", configured)},
    )
    settings = EngineSettings.of(
        chunk_size=16,
        codec="cachegen",
        codec_level=configured,
        profiles_path=str(tmp_path / "profiles"),
    )
    engine = Engine(model, store, settings)
    try:
        # gemma's global layers still boosted
        assert engine.cache.parts.codec.level == expected and engine.cache.parts.codec.boosted
        assert store.codecs["disk"].level == expected
        # the profile's K cap, whatever the level
        assert engine.cache.parts.codec.k_cap == 4.0 and store.codecs["disk"].k_cap == 4.0
    finally:
        engine.close()
    engine = Engine(
        model, TieredStore(MemoryTier(1 << 26)), EngineSettings.of(chunk_size=16, codec="cachegen")
    )
    assert (
        engine.cache.parts.codec.level == DEFAULT_LEVEL
    )  # no profile of this model in the shipped ones
    engine.close()


# ----------------------------------------------------------------------------------- measuring


def test_measure_levels_on_a_tiny_model(tiny_loaded):
    """Rows per level; the lossy KV is what the second engine used (else ``measure_levels``
    raises), more bins cost more bytes and lose less."""
    model = tiny_loaded("llama")
    items = fictional_qa.items("dev", 1, codec_level.DOCUMENTS)
    assert len(codec_level.item_ids(model.tokenizer, items[0])) > 64 + codec_level.HELD_OUT
    done = []
    rows = codec_level.measure_levels(
        model,
        items,
        levels=(1, 4),
        chunk_size=64,
        progress=lambda d, t: done.append((d, t)),
        caps=(None,),
    )
    assert done == [(1, 1)]
    assert [r["level"] for r in rows] == [1, 4] and [r["k_cap"] for r in rows] == [None, None]
    assert set(rows[0]) == {
        "level",
        "k_cap",
        "nll",
        "nll_increase",
        "kl",
        "ratio_vs_int8",
        "bytes_per_token",
    }
    low, high = rows
    assert all(math.isfinite(r["nll"]) and r["kl"] >= 0 for r in rows)
    assert (
        low["ratio_vs_int8"] > high["ratio_vs_int8"] > 1
        and low["bytes_per_token"] < high["bytes_per_token"]
    )
    assert high["kl"] <= low["kl"]
    with pytest.raises(ValueError, match="levels are"):
        codec_level.measure_levels(model, items, levels=(5,))
    # by default each level is measured without and with K's cap, in that order
    both = codec_level.measure_levels(model, items, levels=(2,), chunk_size=64)
    assert [(r["level"], r["k_cap"]) for r in both] == [(2, None), (2, codec_level.K_CAP)]
