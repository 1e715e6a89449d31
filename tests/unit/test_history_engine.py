"""Conversations through the engine on tiny random models (CPU): every earlier token reused turn
after turn, found again by content after a restart, lined up when the ids differ, kept at new
positions after dropped turns, saved off the request path, prefetched for the queue and kept in
memory while queued. Greedy output is compared with a cache-free run where reuse is exact."""

from __future__ import annotations

import threading

import pytest
import torch

from kvfuse.config import EngineSettings
from kvfuse.engine import CacheOptions, Engine
from kvfuse.engine.request import Request
from kvfuse.generation import SamplingParams
from kvfuse.prompts.prompt import Prompt
from kvfuse.store import TieredStore
from kvfuse.store.prefetch import Prefetcher
from kvfuse.tiers import DiskTier, MemoryTier

CH = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def model(tiny_loaded):
    return tiny_loaded("llama")


def reference(model, ids, params=GREEDY):
    return Engine(model, None, EngineSettings.of(chunk_size=CH)).generate(ids, params).token_ids


def converse(engine, model, turns=5, seed=0, cache=CacheOptions()):
    """A conversation of ``turns`` turns: each prompt is the previous prompt, its answer and new
    user tokens. Returns the results; checks every answer against a cache-free run."""
    history, results = [], []
    for turn in range(turns):
        prompt = history + ids_of(7 + 3 * turn, seed * 100 + turn)
        r = engine.generate(prompt, GREEDY, cache=cache)
        assert r.token_ids == reference(model, prompt), f"turn {turn}"
        results.append((prompt, r))
        history = prompt + r.token_ids
    return results


def test_every_turn_reuses_the_previous_prompt_and_answer(model, tmp_path):
    engine = Engine(model, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=CH))
    results = converse(engine, model)
    for (prev_prompt, prev), (prompt, r) in zip(results, results[1:]):
        # ignore_eos: the last answer token is never fed back, so its KV does not exist
        assert r.cached_tokens >= len(prev_prompt) + len(prev.token_ids) - 1
        assert (
            r.prompt_tokens - r.cached_tokens
            <= len(prompt) - len(prev_prompt) - len(prev.token_ids) + 1
        )
    s = engine.stats_snapshot()
    assert s["history_requests"] == 4 and s["history_tokens_reused"] > 0
    engine.close()


def test_a_repeated_prompt_reuses_all_but_its_last_token(model):
    engine = Engine(model, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=CH))
    ids = ids_of(2 * CH + 5, 7)
    engine.generate(ids, GREEDY)
    again = engine.generate(ids, GREEDY)
    assert again.cached_tokens == len(ids) - 1 and again.token_ids == reference(model, ids)
    engine.close()


def test_after_a_restart_the_history_is_found_on_disk_by_content(model, tmp_path):
    def store():
        return TieredStore(MemoryTier(64 << 20), [DiskTier(tmp_path / "kv", 64 << 20)])

    first = Engine(model, store(), EngineSettings.of(chunk_size=CH))
    ((prompt, r),) = converse(first, model, turns=1, seed=3)
    first.close()  # saves and flushes: the disk tier keeps the history
    # no records: found through the chain and the tail
    restarted = Engine(model, store(), EngineSettings.of(chunk_size=CH))
    follow = prompt + r.token_ids + ids_of(5, 99)
    again = restarted.generate(follow, GREEDY)
    assert again.cached_tokens == len(prompt) + len(r.token_ids) - 1
    # by the request, or the prefetcher just before it
    assert restarted.cache_stats()["disk"]["hits"] > 0
    assert again.token_ids == reference(model, follow)
    restarted.close()


def test_a_keyed_conversation_that_tokenizes_differently_is_lined_up_after_a_restart(
    model, tmp_path
):
    def engine():
        e = Engine(
            model,
            TieredStore(MemoryTier(64 << 20), [DiskTier(tmp_path / "kv", 64 << 20)]),
            EngineSettings.of(chunk_size=CH, history_path=str(tmp_path / "kv" / "histories")),
        )
        e.cache.parts.keying.token_bytes = table
        return e

    table = [b"<%d>" % i for i in range(model.config.vocab_size)]
    table[300] = b"<301><302>"
    first = ids_of(40, 8) + [301, 302] + ids_of(5, 9)
    cache = CacheOptions(history_key="conversation-9")
    e1 = engine()
    r1 = e1.generate(first, GREEDY, cache=cache)
    e1.close()
    e2 = engine()  # a restart: the record of the ids that ran is read back from its file
    retokenized = ids_of(40, 8) + [300] + ids_of(5, 9) + r1.token_ids + [4, 4]
    r2 = e2.generate(retokenized, GREEDY, cache=cache)
    assert r2.prompt_tokens == len(first) + len(r1.token_ids) + 2
    assert r2.cached_tokens >= len(first) + len(r1.token_ids) - 1
    # read from disk (by the request, or the prefetcher just before)
    assert e2.cache_stats()["disk"]["hits"] > 0
    e2.close()


def test_a_history_that_tokenizes_differently_reuses_the_stored_ids(model):
    engine = Engine(model, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=CH))
    # A byte table in which token 300 spells what tokens 301 and 302 spell together: the client's
    # text of the history re-tokenizes to [300] where the engine generated [301, 302].
    table = [b"<%d>" % i for i in range(model.config.vocab_size)]
    table[300] = b"<301><302>"
    engine.cache.parts.keying.token_bytes = table
    first = ids_of(20, 5) + [301, 302] + ids_of(5, 6)
    engine.generate(first, GREEDY)
    retokenized = ids_of(20, 5) + [300] + ids_of(5, 6)
    r = engine.generate(retokenized + [9, 9, 9], GREEDY)
    assert r.prompt_tokens == len(first) + 3  # the stored ids run, not the new ones
    assert r.cached_tokens >= len(first)
    assert engine.stats_snapshot()["history_requests"] == 1
    engine.close()


@pytest.mark.parametrize("mode", ["reuse", "recompute"])
def test_kept_turns_after_dropped_ones_are_reused_at_their_new_positions_or_recomputed(model, mode):
    engine = Engine(
        model, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=CH, truncation=mode)
    )
    system, dropped, kept = ids_of(10, 1), ids_of(40, 2), ids_of(40, 3)
    engine.generate(system + dropped + kept, GREEDY)
    truncated = system + kept + ids_of(6, 4)
    r = engine.generate(truncated, GREEDY)
    s = engine.stats_snapshot()
    assert r.prompt_tokens == len(truncated) and len(r.token_ids) == GREEDY.max_tokens
    if mode == "reuse":  # measured, not assumed: the moved tokens are counted
        assert r.cached_tokens >= len(system) + len(kept) and s["moved_tokens_reused"] >= len(kept)
        # the next turn: exact reuse again
        again = engine.generate(truncated + r.token_ids + [5, 6], GREEDY)
        assert again.cached_tokens >= len(truncated) + len(r.token_ids) - 1
    else:
        assert r.cached_tokens <= len(system) and s["moved_tokens_reused"] == 0
        assert r.token_ids == reference(model, truncated)
    engine.close()


class GatedTier(MemoryTier):
    """A lower tier whose writes wait for a gate: a slow store, a fault no real input produces."""

    def __init__(self):
        super().__init__(64 << 20, name="slow")
        self.gate = threading.Event()

    def put(self, key, value):
        self.gate.wait(10)
        super().put(key, value)


def test_neither_the_answer_nor_the_saver_waits_for_a_slow_tier(model):
    slow = GatedTier()
    store = TieredStore(MemoryTier(64 << 20), [slow], write_queue_size=1)
    engine = Engine(model, store, EngineSettings.of(chunk_size=CH))
    ids = ids_of(3 * CH + 3, 11)
    r = engine.generate(ids, GREEDY)  # returns while the slow tier is still blocked
    assert r.token_ids == reference(model, ids) and slow.entries() == 0
    saver = engine.cache.parts.saver
    # the saver is done while the slow tier still holds its first write: it never waited for room
    assert saver.flush(10) and not store.flush(0.05)
    saved = saver.stats.snapshot()
    assert saved["saved_entries"] == r.stored_chunks and saved["save_errors"] == 0
    # one write held at the gate, one queued (unless the second came before the writer took the
    # first off the queue: a race the test does not control), the rest dropped and counted
    s = store.stats()
    dropped = s["slow"]["dropped_writes"]
    assert dropped == s["store"]["queue_full_drops"]
    assert r.stored_chunks - 2 <= dropped <= r.stored_chunks - 1
    assert store.memory.entries() == r.stored_chunks  # every memory copy kept
    slow.gate.set()
    assert engine.flush(10)
    assert slow.entries() == r.stored_chunks - dropped
    again = engine.generate(ids, GREEDY)  # and the memory copies serve
    assert again.token_ids == r.token_ids and again.cached_tokens >= 3 * CH
    engine.close()


def test_a_turn_waits_for_its_history_when_only_a_slow_lower_tier_can_keep_it(model):
    slow = GatedTier()
    # memory keeps nothing: the history is findable only below
    store = TieredStore(MemoryTier(1), [slow])
    engine = Engine(model, store, EngineSettings.of(chunk_size=CH))
    first = ids_of(2 * CH + 3, 12)
    r = engine.generate(first, GREEDY)
    # once the saver has handed them over: queued for the slow tier, not findable yet
    assert engine.cache.parts.saver.flush(10) and not store.flush(0.05)
    follow = first + r.token_ids + [5, 6]
    threading.Timer(0.3, slow.gate.set).start()  # the slow tier finishes its writes a moment later
    again = engine.generate(follow, GREEDY)
    # it waited instead of recomputing
    assert again.cached_tokens >= len(first) + len(r.token_ids) - 1
    assert engine.cache.parts.saver.stats.snapshot()["save_waits"] >= 1
    assert again.token_ids == reference(model, follow)
    engine.close()


@pytest.mark.parametrize("eviction", ["queue", "lru"])
def test_queued_requests_are_prefetched_and_kept_in_memory_while_they_wait(
    model, tmp_path, eviction
):
    writer = Engine(
        model,
        TieredStore(MemoryTier(64 << 20), [DiskTier(tmp_path / "kv", 256 << 20)]),
        EngineSettings.of(chunk_size=CH),
    )
    history = ids_of(4 * CH + 2, 40)
    history += writer.generate(history, GREEDY).token_ids
    writer.close()  # the conversation's history is on disk now
    c = model.config
    chunk_bytes = c.num_layers * 2 * CH * c.num_kv_heads * c.head_dim * 2
    memory = MemoryTier(7 * chunk_bytes)  # room for about one conversation
    store = TieredStore(memory, [DiskTier(tmp_path / "kv", 256 << 20)])
    engine = Engine(
        model, store, EngineSettings.of(chunk_size=CH, eviction=eviction, max_running=1)
    )  # one at a time: a queue
    prefetcher = engine.cache.prefetcher or Prefetcher(store)
    prefetcher.close()  # driven by hand below, so that nothing depends on timing
    store.prefetching = True
    others = [Request(Prompt.plain(ids_of(4 * CH + 2, 50 + i)), GREEDY) for i in range(2)]
    queued = Request(Prompt.plain(history + [7]), GREEDY)
    for r in others + [queued]:  # the conversation's next turn waits behind two other requests
        engine.submit(r)
    wanted = [
        k for k, w in zip(store.upcoming(), store.lookup(store.upcoming()).where) if w is not None
    ]
    assert len(wanted) == 5 and not any(memory.contains(k) for k in wanted)  # 4 chunks and the tail
    assert prefetcher.run_once() == 5  # from disk into memory before the request runs
    while not all(r.done for r in others):  # the others run first and fill memory
        engine.step()
    engine.flush()  # their histories are saved (filling memory) before the queued request runs
    assert memory.stats.snapshot()["evictions"] > 0
    kept = all(memory.contains(k) for k in wanted)
    while engine.has_work():
        engine.step()
    s = store.stats()["store"]
    if eviction == "queue":
        assert kept and s["prefetch_hits"] == 5 and s["prefetch_misses"] == 0
    else:  # LRU evicted what was prefetched: read from disk again when the request ran
        assert not kept and s["prefetch_misses"] > 0
    engine.close()
