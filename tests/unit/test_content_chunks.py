"""Content-defined chunks of token ids (``kvfuse/kv/content.py``) and their keys: the same run of
tokens is cut at the same places wherever it appears (past its first ``horizon()`` tokens), sizes
stay within their bounds, and the keys name the tokens only (namespaced like every key)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvfuse.kv import content
from kvfuse.kv.content import boundaries, chunks, horizon
from kvfuse.kv.keys import ChunkKey, ChunkKind, Namespace, content_keys, document_key

NS = Namespace("model", "float16", "L2xH1xD4")


def run(seed: int, n: int, vocab: int = 50_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


R = run(1, 1500)

# (what precedes the run, what follows it): the run's cuts must agree past its horizon.
CONTEXTS = {
    "nothing before": ([], []),
    "a short prefix": (run(2, 5), []),
    "a long prefix": (run(3, 700), []),
    "a prefix and a suffix": (run(4, 90), run(5, 40)),
    "the run itself before": (R[:300], run(6, 3)),
    "a prefix of repeated tokens": ([7] * 150, []),
}


@pytest.mark.parametrize("name", list(CONTEXTS))
@pytest.mark.parametrize("sizes", [(content.MIN_SIZE, content.MAX_SIZE), (4, 16), (1, 2), (30, 60)])
def test_a_run_is_cut_at_the_same_places_whatever_surrounds_it(name, sizes):
    before, after = CONTEXTS[name]
    lo, hi = sizes
    alone = boundaries(R, lo, hi)
    cuts = [c - len(before) for c in boundaries(before + R + after, lo, hi)]
    # The content cuts (no max_size splits) at least horizon() tokens in and min_size - 1 before
    # the end (a cut after token i looks that far ahead) do not depend on the context; from the
    # first of them to the last, nor do the max_size splits between them.
    natural = [c for c in boundaries(R, lo, 10**9) if horizon(lo) <= c <= len(R) - (lo - 1)]
    first, last = natural[0], natural[-1]
    stable = lambda cs: [c for c in cs if first <= c <= last]  # noqa: E731
    assert stable(cuts) == stable(alone)
    # only chunks at the edges differ
    assert first <= horizon(lo) + 3 * hi and last >= len(R) - 4 * hi


@pytest.mark.parametrize(
    "sizes", [(content.MIN_SIZE, content.MAX_SIZE), (4, 16), (1, 2), (30, 60), (8, 48)]
)
@pytest.mark.parametrize(
    "ids",
    [R, [5] * 400, run(9, 300, vocab=3), list(range(200)) * 3, R[:40]],
    ids=["random", "one token repeated", "three tokens", "a repeated sequence", "short"],
)
def test_sizes_stay_within_bounds(sizes, ids):
    lo, hi = sizes
    cuts = boundaries(ids, lo, hi)
    assert cuts[0] == 0 and cuts[-1] == len(ids) and cuts == sorted(set(cuts))
    lengths = np.diff(cuts)
    assert lengths.max() <= hi
    assert lengths[:-1].min(initial=lo) >= lo  # only the prompt's last chunk may be shorter


EXACT = {  # fixed: keys depend on these cuts, so a change of the rule must be a deliberate one
    "no tokens": ([], {}, [0]),
    "shorter than the window": ([1, 2, 3], {}, [0, 3]),
    "shorter than the minimum": (list(range(10)), {}, [0, 10]),
    "a small table": (
        [(i * 7919) % 1000 for i in range(40)],
        {"min_size": 3, "max_size": 8},
        [0, 8, 13, 18, 22, 27, 33, 39, 40],
    ),
    "the defaults": ([(i * 7919) % 1000 for i in range(40)], {}, [0, 13, 39, 40]),
    "one token repeated: equal parts after the first cut": ([5] * 200, {}, [0, 12, 74, 137, 200]),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_cuts(name):
    ids, kwargs, expected = EXACT[name]
    assert boundaries(ids, **kwargs) == expected
    assert chunks(ids, **kwargs) == list(zip(expected, expected[1:]))


def test_average_size_and_speed_on_a_long_prompt():
    lengths = np.diff(boundaries(R))
    assert 1.5 * content.MIN_SIZE <= lengths.mean() <= 2.5 * content.MIN_SIZE


@pytest.mark.parametrize("lo, hi", [(0, 8), (5, 9), (-1, 4)])
def test_bad_sizes_are_refused(lo, hi):
    with pytest.raises(ValueError):
        boundaries(R, lo, hi)


def test_content_keys_name_the_tokens_only():
    a, b = run(10, 50), run(11, 30)
    spans_a = chunks(a + R)
    keys_a = content_keys(a + R, spans_a, NS)
    spans_b = chunks(b + R + a)
    keys_b = content_keys(b + R + a, spans_b, NS)
    shared = set(keys_a) & set(keys_b)
    assert len(shared) > 40  # the run's chunks, wherever it is
    for key, (s, e) in zip(keys_b, spans_b):
        assert (
            key.kind is ChunkKind.CONTENT and ChunkKey.parse(str(key)) == key and ":c:" in str(key)
        )
        if key in shared:
            i = keys_a.index(key)
            assert (a + R)[spans_a[i][0] : spans_a[i][1]] == (b + R + a)[s:e]
    # namespaced like every key: another tenant, salt or model never shares them
    for other in (
        Namespace("model", "float16", "L2xH1xD4", tenant="t"),
        Namespace("model", "float16", "L2xH1xD4", salt="s"),
        Namespace("other", "float16", "L2xH1xD4"),
        Namespace("model", "bfloat16", "L2xH1xD4"),
    ):
        assert not set(content_keys(a + R, spans_a, other)) & set(keys_a)
    assert content_keys(R, [(0, 20)], NS)[0] != document_key(R[:20], NS)  # not a document's key


@pytest.mark.parametrize("span", [(0, 0), (5, 3), (-1, 4), (0, 1501)])
def test_content_keys_refuse_bad_spans(span):
    with pytest.raises(ValueError):
        content_keys(R, [span], NS)


# ------------------------------------------------------------------ line breaks start segments
NL = np.array([10, 11])  # the "line-break" ids of these tests


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([], [0]),
        ([1, 2, 3], [0, 3]),
        (
            [1] * 20 + [10] + [2] * 20,
            [0, 21, 41],
        ),  # a line break after >= min_size tokens closes a segment
        ([1] * 5 + [10] + [2] * 20, [0, 6, 26]),  # a short line before a long one is a segment too
        (
            [1] * 3 + [10] + [1] * 3 + [11] + [1] * 14 + [10] + [3] * 4,
            [0, 8, 23, 27],
        ),  # short lines stay together
        (
            [1] * 3 + [10] + [1] * 3 + [11] + [1] * 10 + [10] + [3] * 4,
            [0, 23],
        ),  # all short: one segment
        ([1] * 20 + [10, 11, 10] + [2] * 20, [0, 23, 43]),  # a run of line breaks ends one line
        ([1] * 20 + [10], [0, 21]),  # a line break at the end closes nothing
    ],
    ids=[
        "empty",
        "short",
        "two lines",
        "a short first line",
        "short lines",
        "all short",
        "blank lines",
        "final line break",
    ],
)
def test_segments(ids, expected):
    assert content.segments(ids, NL) == expected
    assert content.segments(ids, None) == ([0, len(ids)] if ids else [0])


def test_without_separators_the_cuts_are_the_hash_rule_alone():
    ids = R[:400] + [10] + R[400:800]
    assert (
        boundaries(ids)
        == boundaries(ids, separators=None)
        == boundaries(ids, separators=np.array([], dtype=np.int64))
    )


@pytest.mark.parametrize(
    "before", [run(20, 37), run(21, 300) + [11, 10], R[:12]], ids=["short", "long", "the run"]
)
@pytest.mark.parametrize("after", [[], run(22, 50)], ids=["at the end", "then more"])
def test_a_passage_between_line_breaks_has_the_same_chunks_edges_included(before, after):
    passage = [t for t in run(23, 420) if t not in (10, 11)]
    alone = chunks(passage + ([10] if after else []), separators=NL)
    joined = before + [10] + passage + ([10] + after if after else [])
    start = len(before) + 1
    found = {(s - start, e - start) for s, e in chunks(joined, separators=NL)}
    assert set(alone) <= found  # every chunk of the passage, its first and last included
    assert boundaries(joined, separators=NL)[-1] == len(joined)


def test_content_keys_of_a_moved_passage_all_match():
    docs = [[t for t in run(30 + i, 250) if t not in (10, 11)] for i in range(4)]

    def prompt(order):
        ids = [5, 6, 7, 10]
        for i in order:
            ids += docs[i] + [10, 10]
        return ids + run(40, 20)

    a, b = prompt([0, 1, 2, 3]), prompt([2, 0, 3, 1])
    keys = lambda ids: set(content_keys(ids, chunks(ids, separators=NL), NS))  # noqa: E731
    ka, kb = keys(a), keys(b)
    doc_tokens = sum(len(d) for d in docs)
    shared = sum(
        e - s
        for (s, e), k in zip(
            chunks(b, separators=NL), content_keys(b, chunks(b, separators=NL), NS)
        )
        if k in ka
    )
    assert shared >= doc_tokens  # every passage token (and its trailing line breaks) found
    assert len(kb - ka) <= 3
