"""The sampling surface's pure parts against hand-computed tables: each logits processor, the
penalty history, logprob entries, choice seeds, the new ``SamplingParams`` fields, and the order
the decode state applies them in (bias and penalties, then the constraint, then the sampler)."""

from __future__ import annotations

import math

import pytest
import torch

from kvfuse.engine.sequence import DecodeState
from kvfuse.generation import Sampler, SamplingParams
from kvfuse.sampling import processors as P
from kvfuse.sampling.history import TokenHistory
from kvfuse.sampling.logprobs import TokenLogprob, rows_logprobs, token_logprob
from kvfuse.sampling.seeds import SEED_LIMIT, choice_seed

INF = float("inf")


def t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# ------------------------------------------------------------------------------ processors

BIAS = [
    # logits, bias pairs, expected
    ([1.0, 2.0, 3.0], [], [1.0, 2.0, 3.0]),
    ([1.0, 2.0, 3.0], [(0, 1.5), (2, -100.0)], [2.5, 2.0, -97.0]),
    ([0.0, 0.0], [(1, 100.0)], [0.0, 100.0]),
    ([0.0, 0.0], [(5, 3.0)], [0.0, 0.0]),  # beyond the vector: ignored
]


@pytest.mark.parametrize("logits,bias,expected", BIAS)
def test_logit_bias_adds_to_the_named_tokens(logits, bias, expected):
    x = t(logits)
    assert P.logit_bias(x, bias).tolist() == expected
    assert x.tolist() == logits  # never in place


REPETITION = [
    # logits, seen, penalty, expected: positive / penalty, negative * penalty, unseen untouched
    ([2.0, -2.0, 4.0, -1.0], [1, 1, 0, 0], 2.0, [1.0, -4.0, 4.0, -1.0]),
    ([2.0, -2.0, 4.0, -1.0], [1, 1, 1, 1], 0.5, [4.0, -1.0, 8.0, -0.5]),
    ([2.0, -2.0], [1, 1], 1.0, [2.0, -2.0]),
    ([0.0, 3.0], [1, 0], 4.0, [0.0, 3.0]),
]


@pytest.mark.parametrize("logits,seen,penalty,expected", REPETITION)
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(
    logits, seen, penalty, expected
):
    out = P.repetition_penalty(t(logits), torch.tensor(seen, dtype=torch.bool), penalty)
    assert out.tolist() == expected


FREQUENCY_PRESENCE = [
    # logits, counts, frequency, presence, expected (OpenAI: - count * f - (count > 0) * p)
    ([1.0, 1.0, 1.0, 1.0], [0, 1, 3, 0], 0.5, 0.25, [1.0, 0.25, -0.75, 1.0]),
    ([1.0, 1.0], [0, 2], -1.0, -0.5, [1.0, 3.5]),
    ([1.0, 1.0], [0, 2], 0.0, 2.0, [1.0, -1.0]),
    ([1.0, 1.0], [4, 0], 0.0, 0.0, [1.0, 1.0]),
]


@pytest.mark.parametrize("logits,counts,f,p,expected", FREQUENCY_PRESENCE)
def test_frequency_and_presence_penalties_follow_openai(logits, counts, f, p, expected):
    out = P.frequency_presence(t(logits), torch.tensor(counts), f, p)
    assert out.tolist() == pytest.approx(expected)


def _log(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


MIN_P = [
    # probabilities, min_p, the kept set (a token stays when p >= min_p * p_max)
    ([0.5, 0.3, 0.1, 0.1], 0.0, {0, 1, 2, 3}),
    ([0.5, 0.3, 0.1, 0.1], 0.25, {0, 1}),
    ([0.5, 0.3, 0.1, 0.1], 0.7, {0}),
    ([0.5, 0.3, 0.1, 0.1], 1.0, {0}),
    ([0.4, 0.4, 0.2], 0.9, {0, 1}),
    ([0.4, 0.4, 0.2], 0.45, {0, 1, 2}),
]


@pytest.mark.parametrize("probs,p,kept", MIN_P)
def test_min_p_keeps_tokens_within_a_ratio_of_the_most_likely(probs, p, kept):
    out = P.min_p(_log(probs), p)
    assert {i for i, v in enumerate(out.tolist()) if v > -INF} == kept


TOP_K = [
    ([1.0, 5.0, 3.0, 5.0, 2.0], 2, {1, 3}),
    ([1.0, 5.0, 3.0, 5.0, 2.0], 3, {1, 2, 3}),
    ([1.0, 5.0, 3.0, 5.0, 2.0], 0, {0, 1, 2, 3, 4}),
    ([1.0, 5.0, 3.0, 5.0, 2.0], 9, {0, 1, 2, 3, 4}),
    ([1.0, 3.0, 3.0, 2.0], 1, {1, 2}),  # ties with the k-th stay
    ([1.0, 3.0, 3.0, 2.0], 3, {1, 2, 3}),
]


@pytest.mark.parametrize("logits,k,kept", TOP_K)
def test_top_k_keeps_the_k_largest(logits, k, kept):
    out = P.top_k(t(logits), k)
    assert {i for i, v in enumerate(out.tolist()) if v > -INF} == kept


def test_temperature_and_token_counts():
    assert P.temperature(t([2.0, 4.0]), 2.0).tolist() == [1.0, 2.0]
    assert P.token_counts([3, 1, 3, 9, -1], 5).tolist() == [0, 1, 0, 2, 0]
    assert P.token_counts([], 3).tolist() == [0, 0, 0]


# ------------------------------------------------------------------------------ history


def test_token_history_penalises_the_prompt_and_counts_the_output():
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    h = TokenHistory(p, [1, 1, 2])
    ones = torch.ones(4)
    assert h.adjust(ones).tolist() == [1.0, 0.5, 0.5, 1.0]
    h.accept(3)
    # token 3: seen in the output (1 / 2), then generated once (- 1.0)
    assert h.adjust(ones).tolist() == [1.0, 0.5, 0.5, -0.5]
    other = h.fork()  # another choice: the prompt, none of this choice's tokens
    assert other.adjust(ones).tolist() == [1.0, 0.5, 0.5, 1.0]


def test_token_history_counts_tokens_accepted_before_it_saw_logits():
    h = TokenHistory(SamplingParams(presence_penalty=1.5), [0], generated=[2])
    h.accept(2)
    h.accept(1)
    # presence only: the prompt is not penalised, tokens 1 and 2 once each
    assert h.adjust(torch.zeros(3)).tolist() == [0.0, -1.5, -1.5]
    assert h.counts.tolist() == [0, 1, 2]


def test_bias_comes_before_the_repetition_penalty():
    # vLLM's order: bias first, so a biased seen token's logit is then divided
    h = TokenHistory(SamplingParams(logit_bias={0: 4.0}, repetition_penalty=2.0), [0])
    assert h.adjust(torch.tensor([2.0, 2.0])).tolist() == [3.0, 2.0]


# ------------------------------------------------------------------------------ logprobs


def test_token_logprob_is_the_raw_log_softmax_with_alternatives():
    e = token_logprob(torch.tensor([0.0, math.log(3.0), -INF]), 0, 2)
    assert e.token == 0 and e.logprob == pytest.approx(math.log(0.25))
    assert [i for i, _ in e.top] == [1, 0]
    assert [lp for _, lp in e.top] == pytest.approx([math.log(0.75), math.log(0.25)])
    assert token_logprob(torch.tensor([0.0, 0.0]), 1, 0) == TokenLogprob(
        1, pytest.approx(math.log(0.5))
    )
    # half-precision logits are scored in float32
    e16 = token_logprob(torch.tensor([0.0, math.log(3.0)], dtype=torch.bfloat16), 1, 1)
    assert e16.logprob == pytest.approx(math.log(0.75), abs=1e-2)


def test_rows_logprobs_scores_each_row_at_its_token():
    rows = rows_logprobs(torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]]), [1, 0], 1)
    assert [r.token for r in rows] == [1, 0]
    assert [r.logprob for r in rows] == pytest.approx([math.log(0.5), math.log(0.25)])


# ------------------------------------------------------------------------------ seeds

SEEDS = [
    # seed, index, expected (pinned: a seeded request gives the same choices in every release)
    (None, 0, None),
    (None, 3, None),
    (7, 0, 7),
    (0, 0, 0),
]


@pytest.mark.parametrize("seed,index,expected", SEEDS)
def test_choice_zero_keeps_the_request_seed(seed, index, expected):
    assert choice_seed(seed, index) == expected


def test_other_choices_get_distinct_reproducible_seeds():
    assert choice_seed(7, 1) == 889150868449041414
    assert choice_seed(7, 2) == 4274654559415189135
    derived = {choice_seed(s, i) for s in range(20) for i in range(1, 20)}
    assert len(derived) == 19 * 20  # no collisions (seed + i would collide)
    assert all(0 <= d < SEED_LIMIT for d in derived)


# ------------------------------------------------------------------------------ SamplingParams

BAD = [
    ("n", 0),
    ("n", 129),
    ("n", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("frequency_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("presence_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: math.nan}),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("stop_token_ids", (-1,)),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_new_fields_are_value_errors_naming_them(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field)


def test_logit_bias_is_normalised_and_adjusting_is_known():
    p = SamplingParams(logit_bias={9: -1.0, 2: 5})
    assert p.logit_bias == ((2, 5), (9, -1.0)) and p.adjusts_logits
    assert not SamplingParams(temperature=1.0, top_k=5, min_p=0.1, logprobs=3).adjusts_logits
    assert SamplingParams(repetition_penalty=1.1).adjusts_logits
    assert SamplingParams(presence_penalty=-0.5).adjusts_logits
    assert hash(p) == hash(SamplingParams(logit_bias=[(9, -1.0), (2, 5)]))


# ------------------------------------------------------------------------------ the sampler


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 200) -> set[int]:
    s = Sampler(params)
    return {s(logits) for _ in range(n)}


def test_min_p_applies_after_temperature():
    logits = torch.tensor([2.0, 0.0])  # p1 / p0 = e^-2 = 0.14 at T=1, e^-0.5 = 0.61 at T=4
    assert _draws(SamplingParams(temperature=1.0, min_p=0.2, seed=0), logits) == {0}
    assert _draws(SamplingParams(temperature=4.0, min_p=0.2, seed=0), logits) == {0, 1}


def test_a_choice_seed_overrides_the_params_seed():
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=3)
    a, b = Sampler(p), Sampler(p, seed=choice_seed(3, 1))
    c = Sampler(SamplingParams(temperature=1.0, seed=choice_seed(3, 1)))
    xs, ys, zs = ([s(logits) for _ in range(32)] for s in (a, b, c))
    assert xs != ys and ys == zs


class AllowOnly:
    """A constraint allowing only ``allowed``; records the logits it was handed."""

    def __init__(self, allowed):
        self.allowed, self.seen = set(allowed), []

    def mask(self, logits):
        self.seen.append(logits.clone())
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[list(self.allowed)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def accept(self, token):
        pass

    done = False


def _state(params: SamplingParams, prompt=(), constraint=None) -> DecodeState:
    d = DecodeState(
        sampler=Sampler(params),
        constraint=constraint,
        history=TokenHistory(params, list(prompt)) if params.adjusts_logits else None,
        top=params.logprobs,
    )
    return d


def test_greedy_without_adjustments_is_the_raw_argmax_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(20):
            logits = torch.randn(300, generator=g).to(dtype)
            for params in (SamplingParams(), SamplingParams(logprobs=5, top_k=3, min_p=0.5)):
                d = _state(params)
                d.sample(logits)
                assert d.pending == int(torch.argmax(logits))


def test_the_constraint_masks_the_biased_logits_and_logprobs_stay_raw():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    c = AllowOnly({1, 3})
    d = _state(SamplingParams(logit_bias={3: 2.5}, logprobs=1), constraint=c)
    d.sample(logits)
    # biased: [3, 1, 2, 2.5]; allowed {1, 3}: token 3 wins; its logprob is the raw one
    assert c.seen[0].tolist() == [3.0, 1.0, 2.0, 2.5] and d.pending == 3
    raw = torch.log_softmax(logits, -1)
    assert d.pending_logprob.logprob == pytest.approx(float(raw[3]))
    assert d.pending_logprob.top == ((0, pytest.approx(float(raw[0]))),)


def test_a_biased_token_outside_the_constraint_is_never_sampled():
    c = AllowOnly({0, 1})
    d = _state(SamplingParams(temperature=1.0, seed=1, logit_bias={2: 100.0}), constraint=c)
    for _ in range(50):
        d.sample(torch.zeros(3))
        assert d.take_pending()[0] in (0, 1)


def test_frequency_penalty_steers_greedy_away_from_repeats():
    d = _state(SamplingParams(frequency_penalty=2.0))
    out = []
    for _ in range(4):
        d.sample(torch.tensor([1.0, 0.5, 0.0]))  # the same raw logits every step
        token, entry = d.take_pending()
        d.accepted(token, entry)
        out.append(token)
    # step by step: [1, .5, 0] -> 0; [-1, .5, 0] -> 1; [-1, -1.5, 0] -> 2; [-1, -1.5, -2] -> 0
    assert out == [0, 1, 2, 0]
