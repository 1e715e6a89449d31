"""The server's side of the sampling surface, without a model: the new request fields mapped to
``SamplingParams`` (and their 400s), logprobs in the chat / legacy / Responses shapes, and the
bodies and stream chunks of ``n`` choices, with and without ``echo``."""

from __future__ import annotations

import math

import pytest

from kvfuse.engine import Choice, Delta, GenerationResult
from kvfuse.sampling import TokenLogprob
from kvfuse.server.bodies import Rendering, ResponseBuilder
from kvfuse.server.errors import APIError
from kvfuse.server.logprobs import TokenTexts, chat_logprobs, legacy_end, legacy_logprobs
from kvfuse.server.responses_api import chat_request
from kvfuse.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseCreateRequest,
)
from kvfuse.server.translate import Limits, sampling_params

LIMITS = Limits(max_tokens_limit=100, default_max_tokens=16, context_window=1000, vocab_size=50)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


# ------------------------------------------------------------------------------ request fields

MAPPED = [
    # request, the SamplingParams fields it sets
    (chat(), dict(n=1, logprobs=None, prompt_logprobs=None, top_k=0, min_p=0.0)),
    (chat(n=3, seed=4), dict(n=3, seed=4)),
    (chat(logprobs=True), dict(logprobs=0)),
    (chat(logprobs=True, top_logprobs=20), dict(logprobs=20)),
    (chat(logprobs=False), dict(logprobs=None)),
    (completion(logprobs=2), dict(logprobs=2, prompt_logprobs=None)),
    (completion(logprobs=0, echo=True), dict(logprobs=0, prompt_logprobs=0)),
    (completion(echo=True), dict(logprobs=None, prompt_logprobs=None)),
    (completion(n=2, best_of=2), dict(n=2)),
    (completion(top_k=-1), dict(top_k=0)),
    (completion(top_k=40, min_p=0.05), dict(top_k=40, min_p=0.05)),
    (
        chat(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2),
        dict(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2),
    ),
    (chat(logit_bias={"7": -100, "3": 2.5}), dict(logit_bias=((3, 2.5), (7, -100.0)))),
    (completion(stop_token_ids=[4, 9]), dict(stop_token_ids=(4, 9))),
]


@pytest.mark.parametrize("req,expected", MAPPED)
def test_request_fields_map_to_sampling_params(req, expected):
    p = sampling_params(req, 10, LIMITS)
    assert {k: getattr(p, k) for k in expected} == expected


ERRORS = [
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=False, top_logprobs=0), "top_logprobs"),
    (chat(logit_bias={"x": 1}), "logit_bias"),
    (chat(logit_bias={"50": 1}), "logit_bias"),  # the vocabulary has 50 tokens
    (chat(logit_bias={"-1": 1}), "logit_bias"),
    (chat(logit_bias={"3": 100.5}), "logit_bias"),
    (completion(stop_token_ids=[50]), "stop_token_ids"),
    (completion(stop_token_ids=[-2]), "stop_token_ids"),
    (completion(n=2, best_of=3), "best_of"),
    (completion(n=3, best_of=2), "best_of"),
    (completion(best_of=2), "best_of"),
]


@pytest.mark.parametrize("req,param", ERRORS)
def test_bad_fields_are_400s_naming_them(req, param):
    with pytest.raises(APIError) as e:
        sampling_params(req, 10, LIMITS)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 0},
        {"n": 129},
        {"top_logprobs": 21},
        {"frequency_penalty": 2.01},
        {"min_p": -0.1},
        {"top_k": -2},
        {"repetition_penalty": 0},
        {"logit_bias": {"1": "a"}},
    ],
)
def test_out_of_range_fields_fail_validation(fields):
    with pytest.raises(Exception) as e:
        chat(**fields)
    assert next(iter(fields)) in str(e.value)


def test_completion_logprobs_are_at_most_five():
    with pytest.raises(Exception):
        completion(logprobs=6)


def test_responses_logprobs_come_from_include_or_top_logprobs():
    body = ResponseCreateRequest.model_validate(
        {"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}
    )
    c = chat_request(body, [], [{"role": "user", "content": "x"}])
    assert (c.logprobs, c.top_logprobs) == (True, None)
    body = ResponseCreateRequest.model_validate({"model": "m", "input": "x", "top_logprobs": 4})
    c = chat_request(body, [], [{"role": "user", "content": "x"}])
    assert (c.logprobs, c.top_logprobs) == (True, 4)
    body = ResponseCreateRequest.model_validate({"model": "m", "input": "x"})
    assert chat_request(body, [], [{"role": "user", "content": "x"}]).logprobs is False
    body = ResponseCreateRequest.model_validate(
        {"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}
    )
    with pytest.raises(APIError) as e:
        chat_request(body, [], [{"role": "user", "content": "x"}])
    assert e.value.param == "include" and "reasoning.encrypted_content" in e.value.message


# ------------------------------------------------------------------------------ logprob shapes


class FakeTokenizer:
    """Token i is TABLE[i]; token 4 is the first byte of "é" alone."""

    TABLE = [b"<s>", b"Hi", b" there", b"!", b"\xc3", b"\xa9"]

    def token_bytes(self):
        return self.TABLE

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.TABLE[i] for i in ids).decode("utf-8", errors="replace")


TEXTS = TokenTexts(FakeTokenizer())


def lp(token, logprob, *top) -> TokenLogprob:
    return TokenLogprob(token, logprob, tuple(top))


def test_chat_logprobs_carry_text_bytes_and_alternatives():
    out = chat_logprobs(TEXTS, [lp(2, -0.5, (2, -0.5), (3, -1.5)), lp(4, -float("inf"))])
    assert out == {
        "content": [
            {
                "token": " there",
                "logprob": -0.5,
                "bytes": list(b" there"),
                "top_logprobs": [
                    {"token": " there", "logprob": -0.5, "bytes": list(b" there")},
                    {"token": "!", "logprob": -1.5, "bytes": [33]},
                ],
            },
            {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xC3], "top_logprobs": []},
        ],
        "refusal": None,
    }


def test_legacy_logprobs_with_a_prompt_first_and_the_chosen_token_among_the_top():
    entries = [None, lp(2, -1.0, (3, -0.25)), lp(3, -0.25, (3, -0.25))]
    out = legacy_logprobs(TEXTS, entries, [1, 2, 3], 0)
    assert out == {
        "tokens": ["Hi", " there", "!"],
        "token_logprobs": [None, -1.0, -0.25],
        "top_logprobs": [None, {"!": -0.25, " there": -1.0}, {"!": -0.25}],
        "text_offset": [0, 2, 8],
    }
    assert legacy_end(out, 0) == 9 and legacy_end(legacy_logprobs(TEXTS, [], [], 5), 5) == 5


# ------------------------------------------------------------------------------ bodies and chunks


def result(choices, prompt_logprobs=None) -> GenerationResult:
    return GenerationResult(
        choices=choices,
        prompt_logprobs=prompt_logprobs,
        text=choices[0].text,
        token_ids=choices[0].token_ids,
        finish_reason=choices[0].finish_reason,
        prompt_tokens=2,
    )


TWO = [
    Choice(0, " there", [2], "length", [lp(2, -0.5, (2, -0.5))]),
    Choice(1, "!", [3], "stop", [lp(3, -1.0, (2, -0.5))]),
]


def test_a_chat_body_has_every_choice_with_its_logprobs_and_usage_counts_them_all():
    b = ResponseBuilder("req_x", "m", 1, chat=True, rendering=Rendering(2, True, texts=TEXTS))
    body = b.body(result(TWO))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [" there", "!"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["logprobs"]["content"][0]["token"] == "!"
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 2
    plain = ResponseBuilder("req_x", "m", 1, chat=True, rendering=Rendering(2))
    assert all(c["logprobs"] is None for c in plain.body(result(TWO))["choices"])


def test_a_completion_body_echoes_the_prompt_with_its_logprobs_first():
    r = Rendering(2, True, echo="<s>Hi", prompt_ids=(0, 1), texts=TEXTS)
    b = ResponseBuilder("req_x", "m", 1, chat=False, rendering=r)
    body = b.body(result(TWO, prompt_logprobs=[None, lp(1, -2.0)]))
    c0, c1 = body["choices"]
    assert c0["text"] == "<s>Hi there" and c1["text"] == "<s>Hi!"
    assert c0["logprobs"]["tokens"] == ["<s>", "Hi", " there"]
    assert c0["logprobs"]["token_logprobs"] == [None, -2.0, -0.5]
    assert c0["logprobs"]["top_logprobs"][0] is None
    assert c0["logprobs"]["text_offset"] == [0, 3, 5]
    assert c1["logprobs"]["top_logprobs"][2] == {" there": -0.5, "!": -1.0}
    echo_only = ResponseBuilder("req_x", "m", 1, chat=False, rendering=Rendering(1, echo="Q:"))
    assert echo_only.body(result(TWO[:1]))["choices"][0] == {
        "index": 0,
        "text": "Q: there",
        "finish_reason": "length",
        "logprobs": None,
    }


def test_chat_stream_chunks_per_choice():
    b = ResponseBuilder("req_x", "m", 1, chat=True, rendering=Rendering(2, True, texts=TEXTS))
    firsts = b.first_chunks()
    assert [c["choices"][0]["index"] for c in firsts] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in firsts)
    (chunk,) = b.delta_chunks(Delta(1, "!", (lp(3, -1.0),)))
    choice = chunk["choices"][0]
    assert choice["index"] == 1 and choice["delta"] == {"content": "!"}
    assert choice["logprobs"]["content"][0]["logprob"] == -1.0
    assert b.delta_chunks(Delta(0, prompt_logprobs=(None,))) == []  # chat never asks
    finals = b.final_chunks(result(TWO))
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in finals] == [
        (0, "length"),
        (1, "stop"),
    ]


def test_completion_stream_echoes_with_the_prompt_logprobs_and_offsets_continue():
    r = Rendering(2, True, echo="<s>Hi", prompt_ids=(0, 1), texts=TEXTS)
    b = ResponseBuilder("req_x", "m", 1, chat=False, rendering=r)
    assert b.first_chunks() == []  # the echo waits for the prompt's logprobs
    echoed = b.delta_chunks(Delta(0, prompt_logprobs=(None, lp(1, -2.0))))
    assert [c["choices"][0]["text"] for c in echoed] == ["<s>Hi", "<s>Hi"]
    assert echoed[1]["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0]
    (a,) = b.delta_chunks(Delta(0, " there", (lp(2, -0.5),)))
    (c,) = b.delta_chunks(Delta(1, "!", (lp(3, -1.0),)))
    (d,) = b.delta_chunks(Delta(0, "!", (lp(3, -0.1),)))
    assert a["choices"][0]["logprobs"]["text_offset"] == [5]
    assert c["choices"][0]["logprobs"]["text_offset"] == [5]
    assert d["choices"][0]["logprobs"]["text_offset"] == [11]
    plain = ResponseBuilder("req_x", "m", 1, chat=False, rendering=Rendering(2, echo="Q:"))
    assert [c["choices"][0]["text"] for c in plain.first_chunks()] == ["Q:", "Q:"]


def test_non_finite_logprobs_never_reach_json():
    out = legacy_logprobs(TEXTS, [lp(1, -math.inf, (1, -math.inf))], [1], 0)
    assert out["token_logprobs"] == [-9999.0] and out["top_logprobs"] == [{"Hi": -9999.0}]
