"""Engine bookkeeping on tiny random models (CPU): hits, partial hits, tails, salts, corruption, stats.

Greedy output is compared token for token with a cache-free run of the same model: a cache hit must
never change what is generated.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kvfuse.codecs import get_codec
from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine, Prompt, Request
from kvfuse.generation import SamplingParams
from kvfuse.kv.format import decode_chunk, encode_chunk, verify
from kvfuse.kv.keys import prefix_keys
from kvfuse.models import LoadedModel
from kvfuse.store import TieredStore
from kvfuse.tiers import DiskTier, MemoryTier
from kvfuse.tiers.disk.files import key_to_filename

CH = 32  # chunk size of every engine here


def prefix_engine(model, store, **kw) -> Engine:
    """Chunk-level prefix caching alone, saved on the request path: what these tests pin down.
    Whole-history reuse and the asynchronous saver are tested in test_history.py."""
    return Engine(
        model, store, EngineSettings.of(history=False, async_save=False, **{"chunk_size": CH, **kw})
    )


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture
def models(tiny_loaded):
    """A function giving the LoadedModel of a tiny family (built and loaded once per session)."""
    return tiny_loaded


@pytest.fixture
def model(models) -> LoadedModel:
    return models("llama")


class Stores:
    """Memory + disk stores over one directory; ``fresh()`` is a restart (empty memory, same disk)."""

    def __init__(self, path):
        self.path = path
        self.opened: list[TieredStore] = []

    def fresh(self) -> TieredStore:
        for s in self.opened:
            s.flush()
        store = TieredStore(MemoryTier(64 << 20), [DiskTier(self.path, 256 << 20)])
        self.opened.append(store)
        return store

    def close(self) -> None:
        for s in self.opened:
            s.close()


@pytest.fixture
def stores(tmp_path):
    s = Stores(tmp_path / "kv")
    yield s
    s.close()


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_baselines: dict = {}


def baseline(
    model: LoadedModel, ids: list[int], params: SamplingParams = GREEDY, kv_dtype="float16"
) -> list[int]:
    """Greedy tokens of a cache-free engine (memoised: the same model and prompt recur)."""
    key = (model.fingerprint, tuple(ids), params, kv_dtype)
    if key not in _baselines:
        _baselines[key] = (
            prefix_engine(model, None, chunk_size=CH, kv_dtype=kv_dtype)
            .generate(ids, params)
            .token_ids
        )
    return _baselines[key]


# ------------------------------------------------------------------------------ hits are exact


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_greedy_output_is_identical_with_hits_from_memory_and_from_disk(models, stores, family):
    model = models(family)
    ids = ids_of(5 * CH + 10)
    expected = baseline(model, ids)

    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    first = engine.generate(ids, GREEDY)
    assert (first.cached_tokens, first.hit_tiers, first.stored_chunks) == (0, (), 5)
    assert first.token_ids == expected

    hit = engine.generate(ids, GREEDY)
    assert (hit.cached_tokens, hit.hit_tiers) == (5 * CH, ("memory",) * 5)
    assert hit.token_ids == expected and hit.stored_chunks == 0

    restarted = prefix_engine(model, stores.fresh(), chunk_size=CH)  # empty memory, same directory
    from_disk = restarted.generate(ids, GREEDY)
    assert (from_disk.cached_tokens, from_disk.hit_tiers) == (5 * CH, ("disk",) * 5)
    assert from_disk.token_ids == expected
    again = restarted.generate(ids, GREEDY)  # the disk hits were promoted into memory
    assert again.hit_tiers == ("memory",) * 5 and again.token_ids == expected


@pytest.mark.parametrize("k", [0, 1, 2, 4, 5])
def test_a_prompt_sharing_the_first_k_chunks_reuses_exactly_k(model, stores, k):
    cached = ids_of(5 * CH + 10)
    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    engine.generate(cached, GREEDY)
    other = list(cached)
    other[k * CH + 3] = 3 if other[k * CH + 3] != 3 else 4  # chunk k differs; 0..k-1 are the same
    result = engine.generate(other, GREEDY)
    assert result.cached_tokens == k * CH and result.hit_tiers == ("memory",) * k
    assert result.token_ids == baseline(model, other)
    assert result.stored_chunks == 5 - k  # its own chunks k.. are new


def test_a_shorter_prompt_reuses_the_chunks_it_contains(model, stores):
    long = ids_of(6 * CH + 5)
    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    engine.generate(long, GREEDY)
    short = long[: 2 * CH + 20]
    result = engine.generate(short, GREEDY)
    assert result.cached_tokens == 2 * CH and result.token_ids == baseline(model, short)


def test_a_prompt_of_whole_chunks_loads_them_all_and_computes_its_last_token(model, stores):
    ids = ids_of(4 * CH, seed=1)
    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    first = engine.generate(ids, GREEDY)
    assert first.stored_chunks == 4
    hit = engine.generate(ids, GREEDY)
    # the logits of the last prompt token are needed: that one token is computed again
    assert hit.cached_tokens == 4 * CH - 1 and hit.prompt_tokens - hit.cached_tokens == 1
    assert hit.token_ids == baseline(model, ids)
    assert hit.stored_chunks == 0  # every chunk is stored already: nothing written again
    one = ids_of(CH, seed=2)
    engine.generate(one, GREEDY)
    again = engine.generate(one, GREEDY)
    assert again.cached_tokens == CH - 1 and again.token_ids == baseline(model, one)


def test_the_tail_chunk_is_never_stored(model, stores):
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    ids = ids_of(3 * CH + 30, seed=3)  # prompt + 8 generated tokens crosses into a 5th chunk
    result = engine.generate(ids, GREEDY)
    assert result.stored_chunks == 3
    memory = store.memory
    assert set(memory.keys_lru()) == set(prefix_keys(ids, CH, engine.namespace()))
    store.flush()
    assert store.lower[0].entries() == 3


def test_a_disabled_cache_neither_reads_nor_writes(model, stores):
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    ids = ids_of(3 * CH + 7, seed=4)
    engine.generate(ids, GREEDY)
    store.flush()
    before = store.stats()
    off = CacheOptions(enabled=False)
    result = engine.generate(ids, GREEDY, cache=off)
    assert (result.cached_tokens, result.hit_tiers, result.stored_chunks) == (0, (), 0)
    assert result.token_ids == baseline(model, ids)
    new = ids_of(3 * CH + 7, seed=5)
    assert engine.generate(new, GREEDY, cache=off).stored_chunks == 0
    store.flush()
    assert store.stats() == before  # no lookup, no get, no put anywhere


def test_salts_isolate(model, stores):
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    ids = ids_of(3 * CH + 7, seed=6)
    assert engine.generate(ids, GREEDY, cache=CacheOptions(salt="alice")).stored_chunks == 3
    assert engine.generate(ids, GREEDY, cache=CacheOptions(salt="bob")).cached_tokens == 0
    assert engine.generate(ids, GREEDY).cached_tokens == 0
    alice = engine.generate(ids, GREEDY, cache=CacheOptions(salt="alice"))
    assert alice.cached_tokens == 3 * CH and alice.token_ids == baseline(model, ids)
    # the engine's own salt (from the configuration) separates deployments sharing a store
    other = prefix_engine(model, store, chunk_size=CH, salt="deployment-2")
    assert other.generate(ids, GREEDY).cached_tokens == 0
    assert other.generate(ids, GREEDY, cache=CacheOptions(salt="alice")).cached_tokens == 0


def test_tenants_isolate_and_are_deleted_by_their_tag(model, stores):
    from kvfuse.kv.keys import tenant_tag

    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    ids = ids_of(2 * CH + 5, seed=8)
    for tenant in ("alice", "bob"):
        for salt in ("", "team"):
            assert (
                engine.generate(
                    ids, GREEDY, cache=CacheOptions(tenant=tenant, salt=salt)
                ).cached_tokens
                == 0
            )
    assert (
        engine.generate(ids, GREEDY, cache=CacheOptions(tenant="alice", salt="team")).cached_tokens
        == 2 * CH
    )
    store.delete_prefix(tenant_tag("alice"))  # every namespace of alice's, none of bob's
    for salt in ("", "team"):
        assert (
            engine.generate(
                ids, GREEDY, cache=CacheOptions(tenant="alice", salt=salt)
            ).cached_tokens
            == 0
        )
    store.delete_prefix(tenant_tag("alice"))
    for salt in ("", "team"):
        assert (
            engine.generate(ids, GREEDY, cache=CacheOptions(tenant="bob", salt=salt)).cached_tokens
            == 2 * CH
        )


def test_store_generated_stores_the_answer_chunks_for_the_follow_up(model, stores):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = ids_of(2 * CH + 6, seed=7)  # 70 tokens; the KV of 70 + 39 tokens covers 3 whole chunks
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH, store_generated=True)
    first = engine.generate(prompt, params)
    assert first.stored_chunks == 3
    follow_up = prompt + first.token_ids + ids_of(20, seed=8)
    result = engine.generate(follow_up, GREEDY)
    assert result.cached_tokens == 3 * CH
    assert result.token_ids == baseline(model, follow_up)

    # the per-request option overrides the engine default, both ways
    other = ids_of(2 * CH + 6, seed=9)
    assert (
        engine.generate(other, params, cache=CacheOptions(store_generated=False)).stored_chunks == 2
    )
    plain = prefix_engine(model, stores.fresh(), chunk_size=CH)
    assert plain.generate(ids_of(2 * CH + 6, seed=10), params).stored_chunks == 2
    assert (
        plain.generate(
            ids_of(2 * CH + 6, seed=11), params, cache=CacheOptions(store_generated=True)
        ).stored_chunks
        == 3
    )


# ------------------------------------------------------------------------------ bad entries


def _entry_file(store: TieredStore, key):
    disk = store.lower[0]
    (path,) = disk.root.glob(f"*/{key_to_filename(key)}")
    return path


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_corrupted_disk_entry_is_a_miss_and_is_replaced(model, stores, where):
    ids = ids_of(4 * CH + 9, seed=12)
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    engine.generate(ids, GREEDY)
    store.flush()
    key = prefix_keys(ids, CH, engine.namespace())[2]
    path = _entry_file(store, key)
    data = bytearray(path.read_bytes())
    data[20 if where == "header" else len(data) - 5] ^= 0x40
    path.write_bytes(bytes(data))

    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    result = engine.generate(ids, GREEDY)
    assert result.cached_tokens == 2 * CH and result.hit_tiers == ("disk", "disk")
    assert result.token_ids == baseline(model, ids)
    assert store.lower[0].stats.snapshot()["errors"] == 1
    store.flush()  # chunks 2.. were prefilled again and re-stored: the file is valid once more
    assert path.read_bytes() != bytes(data) and verify(path.read_bytes(), key)
    assert engine.generate(ids, GREEDY).cached_tokens == 4 * CH


def test_a_corrupted_memory_entry_falls_back_to_the_disk_copy(model, stores):
    ids = ids_of(3 * CH + 9, seed=13)
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    engine.generate(ids, GREEDY)
    store.flush()
    key = prefix_keys(ids, CH, engine.namespace())[1]
    memory = store.memory
    bad = memory.get(key).join()  # an Entry in memory; a serialized copy of it is verified on use
    bad[-1] ^= 1
    memory.put(key, bytes(bad))
    result = engine.generate(ids, GREEDY)
    assert result.cached_tokens == 3 * CH and result.token_ids == baseline(model, ids)
    assert memory.stats.snapshot()["errors"] == 1
    # the reported tiers are the ones that served each chunk, not lookup()'s guess
    assert result.hit_tiers == ("memory", "disk", "memory")
    assert engine.stats_snapshot()["hits_by_tier"] == {"memory": 2, "disk": 1}


def test_entries_of_another_dtype_or_model_are_never_used(model, stores):
    store = stores.fresh()
    ids = ids_of(3 * CH + 9, seed=14)
    writer = prefix_engine(model, store, chunk_size=CH)
    writer.generate(ids, GREEDY)
    fingerprint_changed = LoadedModel(
        model.name, model.folder, model.runner, model.tokenizer, "0" * 32
    )
    readers = {
        "bfloat16": prefix_engine(model, store, chunk_size=CH, kv_dtype="bfloat16"),
        "float32": prefix_engine(model, store, chunk_size=CH, kv_dtype="float32"),
        "fingerprint": prefix_engine(fingerprint_changed, store, chunk_size=CH),
    }
    for name, reader in readers.items():
        assert reader.namespace() != writer.namespace()
        result = reader.generate(ids, GREEDY, cache=CacheOptions(store_generated=False))
        assert result.cached_tokens == 0, name
        assert result.token_ids == baseline(
            reader.model, ids, kv_dtype=reader.settings.cache.kv_dtype
        ), name
        assert result.stored_chunks == 3, name  # into its own namespace

    # even the writer's bytes put under a reader's keys are rejected (the key is inside the entry)
    memory = store.memory
    reader = readers["float32"]
    mine = prefix_keys(ids, CH, writer.namespace())
    theirs = prefix_keys(ids, CH, reader.namespace())
    for a, b in zip(mine, theirs):
        memory.put(b, memory.get(a))
    store.flush()
    store.lower[0].clear()
    result = reader.generate(ids, GREEDY)
    assert result.cached_tokens == 0
    assert result.token_ids == baseline(model, ids, kv_dtype="float32")


def test_a_key_names_content_not_encoding_so_entries_of_any_codec_are_read(model, stores):
    """The codec is not part of a chunk's identity: the entry header says how it is encoded."""
    store = stores.fresh()
    ids = ids_of(3 * CH + 9, seed=14)
    raw, int8 = (
        prefix_engine(model, store, chunk_size=CH),
        prefix_engine(model, store, chunk_size=CH, codec="int8"),
    )
    assert raw.namespace() == int8.namespace()
    raw.generate(ids, GREEDY)
    result = int8.generate(ids, GREEDY)  # lossless raw entries: the exact answer
    assert result.cached_tokens == 3 * CH and result.token_ids == baseline(model, ids)
    other = ids_of(3 * CH + 9, seed=21)
    assert int8.generate(other, GREEDY).stored_chunks == 3  # written as int8 ...
    assert {store.memory.get(k).codec.name for k in prefix_keys(other, CH, raw.namespace())} == {
        "int8"
    }
    hit = raw.generate(other, GREEDY)  # ... and read by an engine that writes raw
    assert hit.cached_tokens == 3 * CH and hit.hit_tiers == ("memory",) * 3
    assert raw.stats_snapshot()["chunk_load_failures"] == 0


def test_a_well_formed_entry_of_the_wrong_dtype_or_position_is_a_miss(model, stores):
    store = stores.fresh()
    ids = ids_of(3 * CH + 9, seed=15)
    fp16 = prefix_engine(model, store, chunk_size=CH)
    fp16.generate(ids, GREEDY)
    memory = store.memory
    keys16 = prefix_keys(ids, CH, fp16.namespace())
    chunk0 = decode_chunk(memory.get(keys16[0]))

    # a valid fp16 entry under the fp32 engine's own key: the engine checks the dtype
    fp32 = prefix_engine(model, store, chunk_size=CH, kv_dtype="float32")
    key32 = prefix_keys(ids, CH, fp32.namespace())[0]
    memory.put(key32, encode_chunk(chunk0, key32, get_codec("raw")))
    result = fp32.generate(ids, GREEDY)
    assert result.cached_tokens == 0 and fp32.stats_snapshot()["chunk_load_failures"] == 1
    assert result.token_ids == baseline(model, ids, kv_dtype="float32")

    # chunk 0's KV (positions 0..31) stored as chunk 1: the engine checks the positions
    store.flush()
    store.lower[0].clear()  # no good copy of chunk 1 on disk to fall back to
    memory.put(keys16[1], encode_chunk(chunk0, keys16[1], get_codec("raw")))
    result = fp16.generate(ids, GREEDY)
    assert result.cached_tokens == CH and fp16.stats_snapshot()["chunk_load_failures"] == 1
    assert result.token_ids == baseline(model, ids)


# ------------------------------------------------------------------------------ control


def test_a_set_cancel_event_stops_before_any_token(model, stores):
    cancel = threading.Event()
    cancel.set()
    result = prefix_engine(model, stores.fresh(), chunk_size=CH).generate(
        ids_of(50), GREEDY, cancel=cancel
    )
    assert result.finish_reason == "cancelled" and result.token_ids == [] and result.text == ""


def test_a_request_cancelled_before_it_starts_does_no_work_and_is_counted(model, stores):
    store = stores.fresh()
    engine = prefix_engine(model, store, chunk_size=CH)
    ids = ids_of(2 * CH + 5, seed=20)
    engine.generate(ids, GREEDY)
    lookups = store.stats()["store"]["lookups"]
    cancel = threading.Event()
    cancel.set()
    result = engine.generate(ids, GREEDY, cancel=cancel)
    assert (
        result.finish_reason == "cancelled" and result.cached_tokens == 0 and result.token_ids == []
    )
    assert store.stats()["store"]["lookups"] == lookups  # skipped in the queue: not even looked up
    s = engine.stats_snapshot()
    assert (s["requests"], s["requests_skipped"]) == (2, 1)
    assert s["tokens_reused"] == 0 and s["prompt_tokens"] == len(ids) and s["hits_by_tier"] == {}


def test_cancelling_mid_generation_stops_after_the_current_token(model, stores):
    cancel = threading.Event()
    pieces: list[str] = []

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()

    ids = ids_of(50, seed=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    result = prefix_engine(model, stores.fresh(), chunk_size=CH).generate(
        ids, params, on_text=on_text, cancel=cancel
    )
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) == 3 and result.token_ids == baseline(model, ids, params)[:3]
    assert result.text == "".join(pieces)


def test_stop_strings_and_stop_tokens(model):
    engine = prefix_engine(model, None, chunk_size=CH)
    ids = ids_of(40, seed=17)
    full = engine.generate(ids, GREEDY)
    assert full.finish_reason == "length" and full.text == " ".join(f"t{t}" for t in full.token_ids)
    words = full.text.split(" ")
    result = engine.generate(
        ids, SamplingParams(max_tokens=8, ignore_eos=True, stop=(" " + words[3],))
    )
    assert result.finish_reason == "stop" and result.text == " ".join(words[:3])
    assert result.stop_sequence == " " + words[3] and full.stop_sequence is None
    result = engine.generate(
        ids, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(full.token_ids[2],))
    )
    assert result.finish_reason == "stop" and result.token_ids == full.token_ids[:2]
    assert result.stop_sequence is None


def test_on_start_gets_the_prompt_usage_before_any_text(model, stores):
    """A request's ``on_start`` runs once, when its prompt is prefilled and before its first
    text, with what the prompt reused and wrote (a warm prompt: its cached chunks)."""
    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    ids = ids_of(2 * CH + 5, seed=21)
    engine.generate(ids, GREEDY)
    seen: list = []
    done = threading.Event()
    request = Request(
        Prompt.plain(ids),
        GREEDY,
        on_start=lambda r: seen.append(("start", r)),
        on_text=lambda piece: seen.append(("text", piece)),
        on_done=lambda o: (seen.append(("done", o.result)), done.set()),
    )
    engine.submit(request)
    while not done.is_set():
        engine.step()
    kinds = [k for k, _ in seen]
    assert kinds[0] == "start" and kinds.count("start") == 1 and kinds[-1] == "done"
    assert "text" in kinds
    started, final = seen[0][1], seen[-1][1]
    assert started.cached_tokens == final.cached_tokens == 2 * CH
    assert started.prompt_tokens == len(ids) and started.token_ids == [] and started.text == ""


def test_prompt_and_max_tokens_must_fit_the_context_window(model):
    engine = prefix_engine(model, None, chunk_size=CH)
    window = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context window"):
        engine.generate(ids_of(window - 4), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="context window"):
        engine.generate(ids_of(window + 1), SamplingParams(max_tokens=1))
    assert (
        len(
            engine.generate(
                ids_of(window - 1), SamplingParams(max_tokens=1, ignore_eos=True)
            ).token_ids
        )
        == 1
    )


def test_bad_prompts_are_value_errors(model):
    engine = prefix_engine(model, None, chunk_size=CH)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.prompts.encode_prompt([1, 2, 512])
    with pytest.raises(ValueError):
        prefix_engine(model, None, kv_dtype="int8")


def test_stats_add_up(model, stores):
    engine = prefix_engine(model, stores.fresh(), chunk_size=CH)
    a, b = ids_of(3 * CH + 5, seed=18), ids_of(2 * CH + 1, seed=19)
    results = [
        engine.generate(a, GREEDY),
        engine.generate(a, GREEDY),
        engine.generate(a[: 2 * CH] + b, GREEDY),
        engine.generate(b, GREEDY, cache=CacheOptions(enabled=False)),
        engine.generate(a, GREEDY, cache=CacheOptions(salt="x")),
        engine.generate(b, SamplingParams(max_tokens=3, ignore_eos=True)),
    ]
    s = SimpleNamespace(**engine.stats_snapshot())
    assert s.requests == len(results)
    assert s.prompt_tokens == sum(r.prompt_tokens for r in results)
    assert s.tokens_reused == sum(r.cached_tokens for r in results) == 3 * CH + 2 * CH
    assert s.tokens_prefilled == s.prompt_tokens - s.tokens_reused
    assert s.tokens_generated == sum(r.completion_tokens for r in results) == 5 * 8 + 3
    assert s.chunks_stored == sum(r.stored_chunks for r in results)
    assert s.hits_by_tier == dict(Counter(t for r in results for t in r.hit_tiers)) == {"memory": 5}
    assert s.chunk_load_failures == 0
