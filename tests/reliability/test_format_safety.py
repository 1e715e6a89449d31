"""Format and key safety on real SmolLM2 KV: entries written by another model, another codec or
another format version, and entries filed under another chunk's key, are never used.

Every bad entry is written for real into the disk tier or Redis under the very key a request
looks up (the memory tier keeps nothing here, so every hit is read back from disk or Redis), and
the request then runs: the engine must compute that chunk instead, count the entry unusable
(``unusable_entries``, ``chunk_load_failures``), remove it, and answer exactly as a cache-free run
(up to the near-tie rule, ``load.py``). Each forgery has valid checksums, so what rejects it is
what the entry *means*: the key it holds, its dtype and shape, its codec, its format version, its
token ids.

The default run uses 32-token chunks (short prompts, the same code paths); the slow run repeats
every test with the production chunk size, 256.
"""

from __future__ import annotations

import pytest
import torch
from kvfuse_helpers import SENTENCES, load_builtin, long_text
from load import CODEC_ID, CODEC_LEVEL, VERSION, greedy_reference, near_tie_verdict, relabel, reseal

from kvfuse.codecs import get_codec
from kvfuse.config import BlendOptions, EngineSettings
from kvfuse.engine import Engine, Prompt
from kvfuse.generation import SamplingParams
from kvfuse.kv.format import FORMAT_VERSION, Entry, EntrySpec, FormatError, open_entry, read_header
from kvfuse.kv.keys import Namespace, document_key, prefix_keys
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier, RedisTier

# Documents blend at a fixed budget: smollm2's calibrated ``auto`` reuses them only as a prefix.
BLEND = BlendOptions(recompute_ratio=0.15)

pytestmark = pytest.mark.integration

MAX_TOKENS = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
TIERS = ["disk", "redis"]


@pytest.fixture(scope="module")
def smollm2():
    return load_builtin("smollm2")


@pytest.fixture(
    scope="module",
    params=[pytest.param(32, id="ch32"), pytest.param(256, id="ch256", marks=pytest.mark.slow)],
)
def CH(request) -> int:
    """The chunk size of every engine of a test."""
    return request.param


@pytest.fixture(scope="module")
def prompts(smollm2, CH) -> dict[str, list[int]]:
    """``p``: two whole chunks and a tail; ``q``: the same chunk 0 and tail, another chunk 1 (so
    ``q``'s chunk-1 key differs from ``p``'s while the positions, dtype and shape are the same)."""
    tok = smollm2.tokenizer
    question = tok.encode("\n\nQuestion: Who built the lighthouse?\nAnswer:")
    p = tok.encode(long_text(7))[: 2 * CH + CH // 2 - len(question)] + question
    other = tok.encode(" ".join(reversed(SENTENCES)) * 8)
    q = p[:CH] + other[CH : 2 * CH] + p[2 * CH :]
    assert 2 * CH < len(p) < 3 * CH and len(q) == len(p) and q[CH : 2 * CH] != p[CH : 2 * CH]
    return {"p": p, "q": q}


@pytest.fixture(scope="module")
def references(smollm2, prompts):
    return {name: greedy_reference(smollm2, ids, MAX_TOKENS) for name, ids in prompts.items()}


class Rig:
    """An engine over [memory that keeps nothing, disk, Redis] and the lower tiers themselves."""

    def __init__(self, model, tmp_path, redis_url: str, chunk_size: int, **codecs):
        self.model, self.chunk_size = model, chunk_size
        self.disk = DiskTier(tmp_path / "kv", 1 << 30)
        self.redis = RedisTier(redis_url, timeout_s=2.0)
        self.store = TieredStore(
            MemoryTier(1),
            [self.disk, self.redis],
            codecs={k: get_codec(*v) for k, v in codecs.items()},
        )
        settings = EngineSettings.of(
            chunk_size=chunk_size, history=False, prefetch=False, blend=BLEND
        )
        self.engine = Engine(model, self.store, settings)  # chunks only

    def tier(self, name: str):
        return {"disk": self.disk, "redis": self.redis}[name]

    def plant(self, name: str, key, blob: bytes) -> None:
        """Make ``blob`` the only copy of ``key``: written into tier ``name``, removed from the other."""
        self.engine.flush()
        for t in (self.disk, self.redis):
            t.delete(key)
        self.tier(name).put(key, blob)
        assert bytes(self.tier(name).get(key)) == blob

    def counters(self) -> tuple[int, int]:
        return self.store.stats()["store"]["unusable_entries"], self.engine.stats_snapshot()[
            "chunk_load_failures"
        ]

    def close(self) -> None:
        self.engine.close()
        self.store.close()


@pytest.fixture
def rig(smollm2, tmp_path, redis_server, CH):
    r = Rig(smollm2, tmp_path, redis_server.url, CH)
    yield r
    r.close()


def keys_of(engine: Engine, ids: list[int]):
    return prefix_keys(ids, engine.settings.cache.chunk_size, engine.namespace())


def stored(rig: Rig, ids: list[int]) -> list[bytes]:
    """Run ``ids`` once (nothing cached yet) and return the disk copy of each of its whole chunks."""
    result = rig.engine.generate(ids, GREEDY)
    assert result.cached_tokens == 0
    rig.engine.flush()
    return [bytes(rig.disk.get(k)) for k in keys_of(rig.engine, ids)]


def run_and_check(rig: Rig, ids: list[int], ref, expect_cached: int, rejected: int = 1):
    """Run ``ids``: exactly ``expect_cached`` tokens reused, ``rejected`` more unusable entries,
    and the cache-free answer (near-tie rule)."""
    before = rig.counters()
    result = rig.engine.generate(ids, GREEDY)
    after = rig.counters()
    assert result.cached_tokens == expect_cached
    assert after[0] - before[0] == rejected, f"unusable_entries went {before[0]} -> {after[0]}"
    assert after[1] - before[1] == rejected, f"chunk_load_failures went {before[1]} -> {after[1]}"
    tokens, gaps = ref
    assert near_tie_verdict(result.token_ids, tokens, gaps) != "wrong", (result.token_ids, tokens)
    return result


# ------------------------------------------------------------------------------ token ids


@pytest.mark.parametrize("tier", TIERS)
def test_an_entry_relabelled_with_another_chunks_key_is_rejected_by_its_token_ids(
    rig, prompts, references, tier, CH
):
    p, q = prompts["p"], prompts["q"]
    good = stored(rig, p)
    kp, kq = keys_of(rig.engine, p), keys_of(rig.engine, q)
    assert kp[0] == kq[0] and kp[1] != kq[1]  # same first chunk, another second one

    forged = relabel(good[1], kq[1])  # p's chunk 1 (positions 256..511) claiming to be q's
    c = rig.model.runner.config
    spec = EntrySpec(
        torch.float16, c.num_layers, c.num_kv_heads, c.head_dim, tokens=CH, first_position=CH
    )
    # key, dtype, shape, positions, checksums: all as q expects ...
    open_entry(bytearray(forged), kq[1], spec)
    # ... only the token ids tell it apart
    with pytest.raises(FormatError, match="other token ids"):
        open_entry(
            bytearray(forged),
            kq[1],
            EntrySpec(**{**spec.__dict__, "token_ids": tuple(q[CH : 2 * CH])}),
        )

    rig.plant(tier, kq[1], forged)
    run_and_check(rig, q, references["q"], expect_cached=CH)  # chunk 0 reused, the forgery computed
    rig.engine.flush()
    fresh = rig.tier(tier).get(kq[1])  # the forgery was removed, and q's own chunk 1 stored instead
    assert fresh is not None and open_entry(bytearray(fresh)).token_ids.tolist() == q[CH : 2 * CH]
    hit = rig.engine.generate(q, GREEDY)
    assert hit.cached_tokens == 2 * CH and hit.token_ids == references["q"][0]


@pytest.mark.parametrize("tier", [pytest.param("disk", marks=pytest.mark.slow), "redis"])
def test_an_entry_copied_under_another_chunks_key_is_rejected_by_the_key_it_holds(
    rig, prompts, references, tier, CH
):
    p, q = prompts["p"], prompts["q"]
    good = stored(rig, p)
    kq = keys_of(rig.engine, q)
    rig.plant(tier, kq[1], good[1])  # the same bytes (they still say p's key) under q's key
    run_and_check(rig, q, references["q"], expect_cached=CH)


def test_a_document_relabelled_as_another_document_of_the_same_length_is_rejected(rig, smollm2):
    tok = smollm2.tokenizer
    doc_a = tok.encode(" ".join(SENTENCES[:4]))
    doc_b = tok.encode(" ".join(SENTENCES[4:]))
    n = min(len(doc_a), len(doc_b))
    doc_a, doc_b = doc_a[:n], doc_b[:n]  # same length: same positions behind BOS, same shape
    question = tok.encode("\n\nWhat is this about?")
    engine = rig.engine
    context = engine.cache.parts.keying.document_context()
    ka, kb = (document_key(d, engine.namespace(), context) for d in (doc_a, doc_b))
    engine.generate(Prompt.of(documents=[doc_a], suffix=question), GREEDY)
    engine.flush()
    reference = Engine(
        smollm2,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(chunk_size=rig.chunk_size, blend=BLEND, history=False, prefetch=False),
    )
    # b computed, not loaded
    want = reference.generate(Prompt.of(documents=[doc_b], suffix=question), GREEDY)
    reference.close()

    rig.plant("redis", kb, relabel(rig.disk.get(ka), kb))
    before = rig.counters()
    got = engine.generate(Prompt.of(documents=[doc_b], suffix=question), GREEDY)
    after = rig.counters()
    assert after[0] - before[0] == 1 and got.cached_tokens == 0
    assert got.token_ids == want.token_ids  # b precomputed, exactly as in a cache-empty run


# ------------------------------------------------------------------------------ another model


def test_entries_of_another_model_configuration_are_never_used(
    rig, smollm2, prompts, references, CH
):
    """fp32 KV of the same model is another namespace: other keys (never looked up). Filed under
    this engine's keys anyway, as they are or relabelled, its dtype rejects it."""
    p = prompts["p"]
    other = Engine(
        smollm2,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(chunk_size=CH, kv_dtype="float32", history=False, prefetch=False),
    )
    other.generate(p, SamplingParams(max_tokens=1))
    other.flush()
    theirs = [bytes(other.cache.store.memory.get(k).join()) for k in keys_of(other, p)]
    ours = keys_of(rig.engine, p)
    # another namespace: another key for the same tokens
    assert set(keys_of(other, p)).isdisjoint(ours)
    other.close()
    rig.plant("disk", ours[0], theirs[0])  # as it is: it names its own key
    run_and_check(rig, p, references["p"], expect_cached=0)
    rig.plant("redis", ours[0], relabel(theirs[0], ours[0]))  # relabelled: the dtype is wrong
    run_and_check(rig, p, references["p"], expect_cached=0)


def test_an_entry_of_another_model_architecture_is_never_used(
    rig, tiny_loaded, prompts, references, CH
):
    """A tiny random Llama's entry over the same token ids (its layout differs), relabelled with
    this engine's key."""
    p = prompts["p"]
    tiny = tiny_loaded("llama")
    ids = [t % tiny.runner.config.vocab_size for t in p[:CH]]
    other = Engine(
        tiny,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(chunk_size=CH, history=False, prefetch=False),
    )
    other.generate(ids + [1], SamplingParams(max_tokens=1))
    other.flush()
    theirs = bytes(other.cache.store.memory.get(keys_of(other, ids)[0]).join())
    other.close()
    ours = keys_of(rig.engine, p)[0]
    rig.plant("redis", ours, relabel(theirs, ours))
    run_and_check(rig, p, references["p"], expect_cached=0)


# ------------------------------------------------------------------------------ another codec


def codec_forgeries(raw: bytes, int8: bytes, cachegen: bytes) -> dict[str, bytes]:
    """Entries whose codec fields say something their payload is not."""
    return {
        "unknown codec id": reseal(raw, {CODEC_ID: ("<H", 42)}),
        "raw relabelled int8": reseal(raw, {CODEC_ID: ("<H", get_codec("int8").codec_id)}),
        "int8 relabelled raw": reseal(int8, {CODEC_ID: ("<H", get_codec("raw").codec_id)}),
        "cachegen relabelled int8": reseal(
            cachegen, {CODEC_ID: ("<H", get_codec("int8").codec_id)}
        ),
        "cachegen level 9": reseal(cachegen, {CODEC_LEVEL: ("<H", 9)}),
        "raw with a level": reseal(raw, {CODEC_LEVEL: ("<H", 1)}),
        # the codec's own version byte (CacheGen layer format 1 -> 2) with the layer checksum redone:
        # the entry is intact, its payload does not decode (rejected when loaded, not when read)
        "cachegen layer version 2": reseal(cachegen, layer_edits={(0, 0): 2}),
    }


@pytest.fixture(scope="module")
def encodings(smollm2, prompts, CH):
    """Chunk 0 of ``p`` as raw, int8 and CacheGen entries (written by engines with those codecs:
    a key names content, not encoding, so all three are under the key the test engines look up)."""
    p, out, keys = prompts["p"], {}, set()
    for codec in ("raw", "int8", "cachegen"):
        e = Engine(
            smollm2,
            TieredStore(MemoryTier(1 << 30)),
            EngineSettings.of(chunk_size=CH, codec=codec, history=False, prefetch=False),
        )
        e.generate(p, SamplingParams(max_tokens=1))
        e.flush()
        keys.add(keys_of(e, p)[0])
        out[codec] = bytes(e.cache.store.memory.get(keys_of(e, p)[0]).join())
        e.close()
    assert len(keys) == 1
    assert (
        read_header(out["cachegen"]).codec == "cachegen"
        and out["cachegen"][read_header(out["cachegen"]).header_size] == 1
    )  # layer 0 starts with CacheGen's layer format version
    return out


def test_entries_whose_codec_fields_lie_are_never_used(rig, prompts, references, encodings):
    p = prompts["p"]
    key = keys_of(rig.engine, p)[0]
    forgeries = codec_forgeries(encodings["raw"], encodings["int8"], encodings["cachegen"])
    for i, (what, blob) in enumerate(forgeries.items()):
        rig.plant(TIERS[i % 2], key, blob)
        # chunk 0 is the one forged: nothing loads, the whole prompt is computed (the exact reference)
        result = run_and_check(rig, p, references["p"], expect_cached=0)
        assert result.token_ids == references["p"][0], what


def test_a_cachegen_entry_with_another_layer_version_is_removed_from_every_tier(
    rig, prompts, references, encodings
):
    """An intact entry whose payload its codec refuses is found when it is loaded: it is removed from
    every tier (``TieredStore.discard``), not only the one that served it."""
    p = prompts["p"]
    key = keys_of(rig.engine, p)[0]
    bad = codec_forgeries(encodings["raw"], encodings["int8"], encodings["cachegen"])[
        "cachegen layer version 2"
    ]
    open_entry(bytearray(bad), key)  # intact as an entry
    rig.engine.flush()
    rig.disk.put(key, bad)
    rig.redis.put(key, bad)
    run_and_check(rig, p, references["p"], expect_cached=0)
    rig.engine.flush()
    for t in (rig.disk, rig.redis):  # replaced by the good entry the run stored
        assert open_entry(bytearray(t.get(key))).codec.name == "raw"


# ------------------------------------------------------------------------------ format version


def version_forgeries(raw: bytes) -> dict[str, bytes]:
    e = open_entry(bytearray(raw))
    v2_layout = bytes(
        Entry(e.key, e.codec, e.shape, e.dtype, e.positions, e.payload, e.layer_sizes).join()
    )
    return {
        # what a version-2 build wrote: no token ids, version 2 (sealed as it sealed it)
        "version 2 entry": reseal(v2_layout, {VERSION: ("<H", 2)}),
        "this entry, version 2": reseal(raw, {VERSION: ("<H", 2)}),
        "this entry, version 4": reseal(raw, {VERSION: ("<H", FORMAT_VERSION + 1)}),
        "this entry, version 0": reseal(raw, {VERSION: ("<H", 0)}),
    }


def test_entries_of_another_format_version_are_never_used(rig, prompts, references, encodings):
    p = prompts["p"]
    key = keys_of(rig.engine, p)[0]
    # Another version is another namespace: its keys are never the ones this build looks up.
    ns = rig.engine.namespace()
    old = Namespace(ns.model_fingerprint, ns.kv_dtype, ns.kv_layout, 2, ns.salt, ns.tenant)
    assert FORMAT_VERSION == 3 and prefix_keys(p, rig.chunk_size, old)[0] != key
    for i, (what, blob) in enumerate(version_forgeries(encodings["raw"]).items()):
        with pytest.raises(FormatError, match="version"):
            open_entry(bytearray(blob), key)
        rig.plant(TIERS[i % 2], key, blob)
        result = run_and_check(rig, p, references["p"], expect_cached=0)
        assert result.token_ids == references["p"][0], what


# ------------------------------------------------------------------------------ what is stored


def test_every_entry_the_engine_writes_records_its_token_ids(smollm2, prompts, CH):
    """Prefix chunks, documents, and (with history) the answer's chunk and tail: each records the
    exact ids of its KV, which is what the check above compares."""
    from kvfuse.reuse.planner import history_entries

    ids = prompts["p"][: 2 * CH - 12]
    engine = Engine(
        smollm2,
        TieredStore(MemoryTier(1 << 30)),
        EngineSettings.of(chunk_size=CH, prefetch=False, blend=BLEND),
    )  # history on
    r = engine.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.flush()
    memory = engine.cache.store.memory
    state = ids + r.token_ids[:-1]  # the KV holds the prompt and every answer token fed back
    entries = history_entries(state, CH, engine.namespace())
    assert [(e.source, e.tokens) for e in entries] == [
        (0, CH),
        (CH, CH),
        (2 * CH, len(state) - 2 * CH),
    ]
    for e in entries:  # the prompt's chunk, the chunk the answer completed, the tail
        assert memory.get(e.key).token_ids.tolist() == state[e.source : e.source + e.tokens]
        assert read_header(bytes(memory.get(e.key).join())).has_token_ids
    doc = smollm2.tokenizer.encode(SENTENCES[0])
    engine.generate(Prompt.of(documents=[doc], suffix=[13]), SamplingParams(max_tokens=1))
    dk = document_key(doc, engine.namespace(), engine.cache.parts.keying.document_context())
    assert memory.get(dk).token_ids.tolist() == doc
    engine.close()
