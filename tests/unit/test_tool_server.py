"""The server's tool fields without a model: chat requests with tools planned into prompts, stop
strings and grammars, the 400s, chat bodies and stream chunks (read back with the ``openai``
client's own stream accumulator), and the Responses API's function tools, input items and output
items with their events (validated against the ``openai`` client's event types)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from chat_templates import QWEN25, SMOLLM2
from kvfuse_helpers import write_word_tokenizer
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from kvfuse.engine import Choice, Delta, GenerationResult
from kvfuse.models import Tokenizer
from kvfuse.prompts import PromptBuilder
from kvfuse.server.bodies import Rendering, ResponseBuilder
from kvfuse.server.errors import APIError
from kvfuse.server.responses_api import chat_request, input_messages, plain_messages
from kvfuse.server.responses_tools import OutputItems, tool_fields
from kvfuse.server.schemas import ChatCompletionRequest, ResponseCreateRequest
from kvfuse.server.translate import Limits, Prompting, plan_chat
from kvfuse.tools import HERMES, ToolChoice, tool_calling, tools_from_openai

LIMITS = Limits(max_tokens_limit=100, default_max_tokens=16, context_window=4000)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def prompting(tmp_path_factory):
    """A prompt builder over a word tokenizer with a given chat template."""
    folder = write_word_tokenizer(tmp_path_factory.mktemp("tok"), 64)

    def make(template: str = QWEN25) -> Prompting:
        (folder / "chat_template.jinja").write_text(template)
        model = SimpleNamespace(
            tokenizer=Tokenizer(folder),
            config=SimpleNamespace(vocab_size=64, max_position_embeddings=4000),
        )
        return Prompting(PromptBuilder(model, 4000))

    return make


class StandIn:
    """Stands in for ``kvfuse.structured.json_schema``'s grammar (until that package is merged)."""

    def __init__(self, schema, tokenizer, strict):
        self.schema, self.strict = schema, strict

    def matcher(self):
        raise NotImplementedError


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": QUESTION, **fields})


# ------------------------------------------------------------------------------------ planning


def test_tools_are_rendered_by_the_template_and_parsed(prompting):
    p = prompting()
    call = plan_chat(p, chat(tools=[WEATHER]), "", LIMITS)
    tok = p.prompts.model.tokenizer
    tools = [tools_from_openai([WEATHER])[0].openai()]
    assert call.prompt_ids == tok.encode_chat(QUESTION, tools=tools)
    assert call.tools.choice == ToolChoice("auto") and call.tools.fmt == HERMES
    assert call.params.structure is None and call.params.stop == ()
    plain = plan_chat(p, chat(), "", LIMITS)
    assert plain.tools is None and plain.prompt_ids == tok.encode_chat(QUESTION)


def test_a_forced_call_ends_the_prompt_with_its_opening_and_is_constrained(prompting, monkeypatch):
    monkeypatch.setattr("kvfuse.tools.calling.structured_json_schema", StandIn)
    p = prompting()
    tok = p.prompts.model.tokenizer
    auto = plan_chat(p, chat(tools=[WEATHER]), "", LIMITS)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    named = plan_chat(p, chat(tools=[WEATHER], tool_choice=choice), "", LIMITS)
    opening = tok.encode("<tool_call>\n", add_special_tokens=False)
    assert named.prompt_ids == auto.prompt_ids + opening
    assert named.params.structure.schema["properties"]["name"] == {"const": "get_weather"}
    required = plan_chat(p, chat(tools=[WEATHER], tool_choice="required"), "", LIMITS)
    assert required.params.structure.schema == named.params.structure.schema


def test_parallel_tool_calls_false_stops_after_the_first_call(prompting):
    call = plan_chat(
        prompting(), chat(tools=[WEATHER], parallel_tool_calls=False, stop=["x"]), "", LIMITS
    )
    assert call.params.stop == ("x", "</tool_call>") and not call.tools.parallel


def test_a_conversation_with_calls_and_results_is_rendered_without_tools(prompting):
    messages = QUESTION + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ]
    p = prompting(SMOLLM2)
    seen = []
    encode = p.prompts.encode_chat
    p.prompts.encode_chat = lambda msgs, **kw: seen.append((msgs, kw)) or encode(msgs, **kw)
    call = plan_chat(p, chat(messages=messages), "", LIMITS)
    assert call.tools is None
    ((rendered, kw),) = seen
    assert kw["tools"] is None  # SmolLM2's template takes none: the prompted format
    assert [m["role"] for m in rendered] == ["user", "assistant", "user"]
    assert rendered[1]["content"] == CALL_TEXT
    assert rendered[2]["content"] == "<tool_response>\n18C\n</tool_response>"


def test_breakpoints_on_tool_results_find_their_place(prompting):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}}],
        },
    ]
    call = plan_chat(prompting(SMOLLM2), chat(messages=messages), "", LIMITS)
    assert len(call.cache.breakpoints) == 1


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "r", "tool_call_id": "c9"}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "q",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(prompting, fields, param):
    with pytest.raises(APIError) as e:
        plan_chat(prompting(), chat(**fields), "", LIMITS)
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize(
    "fields,loc",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "r", "tool_call_id": 5}]}, "messages"),
    ],
)
def test_malformed_tool_fields_fail_validation(fields, loc):
    """The server answers these with a 400 naming the field (``errors.validation_error``)."""
    with pytest.raises(ValidationError) as e:
        chat(**fields)
    assert e.value.errors()[0]["loc"][0] == loc


# -------------------------------------------------------------------------- chat bodies, chunks


def result(text: str, reason: str = "stop") -> GenerationResult:
    choice = Choice(0, text, [1] * 5, reason)
    return GenerationResult(
        text=text, token_ids=[1] * 5, finish_reason=reason, prompt_tokens=3, choices=[choice]
    )


def builder(parallel: bool = True, stream: bool = False) -> ResponseBuilder:
    tools = tool_calling(HERMES, tools_from_openai([WEATHER]), ToolChoice("auto"), parallel, None)
    return ResponseBuilder("req_1", "m", 1, chat=True, include_usage=stream, tools=tools)


def test_body_with_calls():
    body = builder().body(result("Checking.\n" + CALL_TEXT))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    only = builder().body(result(CALL_TEXT))["choices"][0]["message"]
    assert only["content"] is None
    text = builder().body(result("Hello", "length"))["choices"][0]
    assert text["message"] == {"role": "assistant", "content": "Hello"}
    assert text["finish_reason"] == "length"
    assert builder().body(result(CALL_TEXT, "length"))["choices"][0]["finish_reason"] == "length"


def assembled(chunks: list[dict]):
    """The completion the ``openai`` client assembles from these chunks (its snapshot: the
    final completion refuses a ``length`` finish)."""
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    return state.current_completion_snapshot.choices[0]


@pytest.mark.parametrize(
    "text",
    [
        "Checking.\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"),
        CALL_TEXT,
        "Just text, no call.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "São Paulo, \\"SP\\"",'
        ' "days": [1, 2.50, 3e2], "units": null}}\n</tool_call>',
    ],
)
def test_stream_chunks_assemble_to_the_body(text):
    chunks = stream_chunks(builder(stream=True), text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    got = assembled(chunks)
    want = builder().body(result(text))["choices"][0]
    assert got.finish_reason == want["finish_reason"]
    assert got.message.content == want["message"]["content"]
    calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    assert calls == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in want["message"].get("tool_calls", [])
    ]


def stream_chunks(b: ResponseBuilder, text: str, reason: str = "stop") -> list[dict]:
    """Every chunk of a stream of ``text``, three characters a token."""
    chunks = b.first_chunks()
    for i in range(0, len(text), 3):
        chunks += b.delta_chunks(Delta(0, text[i : i + 3]))
    return chunks + b.final_chunks(result(text, reason))


def argument_deltas(chunks: list[dict]) -> list[str]:
    return [
        t["function"]["arguments"]
        for c in chunks
        if c["choices"]
        for t in c["choices"][0]["delta"].get("tool_calls") or []
        if "id" not in t
    ]


def test_arguments_stream_in_pieces_as_they_are_generated():
    chunks = stream_chunks(builder(), CALL_TEXT.replace("Paris", "Paris, the capital of France"))
    pieces = argument_deltas(chunks)
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "Paris, the capital of France"}'
    heads = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert heads[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert {t["index"] for t in heads} == {0}


def test_a_call_cut_short_keeps_what_was_sent():
    """The documented difference: the stream sent the call's start and a prefix of its
    arguments before the output ended; it keeps them (as vLLM), the whole answer is text."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    got = assembled(stream_chunks(builder(), text, "length"))
    assert got.finish_reason == "length" and got.message.content is None
    (call,) = got.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Pa')
    whole = builder().body(result(text, "length"))["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": text}
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 1 2}}</tool_call> Bye'
    got = assembled(stream_chunks(builder(), bad))
    assert got.finish_reason == "tool_calls" and got.message.content == "Bye"
    assert got.message.tool_calls[0].function.arguments == '{"city": 1'


def test_n_choices_stream_their_calls_each_from_index_0():
    b = ResponseBuilder("req_1", "m", 1, chat=True, rendering=Rendering(n=2), tools=builder().tools)
    two = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")
    chunks = b.first_chunks()
    for i in range(0, len(two), 2):  # the choices' tokens interleaved
        chunks += b.delta_chunks(Delta(0, two[i : i + 2]))
        chunks += b.delta_chunks(Delta(1, CALL_TEXT[i : i + 2]))
    choices = [Choice(0, two, [1], "stop"), Choice(1, CALL_TEXT, [1], "stop")]
    chunks += b.final_chunks(
        GenerationResult(
            text=two, token_ids=[1], finish_reason="stop", prompt_tokens=3, choices=choices
        )
    )
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    first, second = state.get_final_completion().choices
    assert [json.loads(c.function.arguments)["city"] for c in first.message.tool_calls] == [
        "Paris",
        "Rome",
    ]
    assert [c.function.arguments for c in second.message.tool_calls] == ['{"city": "Paris"}']
    assert first.finish_reason == second.finish_reason == "tool_calls"


def test_a_call_streams_as_openai_sends_it():
    b = builder()
    chunks = b.delta_chunks(Delta(0, CALL_TEXT))
    first, args = (c["choices"][0]["delta"]["tool_calls"] for c in chunks)
    assert first == [
        {
            "index": 0,
            "id": first[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    assert args == [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    assert b.final_chunks(result(CALL_TEXT))[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_false_streams_one_call():
    b = builder(parallel=False)
    chunks = b.delta_chunks(Delta(0, CALL_TEXT + CALL_TEXT)) + b.final_chunks(result(CALL_TEXT))
    assert sum("tool_calls" in c["choices"][0]["delta"] for c in chunks) == 2  # head + arguments


# --------------------------------------------------------------------------------- Responses API


FN = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


def test_tool_fields_map_to_chat_fields():
    assert tool_fields([FN], {"type": "function", "name": "get_weather"}, False) == {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    assert tool_fields(None, None, None) == {}
    for bad, param in (([{"type": "web_search"}], "tools"), ("sometimes", "tool_choice")):
        with pytest.raises(APIError) as e:
            tool_fields(bad, "auto", None) if param == "tools" else tool_fields([FN], bad, None)
        assert e.value.param == param


def test_function_call_items_become_calls_and_results():
    messages, items = input_messages(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "20C"}],
            },
        ]
    )
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[3] == {"role": "tool", "content": "20C", "tool_call_id": "c2"}
    assert [i["type"] for i in items] == [
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
    ]
    assert items[1]["id"].startswith("fc_") and items[3]["output"] == "18C"
    history = plain_messages(messages)
    assert history[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": messages[1]["tool_calls"],
    }
    assert history[2] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    body = ResponseCreateRequest.model_validate(
        {"model": "m", "input": "x", "tools": [FN], "tool_choice": "required"}
    )
    req = chat_request(body, history, [{"role": "user", "content": "Thanks"}])
    assert req.tool_choice == "required" and req.tools[0].function.name == "get_weather"
    assert req.messages[2].tool_call_id == "c1"


@pytest.mark.parametrize(
    "item",
    [
        {"type": "function_call", "name": "f"},
        {"type": "function_call_output", "output": "x"},
        {"type": "function_call_output", "call_id": "c", "output": 5},
        {"type": "web_search_call"},
    ],
)
def test_bad_items_are_400s(item):
    with pytest.raises(APIError) as e:
        input_messages([item])
    assert e.value.status == 400 and e.value.param == "input"


def output_items(text: str, tools: bool = True, pieces: int = 4, stream: bool = True):
    """The events (validated as the ``openai`` client's types) and items of ``text``."""
    counter = iter(range(1000))

    def event(kind, **fields):
        data = {"type": kind, "sequence_number": next(counter), **fields}
        TypeAdapter(ResponseStreamEvent).validate_python(data)
        return data

    calling = tool_calling(HERMES, tools_from_openai([WEATHER]), ToolChoice("auto"), True, None)
    out = OutputItems(event, calling.parser(stream) if tools else None, "msg_1")
    events = out.start()
    for i in range(0, len(text), pieces):
        events += out.feed(text[i : i + pieces])
    return events + out.finish("completed"), out


def test_output_items_of_text_and_a_call():
    events, out = output_items("Checking.\n" + CALL_TEXT)
    assert [i["type"] for i in out.items] == ["message", "function_call"]
    assert out.items[0]["id"] == "msg_1" and out.text == "Checking."
    call = out.items[1]
    assert call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert out.calls == [
        {
            "id": call["call_id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": call["arguments"]},
        }
    ]
    kinds = [e["type"] for e in events]
    at = kinds.index("response.output_item.added", 2)
    deltas = [e["delta"] for e in events[at + 1 : -2]]
    assert kinds[at:] == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert len(deltas) > 1 and "".join(deltas) == call["arguments"] == events[-2]["arguments"]
    assert events[at]["item"]["arguments"] == "" and events[at]["item"]["status"] == "in_progress"
    assert [e["output_index"] for e in events[at:]] == [1] * len(events[at:])
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]


def test_output_items_of_a_call_cut_short():
    """Streamed: the call's item ends incomplete with what was sent, and stays out of the
    stored calls; whole: the text."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    _, out = output_items(text)
    assert [(i["type"], i["status"], i["arguments"]) for i in out.items] == [
        ("function_call", "incomplete", '{"city": "Pa')
    ]
    assert out.calls == []
    _, whole = output_items(text, stream=False)
    assert [i["type"] for i in whole.items] == ["message"] and whole.text == text


def test_output_items_without_tools_are_one_message_opened_first():
    events, out = output_items("Hello there", tools=False)
    assert [i["type"] for i in out.items] == ["message"] and out.text == "Hello there"
    assert events[0]["type"] == "response.output_item.added" and events[0]["output_index"] == 0
    empty_events, empty = output_items("", tools=True)
    assert [i["type"] for i in empty.items] == ["message"] and empty.text == ""
    _, only_call = output_items(CALL_TEXT)
    assert [i["type"] for i in only_call.items] == ["function_call"]
