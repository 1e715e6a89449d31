"""Sampling parameters, the sampler, top-p, stop strings, and streamed decoding of multi-byte text."""

from __future__ import annotations

import math

import pytest
import torch

from kvfuse.generation import Sampler, SamplingParams, StopMatcher, top_p_filter
from kvfuse.models.tokenizer import IncrementalDecoder

# ------------------------------------------------------------------------------ SamplingParams

BAD_PARAMS = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "8"),
    ("temperature", -0.1),
    ("temperature", 100.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", -1),
    ("top_k", 2.5),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("stop", ("",)),
    ("stop", (3,)),
    ("stop", tuple(f"s{i}" for i in range(17))),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_PARAMS])
def test_bad_sampling_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field)


def test_good_sampling_params_and_normalisation():
    p = SamplingParams(
        max_tokens=1, temperature=0, top_p=1.0, top_k=0, seed=0, stop="END", stop_token_ids=[5, 6]
    )
    assert p.greedy and p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert not SamplingParams(temperature=0.7).greedy
    SamplingParams(
        temperature=100.0, top_p=1e-9, top_k=10**6, seed=2**63 - 1, stop=tuple("abcdefghijklmnop")
    )


# ------------------------------------------------------------------------------ Sampler


def test_greedy_is_argmax_whatever_top_k_top_p_and_seed_say():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(300, generator=g)
        for params in (SamplingParams(), SamplingParams(top_k=3, top_p=0.1, seed=5)):
            assert Sampler(params)(logits) == int(torch.argmax(logits))


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 64) -> list[int]:
    sampler = Sampler(params)
    return [sampler(logits) for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.zeros(1000)  # uniform: 64 draws from two seeds essentially never coincide
    a = _draws(SamplingParams(temperature=1.0, seed=1), logits)
    assert a == _draws(SamplingParams(temperature=1.0, seed=1), logits)
    assert a != _draws(SamplingParams(temperature=1.0, seed=2), logits)
    assert len(set(a)) > 32  # it really samples


def test_top_k_only_draws_the_k_most_likely():
    logits = torch.linspace(0, 1, 50)
    logits[7], logits[31] = 5.0, 5.2
    drawn = set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=0), logits, 300))
    assert drawn == {7, 31}
    assert set(_draws(SamplingParams(temperature=5.0, top_k=1, seed=0), logits, 50)) == {31}
    # k larger than the vocabulary: no error, anything may be drawn
    assert len(set(_draws(SamplingParams(temperature=50.0, top_k=500, seed=0), logits, 300))) > 10


def test_top_p_sampling_only_draws_the_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.05, 0.25, 0.15])
    drawn = set(_draws(SamplingParams(temperature=1.0, top_p=0.7, seed=3), probs.log(), 300))
    assert drawn == {1, 3}


TOP_P_CASES = [
    # probs, top_p, the exact kept set
    ([0.5, 0.25, 0.125, 0.125], 0.5, {0}),
    ([0.5, 0.25, 0.125, 0.125], 0.1, {0}),
    ([0.5, 0.25, 0.125, 0.125], 0.75, {0, 1}),  # mass exactly reached: nothing more
    ([0.5, 0.25, 0.125, 0.125], 0.76, {0, 1, 2}),
    ([0.5, 0.25, 0.125, 0.125], 1.0, {0, 1, 2, 3}),
    ([0.125, 0.5, 0.125, 0.25], 0.75, {1, 3}),  # unsorted input
    ([0.0625, 0.125, 0.8125], 0.9, {1, 2}),
    ([0.0625, 0.125, 0.8125], 0.95, {0, 1, 2}),
    ([0.0625, 0.125, 0.8125], 0.8125, {2}),
    ([1.0, 0.0, 0.0], 0.99, {0}),
]


@pytest.mark.parametrize("probs,top_p,kept", TOP_P_CASES)
def test_top_p_filter_keeps_the_smallest_nucleus_and_renormalises(probs, top_p, kept):
    p = torch.tensor(probs, dtype=torch.float32)
    out = top_p_filter(p.clone(), top_p)
    assert {i for i, v in enumerate(out.tolist()) if v > 0} == kept
    assert out.sum().item() == pytest.approx(1.0, abs=1e-6)
    mass = sum(probs[i] for i in kept)
    for i in kept:
        assert out[i].item() == pytest.approx(probs[i] / mass, rel=1e-6)


def test_top_p_filter_with_ties_keeps_just_enough():
    out = top_p_filter(torch.full((4,), 0.25), 0.5)
    assert (out > 0).sum().item() == 2 and out.sum().item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------ StopMatcher

STOP_CASES = [
    # id, stops, pieces, what each feed returns, what flush returns, stopped
    ("split-across-two", ("</s>",), ["Hello </", "s> world"], ["Hello ", ""], "", True),
    ("split-across-three", ("</s>",), ["ab<", "/", "s>cd"], ["ab", "", ""], "", True),
    ("inside-one-piece", ("STOP",), ["xxSTOPyy"], ["xx"], "", True),
    ("nothing-after-stop", ("STOP",), ["a", "bSTOPc", "more"], ["a", "b", ""], "", True),
    ("several-earliest-wins", ("world", "lo"), ["hello world"], ["hel"], "", True),
    ("several-second-first", ("STOP", "\n\n"), ["one\n", "\ntwo STOP"], ["one", ""], "", True),
    ("partial-released-by-flush", ("STOP",), ["the ST"], ["the "], "ST", False),
    ("false-alarm-released", ("STOP",), ["ST", "ART"], ["", "START"], "", False),
    ("overlapping-prefix", ("aab",), ["aa", "aab"], ["", "aa"], "", True),
    ("held-then-extended", ("abc",), ["xa", "b", "d"], ["x", "", "abd"], "", False),
    ("no-stops", (), ["a", "</s>", ""], ["a", "</s>", ""], "", False),
    ("stop-at-very-start", ("##",), ["##tail"], [""], "", True),
]


@pytest.mark.parametrize(
    "stops,pieces,fed,flushed,stopped", [c[1:] for c in STOP_CASES], ids=[c[0] for c in STOP_CASES]
)
def test_stop_matcher(stops, pieces, fed, flushed, stopped):
    m = StopMatcher(stops)
    assert [m.feed(p) for p in pieces] == fed
    assert m.stopped is stopped
    assert m.flush() == flushed
    assert m.flush() == ""  # flushing twice releases nothing more
    emitted = "".join(fed) + flushed
    text = "".join(pieces)
    if stopped:  # exactly the text before the first stop occurrence, nothing after
        first = min(i for s in stops if (i := text.find(s)) >= 0)
        assert emitted == text[:first]
        # the stop string that ended it: the first one listed among those starting there
        assert m.matched == next(s for s in stops if text.find(s) == first)
    else:
        assert emitted == text and m.matched is None


def test_stop_matcher_names_the_earliest_stop_then_the_first_listed():
    m = StopMatcher(("b", "ab", "a"))
    assert m.feed("xab") == "x" and m.matched == "ab"


def test_stop_matcher_ignores_everything_once_stopped():
    m = StopMatcher(("x",))
    assert m.feed("abxcd") == "ab"
    assert m.feed("more") == "" and m.feed("x") == "" and m.flush() == ""


# ------------------------------------------------------------------------------ IncrementalDecoder

TEXTS = [
    "Hello, world! Plain ASCII text with numbers 12345.",
    "Emoji: 🙂👍🏽🎉 and a family 👨‍👩‍👧 in a row.",
    "中文文本：你好，世界。日本語のテキスト、カタカナ。한국어 문장.",
    "Accents: café, naïve, Ærøskøbing, São Paulo, Dvořák, Łódź.",
    "Mixed 🙂 中文 é 🎉\nnew line\ttab  spaces   ",
    "🎉",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def real_tokenizer(request):
    from kvfuse_helpers import builtin_folder

    from kvfuse.models import Tokenizer

    return Tokenizer(builtin_folder(request.param))


def _stream(tok, ids: list[int]) -> list[str]:
    d = IncrementalDecoder(tok)
    pieces = [d.push(i) for i in ids]
    return pieces + [d.flush()]


@pytest.mark.integration
@pytest.mark.parametrize(
    "text", TEXTS, ids=["ascii", "emoji", "cjk", "accents", "mixed", "one-emoji"]
)
def test_stream_decoder_pieces_concatenate_to_the_full_decode(real_tokenizer, text):
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(real_tokenizer, ids)
    assert "".join(pieces) == real_tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces), "a piece released half a character"
    # every prefix of the stream is consistent too (generation may stop anywhere)
    for n in range(1, len(ids)):
        assert "".join(_stream(real_tokenizer, ids[:n])) == real_tokenizer.decode(ids[:n])


@pytest.mark.integration
def test_stream_decoder_holds_back_an_incomplete_character(real_tokenizer):
    # the first rare character the tokenizer spells with several (byte) tokens
    for text in ("🎉", "𓀀", "𝔘", "🦩", "ꙮ"):
        ids = real_tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= 2:
            break
    else:
        pytest.skip("this tokenizer has every candidate character as one token")
    d = IncrementalDecoder(real_tokenizer)
    assert d.push(ids[0]) == ""  # only some of the 4 UTF-8 bytes
    out = "".join(d.push(i) for i in ids[1:]) + d.flush()
    assert out == text
