"""Tool use on Anthropic's Messages API, on a real ``kvfuse serve`` process, driven by the official
``anthropic`` client and ``langchain-anthropic``.

SmolLM2 (its template takes no tools: kvfuse's prompted format): a forced call (``any``, a named
``tool``) is a ``tool_use`` block whose input validates against the tool's ``input_schema``, whole
and streamed (``content_block_start`` with the block, ``input_json_delta``); a history with
``tool_use`` and ``tool_result`` blocks (also ``is_error``) is answered; ``none`` never calls;
count_tokens counts the tools and agrees with the usage; bad tool requests are typed 400s;
``ChatAnthropic.bind_tools(..., tool_choice="any")`` returns tool calls, invoked and streamed, and
takes a ``ToolMessage`` back. Qwen2.5 (native hermes format), marked slow: a forced call.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEY = "sk-alice"
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
MULTIPLY = {
    "name": "multiply",
    "description": "Multiply two integers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
TOOLS = [WEATHER, MULTIPLY]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_PRODUCT = [{"role": "user", "content": "What is 12 times 34?"}]


def start(kvfuse_home: Path, tmp: Path, model: str) -> ServerProcess:
    ensure_model(kvfuse_home, model)
    config = {
        "model": model,
        "cache": {"disk_path": str(tmp / "kv")},
        "server": {"api_keys": [f"{KEY}:alice"]},
    }
    return ServerProcess(kvfuse_home, config=config).start()


@pytest.fixture(scope="module")
def server(kvfuse_home: Path, tmp_path_factory):
    srv = start(kvfuse_home, tmp_path_factory.mktemp("messages-tools"), MODEL)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def only_call(message, name: str | None = None):
    """The message's single tool_use block, checked against its tool's schema."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1, message
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name in SCHEMAS
    assert name is None or use.name == name
    jsonschema.validate(use.input, SCHEMAS[use.name])
    return use


def test_a_forced_call_is_a_valid_tool_use(client):
    m = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    only_call(m)
    m = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK_PRODUCT,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "multiply", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    only_call(m, "multiply")
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    total += m.usage.cache_creation_input_tokens
    counted = client.messages.count_tokens(
        model=MODEL,
        messages=ASK_PRODUCT,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "multiply"},
    ).input_tokens
    assert (
        total
        == counted
        > client.messages.count_tokens(model=MODEL, messages=ASK_PRODUCT).input_tokens
    )


def test_a_streamed_forced_call_is_a_tool_use_block_with_input_json_deltas(client):
    fields = dict(
        model=MODEL,
        max_tokens=60,
        messages=ASK_PRODUCT,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "multiply"},
        extra_body=GREEDY,
    )
    whole = only_call(client.messages.create(**fields), "multiply")
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    streamed = only_call(final, "multiply")
    assert streamed.input == whole.input and streamed.id != whole.id
    events = list(client.messages.create(stream=True, **fields))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    block = starts[0].content_block
    assert block.name == "multiply" and block.id.startswith("toolu_") and block.input == {}
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.type == "input_json_delta" for d in deltas)
    assert len(deltas) > 1  # the input as it is generated, in pieces that join to its JSON
    assert "".join(d.partial_json for d in deltas) == json.dumps(whole.input, ensure_ascii=False)
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]


def history(result: dict) -> list[dict]:
    return [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_01A09q90qw90lq917835lq9",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", **result}
            ],
        },
    ]


@pytest.mark.parametrize(
    "result",
    [
        {"content": "18 degrees and sunny"},
        {"content": [{"type": "text", "text": "City not found"}], "is_error": True},
    ],
)
def test_a_history_with_tool_use_and_tool_result_is_answered(client, result):
    messages = history(result)
    m = client.messages.create(
        model=MODEL, max_tokens=8, messages=messages, tools=TOOLS, extra_body=GREEDY
    )
    assert m.usage.output_tokens > 0 and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert total + m.usage.cache_creation_input_tokens == counted.input_tokens


def test_tool_choice_none_never_calls(client):
    m = client.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert all(b.type == "text" for b in m.content) and m.stop_reason != "tool_use"


@pytest.mark.parametrize(
    "fields,words",
    [
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
            ["tools"],
        ),
        ({"tool_choice": {"type": "any"}}, ["tool_choice", "tools"]),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, ["'nope'"]),
        ({"messages": history({"content": "x"})}, ["must define tools"]),
    ],
)
def test_bad_tool_requests_are_typed_400s(client, fields, words):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=4, **{"messages": ASK_WEATHER, **fields})
    message = exc.value.body["error"]["message"]
    assert all(w in message for w in words), message


def test_langchain_bind_tools_any(server):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    llm = ChatAnthropic(
        model=MODEL, base_url=server.url, api_key=KEY, max_tokens=60, temperature=0, max_retries=0
    )
    bound = llm.bind_tools([WEATHER, MULTIPLY], tool_choice="any")
    ai = bound.invoke("What is 12 times 34?")
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["id"].startswith("toolu_")
    call = ai.tool_calls[0]
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    chunks = list(bound.stream("What is 12 times 34?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    answer = llm.bind_tools([WEATHER, MULTIPLY]).invoke(
        [
            HumanMessage("What is 12 times 34?"),
            AIMessage(content="", tool_calls=[call]),
            ToolMessage("408", tool_call_id=call["id"]),
        ]
    )
    assert isinstance(answer, AIMessage) and answer.response_metadata["stop_reason"]


@pytest.mark.slow
def test_qwen_forced_call_native_format(kvfuse_home: Path, tmp_path):
    srv = start(kvfuse_home, tmp_path, "qwen2.5-0.5b")
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=600)
        fields = dict(
            model="qwen2.5-0.5b",
            max_tokens=60,
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            extra_body=GREEDY,
        )
        only_call(client.messages.create(**fields), "get_weather")
        with client.messages.stream(**fields) as stream:
            only_call(stream.get_final_message(), "get_weather")
    finally:
        srv.close()
