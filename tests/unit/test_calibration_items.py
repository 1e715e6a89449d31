"""Calibration that generalizes: the items (sources x prompt forms), the Wilson interval of
answers kept, the holdout split and its check, the CLI's option parsing and table. Pure: no
model is loaded."""

from __future__ import annotations

import json

import pytest

from kvfuse.calibration import forms, holdout, options, sources
from kvfuse.calibration.answers import any_correct
from kvfuse.calibration.choose import Choice, Measurement, Targets
from kvfuse.calibration.interval import Kept, kept, needed_items, wilson

# Newcombe (1998), Table I, method 3 (Wilson score, no continuity correction), 95% two-sided,
# i.e. each bound one-sided at 0.975
NEWCOMBE = [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize("k,n,low,high", NEWCOMBE)
def test_wilson_matches_published_values(k, n, low, high):
    got = wilson(k, n, 0.975)
    assert got == pytest.approx((low, high), abs=5e-5)


@pytest.mark.parametrize(
    "k,n,confidence,low",
    [
        (20, 20, 0.95, 20 / (20 + 1.6448536**2)),  # all kept: n / (n + z^2)
        (52, 52, 0.95, 0.95054),
        (51, 51, 0.95, 0.94962),
        (17, 24, 0.95, 0.54103),  # the failure that started this: 17 of 24 kept
        (24, 24, 0.95, 0.89870),
    ],
)
def test_wilson_one_sided_lower_bounds(k, n, confidence, low):
    assert wilson(k, n, confidence)[0] == pytest.approx(low, abs=5e-5)


def test_wilson_edges():
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(5, 5)[1] == 1.0 and wilson(0, 5)[0] == 0.0
    for bad in [(3, 2, 0.95), (-1, 2, 0.95), (1, 2, 0.4), (1, 2, 1.0)]:
        with pytest.raises(ValueError):
            wilson(*bad)
    assert needed_items(0.95) == 52 and needed_items(0.9) == 25


@pytest.mark.parametrize(
    "full,other,expected",
    [
        ([True, True, True, False], [True, False, True, True], Kept(2, 3, 1)),
        # answers the blend gains never lift the figure above 1
        ([True, False, False], [True, True, True], Kept(1, 1, 2)),
        ([False, False], [True, False], Kept(0, 0, 1)),
    ],
)
def test_answers_kept_vs_full_prefill(full, other, expected):
    got = kept(full, other)
    assert got == expected and got.point <= 1.0
    assert got.as_dict()["full_correct"] == expected.n


def test_sources_are_deterministic_and_interleaved():
    a = sources.examples(["fictional"], 5)
    assert a == sources.examples(["fictional"], 5)
    assert [e.index for e in a] == [0, 1, 2, 3, 4] and all(len(e.answers) == 1 for e in a)
    assert all(len(e.documents) == 10 and e.needed for e in a)
    with pytest.raises(ValueError, match="unknown source"):
        sources.examples(["wiki"], 3)


def musique_row(i: int) -> dict:
    return {
        "question": f"question {i}?",
        "answers": [f"Answer {i}", f"alias {i}"],
        "ctxs": [{"title": "", "text": f"passage {k} of {i}"} for k in range(9)]
        + [{"title": "", "text": f"the answer {i} is here"}],
    }


@pytest.fixture
def data(tmp_path):
    """A data folder shaped like ../shared/data: 150 MuSiQue rows, ten CacheBlend examples."""
    (tmp_path / "musique_s.json").write_text(json.dumps([musique_row(i) for i in range(150)]))
    for i in range(1, 11):
        ex = {"chunk_num": 5, **{str(k): f"\n\nchunk {k}" for k in range(5)}}
        ex["query"] = f"\n\nAnswer briefly. Question: what is {i}? Answer:"
        (tmp_path / f"cacheblend_example_{i}.json").write_text(json.dumps(ex))
    return tmp_path


def test_musique_reads_the_dev_split_only(data):
    got = sources.musique(500, data)
    assert [e.index for e in got] == list(range(50))  # examples 50-149 are the test split
    assert got[3].answers == ("Answer 3", "alias 3") and got[3].needed == (9,)


def test_cacheblend_examples_have_no_gold_and_keep_every_passage(data):
    got = sources.cacheblend(50, data)  # there are ten
    assert [e.index for e in got] == list(range(1, 11))
    assert (
        got[0].question == "what is 1?"
        and got[0].answers == ()
        and got[0].needed == tuple(range(5))
    )
    with pytest.raises(ValueError, match="no question"):
        sources.parse_cacheblend({"chunk_num": 1, "0": "x", "query": "no question here"}, 7)


@pytest.mark.parametrize(
    "env,folder",
    [({}, None), ({"KVFUSE_DATA": ""}, None), ({"KVFUSE_DATA": "/data/eval"}, "/data/eval")],
)
def test_the_data_folder_is_read_from_the_environment_in_config(env, folder):
    from pathlib import Path

    from kvfuse.config.load import default_data

    assert default_data(env) == (Path(folder) if folder else None)


def test_a_missing_data_folder_leaves_the_fictional_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUSE_DATA", str(tmp_path / "absent"))
    assert sources.data_dir() == tmp_path / "absent"
    assert sources.available() == ("fictional",)
    with pytest.raises(sources.SourceUnavailable, match="KVFUSE_DATA"):
        sources.examples(["fictional", "musique"], 4)
    names, note = options.parse_sources(None, sources.available())
    assert names == ("fictional",) and "musique" in note and "KVFUSE_DATA" in note
    with pytest.raises(ValueError, match="not there"):
        options.parse_sources("musique", sources.available())


def test_examples_take_turns_across_sources(data):
    got = sources.examples(["fictional", "musique", "cacheblend"], 8, data)
    assert [e.key for e in got] == [
        "fictional:0", "musique:0", "cacheblend:1",
        "fictional:1", "musique:1", "cacheblend:2",
        "fictional:2", "musique:2",
    ]  # fmt: skip


DOCS = tuple("the gold one" if k == 5 else f"doc {k}" for k in range(8))
EX = sources.Example("t", 0, DOCS, "q?", ("gold",), (5,))  # passage 5 states the answer


@pytest.mark.parametrize(
    "count,position,at",
    [(4, "first", 0), (4, "middle", 2), (4, "last", 3), (7, "middle", 3), (10, "last", 7)],
)
def test_forms_place_the_answer_and_count_passages(count, position, at):
    item = forms.apply(EX, forms.Form(True, False, count, position))
    assert len(item.documents) == min(count, 8)
    assert item.answer_at == at and item.documents[at] == "the gold one"
    assert any_correct(item.documents[at], item.answers)
    others = [d for d in item.documents if d != "the gold one"]
    assert others == sorted(others)  # the others keep their order


def test_forms_label_passages():
    item = forms.apply(EX, forms.Form(False, True, 4, "last"))
    assert [d.split(":")[0] for d in item.documents] == [f"Passage {i}" for i in (1, 2, 3, 4)]
    assert item.documents[3] == "Passage 4: the gold one"


def test_without_a_gold_answer_the_order_is_the_sources():
    ex = sources.Example("cacheblend", 1, ("a", "b", "c", "d", "e"), "q?", (), (0, 1, 2, 3, 4))
    item = forms.apply(ex, forms.Form(True, False, 4, "first"))
    assert item.documents == ("a", "b", "c", "d", "e") and item.answer_at is None


def test_assign_spreads_every_source_over_the_forms():
    exs = sources.examples(["fictional"], 84)
    items = forms.assign(exs, forms.FormSpace())
    assert items == forms.assign(exs, forms.FormSpace())  # deterministic
    assert {len(it.documents) for it in items} == set(range(4, 11))
    assert {it.form.chat for it in items} == {True, False}
    assert {it.form.labels for it in items} == {True, False}
    assert {it.form.position for it in items} == {"first", "middle", "last"}
    assert len({(it.form.describe()) for it in items}) == 84  # every combination once
    for it in items:
        assert it.answer_at is not None and any_correct(it.documents[it.answer_at], it.answers)
        want = {"first": 0, "middle": len(it.documents) // 2, "last": len(it.documents) - 1}
        assert it.answer_at == want[it.form.position]


def test_base_models_are_asked_as_completions():
    space = forms.for_model(forms.FormSpace(), chat_capable=False)
    assert space.kinds == ("completion",)
    with pytest.raises(ValueError, match="completion"):
        forms.for_model(forms.parse_forms("chat"), chat_capable=False)


@pytest.mark.parametrize(
    "text,kinds,labels,positions",
    [
        (None, forms.KINDS, forms.LABELS, forms.POSITIONS),
        ("completion", ("completion",), forms.LABELS, forms.POSITIONS),
        ("labeled,first,last", forms.KINDS, ("labeled",), ("first", "last")),
    ],
)
def test_parse_forms(text, kinds, labels, positions):
    got = forms.parse_forms(text)
    assert (got.kinds, got.labels, got.positions) == (kinds, labels, positions)


@pytest.mark.parametrize("text", ["sideways", "chat,nope"])
def test_parse_forms_names_an_unknown_word(text):
    with pytest.raises(ValueError, match="unknown form"):
        forms.parse_forms(text)


@pytest.mark.parametrize(
    "text,expected", [("4-10", tuple(range(4, 11))), ("5", (5,)), ("6-6", (6,))]
)
def test_parse_documents(text, expected):
    assert options.parse_documents(text) == expected


@pytest.mark.parametrize("text", ["0", "8-4", "x", "4-100", ""])
def test_parse_documents_refuses(text):
    with pytest.raises(ValueError, match="--documents"):
        options.parse_documents(text)


def test_holdout_split_is_disjoint_deterministic_and_stratified(data):
    items = forms.assign(
        sources.examples(["fictional", "musique", "cacheblend"], 60, data), forms.FormSpace()
    )
    choice, held = holdout.split(items, 0.4)
    assert (choice, held) == holdout.split(items, 0.4)
    assert not {it.key for it in choice} & {it.key for it in held}
    assert len(choice) + len(held) == len(items)
    assert {it.source for it in choice} == {it.source for it in held} == {
        "fictional", "musique", "cacheblend"
    }  # fmt: skip
    assert len(held) == 10 + 10 + 4  # 25 fictional, 25 musique, 10 cacheblend
    # an example's part does not depend on the others: a larger set keeps it where it was
    more = holdout.split(forms.assign(sources.examples(["fictional"], 80), forms.FormSpace()), 0.4)
    fewer = holdout.split(forms.assign(sources.examples(["fictional"], 40), forms.FormSpace()), 0.4)
    held_more = {it.key for it in more[1]}
    assert {it.key for it in fewer[1]} <= held_more | {it.key for it in more[0]}
    assert holdout.split(items, 0.0) == (items, [])
    with pytest.raises(ValueError):
        holdout.split(items, 1.0)


ROW = Measurement("hkvd", 0.3, Kept(120, 120), 0.1, 0.4)
CHOSEN = Choice("hkvd", 0.3, "the smallest budget that keeps the answers", ROW)


@pytest.mark.parametrize(
    "held,method",
    [
        (Kept(60, 60), "hkvd"),  # lower 0.957: the choice stands
        (Kept(17, 24), "prefix"),  # the failure found: 17 of 24 kept
        (Kept(20, 20), "prefix"),  # all kept, but too few to be sure (lower 0.88)
        (None, "hkvd"),  # no holdout: unchecked
    ],
)
def test_holdout_check(held, method):
    got = holdout.check(CHOSEN, held)
    assert got.method == method
    if held is not None:
        assert f"kept {held.kept}/{held.n}" in got.reason
    if method == "prefix":
        assert "below 0.95" in got.reason and got.ratio == 1.0


def test_a_prefix_choice_is_not_rechecked():
    prefix = Choice("prefix", 1.0, "none kept")
    assert holdout.check(prefix, Kept(0, 10)) is prefix
    assert holdout.check(CHOSEN, Kept(55, 60), Targets(accuracy=0.8)).method == "hkvd"


def test_the_printed_table():
    meta = {
        "confidence": 0.95,
        "choice": {"items": 30, "sources": {"fictional": 30}},
        "holdout_part": {"items": 20, "sources": {"fictional": 20}},
        "holdout": {"config": "hkvd 0.3", **Kept(17, 24).as_dict(), "kl": 0.05},
    }
    rows = [{"config": "hkvd 0.3", **Kept(20, 20, 1).as_dict(), "kl": 0.1, "ttft_ms": 12.0}]
    lines = options.table(rows, meta)
    assert "choice part: 30 items" in lines[0] and "one-sided at 0.95" in lines[0]
    assert "kept  20/20  1.00 [0.88, 1.00]  +1" in lines[2] and "TTFT 12 ms" in lines[2]
    assert "holdout: hkvd 0.3" in lines[3] and "17/24  0.71 [0.54, 0.83]" in lines[3]
    old = options.table([{"config": "hkvd 0.3", "correct": 3, "items": 5}], {})
    assert "correct   3/5" in old[2] and "not measured" in old[3]
