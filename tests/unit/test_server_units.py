"""The server's pure parts, without a model: request -> engine request mapping, tenant salts, error
bodies, response chunks, metrics. (The queue and its worker are the engine's: test_scheduler.py,
test_engine_loop.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from kvfuse.engine import (
    CacheOptions,
    Choice,
    Delta,
    EngineStats,
    GenerationResult,
    Outcome,
    RequestCancelled,
    Timings,
)
from kvfuse.models.tokenizer import ChatTemplateError
from kvfuse.reuse import ReuseStats
from kvfuse.server.auth import Authenticator
from kvfuse.server.bodies import SSE_DONE, ResponseBuilder, sse_event, usage
from kvfuse.server.errors import APIError, error_body, validation_error
from kvfuse.server.metrics import ServerMetrics
from kvfuse.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseCreateRequest,
)
from kvfuse.server.translate import (
    Limits,
    cache_options,
    chat_messages,
    completion_prompt,
    plan_chat,
    sampling_params,
)

LIMITS = Limits(max_tokens_limit=100, default_max_tokens=16, context_window=1000)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


# ------------------------------------------------------------------------------------ tenants


def test_cache_options_map_tenant_salt_and_bypass():
    assert cache_options(completion(), "alice") == CacheOptions(
        enabled=True, tenant="alice", salt=""
    )
    opts = cache_options(completion(cache=False, cache_salt="p1"), "bob")
    assert opts == CacheOptions(enabled=False, tenant="bob", salt="p1")


def test_authenticator():
    assert Authenticator({}).tenant(None) == ""
    auth = Authenticator({"k1": "alice", "k2": "bob"})
    assert auth.tenant("k2") == "bob"
    for bad in (None, "", "k3", "k1 "):
        with pytest.raises(APIError) as exc:
            auth.tenant(bad)
        assert exc.value.status == 401 and exc.value.code == "invalid_api_key"


# ------------------------------------------------------------------------------- request mapping


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hi", "hi"),
        (["hi"], "hi"),
        ([1, 2, 3], [1, 2, 3]),
        ([[4, 5]], [4, 5]),
    ],
)
def test_completion_prompt_shapes(prompt, expected):
    assert completion_prompt(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", "b"], [[1], [2]]])
def test_completion_prompt_rejects_empty_and_batches(prompt):
    with pytest.raises(APIError) as exc:
        completion_prompt(completion(prompt=prompt))
    assert exc.value.status == 400 and exc.value.param == "prompt"


def test_chat_messages_join_parts_and_map_roles():
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "bot"},
        ]
    )
    assert chat_messages(req) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]


def test_sampling_params_defaults_and_fields():
    p = sampling_params(completion(), prompt_tokens=10, limits=LIMITS)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (16, 1.0, 1.0, None, ())
    p = sampling_params(
        completion(max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n"), 10, LIMITS
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (7, 0.0, 0.5, 3, ("\n",))
    # the default shrinks to what fits in the context window
    assert sampling_params(completion(), prompt_tokens=990, limits=LIMITS).max_tokens == 10
    # max_completion_tokens wins over max_tokens
    assert sampling_params(chat(max_tokens=5, max_completion_tokens=9), 10, LIMITS).max_tokens == 9
    # sub-float32 values reach the engine as given; the sampler treats them as their limits
    p = sampling_params(completion(temperature=1e-40, top_p=5e-324), 10, LIMITS)
    assert p.greedy and (p.temperature, p.top_p) == (1e-40, 5e-324)


@pytest.mark.parametrize(
    "fields,prompt_tokens,param,code",
    [
        ({"max_tokens": 101}, 10, "max_tokens", "invalid_value"),
        ({"n": 2, "best_of": 3}, 10, "best_of", "invalid_value"),
        ({"stop": [""]}, 10, "stop", "invalid_value"),
        ({}, 1000, "prompt", "context_length_exceeded"),
        ({"max_tokens": 50}, 960, "prompt", "context_length_exceeded"),
    ],
)
def test_sampling_params_errors_name_the_field(fields, prompt_tokens, param, code):
    with pytest.raises(APIError) as exc:
        sampling_params(completion(**fields), prompt_tokens, LIMITS)
    assert exc.value.status == 400 and exc.value.param == param and exc.value.code == code
    assert param in exc.value.message


def test_context_error_names_the_limit():
    with pytest.raises(APIError) as exc:
        sampling_params(chat(), 1200, LIMITS)
    assert "1000" in exc.value.message and exc.value.param == "messages"


def test_chat_template_failure_is_a_400():
    class TemplateFails:  # stands in for the engine's prompt builder: only its encode_chat is involved
        def encode_chat(self, messages, reserve=0, tools=None):
            raise ChatTemplateError("Conversation roles must alternate user/assistant")

    class Engine:
        prompts = TemplateFails()

    with pytest.raises(APIError) as exc:
        plan_chat(Engine(), chat(), "", LIMITS)
    assert (
        exc.value.status == 400
        and exc.value.code == "invalid_chat_template"
        and "alternate" in exc.value.message
    )


# ----------------------------------------------------------------------------- schemas and errors


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": "0"}, "temperature"),
        ({"stream": 1}, "stream"),
        ({"cache": "false"}, "cache"),
        ({"cache_salt": 3}, "cache_salt"),
        ({"prompt": [True]}, "prompt"),
        ({"stop": [1]}, "stop"),
        ({"temperature": 3}, "temperature"),
        ({"model": None}, "model"),
    ],
)
def test_wrong_types_are_rejected_and_named(fields, param):
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    err = validation_error(exc.value.errors())
    assert err.status == 400 and err.param == param and err.message.startswith(param)


@pytest.mark.parametrize(
    "model, fields, path",
    [
        (CompletionRequest, {"prompt": "hi", "whatever": [1, 2]}, "whatever"),
        (CompletionRequest, {"prompt": "hi", "suffix": "x"}, "suffix"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "audio": {}},
            "audio",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x", "refusal": None}]},
            "messages[0].refusal",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"x": True}},
            "stream_options.x",
        ),
        (ResponseCreateRequest, {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ],
)
def test_fields_kvfuse_does_not_implement_are_refused_by_name(model, fields, path):
    with pytest.raises(ValidationError) as exc:
        model.model_validate({"model": "m", **fields})
    err = validation_error(exc.value.errors())
    assert err.status == 400 and err.code == "unsupported_parameter"
    assert err.message.startswith(f"{path}: this field is not supported by kvfuse")
    assert err.param == path.split(".")[0].split("[")[0]


def test_validation_error_of_invalid_json():
    err = validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 3),
                "msg": "JSON decode error",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert err.status == 400 and err.code == "invalid_json" and err.param is None


def test_error_body_shape():
    assert error_body("m", "t", "p", "c") == {
        "error": {"message": "m", "type": "t", "param": "p", "code": "c"}
    }
    e = APIError(429, "busy", code="queue_full")
    assert e.body()["error"]["type"] == "rate_limit_error" and e.response().status_code == 429


# ------------------------------------------------------------------------------------- responses


def result(text="ab", ids=(1, 2), reason="length", prompt=5, cached=0) -> GenerationResult:
    return GenerationResult(
        choices=[Choice(0, text, list(ids), reason)],
        text=text,
        token_ids=list(ids),
        finish_reason=reason,
        prompt_tokens=prompt,
        cached_tokens=cached,
        timings=Timings(queued_s=0.01, ttft_s=0.02, decode_s=0.03),
    )


def test_usage_reports_cached_tokens_where_they_came_from_and_the_save_time():
    r = result(prompt=300, cached=299)
    r.hit_tiers, r.timings.store_s = ("memory", "disk", "memory"), 0.00012
    r.prefix_reused_tokens = 299
    assert usage(r) == {
        "prompt_tokens": 300,
        "completion_tokens": 2,
        "total_tokens": 302,
        "prompt_tokens_details": {
            "cached_tokens": 299,
            "recomputed_tokens": 0,
            "prefix_reused_tokens": 299,
            "span_reused_tokens": 0,
            "prefilled_tokens": 1,
            "auto_reuse": "off",
            "cached_entries_by_tier": {"disk": 1, "memory": 2},
            "save_ms": 0.12,
        },
    }


def test_completion_stream_chunks():
    b = ResponseBuilder("req_abc", "m", 123, chat=False, include_usage=True)
    assert b.first_chunks() == []
    (c,) = b.delta_chunks(Delta(0, "x"))
    assert (
        c["object"] == "text_completion"
        and c["id"] == "cmpl-abc"
        and c["choices"][0]["text"] == "x"
    )
    assert c["usage"] is None
    final, usage_chunk = b.final_chunks(result(reason="stop"))
    assert final["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2


def test_chat_stream_chunks_and_body():
    b = ResponseBuilder("req_abc", "m", 123, chat=True)
    (first,) = b.first_chunks()
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert b.delta_chunks(Delta(0, "hi"))[0]["choices"][0]["delta"] == {"content": "hi"}
    (final,) = b.final_chunks(result())
    assert final["object"] == "chat.completion.chunk" and final["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "length",
        "logprobs": None,
    }
    assert "usage" not in final
    body = b.body(result(text="hello"))
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hello",
    }


def test_sse_framing():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    assert json.loads(sse_event({"x": [1]})[6:]) == {"x": [1]}


# ------------------------------------------------------------------------------------------- metrics


def test_metrics_render_and_count_outcomes():
    from prometheus_client.parser import text_string_to_metric_families

    stats, reuse = (
        EngineStats(requests=2),
        ReuseStats(tokens_reused=256, tokens_prefilled=10, hits_by_tier={"memory": 1}),
    )
    engine = SimpleNamespace(
        stats_snapshot=lambda: {**stats.snapshot(), **reuse.snapshot()}, cache_enabled=False
    )
    m = ServerMetrics(lambda: engine, queue=lambda: {"waiting": 3, "running": 1})
    m.observe_outcome(Outcome(result=result(reason="cancelled")))
    m.observe_outcome(Outcome(error=RequestCancelled("left")))
    m.observe_outcome(Outcome(result=result()))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.render().decode())
        for s in f.samples
    }
    assert samples[("kvfuse_requests_cancelled_total", (("stage", "running"),))] == 1
    assert samples[("kvfuse_requests_cancelled_total", (("stage", "queued"),))] == 1
    assert samples[("kvfuse_time_to_first_token_seconds_count", ())] == 2
    assert samples[("kvfuse_prompt_tokens_total", (("source", "cached"),))] == 256
    assert samples[("kvfuse_queue_depth", ())] == 3
    # a registry per app: a second app's metrics start from zero
    other = ServerMetrics(lambda: None, queue=lambda: {})
    assert b"kvfuse_requests_cancelled_total{" not in other.render()


# What vllm-router 0.1.17 adds to every body it forwards (SGLang's extensions at their defaults).
ROUTER_DEFAULTS = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}


def test_the_fields_vllm_router_adds_are_accepted_at_their_defaults():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **ROUTER_DEFAULTS}
    ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    "field,value",
    [("no_stop_trim", True), ("skip_special_tokens", False), ("continue_final_message", True),
     ("separate_reasoning", False), ("return_hidden_states", True)],
)  # fmt: skip
def test_the_router_fields_are_refused_at_any_other_value(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(body)
    err = validation_error(exc.value.errors())
    assert err.status == 400 and err.param == field
