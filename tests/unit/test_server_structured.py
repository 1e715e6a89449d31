"""The structured-output request fields (kvfuse/server/structured.py): what each shape of
``response_format``, ``text.format`` and vLLM's guided fields means, every mistake a 400 naming
the field, and compiling through a vocabulary (schema errors as 400s naming the field)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from json_tokenizer import write_json_tokenizer

from kvfuse.models import Tokenizer
from kvfuse.server.errors import APIError
from kvfuse.server.schemas import ChatCompletionRequest
from kvfuse.server.structured import (
    Grammars,
    OutputFormat,
    as_response_format,
    chat_format,
    compile_format,
    guided_format,
    request_format,
    require_json_word,
    responses_format,
)
from kvfuse.structured import Grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, OutputFormat("json_object", "response_format")),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "n-1", "schema": SCHEMA, "strict": True},
            },
            OutputFormat("json_schema", "response_format", SCHEMA, True, "n-1"),
        ),
        (  # strict absent or null: false; a description kept; no schema: any JSON value
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "description": "d", "strict": None},
            },
            OutputFormat("json_schema", "response_format", {}, False, "n", "d"),
        ),
    ],
)
def test_response_format_shapes(value, expected):
    assert chat_format(value) == expected


@pytest.mark.parametrize(
    "value, words",
    [
        ("json_object", "must be an object"),
        ({}, "response_format.type: must be one of"),
        ({"type": "json"}, "got 'json'"),
        ({"type": "json_schema"}, "response_format.json_schema: required"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name: required"),
        ({"type": "json_schema", "json_schema": {"name": "a b"}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}, "strict"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": []}}, "schema: must be"),
        ({"type": "json_schema", "json_schema": {"name": "n", "description": 3}}, "description"),
    ],
)
def test_response_format_mistakes_are_400s_naming_the_field(value, words):
    with pytest.raises(APIError) as e:
        chat_format(value)
    assert e.value.status == 400 and e.value.param == "response_format"
    assert words in e.value.message


def test_responses_text_format_is_flat_and_echoed_back():
    text = {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}}
    fmt = responses_format(text)
    assert fmt == OutputFormat("json_schema", "text.format", SCHEMA, True, "n")
    assert fmt.echo() == {**text["format"], "description": None}
    assert as_response_format(fmt) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
    }
    assert responses_format({"format": {"type": "json_object"}}).echo() == {"type": "json_object"}
    assert as_response_format(responses_format({"format": {"type": "json_object"}})) == {
        "type": "json_object"
    }
    for plain in (None, {}, {"format": {"type": "text"}}, {"verbosity": "medium"}):
        assert responses_format(plain) is None


@pytest.mark.parametrize(
    "text, param",
    [
        ("json", "text"),
        ({"format": {"type": "xml"}}, "text.format"),
        ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format"),
        ({"verbosity": "low"}, "text.verbosity"),
    ],
)
def test_responses_text_mistakes_name_the_field(text, param):
    with pytest.raises(APIError) as e:
        responses_format(text)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"guided_json": SCHEMA}, OutputFormat("json_schema", "guided_json", SCHEMA, True)),
        ({"guided_json": '{"type": "object"}'}, OutputFormat("json_schema", "guided_json", {"type": "object"}, True)),
        ({"guided_regex": "a+"}, OutputFormat("regex", "guided_regex", pattern="a+")),
        ({"guided_choice": ["a", "b"]}, OutputFormat("choice", "guided_choice", choices=("a", "b"))),
        ({"structured_outputs": {"json": SCHEMA}}, OutputFormat("json_schema", "structured_outputs", SCHEMA, True)),
        ({"structured_outputs": {"json_object": True}}, OutputFormat("json_object", "structured_outputs")),
        ({"structured_outputs": {"regex": "x", "choice": None}}, OutputFormat("regex", "structured_outputs", pattern="x")),
        ({"guided_choice": ["a"], "guided_decoding_backend": "guidance"}, OutputFormat("choice", "guided_choice", choices=("a",))),
    ],
)  # fmt: skip
def test_vllm_guided_fields(fields, expected):
    assert guided_format(fields) == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": "json"}, "structured_outputs"),
    ],
)
def test_vllm_guided_mistakes_name_the_field(fields, param):
    with pytest.raises(APIError) as e:
        guided_format(fields)
    assert e.value.status == 400 and e.value.param == param


def test_one_structured_field_per_request():
    req = SimpleNamespace(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(APIError) as e:
        request_format(req)
    assert e.value.param == "guided_regex"
    assert request_format(SimpleNamespace(guided_regex="a")).kind == "regex"
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_choice": ["a"]}
    )
    assert request_format(body).kind == "choice"


def test_json_object_needs_the_word_json_in_the_messages():
    fmt = OutputFormat("json_object", "response_format")
    require_json_word(fmt, ["Answer in Json please"], "messages")
    require_json_word(None, ["nothing"], "messages")
    require_json_word(OutputFormat("json_schema", "response_format", {}), ["x"], "messages")
    require_json_word(OutputFormat("json_object", "structured_outputs"), ["x"], "messages")
    with pytest.raises(APIError) as e:
        require_json_word(fmt, ["hello", "world"], "messages")
    assert e.value.param == "messages" and "'json'" in e.value.message


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    tok = Tokenizer(write_json_tokenizer(tmp_path_factory.mktemp("tok")))
    return Grammars(SimpleNamespace(tokenizer=tok, eos_token_ids=(2,)), cache_size=4)


def test_compile_format_gives_grammars_and_schema_errors_name_the_field(grammars):
    assert compile_format(None, grammars) is None
    for fmt in (
        OutputFormat("json_object", "response_format"),
        OutputFormat("json_schema", "response_format", SCHEMA, True, "n"),
        OutputFormat("regex", "guided_regex", pattern="[ab]+"),
        OutputFormat("choice", "guided_choice", choices=("a", "b")),
    ):
        assert isinstance(compile_format(fmt, grammars), Grammar)
    assert grammars.vocabulary().cache.size == 4
    bad = OutputFormat("json_schema", "response_format", {"type": "strin"}, True, "shape")
    with pytest.raises(APIError) as e:
        compile_format(bad, grammars)
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "Invalid schema for response_format 'shape'" in e.value.message
    assert "strin" in e.value.message
    unenforceable = OutputFormat("json_schema", "guided_json", {"not": {}}, True)
    with pytest.raises(APIError) as e:
        compile_format(unenforceable, grammars)
    assert e.value.param == "guided_json" and "not" in e.value.message
