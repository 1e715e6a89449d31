"""Tools (function calling) on real ``kvfuse serve`` processes (one per model for the module),
driven by the official ``openai`` client, ``langchain-openai`` and LangGraph's prebuilt ReAct agent.

- SmolLM2 (the default model, kvfuse's prompted format): ``auto`` streamed and whole agree,
  ``none`` renders the same prompt and never calls, a tool result turn, the Responses API
  chaining a call and its output through ``previous_response_id``, the 400s; ``required`` and
  named functions, streamed and whole: every call parses and validates against its tool's
  parameters schema (also on Gemma 3 with the slow tests).
- Qwen2.5-Coder-0.5B (slow: ``kvfuse models pull`` fetches 491 MB where it is not converted),
  whose template supports tools: all four ``tool_choice`` modes streamed and whole, a history of
  assistant ``tool_calls`` and ``tool`` messages rendered by its own template,
  ``ChatOpenAI.bind_tools(..., tool_choice="required").invoke(...)``, and a ReAct agent whose
  first turn is forced to call a Python tool and whose second answers with its result.

``required`` and named functions need constrained decoding (``kvfuse.structured``); without it
they are 400s and those tests skip.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, MULTIPLY]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_PRODUCT = [{"role": "user", "content": "What is 12 times 34?"}]


@pytest.fixture(scope="module")
def servers(kvfuse_home, tmp_path_factory):
    """A function giving a started server of a built-in model (each started once per module)."""
    started: dict[str, ServerProcess] = {}

    def get(model: str) -> ServerProcess:
        if model not in started:
            ensure_model(kvfuse_home, model)
            tmp = tmp_path_factory.mktemp(f"tools-{model}")
            config = {
                "model": model,
                "cache": {"disk_path": str(tmp / "kv")},
                "responses": {"path": str(tmp / "responses.sqlite3")},
            }
            started[model] = ServerProcess(kvfuse_home, config=config).start()
        return started[model]

    yield get
    for srv in started.values():
        srv.close()


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def create(c: OpenAI, messages, **fields):
    return c.chat.completions.create(
        model=c.models.list().data[0].id, messages=messages, temperature=0, **fields
    )


def streamed(c: OpenAI, messages, **fields):
    """The streamed answer as the client assembles it, and the chunks' tool-call deltas."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, deltas = ChatCompletionStreamState(), []
    for chunk in create(c, messages, stream=True, **fields):
        state.handle_chunk(chunk)
        deltas += [d for ch in chunk.choices for d in ch.delta.tool_calls or []]
    return state.get_final_completion().choices[0], deltas


def calls(choice) -> list[tuple[str, dict]]:
    """The calls of a choice, each checked: a known tool, arguments valid against its schema."""
    out = []
    for call in choice.message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.type == "function" and call.id.startswith("call_")
        out.append((call.function.name, args))
    return out


# --------------------------------------------------------------------------- SmolLM2, no grammar


def test_auto_streamed_and_whole_agree(servers):
    c = client(servers("smollm2"))
    whole = create(c, ASK_WEATHER, tools=TOOLS, max_tokens=48).choices[0]
    stream, deltas = streamed(c, ASK_WEATHER, tools=TOOLS, max_tokens=48)
    assert calls(stream) == calls(whole)
    assert (stream.message.content or None) == whole.message.content
    assert stream.finish_reason == whole.finish_reason
    assert whole.finish_reason == ("tool_calls" if calls(whole) else whole.finish_reason)
    if calls(whole):  # as OpenAI streams a call: id, type and name first, then the arguments
        assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""


def test_none_renders_the_same_prompt_and_never_calls(servers):
    c = client(servers("smollm2"))
    auto = create(c, ASK_PRODUCT, tools=TOOLS, max_tokens=1)
    none = create(c, ASK_PRODUCT, tools=TOOLS, tool_choice="none", max_tokens=24)
    plain = create(c, ASK_PRODUCT, max_tokens=1)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens > plain.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_turn(servers):
    c = client(servers("smollm2"))
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = create(c, history, tools=TOOLS, max_tokens=24)
    asked = create(c, ASK_WEATHER, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > asked.usage.prompt_tokens + 20  # the call and its result
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages"),
    ],
)
def test_bad_tool_fields_are_400s(servers, fields, param):
    c = client(servers("smollm2"))
    fields = {"messages": ASK_WEATHER, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smollm2", max_tokens=4, **fields)
    assert e.value.body["param"] == param


def test_responses_chain_a_call_and_its_output(servers):
    """A function_call input item in one response, its output in the next (named by
    ``previous_response_id``): the stored history carries the call, or the output would be a 400."""
    c = client(servers("smollm2"))
    fn = {"type": "function", **MULTIPLY["function"]}
    r1 = c.responses.create(
        model="smollm2",
        tools=[fn],
        input=[
            {"role": "user", "content": "What is 12 times 34?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "multiply",
                "arguments": '{"a": 12, "b": 34}',
            },
        ],
        max_output_tokens=8,
        temperature=0,
    )
    r2 = c.responses.create(
        model="smollm2",
        tools=[fn],
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": "c1", "output": "408"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert r2.status in ("completed", "incomplete") and r2.tools[0].name == "multiply"
    items = c.responses.input_items.list(r1.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call"]
    with pytest.raises(openai.BadRequestError):  # no call c2 in the history
        c.responses.create(
            model="smollm2",
            previous_response_id=r1.id,
            input=[{"type": "function_call_output", "call_id": "c2", "output": "x"}],
        )


# ------------------------------------------------------------------ forced calls: always valid


def forced(c: OpenAI, messages, choice, stream: bool):
    fields = dict(tools=TOOLS, tool_choice=choice, max_tokens=64)
    if stream:
        return streamed(c, messages, **fields)[0]
    return create(c, messages, **fields).choices[0]


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_required_and_named_calls_are_always_valid(servers, model):
    pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")
    c = client(servers(model))
    named = {"type": "function", "function": {"name": "multiply"}}
    cases = [
        (ASK_WEATHER, "required", False, None),
        (ASK_PRODUCT, "required", True, None),
        ([{"role": "user", "content": "Hi there"}], named, False, "multiply"),
        (
            ASK_WEATHER,
            {"type": "function", "function": {"name": "get_weather"}},
            True,
            "get_weather",
        ),
    ]
    for messages, choice, stream, name in cases:
        choice_out = forced(c, messages, choice, stream)
        made = calls(choice_out)  # parses and validates
        assert len(made) == 1 and choice_out.finish_reason == "tool_calls", choice_out
        assert name is None or made[0][0] == name
        assert choice_out.message.content is None


def test_a_forced_call_streams_its_arguments_as_they_are_generated(servers):
    """``required``, streamed with ``n: 2``: each choice's call comes as OpenAI sends one (a head
    with index, id, type and name, then arguments pieces), in several pieces, and assembles to
    exactly the whole answer's call (the arguments string byte for byte)."""
    pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")
    from openai.lib.streaming.chat import ChatCompletionStreamState

    c = client(servers("smollm2"))
    fields = dict(tools=TOOLS, tool_choice="required", max_tokens=64)
    (want,) = create(c, ASK_WEATHER, **fields).choices[0].message.tool_calls
    state, deltas = ChatCompletionStreamState(), {0: [], 1: []}
    for chunk in create(c, ASK_WEATHER, stream=True, n=2, **fields):
        state.handle_chunk(chunk)
        for ch in chunk.choices:
            deltas[ch.index] += ch.delta.tool_calls or []
    for choice in state.get_final_completion().choices:
        (got,) = choice.message.tool_calls
        assert (got.function.name, got.function.arguments) == (
            want.function.name,
            want.function.arguments,
        )
        head, *pieces = deltas[choice.index]
        assert head.id == got.id and head.type == "function" and head.index == 0
        assert head.function.name == want.function.name and head.function.arguments == ""
        assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
        assert len(pieces) > 1
        assert "".join(p.function.arguments for p in pieces) == want.function.arguments


def test_responses_function_call_output_items(servers):
    """Responses with a forced call: a ``function_call`` output item (streamed as OpenAI does),
    then its output sent back through ``previous_response_id``."""
    pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")
    c = client(servers("smollm2"))
    fn = {"type": "function", **MULTIPLY["function"]}
    r1 = c.responses.create(
        model="smollm2",
        tools=[fn],
        tool_choice="required",
        input="What is 12 times 34?",
        max_output_tokens=48,
        temperature=0,
    )
    (call,) = [i for i in r1.output if i.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["multiply"])
    events = list(
        c.responses.create(
            model="smollm2",
            tools=[fn],
            previous_response_id=r1.id,
            stream=True,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "408"}],
            max_output_tokens=16,
            temperature=0,
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    streamed_call = list(
        c.responses.create(
            model="smollm2",
            tools=[fn],
            tool_choice={"type": "function", "name": "multiply"},
            input="Multiply 6 by 7.",
            stream=True,
            max_output_tokens=48,
            temperature=0,
        )
    )
    kinds = [e.type for e in streamed_call]
    assert "response.function_call_arguments.done" in kinds
    done = streamed_call[-1].response
    assert [i.type for i in done.output] == ["function_call"]
    jsonschema.validate(json.loads(done.output[0].arguments), SCHEMAS["multiply"])
    # as OpenAI streams it: the item added with empty arguments, then their pieces
    (added,) = [e for e in streamed_call if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.arguments == ""
    pieces = [e.delta for e in streamed_call if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == done.output[0].arguments
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta"
    )


# -------------------------------------------------------------- Qwen2.5: a model that calls tools


QWEN = "qwen2.5-0.5b"
MULTIPLY_CALL = [("multiply", {"a": 12, "b": 34})]
MULTIPLIED = {"name": "multiply", "arguments": {"a": 12, "b": 34}}


def needs_grammar(choice) -> None:
    if choice == "required" or isinstance(choice, dict):
        pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "choice",
    ["none", "auto", "required", {"type": "function", "function": {"name": "multiply"}}],
    ids=["none", "auto", "required", "named"],
)
def test_qwen_in_every_tool_choice_mode(servers, choice, stream):
    """Qwen asked for a product with both tools: ``none`` answers in text, the others call
    ``multiply(12, 34)`` (``auto`` by the model's own choice, ``required`` and named under the
    grammar), its arguments valid against the tool's schema."""
    needs_grammar(choice)
    c = client(servers(QWEN))
    fields = dict(tools=TOOLS, tool_choice=choice, max_tokens=48)
    if stream:
        out, deltas = streamed(c, ASK_PRODUCT, **fields)
    else:
        out, deltas = create(c, ASK_PRODUCT, **fields).choices[0], []
    if choice == "none":
        assert out.message.tool_calls is None and out.message.content
        assert "<tool_call>" not in out.message.content
        assert out.finish_reason in ("stop", "length")
        return
    assert calls(out) == MULTIPLY_CALL, out
    assert out.finish_reason == "tool_calls" and out.message.content is None
    if stream:  # as OpenAI streams a call: id, type and name first, then the arguments
        assert deltas[0].id and deltas[0].function.name == "multiply"


@pytest.mark.slow
def test_qwen_renders_a_history_of_calls_and_results(servers, kvfuse_home):
    """A history with the assistant's ``tool_calls`` and the ``tool`` message answering it is
    rendered by Qwen's own template as Hugging Face renders it (arguments as an object): the
    prompt has exactly that many tokens. What this 0.5B model says next is its own affair (it
    often calls again), so only that any call it makes is valid is asserted."""
    from kvfuse.models import Tokenizer
    from kvfuse.models.registry import converted_dir

    c = client(servers(QWEN))
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'},
    }
    history = ASK_PRODUCT + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "408"},
    ]
    native = [*history[:1], {**history[1], "tool_calls": [{**call, "function": MULTIPLIED}]}]
    tok = Tokenizer(converted_dir(kvfuse_home, QWEN))
    want = len(tok.encode_chat([*native, history[2]], tools=TOOLS))
    whole = create(c, history, tools=TOOLS, max_tokens=32)
    assert whole.usage.prompt_tokens == want
    calls(whole.choices[0])


@pytest.mark.slow
def test_langchain_bind_tools_returns_tool_calls(servers):
    pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")
    from langchain_openai import ChatOpenAI

    srv = servers(QWEN)
    llm = ChatOpenAI(
        model=QWEN, base_url=srv.base_url, api_key="unused", temperature=0, max_tokens=48
    )
    message = llm.bind_tools(TOOLS, tool_choice="required").invoke("What is 12 times 34?")
    assert [(t["name"], t["args"]) for t in message.tool_calls] == MULTIPLY_CALL
    for t in message.tool_calls:
        jsonschema.validate(t["args"], SCHEMAS[t["name"]])


@pytest.mark.slow
def test_langgraph_react_agent_calls_a_python_tool_and_answers(servers):
    """LangGraph's prebuilt agent (``langchain.agents.create_agent`` where ``langchain`` is
    installed, else ``create_react_agent``) with a model chosen per turn: the first turn forced
    (``tool_choice: required``) to call the Python tool, which the agent runs; the next one with
    ``tool_choice: none`` (this 0.5B model, free, calls again and again), an answer in text."""
    pytest.importorskip("kvfuse.structured", reason="constrained decoding: kvfuse.structured")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    used = []

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        used.append((a, b))
        return a * b

    srv = servers(QWEN)
    llm = ChatOpenAI(
        model=QWEN, base_url=srv.base_url, api_key="unused", temperature=0, max_tokens=48
    )

    def model(state, runtime):
        called = any(m.type == "tool" for m in state["messages"])
        return llm.bind_tools([multiply], tool_choice="none" if called else "required")

    agent = create_react_agent(model, [multiply])
    state = agent.invoke(
        {"messages": [("user", "What is 12 times 34? Use the multiply tool.")]},
        {"recursion_limit": 6},
    )
    assert used == [(12, 34)]
    kinds = [m.type for m in state["messages"]]
    assert kinds == ["human", "ai", "tool", "ai"], kinds
    assert state["messages"][2].content == "408"
    answer = state["messages"][-1]
    assert not answer.tool_calls and answer.content and "<tool_call>" not in answer.content
