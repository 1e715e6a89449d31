"""A call object's JSON read as it comes (``kvfuse.tools.args``): the normal form is exactly
``json.dumps(json.loads(text), ensure_ascii=False)``, whatever pieces the text comes in, and
nothing invalid gets through."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfuse.tools.args import CallReader, JsonError, Lexer, normal, read_call

VALID = [
    '{"a": 1}',
    '{ "a" :[1,2.50, -0, -0.0, 1E2, 1e-7, 123456789012345678901234567890] , "b":{}}',
    '{"s": "x\\u00e9\\n\\ud83d\\ude00\\/\\u0001\\t\\"\\\\", "t": true, "f": false, "n": null}',
    "[]",
    '"abc"',
    " 12 ",
    '{"k\\u0041": [[], [{}], "é"]}',
]
INVALID = [
    '{"a":}',
    '{"a" 1}',
    "[1,]",
    "{,}",
    "tru",
    '{"a":NaN}',
    '{"a":Infinity}',
    '"\\ud83d"',  # a lone surrogate
    '"\\ude00"',
    '"\\ud83dx"',
    "1e400",  # no float holds it
    '{"a":1}}',
    "01",
    "1.",
    "-",
    '{"a":1,}',
    '{"a":1 "b":2}',
    "[1}",
    '"\\x"',
    '"a\nb"',  # a raw control character
    "{'a': 1}",
    '{"a": 1',
]


def pieces_normal(text: str, size: int) -> str:
    lexer = Lexer()
    out = [t.text for i in range(0, len(text), size) for t in lexer.feed(text[i : i + size])]
    return "".join(out + [t.text for t in lexer.end()])


@pytest.mark.parametrize("text", VALID)
def test_the_normal_form_is_what_json_dumps_writes(text):
    want = json.dumps(json.loads(text), ensure_ascii=False)
    assert normal(text) == want
    for size in (1, 2, 3, 7):
        assert pieces_normal(text, size) == want


@pytest.mark.parametrize("text", INVALID)
def test_invalid_json_is_refused(text):
    with pytest.raises(JsonError):
        normal(text)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans(), st.sampled_from([None, 0, 2]), st.integers(1, 9))
def test_any_json_in_any_layout_normalises_as_json_dumps(value, ascii_, indent, size):
    text = json.dumps(value, ensure_ascii=ascii_, indent=indent)
    assert pieces_normal(text, size) == json.dumps(value, ensure_ascii=False)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]":,0123456789.eE-+ tfnrulase\\u', max_size=30))
def test_any_text_is_normalised_or_refused_as_json_loads_does(text):
    try:
        want = json.dumps(json.loads(text), ensure_ascii=False)
    except (ValueError, RecursionError):
        want = None
    try:
        got = normal(text)
    except JsonError:
        got = None
    if want is None or "\\u" not in text and "Infinity" not in want:
        assert got == want


@pytest.mark.parametrize(
    "text,name,arguments",
    [
        ('{"name": "f", "arguments": {"x": [1, {"y": "z"}]}}', "f", '{"x": [1, {"y": "z"}]}'),
        ('{"arguments": "{\\"a\\":1}", "name":"g"}', "g", '{"a": 1}'),
        ('{"name":"now"}', "now", "{}"),
        ('{"name": "f", "parameters": {"a": 1}, "id": 7}', "f", '{"a": 1}'),
    ],
)
def test_calls_are_read(text, name, arguments):
    reader = read_call(text)
    assert reader.complete and (reader.name, reader.arguments) == (name, arguments)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": 1}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": {}, "parameters": {}}',
        '{"name": "f", "name": "g"}',
        '{"arguments": {}}',
        '["name", "f"]',
        '{"name": "f", "arguments": {}',
    ],
)
def test_what_is_no_call_is_not_read_as_one(text):
    assert not read_call(text).complete


def test_arguments_grow_only_by_what_is_certain():
    text = '{"name": "f", "arguments": {"city": "Pa\\u00e9ris", "n": 12, "ok": true}}'
    reader, seen = CallReader(), []
    for c in text:
        reader.feed(c)
        seen.append(reader.arguments)
    final = reader.arguments
    assert reader.complete and final == '{"city": "Paéris", "n": 12, "ok": true}'
    assert all(final.startswith(s) for s in seen)
    at = text.index("12")
    assert seen[at] == seen[at + 1] == '{"city": "Paéris", "n": '  # "12" waits for its end
    assert seen[text.index("\\u00e9") + 4] == '{"city": "Pa'  # the escape waits until whole
