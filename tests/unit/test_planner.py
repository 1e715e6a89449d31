"""The planner, without a model: exact expected plans for hits, partial hits, misses, damaged entries
and documents (as vLLM tests its block manager: the plan is data, every field asserted)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfuse.kv.keys import Namespace, content_keys, document_key, prefix_keys
from kvfuse.prompts.prompt import Prompt
from kvfuse.reuse.planner import (
    Compute,
    ContentChunk,
    Load,
    Plan,
    Precompute,
    Save,
    content_lookups,
    full_prefill,
    generated_saves,
    make_plan,
    prompt_keys,
    replan,
)

CH = 4
NS = Namespace("model", "float16", "L2xH1xD4")
M, D = "memory", "disk"


def plain(n: int) -> tuple[Prompt, list]:
    prompt = Prompt.plain(range(100, 100 + n))
    return prompt, prefix_keys(prompt.ids, CH, NS)


def plan_of(prompt: Prompt, where, context=()) -> Plan:
    return make_plan(prompt, prompt_keys(prompt, CH, NS, context), where)


# ------------------------------------------------------------------------------- plain prompts

P10, K10 = plain(10)  # chunks [0, 4) [4, 8), tail [8, 10)
P8, K8 = plain(8)  # whole chunks only
P4, K4 = plain(4)

CASES = {
    "miss: compute all, store every whole chunk": (
        P10,
        [None, None],
        Plan(10, computes=(Compute(0, 10),), saves=(Save(K10[0], 0, 4), Save(K10[1], 4, 8))),
    ),
    "hit: load the chunks, compute the tail": (
        P10,
        [M, D],
        Plan(
            10,
            loads=(Load(K10[0], M, 0, 4, 0), Load(K10[1], D, 4, 8, 4)),
            computes=(Compute(8, 10),),
        ),
    ),
    "partial hit: load the first, compute and store the rest": (
        P10,
        [M, None],
        Plan(
            10,
            loads=(Load(K10[0], M, 0, 4, 0),),
            computes=(Compute(4, 10),),
            saves=(Save(K10[1], 4, 8),),
        ),
    ),
    "a later hit after a miss is not a prefix: nothing loads, the hit is not stored again": (
        P10,
        [None, M],
        Plan(10, computes=(Compute(0, 10),), saves=(Save(K10[0], 0, 4),)),
    ),
    "whole chunks all cached: everything loads, the last token is computed for its logits": (
        P8,
        [M, M],
        Plan(
            8, loads=(Load(K8[0], M, 0, 4, 0), Load(K8[1], M, 4, 8, 4)), computes=(Compute(7, 8),)
        ),
    ),
    "whole chunks, the last one missing: computed and stored": (
        P8,
        [D, None],
        Plan(
            8,
            loads=(Load(K8[0], D, 0, 4, 0),),
            computes=(Compute(4, 8),),
            saves=(Save(K8[1], 4, 8),),
        ),
    ),
    "one cached chunk is the whole prompt: loaded, its last token computed, nothing stored": (
        P4,
        [M],
        Plan(4, loads=(Load(K4[0], M, 0, 4, 0),), computes=(Compute(3, 4),)),
    ),
    "a prompt shorter than a chunk has no keys": (
        Prompt.plain([1, 2, 3]),
        [],
        Plan(3, computes=(Compute(0, 3),)),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plain_prompt_plans(name):
    prompt, where, expected = CASES[name]
    assert plan_of(prompt, where) == expected


def test_unusable_entries_are_planned_around_as_misses():
    prompt, keys = plain(14)  # 3 chunks + 2
    where = [M, M, D]
    assert plan_of(prompt, where).loads == tuple(
        Load(keys[i], where[i], 4 * i, 4 * i + 4, 4 * i) for i in range(3)
    )
    # chunk 1 turned out damaged when fetched (the store removed it): the chain stops there, chunk 1 is
    # computed and stored again; chunk 2 is computed (it follows a miss) but still held by disk: not stored
    after = replan(prompt, prompt_keys(prompt, CH, NS), where, {keys[1]})
    assert after == Plan(
        14,
        loads=(Load(keys[0], M, 0, 4, 0),),
        computes=(Compute(4, 14),),
        saves=(Save(keys[1], 4, 8),),
    )
    # the first chunk damaged: nothing is loaded
    assert replan(prompt, prompt_keys(prompt, CH, NS), where, {keys[0]}) == Plan(
        14, computes=(Compute(0, 14),), saves=(Save(keys[0], 0, 4),)
    )
    assert replan(prompt, prompt_keys(prompt, CH, NS), where, set()) == plan_of(prompt, where)


# ------------------------------------------------------------------------------- found spans (automatic reuse)

P24, K24 = plain(24)  # 6 chunks
C_SPANS = [
    (0, 5),
    (5, 9),
    (9, 14),
    (14, 20),
    (20, 24),
]  # content-defined chunks (kv/content.py gives them)
KC = content_keys(P24.ids, C_SPANS, NS)
CONTENT_KEYS = replace(
    prompt_keys(P24, CH, NS),
    content=tuple(ContentChunk(k, s, e) for k, (s, e) in zip(KC, C_SPANS)),
    store_content=True,
)
NO_PREFIX = [M] + [None] * 5  # the first chunk hits, the rest of the chain misses

FOUND = {
    "found spans after the chain's hits: loaded as stored, the rest computed; nothing stored under the "
    "chain after the first span; the chunks not found stored as content": (
        NO_PREFIX,
        [None, M, None, D, None],
        Plan(
            24,
            loads=(
                Load(K24[0], M, 0, 4, 0),
                Load(KC[1], M, 5, 9, None),
                Load(KC[3], D, 14, 20, None),
            ),
            computes=(Compute(4, 5), Compute(9, 14), Compute(20, 24)),
            saves=(Save(KC[0], 0, 5), Save(KC[2], 9, 14), Save(KC[4], 20, 24)),
        ),
    ),
    "a found chunk holding the last token is not used (its logits are needed); the chain is stored": (
        NO_PREFIX,
        [None, None, None, None, M],
        Plan(
            24,
            loads=(Load(K24[0], M, 0, 4, 0),),
            computes=(Compute(4, 24),),
            saves=(
                *(Save(K24[i], 4 * i, 4 * i + 4) for i in range(1, 6)),
                Save(KC[0], 0, 5),
                Save(KC[1], 5, 9),
                Save(KC[2], 9, 14),
                Save(KC[3], 14, 20),
            ),
        ),
    ),
    "a found chunk overlapping the chain's hits is not used": (
        [M, M, M, None, None, None],
        [None, M, None, None, None],
        Plan(
            24,
            loads=tuple(Load(K24[i], M, 4 * i, 4 * i + 4, 4 * i) for i in range(3)),
            computes=(Compute(12, 24),),
            saves=(
                *(Save(K24[i], 4 * i, 4 * i + 4) for i in range(3, 6)),
                Save(KC[0], 0, 5),
                Save(KC[2], 9, 14),
                Save(KC[3], 14, 20),
                Save(KC[4], 20, 24),
            ),
        ),
    ),
    "a span right at the start, nothing from the chain: every prefix chunk after it holds blended KV": (
        [None] * 6,
        [M, None, None, None, None],
        Plan(
            24,
            loads=(Load(KC[0], M, 0, 5, None),),
            computes=(Compute(5, 24),),
            saves=(Save(KC[1], 5, 9), Save(KC[2], 9, 14), Save(KC[3], 14, 20), Save(KC[4], 20, 24)),
        ),
    ),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found_span_plans(name):
    where, found, expected = FOUND[name]
    plan = make_plan(P24, CONTENT_KEYS, where, found)
    assert plan == expected
    assert plan.blended == bool(plan.found_spans) and all(x.moved for x in plan.found_spans)


def test_found_spans_without_storage_and_when_damaged():
    keys = replace(CONTENT_KEYS, store_content=False)  # a prompt below blend.auto_min_tokens
    plan = make_plan(P24, keys, NO_PREFIX, [None, M, None, D, None])
    assert plan.saves == () and [x.key for x in plan.found_spans] == [KC[1], KC[3]]
    assert plan.reused_tokens == 4 + 4 + 6 and plan.computed_tokens == 10
    # a span found damaged when read: planned around like any unusable entry (computed, stored again)
    after = replan(P24, CONTENT_KEYS, NO_PREFIX, {KC[3]}, [None, M, None, D, None])
    assert [x.key for x in after.found_spans] == [KC[1]] and Compute(9, 24) in after.computes
    assert Save(KC[3], 14, 20) in after.saves
    assert make_plan(P24, CONTENT_KEYS, NO_PREFIX) == make_plan(
        P24, CONTENT_KEYS, NO_PREFIX, [None] * 5
    )


def test_content_lookups_are_the_chunks_after_the_chain_before_the_last_token():
    assert content_lookups(CONTENT_KEYS, NO_PREFIX) == [1, 2, 3]  # [5, 9) [9, 14) [14, 20)
    assert content_lookups(CONTENT_KEYS, [None] * 6) == [0, 1, 2, 3]
    assert content_lookups(CONTENT_KEYS, [M] * 6) == []  # a whole-prompt hit: nothing to look for
    # automatic reuse off: no content keys
    assert content_lookups(prompt_keys(P24, CH, NS), NO_PREFIX) == []


# ------------------------------------------------------------------------------- documents

PREFIX, DOC1, DOC2, SUFFIX = list(range(1, 7)), [20, 21, 22, 23, 24], [30, 31, 32], [40, 41]
# prefix [0, 6), doc1 [6, 11), doc2 [11, 14), suffix [14, 16)
BLENDED = Prompt.of(PREFIX, [DOC1, DOC2], SUFFIX)
KP = prefix_keys(PREFIX, CH, NS)
KD1, KD2 = document_key(DOC1, NS), document_key(DOC2, NS)


def test_prompt_keys_are_the_prefix_chain_then_one_key_per_document():
    keys = prompt_keys(BLENDED, CH, NS)
    assert (
        keys.all() == [KP[0], KD1, KD2] and keys.prefix == (KP[0],) and keys.documents == (KD1, KD2)
    )


def test_documents_load_wherever_they_are_and_move_to_their_place():
    plan = plan_of(BLENDED, [M, D, M])
    assert plan == Plan(
        16,
        loads=(Load(KP[0], M, 0, 4, 0), Load(KD1, D, 6, 11, 0), Load(KD2, M, 11, 14, 0)),
        computes=(Compute(4, 6), Compute(14, 16)),
    )
    assert [x.moved for x in plan.loads] == [False, True, True]
    # the steps in slot order: a compute only needs the slots before it
    assert plan.in_order() == [
        Load(KP[0], M, 0, 4, 0),
        Compute(4, 6),
        Load(KD1, D, 6, 11, 0),
        Load(KD2, M, 11, 14, 0),
        Compute(14, 16),
    ]
    assert plan.reused_tokens == 4 + 5 + 3 and plan.computed_tokens == 4 and plan.has_documents


def test_a_missing_document_is_precomputed_on_its_own_once_then_loaded():
    prompt = Prompt.of(PREFIX, [DOC1, DOC2, DOC1], SUFFIX)  # doc1 twice: [6, 11) and [14, 19)
    plan = plan_of(prompt, [None, None, M, None], context=(1,))
    kd1, kd2 = (
        document_key(DOC1, NS, (1,)),
        document_key(DOC2, NS, (1,)),
    )  # computed behind BOS: other keys
    assert plan.precomputes == (Precompute(kd1, tuple(DOC1), (1,)),)
    assert plan.loads == (
        Load(kd1, None, 6, 11, 1),
        Load(kd2, M, 11, 14, 1),
        Load(kd1, None, 14, 19, 1),
    )
    assert plan.computes == (Compute(0, 6), Compute(19, 21)) and plan.saves == (Save(KP[0], 0, 4),)
    # only the stored doc2 was reused; doc1 was computed for this request
    assert plan.reused_tokens == 3


def test_a_prompt_ending_in_a_document_recomputes_its_last_token():
    prompt = Prompt.of(documents=[DOC1])
    plan = plan_of(prompt, [M])
    assert plan == Plan(5, loads=(Load(KD1, M, 0, 5, 0),), computes=(Compute(4, 5),))
    assert plan.in_order() == [Load(KD1, M, 0, 5, 0), Compute(4, 5)] and plan.reused_tokens == 4


BLEND_NS = Namespace("model", "float16", "L2xH1xD4", salt="blend:test")


def test_a_blended_prompt_is_stored_as_a_chain_and_then_an_exact_prefix_hit():
    keys = prompt_keys(BLENDED, CH, NS, blend_namespace=BLEND_NS)
    # everything before the suffix: 3 whole chunks
    chain = prefix_keys(BLENDED.ids[:14], CH, BLEND_NS)
    assert keys.blended == tuple(chain) and keys.all()[-3:] == chain
    plan = make_plan(BLENDED, keys, [M, M, M, None, None, None])
    # after the blend
    assert plan.saves == tuple(Save(k, 4 * i, 4 * i + 4) for i, k in enumerate(chain))
    assert plan.computes == (Compute(4, 6), Compute(14, 16)) and plan.has_documents
    # blended before: the documents are not needed
    hit = make_plan(BLENDED, keys, [M, None, None, M, D, D])
    assert hit == Plan(
        16,
        loads=(Load(chain[0], M, 0, 4, 0), Load(chain[1], D, 4, 8, 4), Load(chain[2], D, 8, 12, 8)),
        computes=(Compute(12, 16),),
    )
    partial = make_plan(BLENDED, keys, [M, M, M, M, None, D])  # a partial chain is not used
    assert partial.has_documents and len(partial.saves) == 3
    # no documents
    assert prompt_keys(Prompt.plain(range(20)), CH, NS, blend_namespace=BLEND_NS).blended == ()


def test_a_damaged_document_becomes_a_precompute():
    plan = replan(BLENDED, prompt_keys(BLENDED, CH, NS), [M, D, M], {KD1})
    assert plan.precomputes == (Precompute(KD1, tuple(DOC1)),) and plan.loads[1] == Load(
        KD1, None, 6, 11, 0
    )


# ------------------------------------------------------------------------------- the rest


def test_bad_inputs():
    with pytest.raises(ValueError, match="lookup answers"):
        plan_of(P10, [M])
    with pytest.raises(ValueError, match="empty"):
        Prompt.of(documents=[[1], []])
    with pytest.raises(ValueError):
        Prompt(())


def test_without_a_cache_everything_is_computed():
    assert full_prefill(BLENDED) == Plan(16, computes=(Compute(0, 16),))


def test_generated_stores_cover_the_answer_chunks_whose_kv_exists():
    ids = list(range(100, 100 + 13))  # a 6-token prompt (1 whole chunk) + 7 generated tokens
    keys = prefix_keys(ids[:12], CH, NS)
    assert generated_saves(ids, 12, CH, NS, first_chunk=1) == [
        Save(keys[1], 4, 8),
        Save(keys[2], 8, 12),
    ]
    # chunk 2's KV is not all there
    assert generated_saves(ids, 11, CH, NS, first_chunk=1) == [Save(keys[1], 4, 8)]
