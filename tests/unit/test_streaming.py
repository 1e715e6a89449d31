"""Per-tier codecs, stored streaming levels and bandwidth-adaptive loading (CacheGen streaming).

The level choice is a pure function tested with a table; the loader runs on a tiny model against a
real disk tier behind a ``ThrottledTier``, and its greedy output is compared with a cache-free run
(lossless choices and recomputed chunks must not change a token).
"""

from __future__ import annotations

import pytest
import torch

from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine
from kvfuse.generation import SamplingParams
from kvfuse.kv.chunk import KVChunk
from kvfuse.kv.format import Entry, encode_entry, open_entry, read_header
from kvfuse.kv.keys import ChunkKey, ChunkKind, prefix_keys
from kvfuse.reuse.kv_stream import (
    RECOMPUTE,
    KVStreamReport,
    LoadEstimates,
    Option,
    choose,
    quality,
)
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.disk.files import key_to_filename
from kvfuse_testkit.throttled import ThrottledTier, load_trace

CH = 32
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


# -- the choice (pure) --------------------------------------------------------------------------


def _opts(**times):
    return [
        Option(name.replace("_", "."), read, decode, quality(name.replace("_", ".")))
        for name, (read, decode) in times.items()
    ]


# read and decode seconds per chunk: raw needs no decoding, smaller levels read faster
OPTS = _opts(
    raw=(0.100, 0.0),
    cachegen_3=(0.035, 0.005),
    cachegen_2=(0.020, 0.005),
    cachegen_1=(0.010, 0.005),
)


@pytest.mark.parametrize(
    "remaining, left, recompute, backlog, expected",
    [
        (1.000, 1, 0.5, 0.0, "raw"),  # everything fits: lossless
        (0.400, 4, 0.5, 0.0, "raw"),  # 4 reads of 0.100 fit exactly
        (
            0.399,
            4,
            0.5,
            0.0,
            "cachegen.3",
        ),  # the rest at raw would not fit; 4 x 0.035 + a decode does
        (0.100, 4, 0.5, 0.0, "cachegen.2"),
        (0.060, 4, 0.5, 0.0, "cachegen.1"),
        (
            0.040,
            4,
            0.5,
            0.0,
            "cachegen.1",
        ),  # nothing fits, recompute is slower: the soonest-ready level
        (0.040, 4, 0.010, 0.0, RECOMPUTE),  # nothing fits, recompute is sooner: text fallback
        (0.0, 1, 0.5, 0.0, "cachegen.1"),  # already late: the soonest-ready choice
        (-1.0, 3, 0.001, 0.0, RECOMPUTE),
        (0.020, 1, 0.001, 0.0, "cachegen.1"),  # a level fits: recompute is only a fallback
        (0.020, 0, 0.001, 0.0, "cachegen.1"),  # chunks_left is at least this chunk
        (1.000, 4, 0.5, 0.9, "raw"),  # the request's thread is the bottleneck: reads overlap it
        (0.500, 4, 0.5, 0.9, "raw"),  # late, but a raw read (no decode) is ready soonest
        (0.500, 4, 0.05, 0.9, "raw"),  # recomputing would wait for the backlog too
        (
            0.500,
            4,
            0.05,
            0.0,
            RECOMPUTE,
        ),  # an idle request thread recomputes while the link is slow
    ],
)
def test_choose(remaining, left, recompute, backlog, expected):
    slow_link = (
        _opts(raw=(1.0, 0.0), cachegen_1=(0.2, 0.005))
        if (remaining, recompute, backlog) == (0.5, 0.05, 0.0)
        else OPTS
    )
    assert choose(slow_link, remaining, left, recompute, backlog) == expected


def test_choose_without_options_recomputes_and_prefers_quality_then_speed_on_ties():
    assert choose([], 10.0, 1, 1.0) == RECOMPUTE
    tie = [Option("cachegen.2", 0.02, 0.0, 2), Option("int8", 0.05, 0.0, 500)]
    assert choose(tie, 1.0, 1, 1.0) == "int8"
    assert quality("raw") > quality("int8") > quality("cachegen.4") > quality("cachegen.1")
    o = Option("cachegen.2", read_s=0.1, decode_s=0.05, quality=2)
    assert o.finish_all(3, 0.0) == pytest.approx(0.35) and o.finish_all(3, 1.0) == pytest.approx(
        1.15
    )
    assert o.ready(0.0) == pytest.approx(0.15) and o.ready(0.5) == pytest.approx(0.55)


def test_estimates_learn_from_reads_and_computes():
    est = LoadEstimates()
    before = {
        o.encoding: o.seconds for o in est.options("disk", ["raw", "cachegen.2"], 1_000_000, 2)
    }
    # Priors before any read: 1 GB/s; raw 2 bytes per value and no decoding, CacheGen level 2 about a
    # third of a byte and 15 ns per value to decode (on a fast link raw is the quicker one).
    assert before["raw"] == pytest.approx(0.002) and before["cachegen.2"] == pytest.approx(
        0.00032 + 0.015
    )
    est.read("disk", "cachegen.2", nbytes=100_000, values=1_000_000, read_s=0.1)
    est.decoded("cachegen.2", values=1_000_000, seconds=0.02)
    after = {
        o.encoding: o.seconds for o in est.options("disk", ["raw", "cachegen.2"], 1_000_000, 2)
    }
    assert (
        est.bandwidth["disk"] == pytest.approx(1e6)
        and est.measured("disk")
        and not est.measured("redis")
    )
    assert after["cachegen.2"] == pytest.approx(0.1 + 0.02)
    assert after["raw"] == pytest.approx(2.0)
    est.computed(100, 0.5)
    assert est.recompute_s(10) < 0.05 + 1e-9 and est.recompute_s(10) > 0.01
    assert "redis" not in est.bandwidth and est.options("redis", ["raw"], 10, 2)[0].seconds > 0


# -- the throttled tier ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


def test_throttled_tier_replays_the_trace_over_time():
    c = FakeClock()
    inner = MemoryTier(1 << 20)
    # 1 MB/s during the first 10 ms, 0.1 MB/s during the next 10 ms, then again
    tier = ThrottledTier(inner, [8.0, 0.8], scale=1e-3, period_s=0.01, clock=c.clock, sleep=c.sleep)
    key = prefix_keys(list(range(4)), 4, _ns())[0]
    tier.put(key, b"x" * 5000)
    assert tier.get(key) == b"x" * 5000 and c.now == pytest.approx(0.005)  # 5 kB at 1 MB/s
    # 10 kB from t=5 ms: 5 kB by 10 ms at 1 MB/s, then 0.1 MB/s: 1 kB by 20 ms, then 4 kB at 1 MB/s
    assert tier.transfer_end(0.005, 10_000) == pytest.approx(0.024)
    for start in (
        0.01,
        0.03,
        0.1,
        0.3,
        0.7,
    ):  # starting on a segment boundary (float rounding) ends
        assert start < tier.transfer_end(start, 12_345) < start + 0.2
    tier.put(key, b"y" * 10_000)
    assert bytes(tier.read_range(key, 0, 10_000)) == b"y" * 10_000 and c.now == pytest.approx(0.024)
    missing = prefix_keys(list(range(8)), 4, _ns())[1]
    before = c.now
    assert tier.get(missing) is None and c.now == before  # a miss costs no transfer
    c.now = 0.5  # the link's clock runs on while nothing is read (e.g. a chunk is recomputed)
    assert tier.bandwidth_at(0.503) == pytest.approx(1e6) and tier.bandwidth_at(
        0.515
    ) == pytest.approx(1e5)
    tier.reset()
    assert tier.bandwidth_at(c.now) == pytest.approx(1e6)
    assert (
        tier.contains(key) and tier.entries() == 1 and tier.stats is inner.stats and tier.reads == 2
    )
    with pytest.raises(ValueError):
        ThrottledTier(inner, [])
    with pytest.raises(ValueError):
        ThrottledTier(inner, [1.0, 0.0])
    with pytest.raises(ValueError):
        ThrottledTier(inner, [1.0], period_s=0)


def test_load_trace_reads_the_published_format(tmp_path):
    f = tmp_path / "bw.jsonl"
    f.write_text('{"bw": [1.5, 2.0]}\n{"bw": [0.5]}\n')
    assert load_trace(f) == [1.5, 2.0, 0.5] and load_trace(f, row=1) == [0.5]


# -- per-tier codecs and stored levels ----------------------------------------------------------------


def _ns():
    from kvfuse.kv.keys import Namespace

    return Namespace(model_fingerprint="test", kv_dtype="float16", kv_layout="L2xH2xD8")


def _chunk(tokens=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return KVChunk(
        kv=torch.randn(2, 2, tokens, 2, 8, generator=g).half(), positions=torch.arange(tokens)
    )


def test_tiers_write_their_own_codec_and_the_stream_levels(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    store = TieredStore(
        MemoryTier(1 << 30),
        [disk],
        codecs={"disk": get_codec("cachegen", 2)},
        stream_levels=(1, 2, 3),
    )
    key = prefix_keys(list(range(16)), 16, _ns())[0]
    chunk = _chunk()
    store.put([(key, encode_entry(chunk, key, get_codec("raw")))])
    store.flush()
    assert read_header(store.memory.get(key)).codec == "raw"  # memory: as put
    h = read_header(disk.get(key))
    assert (h.codec, h.level) == ("cachegen", 2)
    levels = {read_header(disk.get(key.encoded_as("cachegen", lv))).level for lv in (1, 3)}
    # the primary is level 2
    assert levels == {1, 3} and disk.get(key.encoded_as("cachegen", 2)) is None
    assert disk.entries() == 3 and store.stats()["store"]["reencoded"] == 3
    assert (
        store.encodings("disk") == ["cachegen.1", "cachegen.2", "cachegen.3"]
        and store.encodings("memory") == []
    )

    # Lookups find the chunk whatever wrote it; a fetch from disk decodes the CacheGen entry.
    store.memory.clear()
    assert store.lookup([key]).where == ("disk",)
    got = store.fetch([key])[0]
    assert got.tier == "disk" and got.entry.codec.name == "cachegen"
    assert (got.entry.decode().float() - chunk.kv.float()).abs().max() < 0.5

    one = store.fetch_encoded(key, "disk", "cachegen.1")
    assert (
        one.variant == "cachegen.1"
        and one.entry.codec.level == 1
        and one.nbytes == len(disk.get(one.entry.key and key.encoded_as("cachegen", 1)))
    )
    assert store.fetch_encoded(key, "disk", "cachegen.4").variant == ""  # not stored: the primary
    assert store.fetch_encoded(key, "disk").entry.codec.level == 2
    with pytest.raises(ValueError, match="no tier named"):
        store.fetch_encoded(key, "redis")
    store.close()


def test_a_damaged_variant_is_removed_and_the_primary_serves(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    store = TieredStore(MemoryTier(1 << 30), [disk], stream_levels=(1,))
    key = prefix_keys(list(range(16)), 16, _ns())[0]
    store.put([(key, encode_entry(_chunk(), key, get_codec("raw")))])
    store.flush()
    variant = key.encoded_as("cachegen", 1)
    path = next((tmp_path / "kv").rglob(key_to_filename(variant)))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    got = store.fetch_encoded(key, "disk", "cachegen.1")
    assert got.variant == "" and got.entry.codec.name == "raw"
    assert disk.get(variant) is None and store.stats()["store"]["unusable_entries"] == 1
    store.close()


def test_a_codec_that_refuses_the_kv_skips_that_tier_only(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 30)
    store = TieredStore(MemoryTier(1 << 30), [disk], codecs={"disk": get_codec("cachegen")})
    key = prefix_keys(list(range(16)), 16, _ns())[0]
    bad = KVChunk(kv=torch.full((2, 2, 16, 2, 8), float("inf")).half(), positions=torch.arange(16))
    store.put([(key, encode_entry(bad, key, get_codec("raw")))])
    store.flush()
    assert store.memory.get(key) is not None and disk.get(key) is None
    assert store.stats()["store"]["reencode_errors"] == 1
    store.close()


def test_variant_keys_parse_and_name_their_chunk():
    key = prefix_keys(list(range(16)), 16, _ns())[0]
    v = key.encoded_as("cachegen", 3)
    assert (
        str(v) == f"{key}@cachegen.3" and ChunkKey.parse(str(v)) == v and v.base == key and v != key
    )
    with pytest.raises(ValueError):
        ChunkKey(key.namespace_id, key.digest, ChunkKind.PREFIX, "Cache Gen")
    assert key_to_filename(v).endswith("@cachegen.3.kvf")


# -- the engine: adaptive loading ---------------------------------------------------------------


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded("llama")


def _ids(n, seed=0):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Setup:
    """An engine over memory + a throttled disk (raw primaries, CacheGen levels 1 and 3)."""

    def __init__(self, model, path, trace=(100.0,), **engine_kw):
        self.disk = DiskTier(path, 1 << 30)
        self.slow = ThrottledTier(self.disk, list(trace), scale=1.0)
        self.memory = MemoryTier(1 << 30)
        self.store = TieredStore(self.memory, [self.slow], stream_levels=(1, 3))
        self.engine = Engine(
            model,
            self.store,
            EngineSettings.of(
                chunk_size=CH, history=False, async_save=False, prefetch=False, **engine_kw
            ),
        )

    def cold(self):
        """Forget what memory holds: the next request reads the slow tier."""
        self.store.flush()
        self.memory.clear()

    def close(self):
        self.engine.close()


@pytest.fixture
def setup(model, tmp_path):
    s = Setup(model, tmp_path / "kv")
    yield s
    s.close()


def _reference(model, ids):
    return Engine(model, None, EngineSettings.of(chunk_size=CH)).generate(ids, GREEDY).token_ids


def test_a_generous_budget_loads_lossless_and_answers_as_a_full_prefill(model, setup):
    ids = _ids(5 * CH + 7)
    expected = _reference(model, ids)
    assert setup.engine.generate(ids, GREEDY).token_ids == expected
    setup.cold()
    # A link never measured is probed with its smallest encoding first (a slow start) ...
    first = setup.engine.generate(ids, GREEDY, cache=CacheOptions(kv_slo_ms=60_000))
    assert first.kv_stream.chunks == {
        "cachegen.1": 1,
        "raw": 4,
    } and setup.engine.cache.parts.estimates.measured("disk")
    setup.cold()
    # ... then, measured fast, every chunk is read lossless.
    r = setup.engine.generate(ids, GREEDY, cache=CacheOptions(kv_slo_ms=60_000))
    assert r.token_ids == expected and r.cached_tokens == 5 * CH and r.hit_tiers == ("disk",) * 5
    assert r.kv_stream.chunks == {"raw": 5} and r.kv_stream.met and r.kv_stream.bytes_read > 0
    s = setup.engine.stats_snapshot()
    assert s["streamed_requests"] == 2 and s["stream_chunks"] == {"raw": 9, "cachegen.1": 1}
    assert s["stream_slo_violations"] == 0
    # Without a budget the same chunks load as before (one batch, promoted into memory).
    setup.cold()
    plain = setup.engine.generate(ids, GREEDY)
    assert (
        plain.kv_stream is None and plain.token_ids == expected and plain.hit_tiers == ("disk",) * 5
    )


def test_when_no_level_fits_the_chunks_are_recomputed_exactly(model, setup):
    ids = _ids(4 * CH + 3, seed=1)
    expected = _reference(model, ids)
    setup.engine.generate(ids, GREEDY)
    setup.cold()
    est = setup.engine.cache.parts.estimates
    est.bandwidth["disk"] = 1e3  # 1 kB/s, measured: every encoding takes seconds
    est.compute_s_per_token = 1e-7  # and recomputing is nearly free
    est.computed = lambda tokens, seconds: None  # keep it so for this test
    r = setup.engine.generate(ids, GREEDY, cache=CacheOptions(kv_slo_ms=1))
    assert r.kv_stream.chunks == {RECOMPUTE: 4} and r.cached_tokens == 0 and r.hit_tiers == ()
    assert r.token_ids == expected and r.kv_stream.bytes_read == 0


def test_a_tight_budget_picks_smaller_levels_and_spends_the_slack(model, setup):
    ids = _ids(4 * CH + 3, seed=2)
    setup.engine.generate(ids, GREEDY)
    est = setup.engine.cache.parts.estimates
    values = CH * model.config.num_layers * 2 * model.config.num_kv_heads * model.config.head_dim
    # Fixed estimates (the real reads are instant here): 10 kB/s, so a level-3 chunk "takes"
    # values * 0.5 / 1e4 s and a level-1 chunk values * 0.2 / 1e4 s; recomputing is out of reach.
    est.bandwidth["disk"] = 1e4
    est.bytes_per_value.update({"raw": 2.0, "cachegen.3": 0.5, "cachegen.1": 0.2})
    est.decode_s_per_value.update({"raw": 0.0, "cachegen.3": 0.0, "cachegen.1": 0.0})
    est.compute_s_per_token = 10.0
    est.computed = lambda tokens, seconds: None
    est.read = lambda *a, **k: None
    est.decoded = lambda *a, **k: None
    unit_ms = values / 1e4 * 1000
    cases = [  # the loader plans with 90% of the budget (streaming.SAFETY)
        # 4 chunks at level 3 (2.0 units) do not fit 0.9 x 1.2 units, level 1 (0.8) does; after two
        # level-1 chunks, the two left fit at level 3 (1.0 unit): CacheGen spends the slack on quality.
        (1.2 * unit_ms, {"cachegen.1": 2, "cachegen.3": 2}),
        (2.02 * unit_ms, {"cachegen.1": 1, "cachegen.3": 3}),
        (9.0 * unit_ms, {"raw": 4}),
    ]
    for budget_ms, expected in cases:
        setup.cold()
        r = setup.engine.generate(ids, GREEDY, cache=CacheOptions(kv_slo_ms=budget_ms))
        assert r.kv_stream.chunks == expected and r.cached_tokens == 4 * CH
        assert len(r.token_ids) == GREEDY.max_tokens


def test_streaming_from_a_slow_link_measures_it(model, tmp_path):
    s = Setup(model, tmp_path / "kv", trace=(0.002,))  # 0.25 MB/s: a raw chunk (12 kB) takes ~50 ms
    try:
        ids = _ids(3 * CH + 5, seed=3)
        s.engine.generate(ids, GREEDY)
        s.cold()
        r = s.engine.generate(ids, GREEDY, cache=CacheOptions(kv_slo_ms=60))
        # The first chunk goes at the prior's choice; once the link is measured, the rest shrink.
        assert (
            sum(r.kv_stream.chunks.values()) == 3
            and s.engine.cache.parts.estimates.bandwidth["disk"] < 1e6
        )
        assert r.kv_stream.chunks.get("raw", 0) <= 1
    finally:
        s.close()


def test_an_entry_that_does_not_decode_is_a_miss_and_is_removed(model):
    """An entry whose bytes are intact but whose CacheGen payload does not decode (e.g. written
    where the coder's tables differ) is never used: the chunk is computed and the entry dropped."""
    ids = _ids(3 * CH + 4, seed=4)

    def run(damage: bool):
        store = TieredStore(MemoryTier(1 << 30))
        engine = Engine(
            model,
            store,
            EngineSettings.of(chunk_size=CH, history=False, async_save=False, codec="cachegen"),
        )
        engine.generate(ids, GREEDY)
        key = prefix_keys(ids, CH, engine.namespace())[1]
        if damage:
            e = store.memory.get(key)
            payload = bytearray(e.payload)
            payload[40] ^= 0xFF
            forged = Entry(
                e.key, e.codec, e.shape, e.dtype, e.positions, memoryview(payload), e.layer_sizes
            )
            # fresh checksums: only decoding can tell
            store.memory.put(key, open_entry(forged.join()))
        else:
            store.memory.delete(key)  # the reference: the same chunk simply missing
        r = engine.generate(ids, GREEDY)
        stats, store_stats, left = (
            engine.stats_snapshot(),
            store.stats()["store"],
            store.memory.get(key),
        )
        engine.close()
        return r, stats, store_stats, left

    r, stats, store_stats, left = run(damage=True)
    ref, *_ = run(damage=False)
    assert (
        r.cached_tokens == CH
        and stats["chunk_load_failures"] == 1
        and store_stats["unusable_entries"] == 1
    )
    assert left is not None and left.codec.name == "cachegen"  # recomputed and stored again, intact
    assert r.token_ids == ref.token_ids


def test_stream_report_counts():
    r = KVStreamReport(0.1)
    r.add("raw")
    r.add("raw")
    r.add(RECOMPUTE)
    r.load_s = 0.2
    assert r.chunks == {"raw": 2, RECOMPUTE: 1} and not r.met
