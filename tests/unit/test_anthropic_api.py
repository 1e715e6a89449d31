"""The Messages API's pure parts, without a model: content blocks -> chat messages, cache_control
-> marks and breakpoints (through a real tokenizer and chat template), refused fields, sampling,
the usage mapping (tables), stop reasons, the stream's event sequence, Anthropic's error shape,
and the routes' errors through the app (auth, validation, 404s) with an engine that is never
reached."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from kvfuse_helpers import write_word_tokenizer
from pydantic import ValidationError

from kvfuse.config import load_config
from kvfuse.engine import Breakpoint, GenerationResult
from kvfuse.models import Tokenizer
from kvfuse.prompts import PromptBuilder
from kvfuse.server.anthropic_bodies import (
    CacheUsage,
    MessageBuilder,
    cache_usage,
    stop_reason,
    usage,
)
from kvfuse.server.anthropic_errors import error_body, error_headers, error_type
from kvfuse.server.anthropic_schemas import MessagesRequest
from kvfuse.server.anthropic_translate import (
    Mark,
    conversation,
    count_tokens,
    plan_messages,
    sampling,
)
from kvfuse.server.errors import APIError, validation_error
from kvfuse.server.translate import Limits, Prompting

LIMITS = Limits(max_tokens_limit=100, default_max_tokens=16, context_window=1000)
FIVE_MIN, ONE_HOUR = 300.0, 3600.0


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesRequest.model_validate({**body, **fields})


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(*args)
    assert exc.value.status == 400
    return exc.value


def cc(ttl: str | None = None) -> dict:
    return {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}


# -------------------------------------------------------------------- blocks -> chat messages


def test_system_and_messages_become_chat_messages():
    conv = conversation(
        request(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            messages=[
                {"role": "user", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Bye"},
            ],
        )
    )
    assert conv.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Hello\nagain"},  # consecutive turns combined, as Anthropic
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"},
    ]
    assert conv.marks == []
    assert conversation(request(system="S")).messages[0] == {"role": "system", "content": "S"}
    assert conversation(request(system="")).messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "fields,field,words",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages",
            ["messages[0].content[0]", "'image'"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages",
            ["'document'"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages",
            ["messages[0].content[0].tool_use_id", "required"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages",
            ["messages[0].content[0].text"],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
            "messages",
            ["messages[0].content[0].x"],
        ),
        ({"messages": [{"role": "user", "content": ""}]}, "messages", ["non-empty"]),
        ({"messages": [{"role": "user", "content": []}]}, "messages", ["non-empty"]),
        ({"messages": []}, "messages", ["at least one"]),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "messages",
            ["prefill"],
        ),
        ({"tools": [{"name": "f", "input_schema": {}}]}, "tools", ["tools[0].input_schema"]),
        ({"tool_choice": {"type": "auto"}}, "tool_choice", ["tool_choice", "tools"]),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking", ["thinking"]),
        ({"speed": "fast"}, "speed", ["speed"]),
        ({"container": "c1"}, "container", ["container"]),
    ],
)
def test_what_cannot_be_rendered_is_a_400_naming_it(fields, field, words):
    err = refused(conversation, request(**fields))
    assert err.param == field and all(w in err.message for w in words), err.message


def test_harmless_values_of_refused_fields_are_accepted():
    for fields in ({"thinking": {"type": "disabled"}}, {"tools": []}, {"speed": "standard"}):
        assert conversation(request(**fields)).messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "fields,loc",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"metadata": {"user_id": "u", "other": 1}}, "metadata"),
        ({"frobnicate": True}, "frobnicate"),
        ({"system": [{"type": "text", "text": ""}]}, "system"),
        ({"cache_control": {"type": "ephemeral", "ttl": "10m"}}, "cache_control"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ],
)
def test_schema_errors_name_the_field(fields, loc):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError) as exc:
        MessagesRequest.model_validate(body)
    err = validation_error(exc.value.errors())
    assert err.status == 400 and err.param == loc, err.message


# --------------------------------------------------------------------- cache_control -> marks


def test_cache_control_marks_the_end_of_its_block():
    conv = conversation(
        request(
            system=[
                {"type": "text", "text": "Rules.", "cache_control": cc("1h")},
                {"type": "text", "text": "More."},
            ],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Doc", "cache_control": cc()}],
                },
                {"role": "user", "content": [{"type": "text", "text": "Q?"}]},
            ],
            cache_control=cc(),
        )
    )
    assert conv.messages[1]["content"] == "Doc\nQ?"
    assert conv.marks == [
        Mark(0, len("Rules."), ONE_HOUR),
        Mark(1, len("Doc"), FIVE_MIN),  # the default ttl is 5m, as Anthropic
        Mark(1, len("Doc\nQ?"), FIVE_MIN),  # top-level: the end of the last block
    ]


def test_breakpoint_rules_are_anthropics():
    five = [{"type": "text", "text": f"b{i}", "cache_control": cc()} for i in range(5)]
    err = refused(conversation, request(system=five))
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in err.message
    late_hour = [
        {"type": "text", "text": "a", "cache_control": cc("5m")},
        {"type": "text", "text": "b", "cache_control": cc("1h")},
    ]
    assert "1h" in refused(conversation, request(system=late_hour)).message
    assert len(conversation(request(system=late_hour[::-1])).marks) == 2


# ------------------------------------------------------------------- prompts, positions (real
# tokenizer and template: a word-level tokenizer whose template wraps each message in tags)

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


@pytest.fixture(scope="module")
def prompting(tmp_path_factory) -> Prompting:
    folder = write_word_tokenizer(tmp_path_factory.mktemp("tok"), 50)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    model = SimpleNamespace(
        tokenizer=Tokenizer(folder), config=SimpleNamespace(max_position_embeddings=1000)
    )
    return Prompting(PromptBuilder(model, 1000))


def test_plan_puts_breakpoints_at_the_marked_blocks_ends(prompting):
    req = request(
        system=[{"type": "text", "text": "a b c", "cache_control": cc("1h")}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "d e", "cache_control": cc()},
                    {"type": "text", "text": "f"},
                ],
            }
        ],
        stop_sequences=["END"],
        temperature=0,
        top_k=5,
    )
    plan = plan_messages(prompting, req, "alice", LIMITS)
    # "<system> a b c </system> <user> d e \n f </user> <assistant>": the Whitespace
    # pre-tokenizer splits "<system>" into "<", "system", ">" (and "</user>" into 3 too)
    system = ["<", "system", ">", "a", "b", "c"]
    user = ["</", "system", ">", "<", "user", ">", "d", "e"]
    assert plan.breakpoints == (
        Breakpoint(len(system), ONE_HOUR),
        Breakpoint(len(system) + len(user), FIVE_MIN),
    )
    call = plan.call
    assert call.cache.tenant == "alice" and call.cache.enabled
    p = call.params
    assert (p.max_tokens, p.temperature, p.top_k, p.stop) == (10, 0.0, 5, ("END",))
    assert (
        count_tokens(prompting, req)
        == len(call.prompt)
        == len(prompting.prompts.encode_prompt(messages=conversation(req).messages))
    )


def test_prompt_too_long_and_max_tokens_beyond_the_limit(prompting):
    long = request(messages=[{"role": "user", "content": "w " * 1200}])
    err = refused(plan_messages, prompting, long, "", LIMITS)
    assert err.message.startswith("prompt is too long") and err.param == "messages"
    err = refused(plan_messages, prompting, request(max_tokens=101), "", LIMITS)
    assert err.param == "max_tokens" and "100" in err.message


@pytest.mark.parametrize(
    "fields,prompt_tokens,expected",
    [
        ({}, 10, (10, 1.0, 1.0, 0)),  # Anthropic's default temperature is 1
        ({"max_tokens": 50}, 980, (20, 1.0, 1.0, 0)),  # cut to the window's room
        ({"max_tokens": 0}, 10, (1, 1.0, 1.0, 0)),  # pre-warming: one token, not returned
        ({"top_p": 0.0}, 10, (10, 1.0, 1.0, 1)),  # nucleus of mass 0: the likeliest token
        ({"top_p": 0.5, "top_k": 3, "temperature": 0.2}, 10, (10, 0.2, 0.5, 3)),
    ],
)
def test_sampling(fields, prompt_tokens, expected):
    p = sampling(request(**fields), prompt_tokens, LIMITS)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == expected


def test_sampling_errors_name_the_field():
    assert refused(sampling, request(stop_sequences=[""]), 10, LIMITS).param == "stop_sequences"
    err = refused(sampling, request(max_tokens=0, stream=True), 10, LIMITS)
    assert err.param == "max_tokens" and "stream" in err.message


# ------------------------------------------------------------------------------------- usage

B5 = Breakpoint  # (position, ttl)


@pytest.mark.parametrize(
    "case,prompt,cached,written,breakpoints,expected",
    [
        # input, creation 5m, creation 1h, read
        ("no cache_control, cold", 1000, 0, 768, (), (1000, 0, 0, 0)),
        # kvfuse reuses whole chunks without any breakpoint: reported as read
        ("no cache_control, warm", 1000, 768, 0, (), (232, 0, 0, 768)),
        ("system breakpoint, first", 1000, 0, 856, (B5(600, FIVE_MIN),), (400, 600, 0, 0)),
        ("system breakpoint, again", 1000, 600, 0, (B5(600, FIVE_MIN),), (400, 0, 0, 600)),
        ("a longer prefix was cached", 1000, 900, 0, (B5(600, FIVE_MIN),), (100, 0, 0, 900)),
        ("part of the prefix was cached", 1000, 512, 88, (B5(600, FIVE_MIN),), (400, 88, 0, 512)),
        ("1h then 5m", 1000, 0, 1000, (B5(300, ONE_HOUR), B5(700, FIVE_MIN)), (300, 400, 300, 0)),
        (
            "1h read, 5m written",
            1000,
            300,
            400,
            (B5(300, ONE_HOUR), B5(700, FIVE_MIN)),
            (300, 400, 0, 300),
        ),
        ("cache off: nothing written", 1000, 0, 0, (B5(600, FIVE_MIN),), (1000, 0, 0, 0)),
        ("breakpoint at the end", 50, 0, 50, (B5(50, ONE_HOUR),), (0, 0, 50, 0)),
    ],
)
def test_cache_usage_table(case, prompt, cached, written, breakpoints, expected):
    u = cache_usage(prompt, cached, written, breakpoints)
    assert u == CacheUsage(*expected), case
    assert u.input_tokens + u.creation + u.read == prompt


def result(**fields) -> GenerationResult:
    base = dict(text="Hello there", token_ids=[1, 2, 3], finish_reason="stop", prompt_tokens=20)
    return GenerationResult(**{**base, **fields})


def test_usage_body():
    r = result(cached_tokens=8, written_tokens=12)
    assert usage(r, (Breakpoint(16, None),), 3) == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 8,
        "cache_read_input_tokens": 8,
        "cache_creation": {"ephemeral_5m_input_tokens": 8, "ephemeral_1h_input_tokens": 0},
        "output_tokens": 3,
        "service_tier": "standard",
    }


@pytest.mark.parametrize(
    "fields,max_tokens,expected",
    [
        ({}, 10, ("end_turn", None)),
        ({"stop_sequence": "END"}, 10, ("stop_sequence", "END")),
        ({"finish_reason": "length"}, 3, ("max_tokens", None)),
        ({"finish_reason": "length"}, 10, ("model_context_window_exceeded", None)),
        ({"finish_reason": "length", "token_ids": [1]}, 0, ("max_tokens", None)),
    ],
)
def test_stop_reason(fields, max_tokens, expected):
    assert stop_reason(result(**fields), max_tokens) == expected


def test_prewarm_body_has_no_content():
    b = MessageBuilder("msg_1", "m", 0).body(result(finish_reason="length", token_ids=[5]))
    assert b["content"] == [] and b["usage"]["output_tokens"] == 0
    assert b["stop_reason"] == "max_tokens"


# ------------------------------------------------------------------------------------ events


def parse(events: list[str]) -> list[tuple[str, dict]]:
    out = []
    for e in events:
        head, data, blank = e.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and blank == "\n"
        out.append((head[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def test_event_sequence_is_anthropics():
    b = MessageBuilder("msg_1", "m", 10, (Breakpoint(10, None),))
    first = result(text="", token_ids=[], written_tokens=10)
    events = (
        b.start(first)
        + b.text("Hel")
        + b.text("lo")
        + b.finish(result(text="Hello", token_ids=[1, 2], stop_sequence="!", written_tokens=10))
    )
    got = parse(events)
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in got)
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"] == "msg_1"
    assert start["usage"]["cache_creation_input_tokens"] == 10
    assert start["usage"]["input_tokens"] == 10 and start["usage"]["output_tokens"] == 0
    assert got[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert got[3][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    delta = got[6][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "!"}
    assert delta["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 10,
        "cache_read_input_tokens": 0,
        "output_tokens": 2,
    }


def test_a_message_without_text_has_no_block():
    b = MessageBuilder("msg_1", "m", 10)
    got = parse(b.start(result()) + b.finish(result(text="", token_ids=[])))
    assert [name for name, _ in got] == ["message_start", "ping", "message_delta", "message_stop"]


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "status,kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types_follow_the_status(status, kind):
    assert error_type(status) == kind
    assert error_body(status, "m", "req_1") == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
        "request_id": "req_1",
    }


def test_rate_limit_headers():
    h = error_headers(
        {
            "retry-after": "3",
            "x-ratelimit-limit-requests": "5",
            "x-ratelimit-remaining-requests": "0",
        },
        "req_1",
        now=0.0,
    )
    assert h["request-id"] == "req_1" and h["anthropic-ratelimit-requests-limit"] == "5"
    assert h["anthropic-ratelimit-requests-reset"] == "1970-01-01T00:00:03Z"


@pytest.fixture(scope="module")
def app_client(prompting, tmp_path_factory):
    """The app with API keys (carol's limited to one request a minute) and a 4 KiB body limit,
    over an engine that is never reached (every request here fails before it would be queued)."""
    from kvfuse.server.app import create_app

    path = tmp_path_factory.mktemp("config") / "kvfuse.yaml"
    path.write_text(
        "server:\n  api_keys: ['sk-a:alice', 'sk-c:carol']\n  max_body_bytes: 4096\n"
        "tenants:\n  carol:\n    quota:\n      requests_per_minute: 1\n"
    )
    config = load_config(path)
    engine = SimpleNamespace(
        model=SimpleNamespace(name="m", config=SimpleNamespace(vocab_size=50)),
        context_window=1000,
        start=lambda: None,
        stop=lambda: None,
        flush=lambda timeout=None: True,
        free_entries=lambda keys: None,
    )
    serving = SimpleNamespace(engine=engine, prompts=prompting.prompts)
    with TestClient(create_app(config, serving)) as client:
        yield client


def post(client, path, body, key="sk-a", **headers):
    if key is not None:
        headers["x-api-key"] = key
    return client.post(path, json=body, headers=headers)


def test_routes_answer_in_anthropics_shape(app_client):
    ok = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/messages", ok, None, 401, "authentication_error", "x-api-key"),
        ("/v1/messages", ok, "sk-b", 401, "authentication_error", "invalid x-api-key"),
        ("/v1/messages", {**ok, "model": "x"}, "sk-a", 404, "not_found_error", "'x'"),
        (
            "/v1/messages",
            {**ok, "thinking": {"type": "enabled"}},
            "sk-a",
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            "/v1/messages",
            {**ok, "max_tokens": None},
            "sk-a",
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            "/v1/messages/count_tokens",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "sk-a",
            400,
            "invalid_request_error",
            "image",
        ),
        ("/v1/messages/nothing", ok, "sk-a", 404, "not_found_error", "no such endpoint"),
    ]
    for path, body, key, status, kind, words in cases:
        r = post(app_client, path, body, key)
        got = r.json()
        assert r.status_code == status and got["type"] == "error", (path, body, got)
        assert got["error"]["type"] == kind and words in got["error"]["message"], got
        assert got["request_id"] == r.headers["request-id"] == r.headers["x-request-id"]


def test_count_tokens_and_bearer_keys(app_client):
    body = {"model": "m", "messages": [{"role": "user", "content": "a b"}], "system": "s"}
    r = app_client.post(
        "/v1/messages/count_tokens",
        json=body,
        headers={"authorization": "Bearer sk-a", "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 200 and r.json()["input_tokens"] > 4


def test_openai_routes_keep_openais_shape(app_client):
    r = app_client.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_limits_answer_in_anthropics_shape(app_client):
    big = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = post(app_client, "/v1/messages", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    body = {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert post(app_client, "/v1/messages", body, "sk-c").status_code == 404  # counted
    r = post(app_client, "/v1/messages", body, "sk-c")
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert "tenants.carol.quota.requests_per_minute" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["anthropic-ratelimit-requests-limit"] == "1"
