"""Model output -> text and tool calls (``kvfuse.tools.parse``): a table per family (Qwen2.5 /
Hermes, Llama 3.x, kvfuse's prompted format for SmolLM2 and Gemma 3, and what small models drift
into), the invalid cases that must stay text, and the streaming parser fed in any pieces (token by
token included) agreeing with the whole parse."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse.tools import Call, CallArgs, CallParser, CallStart, Text, ToolCall, parse

NAMES = frozenset({"get_weather", "multiply", "now"})
PARIS = ("get_weather", '{"city": "Paris"}')
MUL = ("multiply", '{"a": 12, "b": 34}')


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def whole(text: str, parallel: bool = True):
    p = parse(text, NAMES, parallel, ids())
    return p.content, [(c.name, c.arguments) for c in p.calls]


# (output, content, calls)
QWEN = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [PARIS],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
        None,
        [PARIS, MUL],
    ),
    (
        'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me look that up.",
        [PARIS],
    ),
    # the end tag cut off by a stop string (parallel_tool_calls: false stops there)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    # arguments as a string holding the object, and no arguments at all
    (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        None,
        [PARIS],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # key order does not matter; non-ASCII is kept
    (
        '<tool_call>{"arguments": {"city": "Zürich"}, "name": "get_weather"}</tool_call>',
        None,
        [("get_weather", '{"city": "Zürich"}')],
    ),
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('Sure. {"name": "get_weather", "parameters": {"city": "Paris"}}', "Sure.", [PARIS]),
    ('{ "name": "multiply", "parameters": {"a": 12, "b": 34} }', None, [MUL]),
]
# kvfuse's prompted format (SmolLM2, Gemma 3): the Hermes envelope, with or without newlines
PROMPTED = [
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        None,
        [PARIS],
    ),
    ('<tool_call>\n{"name":"multiply","arguments":{"a":12,"b":34}}\n</tool_call>\n', None, [MUL]),
]
# what Qwen2.5-Coder-0.5B writes for the same prompt at temperature 0
DRIFT = [
    (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        None,
        [PARIS],
    ),
    ('```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None, [PARIS]),
    (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '{"name": "multiply", "arguments": {"a": 12, "b": 34}}',
        None,
        [PARIS, MUL],
    ),
]
# nothing here is a valid call: the text comes back verbatim
TEXT = [
    "Hello! I'm Qwen, how can I help?",
    "",
    'a {b} c ``` d <tool e {"x": 1}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # not a tool
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # invalid JSON
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "multiply", "arguments": {"a": NaN}}\n</tool_call>',  # not JSON
    "<tool_call>no object here</tool_call>",
    '{"name": "Paris", "country": "France"}',  # JSON with a name that is no tool
    "```python\nprint('hi')\n```",
    "<tool_call>",
]


@pytest.mark.parametrize("output,content,calls", QWEN + LLAMA3 + PROMPTED + DRIFT)
def test_calls_per_family(output, content, calls):
    assert whole(output) == (content, calls)


@pytest.mark.parametrize("output", TEXT)
def test_invalid_calls_stay_text(output):
    assert whole(output) == (output, [])


def test_text_around_an_invalid_block_and_a_valid_one():
    bad = '<tool_call>{"name": "nope"}</tool_call>'
    good = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert whole(f"A {bad} B {good} C") == (f"A {bad} BC", [("now", "{}")])


def test_parallel_false_keeps_only_the_first_call():
    two = QWEN[1][0]
    assert whole(two, parallel=False) == (None, [PARIS])


def test_call_ids_are_fresh_and_openai_shaped():
    p = parse(QWEN[1][0], NAMES)
    a, b = (c.id for c in p.calls)
    assert a != b and a.startswith("call_") and len(a) == 29
    assert p.calls[0].openai() == {
        "id": a,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def streamed(pieces: list[str], parallel: bool = True):
    """The streaming parser's events for ``pieces``, checked as a client sees them."""
    parser = CallParser(NAMES, parallel, ids())
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, Text))
    calls = [e for e in events if isinstance(e, Call)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(e.text for e in events if isinstance(e, Text))  # no empty deltas
    calls = [(c.call.name, c.call.arguments) for c in calls]
    return (text if text or not calls else None), calls


ALL = [o for o, _, _ in QWEN + LLAMA3 + PROMPTED + DRIFT] + TEXT


@pytest.mark.parametrize("output", ALL)
def test_streaming_character_by_character_agrees(output):
    assert streamed(list(output)) == whole(output)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL), st.lists(st.integers(0, 200), max_size=12))
def test_streaming_in_any_pieces_agrees(output, cuts):
    cuts = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
    assert streamed(pieces) == whole(output)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='<>{}"`:, \nabtoolcal_name', max_size=60))
def test_any_text_parses_without_crashing_and_streams_the_same(text):
    assert streamed(list(text)) == whole(text)


def test_text_before_a_call_streams_before_the_call_completes():
    parser = CallParser(NAMES, True, ids())
    assert parser.feed("Checking") == [Text("Checking")]
    assert parser.feed(" now.\n<tool") == [Text(" now.")]  # the whitespace and "<tool" wait
    assert parser.feed('_call>\n{"name": "now", "arguments": {}') == []
    assert parser.feed("}\n</tool_call>") == [Call(0, parser.calls[0])]
    assert parser.finish() == []
    assert json.loads(parser.calls[0].arguments) == {}


# ------------------------------------------------------------------ arguments streamed in pieces

# longer arguments, in each family's envelope, with what makes normalising hard: escapes, a
# surrogate pair, non-ASCII, numbers Python prints differently, nesting, a name after the
# arguments, arguments as a string, none at all
LONG = '{"city": "S\\u00e3o Paulo \\"SP\\"\\n\\ud83d\\ude00", "days": [1, 2.50, -0, 1E2], "deep": {"a": [true, false, null, {}], "b": []}}'
PIECES = [
    f'<tool_call>\n{{"name": "get_weather", "arguments": {LONG}}}\n</tool_call>',  # Qwen2.5
    f'I will check.\n<tool_call>{{"name":"get_weather","arguments":{LONG}}}</tool_call>'
    '\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
    f'{{"name": "get_weather", "parameters": {LONG}}}',  # Llama 3.x
    f'<|python_tag|>{{"name": "get_weather", "parameters": {LONG}}}',
    f'```json\n{{\n  "name": "get_weather",\n  "arguments": {LONG}\n}}\n```',
    f'<tool_call>{{"arguments": {LONG}, "name": "get_weather"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
    '<tool_call>{"name": "now"}</tool_call>',
] + [o for o, _, calls in QWEN + LLAMA3 + PROMPTED + DRIFT if calls]


def stream_events(pieces: list[str], parallel: bool = True) -> list:
    parser = CallParser(NAMES, parallel, ids(), stream=True)
    return [e for p in pieces for e in parser.feed(p)] + parser.finish()


def streamed_calls(
    events: list, broken_ok: bool = False
) -> tuple[str | None, list[tuple[str, str]], list[list[str]]]:
    """Text, whole calls and each one's argument pieces of a stream's events, checked for order:
    each call starts (once), sends its pieces, ends (whole unless ``broken_ok``) with the start's
    id and name and the pieces' concatenation as its arguments."""
    text, calls, pieces, open_ = "", [], [], None
    for e in events:
        if isinstance(e, Text):
            assert open_ is None and e.text
            text += e.text
        elif isinstance(e, CallStart):
            assert open_ is None and e.index == len(calls)
            open_, parts = e, []
        elif isinstance(e, CallArgs):
            assert open_ is not None and e.index == open_.index and e.text
            parts.append(e.text)
        else:
            assert open_ is not None and (e.complete or broken_ok) and e.index == open_.index
            assert (e.call.id, e.call.name) == (open_.id, open_.name)
            assert e.call.arguments == "".join(parts)
            if e.complete:
                calls.append((e.call.name, e.call.arguments))
                pieces.append(parts)
            open_ = None
    assert open_ is None
    return (text if text or not calls else None), calls, pieces


@pytest.mark.parametrize("output", PIECES)
def test_pieces_add_up_to_the_whole_arguments_at_every_split(output):
    want = whole(output)
    for i in range(len(output) + 1):
        assert streamed_calls(stream_events([output[:i], output[i:]]))[:2] == want


@pytest.mark.parametrize("output", PIECES)
def test_arguments_stream_character_by_character(output):
    content, calls, pieces = streamed_calls(stream_events(list(output)))
    assert (content, calls) == whole(output)
    for (_, args), parts in zip(calls, pieces, strict=True):
        if args.startswith('{"city": "S') and '{"arguments"' not in output:
            # long arguments come in many pieces (when the name comes before them)
            assert len(parts) > 20


def test_long_arguments_are_normalised_as_a_whole_parse_does():
    (_, args), *_ = whole(PIECES[0])[1]
    assert args == json.dumps(json.loads(LONG), ensure_ascii=False)


@pytest.mark.parametrize("output", ALL)
def test_streaming_calls_agree_with_the_whole_parse(output):
    """Every table row, valid or not, that breaks off no started call, streams as it parses."""
    events = stream_events(list(output))
    if not any(isinstance(e, Call) and not e.complete for e in events):
        assert streamed_calls(events)[:2] == whole(output)


def test_a_call_starts_when_its_name_is_read():
    parser = CallParser(NAMES, True, ids(), stream=True)
    assert parser.feed('<tool_call>\n{"name": "get_wea') == []
    assert parser.feed('ther", ') == [CallStart(0, "call_0", "get_weather")]
    assert parser.feed('"arguments": {"ci') == [CallArgs(0, '{"ci')]
    assert parser.feed('ty": 12') == [CallArgs(0, 'ty": ')]  # the number may go on
    assert parser.feed("5}") == [CallArgs(0, "125}")]
    assert parser.feed("}\n</tool") == []  # the call ends with its envelope
    (end,) = parser.feed("_call>")
    assert end == Call(0, parser.calls[0]) and parser.calls[0].arguments == '{"city": 125}'


@pytest.mark.parametrize(
    "output,sent",
    [
        # cut short (max_tokens): what was sent stays
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"n": 1.', '{"n": '),
        ('<tool_call>\n{"name": "get_weather", "arg', ""),
        # invalid JSON after the start: nothing past the last valid character is sent
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }}</tool_call>', '{"city": '),
        ('<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>', ""),
        ('<tool_call>{"name": "get_weather", "arguments": {"a": NaN}}</tool_call>', '{"a": '),
    ],
)
def test_a_started_call_that_breaks_off_ends_with_what_was_sent(output, sent):
    events = stream_events(list(output))
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    assert "".join(e.text for e in events if isinstance(e, CallArgs)) == sent
    assert events[-1] == Call(0, ToolCall("call_0", "get_weather", sent), complete=False)
    assert not any(isinstance(e, Text) for e in events)  # the block's text is not shown
    assert whole(output) == (output, [])  # a whole answer gives it as text


def test_text_after_a_broken_call_is_read_as_usual():
    good = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    events = stream_events(
        list('<tool_call>{"name": "now", "arguments": {"x": }}</tool_call> ok ' + good)
    )
    kinds = [k for k, _ in itertools.groupby(type(e).__name__ for e in events)]
    assert kinds == ["CallStart", "CallArgs", "Call", "Text", "CallStart", "CallArgs", "Call"]
    assert "".join(e.text for e in events if isinstance(e, Text)) == "ok"
    assert events[-1].index == 1 and events[-1].complete


def test_unknown_names_never_start_and_stay_text():
    text = '<tool_call>\n{"name": "delete_everything", "arguments": {"all": true}}\n</tool_call>'
    assert stream_events(list(text)) == [Text(text)]


def test_parallel_false_streams_only_the_first_call():
    output = QWEN[1][0]
    content, calls, _ = streamed_calls(stream_events(list(output), parallel=False))
    assert (content, calls) == (None, [PARIS])


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(PIECES + ALL) | st.text(alphabet='<>{}"`:, \nabtoolcal_name\\', max_size=60),
    st.lists(st.integers(0, 300), max_size=12),
)
def test_any_output_in_any_pieces_streams_well_formed(output, cuts):
    """Any output, cut anywhere: the events are well formed (``streamed_calls`` checks them) and
    agree with the whole parse, unless a started call broke off."""
    cuts = sorted({c % (len(output) + 1) for c in cuts})
    events = stream_events([output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])])
    got = streamed_calls(events, broken_ok=True)[:2]
    if all(e.complete for e in events if isinstance(e, Call)):
        assert got == whole(output)
