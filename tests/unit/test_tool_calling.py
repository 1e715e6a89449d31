"""Tools into prompts (``kvfuse.tools``): checked definitions and choices, each chat template's
format, the messages and tools each template gets and the text it renders (Qwen2.5 and Llama 3.2
natively, SmolLM2 and Gemma 3 in the prompted format), and the schema of a forced call."""

from __future__ import annotations

import json

import pytest
from chat_templates import GEMMA3, LLAMA32, QWEN25, SMOLLM2
from kvfuse_helpers import write_word_tokenizer

from kvfuse.models import Tokenizer
from kvfuse.tools import (
    HERMES,
    LLAMA3,
    PROMPTED,
    Call,
    Tool,
    ToolChoice,
    ToolsError,
    call_schema,
    choice_from_openai,
    detect,
    parse,
    render,
    tool_calling,
    tools_from_openai,
    tools_section,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = tools_from_openai([WEATHER, NOW])
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A tokenizer whose chat template each test sets (only rendering is involved)."""
    folder = write_word_tokenizer(tmp_path_factory.mktemp("tok"), 64)

    def make(template: str) -> Tokenizer:
        (folder / "chat_template.jinja").write_text(template)
        return Tokenizer(folder)

    return make


def rendered(tokenizer, template: str, messages=CONVERSATION, tools=TOOLS) -> str:
    tok = tokenizer(template)
    r = render(messages, detect(template), tools)
    return tok.render_chat(r.messages, tools=r.tools)


# ---------------------------------------------------------------------------------- definitions


def test_tools_from_openai_reads_function_tools():
    assert TOOLS[0] == Tool(
        "get_weather", "The weather in a city", WEATHER["function"]["parameters"], False
    )
    assert TOOLS[1].schema == {"type": "object", "properties": {}}
    assert TOOLS[1].openai() == {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
    }


@pytest.mark.parametrize(
    "tools,match",
    [
        ([], "at least one"),
        ([{"type": "web_search"}], 'only "function"'),
        ([{"type": "function"}], "function"),
        ([{"type": "function", "function": {"name": "a b"}}], "name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "name"),
        ([NOW, NOW], "more than once"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "object",
        ),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "object"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "strict"),
        ([NOW] * 129, "at most 128"),
    ],
)
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(ToolsError, match=match) as e:
        tools_from_openai(tools)
    assert e.value.param == "tools"


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, ToolChoice("auto")),
        ("none", ToolChoice("none")),
        ("required", ToolChoice("required")),
        ({"type": "function", "function": {"name": "now"}}, ToolChoice("function", "now")),
    ],
)
def test_tool_choice(value, expected):
    assert choice_from_openai(value, TOOLS) == expected


@pytest.mark.parametrize(
    "value", ["any", {"type": "function", "function": {"name": "other"}}, {"type": "x"}]
)
def test_bad_tool_choice(value):
    with pytest.raises(ToolsError) as e:
        choice_from_openai(value, TOOLS)
    assert e.value.param == "tool_choice"


# -------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    "template,fmt",
    [
        (QWEN25, HERMES),
        (LLAMA32, LLAMA3),
        (SMOLLM2, PROMPTED),
        (GEMMA3, PROMPTED),
        (None, PROMPTED),
    ],
)
def test_detect(template, fmt):
    assert detect(template) == fmt


def test_a_template_that_only_says_tools_is_prompted():
    assert detect("{{ messages[0]['content'] }} tools <tool_call>") == PROMPTED


# ------------------------------------------------------------------------------------ rendering


def test_qwen_renders_tools_calls_and_results_natively(tokenizer):
    text = rendered(tokenizer, QWEN25)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "\n" + json.dumps(TOOLS[0].openai()) + "\n" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama_renders_tools_calls_and_results_natively(tokenizer):
    text = rendered(tokenizer, LLAMA32)
    assert "Environment: ipython" in text and '"name": "get_weather"' in text
    assert text.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"18C, sunny"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_smollm2_gets_the_prompted_format(tokenizer):
    text = rendered(tokenizer, SMOLLM2)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + tools_section(TOOLS) + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the section tells the model the format the parser reads
    example = tools_section(TOOLS).split("tags:\n")[-1].split("\n\n")[0]
    assert example.startswith("<tool_call>\n") and example.endswith("</tool_call>")


def test_gemma_turns_still_alternate_with_results_and_a_new_question(tokenizer):
    messages = CONVERSATION + [
        {"role": "assistant", "content": "It is 18C."},
        {"role": "tool", "content": "x", "tool_call_id": "call_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = rendered(tokenizer, GEMMA3, messages)  # Gemma's template raises when they do not
    assert text.startswith("<start_of_turn>user\nBe brief.\n\n# Tools")
    assert (
        "<start_of_turn>user\n<tool_response>\nx\n</tool_response>\n\nAnd tomorrow?<end_of_turn>"
        in text
    )


def test_prompted_without_a_system_message_adds_one_and_maps_positions():
    messages = CONVERSATION[1:] + [
        {"role": "tool", "content": "second", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks"},
    ]
    r = render(messages, PROMPTED, TOOLS)
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "user"]
    assert r.messages[0]["content"] == tools_section(TOOLS)
    # every message's content is found where ``where`` says
    for i, m in enumerate(messages):
        index, start = r.mark(i, 0)
        assert r.messages[index]["content"][start:].startswith(m["content"])
    assert r.where[0] == (1, 0)


def test_native_rendering_passes_arguments_as_objects():
    r = render(CONVERSATION, HERMES, TOOLS)
    assert r.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert r.messages[:2] == CONVERSATION[:2] and r.tools == [t.openai() for t in TOOLS]
    bad = {**CALL, "function": {"name": "now", "arguments": "not json"}}
    r = render([{"role": "assistant", "content": "", "tool_calls": [bad]}], HERMES, ())
    assert r.messages[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert r.tools is None


def test_a_result_must_answer_an_earlier_call():
    orphan = [{"role": "user", "content": "q"}, {**CONVERSATION[3], "tool_call_id": "call_9"}]
    with pytest.raises(ToolsError, match="call_9") as e:
        render(orphan, HERMES, TOOLS)
    assert e.value.param == "messages"


# -------------------------------------------------------------------------------- forced calls


def test_call_schema_for_a_named_function_and_for_required():
    named = call_schema(HERMES, TOOLS, ToolChoice("function", "get_weather"))
    assert named == {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {**WEATHER["function"]["parameters"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    required = call_schema(LLAMA3, TOOLS, ToolChoice("required"))
    assert [s["properties"]["name"]["const"] for s in required["anyOf"]] == ["get_weather", "now"]
    assert all(s["required"] == ["name", "parameters"] for s in required["anyOf"])
    assert call_schema(HERMES, TOOLS[:1], ToolChoice("required")) == named


class StandIn:
    """A stand-in for ``kvfuse.structured``'s compiled grammar: records what it was asked."""

    def __init__(self, schema, tokenizer, strict):
        self.schema, self.tokenizer, self.strict = schema, tokenizer, strict

    def matcher(self):
        raise NotImplementedError


def test_tool_calling_compiles_only_forced_choices():
    auto = tool_calling(HERMES, TOOLS, ToolChoice("auto"), True, "tok", compile=StandIn)
    assert auto.structure is None and auto.forced_text == "" and auto.stops == ()
    one = tool_calling(HERMES, TOOLS, ToolChoice("auto"), False, "tok", compile=StandIn)
    assert one.stops == ("</tool_call>",)
    named = tool_calling(HERMES, TOOLS, ToolChoice("function", "now"), True, "tok", StandIn)
    assert named.structure.schema == call_schema(HERMES, TOOLS, ToolChoice("function", "now"))
    assert named.structure.tokenizer == "tok" and named.structure.strict is False
    assert named.forced_text == "<tool_call>\n" and named.stops == ()
    strict = tools_from_openai([{**NOW, "function": {"name": "now", "strict": True}}])
    assert tool_calling(
        LLAMA3, strict, ToolChoice("required"), True, None, StandIn
    ).structure.strict


def test_a_forced_calls_output_is_read_after_its_opening():
    named = tool_calling(HERMES, TOOLS, ToolChoice("function", "now"), True, None, StandIn)
    out = named.parse('{"name": "now", "arguments": {}}')
    assert out.content is None and [(c.name, c.arguments) for c in out.calls] == [("now", "{}")]
    for parser in (named.parser(), named.parser(stream=False)):
        events = parser.feed('{"name": "now", "arguments": {}}') + parser.finish()
        assert [(e.call.name, e.call.arguments) for e in events if isinstance(e, Call)] == [
            ("now", "{}")
        ]


def test_tool_choice_none_never_parses():
    none = tool_calling(PROMPTED, TOOLS, ToolChoice("none"), True, None)
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert none.parse(text) == parse(text, frozenset()) and none.parser() is None


def test_without_kvfuse_structured_a_forced_choice_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kvfuse.structured", None)  # import fails
    with pytest.raises(ToolsError, match="constrained decoding") as e:
        tool_calling(HERMES, TOOLS, ToolChoice("required"), True, None)
    assert e.value.param == "tool_choice"


def test_a_schema_the_grammar_refuses_is_a_tools_error():
    def refuse(schema, tokenizer, strict):
        raise ValueError("pattern is not supported")

    with pytest.raises(ToolsError, match="pattern") as e:
        tool_calling(HERMES, TOOLS, ToolChoice("required"), True, None, refuse)
    assert e.value.param == "tools"


# ----------------------------------------------------------------------- a forced call's schema

SAFE = 2**53 - 1
INT = {"type": "integer", "minimum": -SAFE, "maximum": SAFE}


@pytest.mark.parametrize(
    "schema,expected",
    [
        ({"type": "integer"}, INT),
        ({"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 0, "maximum": SAFE}),
        (
            {"type": "integer", "exclusiveMaximum": 5},
            {"type": "integer", "exclusiveMaximum": 5, "minimum": -SAFE},
        ),
        ({"type": ["integer", "null"]}, {**INT, "type": ["integer", "null"]}),
        ({"type": "number"}, {"type": "number"}),
        ({"type": "string"}, {"type": "string"}),
        (True, True),
        ({"type": "object"}, {"type": "object"}),  # free-form: left open
        (
            {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}},
            {
                "type": "object",
                "properties": {"n": INT, "s": {"type": "string"}},
                "additionalProperties": False,
            },
        ),
        (
            {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
            {"type": "object", "properties": {}, "additionalProperties": INT},
        ),
        (
            {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
            {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        ),
        (  # allOf branches stay open: they may declare one object's keys between them
            {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        ),
        (
            {
                "type": "array",
                "items": {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/x"}]},
                "$defs": {"x": {"type": "integer", "maximum": 3}},
            },
            {
                "type": "array",
                "items": {"anyOf": [INT, {"$ref": "#/$defs/x"}]},
                "$defs": {"x": {"type": "integer", "maximum": 3, "minimum": -SAFE}},
            },
        ),
    ],
)
def test_a_forced_call_is_narrowed_to_end(schema, expected):
    from kvfuse.tools.bounds import bounded

    assert bounded(schema) == expected


def test_a_forced_calls_schema_is_narrowed_not_the_tool():
    params = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tools = tools_from_openai(
        [{"type": "function", "function": {"name": "f", "parameters": params}}]
    )
    schema = call_schema(HERMES, tools, ToolChoice("required"))["properties"]["arguments"]
    assert schema == {"type": "object", "properties": {"n": INT}, "additionalProperties": False}
    assert tools[0].schema == {"type": "object", "properties": {"n": {"type": "integer"}}}
