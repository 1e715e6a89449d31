"""Conversations, without a model: lining prompts up against stored ids (re-tokenized text, a
trimmed answer, dropped turns), the index of stored histories, which turns truncation drops, and
the planner's loads from a stored history."""

from __future__ import annotations

import numpy as np
import pytest

from kvfuse.history import (
    HistoryIndex,
    Record,
    Run,
    StoredEntry,
    align,
    byte_sync,
)
from kvfuse.history.align import common_prefix
from kvfuse.history.records import decode_record, encode_record
from kvfuse.kv.keys import ChunkKind, Namespace, prefix_keys, tail_key
from kvfuse.prompts.prompt import Prompt
from kvfuse.prompts.truncate import drop_oldest_turns, without_oldest
from kvfuse.reuse.planner import (
    Compute,
    Load,
    Plan,
    Save,
    history_entries,
    make_plan,
    prompt_keys,
    tail_probe,
)

# A byte table: ids 0..99 spell one letter each ("a".."z" cycling), 100 spells "ab", 101 spells
# "cd", 102 spells "" (a token with no bytes).
TABLE = [bytes([97 + i % 26]) for i in range(100)] + [b"ab", b"cd", b""]


@pytest.mark.parametrize(
    "a,b,start,expected",
    [
        ([0, 1, 2], [0, 1, 2], 0, (3, 3)),  # equal
        ([0, 1, 2, 3], [100, 101], 0, (4, 2)),  # "abcd" both ways
        (
            [0, 1, 2, 5],
            [100, 101],
            0,
            (2, 1),
        ),  # "abcf" vs "abcd": the last common boundary is after "ab"
        ([7, 0, 1], [7, 100, 4], 1, (3, 2)),  # after a shared token
        ([0], [1], 0, (0, 0)),  # nothing in common
        (
            [0, 1],
            [100, 102, 2],
            0,
            (2, 1),
        ),  # an empty new token is never the boundary (it would be dropped)
    ],
)
def test_byte_sync_finds_the_last_common_token_boundary(a, b, start, expected):
    assert byte_sync(a, b, TABLE, start) == expected


def test_align_keeps_the_stored_ids_where_the_text_is_the_same():
    stored = [5, 6, 0, 1, 2, 3]  # "fg" + "abcd", the answer as the model generated it
    new = [5, 6, 100, 101, 9, 9]  # the same text re-tokenized, then a new turn
    al = align(stored, new, TABLE)
    assert al.ids == (5, 6, 0, 1, 2, 3, 9, 9) and al.runs == (Run(0, 6, 0),) and al.reusable == 6
    assert not al.moved
    assert align(stored, new).ids == tuple(new) and align(stored, new).runs == (
        Run(0, 2, 0),
    )  # no table: ids only


def test_align_with_a_trimmed_answer_reuses_up_to_where_the_texts_part():
    stored = [5, 0, 1, 2, 3, 4]
    new = [5, 100, 7, 7]  # the client sent back only "ab" of the answer
    al = align(stored, new, TABLE)
    assert al.ids == (5, 0, 1, 7, 7) and al.runs == (Run(0, 3, 0),)


def test_align_finds_the_kept_turns_after_dropped_ones():
    system = [50, 51, 52]
    dropped = list(range(60, 80))
    kept = list(range(20, 40))
    stored = system + dropped + kept
    new = system + kept + [90, 91]
    al = align(stored, new, TABLE, allow_gap=True)
    assert al.ids == tuple(system + kept + [90, 91])
    assert al.runs == (Run(0, 3, 0), Run(3, 23, 23)) and al.moved and al.reusable == 23
    without = align(stored, new, TABLE)  # truncation mode "recompute": only the head is reused
    assert without.runs == (Run(0, 3, 0),) and without.ids == tuple(new)


def test_a_passage_that_recurs_inside_another_history_is_not_reused_after_a_gap():
    system = [50, 51, 52]
    passage = list(range(20, 40))
    # the passage, then 40 more tokens
    stored = system + list(range(60, 80)) + passage + list(range(0, 40))
    new = system + passage + [90, 91]
    assert align(stored, new, TABLE, allow_gap=True).runs == (Run(0, 3, 0),)


def test_a_short_chance_match_after_a_gap_is_not_reused():
    stored = [50, 51] + list(range(60, 80)) + [1, 2, 3]
    new = [50, 51, 1, 2, 3, 9]
    assert align(stored, new, TABLE, allow_gap=True).runs == (Run(0, 2, 0),)


def test_common_prefix():
    assert (
        common_prefix([1, 2, 3], [1, 2, 4]) == 2
        and common_prefix([], [1]) == 0
        and common_prefix([1], [1]) == 1
    )


# ------------------------------------------------------------------------------ truncation


def msgs(*roles):
    return [{"role": r, "content": f"{r}{i}"} for i, r in enumerate(roles)]


def fits_within(n):
    return lambda m: len(m) <= n


@pytest.mark.parametrize(
    "roles,limit,kept",
    [
        (("system", "user", "assistant", "user"), 4, [0, 1, 2, 3]),  # fits: unchanged
        (
            ("system", "user", "assistant", "user", "assistant", "user"),
            4,
            [0, 3, 4, 5],
        ),  # one turn dropped
        (
            ("system", "user", "assistant", "user", "assistant", "user"),
            2,
            [0, 5],
        ),  # all but the last
        (("user", "assistant", "user", "assistant", "user"), 3, [2, 3, 4]),  # no system prompt
        (("system", "user", "assistant", "user"), 1, None),  # even the last turn alone does not fit
    ],
)
def test_drop_oldest_turns_keeps_the_system_prompt_and_the_last_turn(roles, limit, kept):
    m = msgs(*roles)
    out = drop_oldest_turns(m, fits_within(limit))
    assert (None if out is None else [m.index(x) for x in out]) == kept
    if out is not None:  # what a caller going on with the conversation rebuilds from the count
        assert without_oldest(m, len(m) - len(out)) == out


# ------------------------------------------------------------------------------ the index


def test_records_are_found_by_key_and_by_content_and_stay_in_their_scope():
    index = HistoryIndex(capacity=3)
    ids = list(range(1000, 1300))
    rec = index.add("tenantA:", ids, "ns", cache_key="conv-1")
    # by key, whatever the prompt
    assert index.candidates("tenantA:", [7, 7, 7], cache_key="conv-1") == [rec]
    assert index.candidates("tenantA:", ids[:200] + [5, 5]) == [rec]  # by content
    assert index.candidates("tenantA:", ids[150:]) == [rec]  # content anywhere (dropped turns)
    assert index.candidates("tenantB:", ids, cache_key="conv-1") == []  # never another scope's
    assert index.candidates("tenantA:", list(range(5000, 5300))) == []


def test_a_turn_replaces_the_record_it_extended_and_capacity_bounds_the_rest():
    index = HistoryIndex(capacity=2)
    first = index.add("s:", list(range(100)), "ns")
    second = index.add("s:", list(range(130)), "ns", replaces=first)
    assert len(index) == 1 and index.candidates("s:", list(range(120))) == [second]
    index.add("s:", list(range(500, 600)), "ns")
    index.add("s:", list(range(700, 800)), "ns")
    assert len(index) == 2 and index.candidates("s:", list(range(120))) == []  # the oldest went
    assert index.delete_prefix("s:") == 2 and len(index) == 0
    assert HistoryIndex(capacity=0).add("s:", [1, 2], "ns") is None


def test_records_survive_a_restart_in_their_folder_and_damaged_files_are_never_used(tmp_path):
    ns = Namespace("model", "float16", "L2xH1xD4", tenant="alice")
    scope = ns.key_prefix()  # records are checked against their scope when read back
    ids = list(range(1000, 1300))
    entries = tuple(StoredEntry(k, i * 4, 4) for i, k in enumerate(prefix_keys(ids[:8], 4, ns)))
    index = HistoryIndex(capacity=8, path=tmp_path)
    rec = index.add(scope, ids, ns, entries, cache_key="conv-1")
    other = index.add(scope, list(range(5000, 5300)), ns)
    restarted = HistoryIndex(capacity=8, path=tmp_path)
    found = restarted.candidates(scope, [1, 2], cache_key="conv-1")
    assert len(found) == 1 and found[0].ids.tolist() == ids and found[0].entries == entries
    assert found[0].namespace == ns and found[0].cache_key == "conv-1"
    assert restarted.candidates(scope, ids[100:])[0].ids.tolist() == ids  # by content too
    damaged = tmp_path / other.file
    damaged.write_bytes(damaged.read_bytes()[:-3])  # truncated
    (tmp_path / "junk.rec").write_bytes(b"not a record")
    again = HistoryIndex(capacity=8, path=tmp_path)
    assert len(again) == 1 and again.damaged == 2 and not damaged.exists()
    assert again.delete_prefix(scope) == 1 and not list(tmp_path.glob("*.rec"))
    assert rec.file is not None


def test_a_record_file_round_trips():
    ns = Namespace("m", "float16", "L1xH1xD1", salt="s\x00history:ab")
    base = Namespace("m", "float16", "L1xH1xD1", salt="s")  # ns is derived from it
    rec = Record(base.key_prefix(), np.arange(7, dtype=np.uint32), ns, (), None)
    back = decode_record(encode_record(rec))
    assert back.ids.tolist() == list(range(7)) and back.namespace == ns and back.cache_key is None
    for bad in (
        b"",
        b"KVFHIST1",
        encode_record(rec)[:-1],
        encode_record(rec).replace(b'"n": 7', b'"n": 8'),
    ):
        with pytest.raises(ValueError):
            decode_record(bad)


# ------------------------------------------------------------------------------ the planner

CH = 4
NS = Namespace("model", "float16", "L2xH1xD4")
M, D = "memory", "disk"


def test_history_entries_are_the_chain_and_a_tail():
    ids = list(range(10, 20))
    entries = history_entries(ids, CH, NS)
    chain = prefix_keys(ids, CH, NS)
    assert entries == [
        StoredEntry(chain[0], 0, 4),
        StoredEntry(chain[1], 4, 4),
        StoredEntry(tail_key(chain[1], ids[8:], NS), 8, 2),
    ]
    assert entries[-1].key.kind is ChunkKind.TAIL
    assert history_entries(ids[:8], CH, NS)[-1].key == chain[1]  # no partial chunk: no tail


def test_tail_probe_names_every_length_longest_first():
    ids = list(range(10, 17))  # one chunk, then 3 tokens
    chain = prefix_keys(ids, CH, NS)
    probe = tail_probe(ids, chain, 1, CH, NS)
    assert [e.tokens for e in probe] == [3, 2, 1]
    assert probe[0] == StoredEntry(tail_key(chain[0], ids[4:7], NS), 4, 3)
    assert [e.tokens for e in tail_probe(ids, chain, 0, CH, NS)] == [
        3,
        2,
        1,
    ]  # from the root: a chunk minus one


def test_a_stored_history_loads_its_tail_and_only_the_new_tokens_are_computed():
    stored = list(range(10, 20))  # the previous turn: 2 chunks + a tail of 2
    entries = history_entries(stored, CH, NS)
    prompt = Prompt.plain(stored + [50, 51, 52])
    keys = prompt_keys(prompt, CH, NS).with_history(entries, [Run(0, 10, 0)])
    # the chain's own chunks are not repeated
    assert [e.key for e in keys.history] == [entries[2].key]
    chain = keys.prefix
    plan = make_plan(prompt, keys, [M, M, None, D])  # chain chunk 2 ([8, 12)) is new: a miss
    assert plan == Plan(
        13,
        loads=(
            Load(chain[0], M, 0, 4, 0),
            Load(chain[1], M, 4, 8, 4),
            Load(entries[2].key, D, 8, 10, 8, 0, 2),
        ),
        computes=(Compute(10, 13),),
        saves=(Save(chain[2], 8, 12),),
    )
    assert plan.reused_tokens == 10


def test_a_longer_stored_history_is_used_in_part_and_the_last_token_is_computed():
    stored = list(range(10, 20))
    entries = history_entries(stored, CH, NS)
    prompt = Prompt.plain(stored[:9])  # a prompt the history contains (a repeated prompt)
    keys = prompt_keys(prompt, CH, NS).with_history(entries, [Run(0, 9, 0)])
    plan = make_plan(prompt, keys, [M, M, M])
    assert plan.loads[-1] == Load(entries[2].key, M, 8, 9, 8, 0, 2)
    assert plan.computes == (Compute(8, 9),) and plan.reused_tokens == 8


def test_kept_turns_load_at_their_new_positions_from_inside_stored_entries():
    stored = list(range(10, 22))  # 3 chunks; tokens [6, 12) are kept after dropping [2, 6)
    entries = history_entries(stored, CH, NS)
    prompt = Prompt.plain(stored[:2] + stored[6:] + [70])
    keys = prompt_keys(prompt, CH, NS).with_history(entries, [Run(0, 2, 0), Run(2, 8, 6)])
    plan = make_plan(prompt, keys, [None, None, M, D, M])
    assert plan.loads == (
        Load(entries[0].key, M, 0, 2, 0, 0, 4),
        Load(entries[1].key, D, 2, 4, 4, 2, 4),
        Load(entries[2].key, M, 4, 8, 8, 0, 4),
    )
    assert all(x.moved for x in plan.loads[1:]) and not plan.loads[0].moved
    assert plan.computes == (Compute(8, 9),) and plan.reused_tokens == 8


def test_a_missing_entry_in_the_middle_of_a_history_is_computed():
    stored = list(range(10, 22))
    entries = history_entries(stored, CH, NS)
    prompt = Prompt.plain(stored[:2] + stored[6:] + [70])
    keys = prompt_keys(prompt, CH, NS).with_history(entries, [Run(0, 2, 0), Run(2, 8, 6)])
    plan = make_plan(prompt, keys, [None, None, M, None, M])  # the entry of stored [4, 8) is gone
    assert [(x.start, x.end) for x in plan.loads] == [(0, 2), (4, 8)]
    assert plan.computes == (Compute(2, 4), Compute(8, 9)) and plan.reused_tokens == 6
