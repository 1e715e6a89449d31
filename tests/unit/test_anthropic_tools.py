"""Tool use on the Messages API, without a model: Anthropic's tools and tool_choice -> kvfuse.tools
(tables), tool_use / tool_result blocks -> chat messages, the schema's 400s, response bodies and
the event stream of calls, stop reasons, and the prompt (tools rendered, forced call's opening)
through a real tokenizer and template."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError
from test_anthropic_api import LIMITS, parse, prompting, refused, request, result  # noqa: F401

from kvfuse.server.anthropic_bodies import MessageBuilder, stop_reason
from kvfuse.server.anthropic_schemas import MessagesRequest, ToolDefinition, ToolResultBlock
from kvfuse.server.anthropic_tools import (
    NEEDS_TOOLS,
    choice_from_anthropic,
    new_tool_use_id,
    result_text,
    tool_use,
    tools_from_anthropic,
)
from kvfuse.server.anthropic_translate import conversation, count_tokens, plan_messages
from kvfuse.tools import PROMPTED, Tool, ToolCalling, ToolChoice, ToolsError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather.", "input_schema": SCHEMA}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def defs(*tools: dict) -> list[ToolDefinition]:
    return [ToolDefinition.model_validate(t) for t in tools]


def choice(value: dict | None):
    return request(tools=[WEATHER, CLOCK], tool_choice=value).tool_choice if value else None


# ----------------------------------------------------------------------- tools and tool_choice


def test_custom_tools_become_tools():
    tools = tools_from_anthropic(defs(WEATHER, {**CLOCK, "type": "custom", "strict": True}))
    assert tools == (
        Tool("get_weather", "The weather.", SCHEMA, False),
        Tool("get_time", None, {"type": "object", "properties": {}}, True),
    )


@pytest.mark.parametrize(
    "tools,words",
    [
        ([{**WEATHER, "name": "get weather"}], ["tools[0].name", "pattern"]),
        ([{**WEATHER, "name": "x" * 65}], ["tools[0].name"]),
        ([WEATHER, {**CLOCK, "input_schema": {"type": "array"}}], ["tools[1].input_schema.type"]),
        ([WEATHER, {**WEATHER, "description": None}], ["unique", "get_weather"]),
    ],
)
def test_bad_tools_are_errors_naming_them(tools, words):
    with pytest.raises(ToolsError) as exc:
        tools_from_anthropic(defs(*tools))
    assert exc.value.param == "tools" and all(w in str(exc.value) for w in words), str(exc.value)


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, (ToolChoice("auto"), True)),
        ({"type": "auto"}, (ToolChoice("auto"), True)),
        ({"type": "auto", "disable_parallel_tool_use": True}, (ToolChoice("auto"), False)),
        ({"type": "auto", "disable_parallel_tool_use": False}, (ToolChoice("auto"), True)),
        ({"type": "any"}, (ToolChoice("required"), True)),
        ({"type": "any", "disable_parallel_tool_use": True}, (ToolChoice("required"), False)),
        ({"type": "tool", "name": "get_time"}, (ToolChoice("function", "get_time"), True)),
        ({"type": "none"}, (ToolChoice("none"), True)),
    ],
)
def test_tool_choice_maps_to_kvfuse_tools(value, expected):
    tools = tools_from_anthropic(defs(WEATHER, CLOCK))
    assert choice_from_anthropic(choice(value), tools) == expected


def test_a_named_choice_must_be_one_of_the_tools():
    tools = tools_from_anthropic(defs(WEATHER, CLOCK))
    with pytest.raises(ToolsError) as exc:
        choice_from_anthropic(choice({"type": "tool", "name": "nope"}), tools)
    assert exc.value.param == "tool_choice" and "'nope'" in str(exc.value)


@pytest.mark.parametrize(
    "tools,value,history,param,words",
    [
        (None, {"type": "auto"}, False, "tool_choice", ["only allowed when tools"]),
        ([], {"type": "any"}, False, "tool_choice", ["only allowed when tools"]),
        (None, None, True, "tools", [NEEDS_TOOLS]),
    ],
)
def test_tool_choice_and_history_need_tools(tools, value, history, param, words):
    chosen = request(tools=[WEATHER], tool_choice=value).tool_choice if value else None
    with pytest.raises(ToolsError) as exc:
        tool_use(defs(*tools) if tools else tools, chosen, history)
    assert exc.value.param == param and all(w in str(exc.value) for w in words)


def test_no_tools_is_no_tool_use():
    assert tool_use(None, None, False) is None and tool_use([], None, False) is None


@pytest.mark.parametrize(
    "fields,loc",
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"tools": [{**WEATHER, "input_examples": [{}]}]}, "tools"),
        ({"tools": [{"name": "f"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "none", "disable_parallel_tool_use": 1}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_schema_errors_name_the_tool_field(fields, loc):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as exc:
        MessagesRequest.model_validate({**body, **fields})
    assert exc.value.errors()[0]["loc"][0] == loc


# ------------------------------------------------------------------------------- history


@pytest.mark.parametrize(
    "block,text",
    [
        ({"content": "18 C"}, "18 C"),
        ({}, ""),
        ({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, "a\nb"),
        ({"content": "no such city", "is_error": True}, "Error: no such city"),
        ({"is_error": False, "content": "ok"}, "ok"),
    ],
)
def test_result_text(block, text):
    base = {"type": "tool_result", "tool_use_id": "toolu_1"}
    assert result_text(ToolResultBlock.model_validate({**base, **block})) == text


def history(*extra: dict, **fields):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "text", "text": "Thanks"},
            ],
        },
        *extra,
    ]
    return request(messages=messages, **{"tools": [WEATHER], **fields})


def test_tool_use_and_tool_result_become_calls_and_tool_messages():
    conv = conversation(history(system="S"))
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert conv.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": call}],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Thanks"},
    ]
    assert conv.tools.choice == ToolChoice("auto") and conv.tools.parallel


def test_a_conversation_may_end_with_tool_results():
    req = request(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True}],
            },
        ],
    )
    assert conversation(req).messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "Error: ", "tool_call_id": "toolu_1"},
    ]


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}


@pytest.mark.parametrize(
    "messages,fields,param,words",
    [
        ([{"role": "user", "content": [USE]}], {}, "messages", ["tool_use blocks go in assistant"]),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": [RESULT]}],
            {},
            "messages",
            ["messages[1].content[0]", "tool_result blocks go in user"],
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": [USE]}],
            {},
            "messages",
            ["prefill"],
        ),
        ([{"role": "user", "content": [RESULT]}], {}, "messages", ["toolu_1"]),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [USE]},
                {"role": "user", "content": [RESULT]},
            ],
            {"tools": None},
            "tools",
            [NEEDS_TOOLS],
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": [{**USE, "input": 1}]},
            ],
            {},
            "messages",
            ["messages[1].content[0].input"],
        ),
    ],
)
def test_bad_tool_history_is_a_400_naming_it(prompting, messages, fields, param, words):  # noqa: F811
    req = request(messages=messages, **{"tools": [WEATHER], **fields})
    err = refused(plan_messages, prompting, req, "t", LIMITS)
    assert err.param == param and all(w in err.message for w in words), err.message


def test_cache_control_on_tools_and_calls_are_marks():
    tool = {**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    req = history(system="S", tools=[tool])
    req.messages[1].content[1]["cache_control"] = {"type": "ephemeral"}
    conv = conversation(req)
    # the tools: before the first non-system message; a call: its message's text's end
    assert [(m.message, m.offset, m.ttl_s) for m in conv.marks] == [
        (1, 0, 3600.0),
        (2, len("Let me look."), 300.0),
    ]


# ------------------------------------------------------------------- prompts (real tokenizer)


def test_prompt_has_the_tools_and_a_forced_calls_opening(prompting):  # noqa: F811
    plain = count_tokens(prompting, request())
    auto = count_tokens(prompting, request(tools=[WEATHER]))
    forced = count_tokens(prompting, request(tools=[WEATHER], tool_choice={"type": "any"}))
    assert plain < auto < forced  # the tools section, then "<tool_call>\n"
    plan = plan_messages(prompting, request(tools=[WEATHER]), "t", LIMITS)
    assert len(plan.call.prompt) == auto and plan.call.tools.choice == ToolChoice("auto")
    assert plan.call.tools.new_id().startswith("toolu_")
    one = request(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    plan = plan_messages(prompting, one, "t", LIMITS)
    assert plan.call.params.stop == ("</tool_call>",) and plan.stop_sequences == ()


# ------------------------------------------------------------------------ bodies and events


def calling(mode: str = "auto", parallel: bool = True) -> ToolCalling:
    ids = iter(f"toolu_{i}" for i in range(10))
    tool = Tool("get_weather", None, SCHEMA)
    return ToolCalling(PROMPTED, (tool,), ToolChoice(mode), parallel, new_id=lambda: next(ids))


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_new_tool_use_ids_are_anthropics():
    ids = {new_tool_use_id() for _ in range(20)}
    assert len(ids) == 20 and all(re.fullmatch(r"toolu_[A-Za-z0-9]{24}", i) for i in ids)


@pytest.mark.parametrize(
    "text,content,reason",
    [
        (
            "Sure. " + CALL_TEXT,
            [
                {"type": "text", "text": "Sure."},
                {
                    "type": "tool_use",
                    "id": "toolu_0",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
            "tool_use",
        ),
        (
            CALL_TEXT,
            [
                {
                    "type": "tool_use",
                    "id": "toolu_0",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                }
            ],
            "tool_use",
        ),
        ("Just text.", [{"type": "text", "text": "Just text."}], "end_turn"),
        (
            '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
            [
                {
                    "type": "text",
                    "text": '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                }
            ],
            "end_turn",
        ),
    ],
)
def test_body_has_tool_use_blocks(text, content, reason):
    b = MessageBuilder("msg_1", "m", 50, (), calling()).body(result(text=text))
    assert b["content"] == content and b["stop_reason"] == reason and b["stop_sequence"] is None


def test_tool_choice_none_is_never_parsed():
    b = MessageBuilder("msg_1", "m", 50, (), calling("none")).body(result(text=CALL_TEXT))
    assert b["content"] == [{"type": "text", "text": CALL_TEXT}] and b["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    "fields,called,stops,expected",
    [
        ({"stop_sequence": "</tool_call>"}, False, (), ("end_turn", None)),  # the tools' own
        ({"stop_sequence": "END"}, False, ("END",), ("stop_sequence", "END")),
        ({"stop_sequence": "END"}, False, None, ("stop_sequence", "END")),
        ({"stop_sequence": "</tool_call>"}, True, (), ("tool_use", None)),
        ({}, True, (), ("tool_use", None)),
        ({"finish_reason": "length", "token_ids": list(range(10))}, True, (), ("max_tokens", None)),
    ],
)
def test_stop_reason_with_tools(fields, called, stops, expected):
    assert stop_reason(result(**fields), 10, called, stops) == expected


def test_streamed_calls_are_tool_use_blocks_with_input_json_deltas():
    b = MessageBuilder("msg_1", "m", 50, (), calling())
    pieces = ["Sure. ", CALL_TEXT[:20], CALL_TEXT[20:], " Done."]
    events = b.start(result(text="", token_ids=[]))
    for piece in pieces:
        events += b.text(piece)
    got = parse(events + b.finish(result(text="".join(pieces))))
    assert [(name, d.get("index")) for name, d in got] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("ping", None),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert got[3][1]["delta"] == {"type": "text_delta", "text": "Sure."}
    assert got[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_0",
        "name": "get_weather",
        "input": {},
    }
    delta = got[6][1]["delta"]
    assert delta["type"] == "input_json_delta" and json.loads(delta["partial_json"]) == {
        "city": "Paris"
    }
    assert got[9][1]["delta"] == {"type": "text_delta", "text": "Done."}
    assert got[11][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_a_stream_of_only_a_call():
    b = MessageBuilder("msg_1", "m", 50, (), calling("required"))
    events = b.start(result(text="", token_ids=[])) + b.text(CALL_TEXT[len("<tool_call>\n") :])
    got = parse(events + b.finish(result()))
    names = [name for name, _ in got]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[1][1]["index"] == 0 and got[1][1]["content_block"]["type"] == "tool_use"


def test_a_calls_input_streams_in_pieces_that_the_sdk_joins():
    """Token by token, the input comes as several ``input_json_delta`` pieces; the ``anthropic``
    SDK's own accumulator joins them into the whole answer's input."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    text = CALL_TEXT.replace("Paris", "Paris, in France")
    b = MessageBuilder("msg_1", "m", 50, (), calling())
    events = b.start(result(text="", token_ids=[]))
    for i in range(0, len(text), 2):
        events += b.text(text[i : i + 2])
    got = parse(events + b.finish(result(text=text)))
    pieces = [d["delta"]["partial_json"] for n, d in got if d.get("delta", {}).get("partial_json")]
    assert len(pieces) > 3 and "".join(pieces) == '{"city": "Paris, in France"}'
    message, adapter, bufs = None, TypeAdapter(RawMessageStreamEvent), {}
    for _, data in got:
        if data["type"] != "ping":
            event = adapter.validate_python(data)
            message = accumulate_event(event=event, current_snapshot=message, json_bufs=bufs)
    (block,) = message.content
    assert block.type == "tool_use" and block.input == {"city": "Paris, in France"}
    whole = MessageBuilder("msg_1", "m", 50, (), calling()).body(result(text=text))
    assert whole["content"][0]["input"] == block.input
    assert message.stop_reason == whole["stop_reason"] == "tool_use"


def test_a_streamed_call_cut_short_stops_with_what_was_sent():
    text = CALL_TEXT[: CALL_TEXT.index("Paris") + 2]
    b = MessageBuilder("msg_1", "m", 5, (), calling())
    events = b.start(result(text="", token_ids=[]))
    for i in range(0, len(text), 2):
        events += b.text(text[i : i + 2])
    got = parse(events + b.finish(result(text=text, finish_reason="length", token_ids=[1] * 5)))
    assert [n for n, _ in got][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    pieces = "".join(d["delta"].get("partial_json", "") for n, d in got if "delta" in d)
    assert pieces == '{"city": "Pa' and got[-2][1]["delta"]["stop_reason"] == "max_tokens"
