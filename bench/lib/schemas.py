"""JSON schemas of realistic structured-output requests, and probes of single schema features, for
``bench/structured.py``.

``CASES``: a flat object, nested objects with arrays and enums, a tool-call envelope (``anyOf``
over three tools' parameter schemas, as a function-calling layer asks for) and ``json_object``
(``schema`` None: any JSON object), each with a chat prompt and a valid instance. ``PROBES``: one
keyword each, with an instance the keyword allows and one it forbids, so that an engine that
accepts a schema but does not enforce a keyword is told apart from one that enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    schema: dict | None
    prompt: str
    instance: Any


FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "active"],
    "additionalProperties": False,
}

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "country": {"type": "string", "enum": ["FR", "DE", "NL", "UK", "US"]},
    },
    "required": ["street", "city", "country"],
    "additionalProperties": False,
}

NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": _ADDRESS},
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "status", "customer", "items", "gift"],
    "additionalProperties": False,
}


def _tool(name: str, params: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": name},
            "arguments": {
                "type": "object",
                "properties": params,
                "required": required,
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


TOOLS = {
    "type": "object",
    "properties": {
        "tool_calls": {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    _tool(
                        "get_weather",
                        {
                            "city": {"type": "string"},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        },
                        ["city", "unit"],
                    ),
                    _tool(
                        "search_flights",
                        {
                            "origin": {"type": "string"},
                            "destination": {"type": "string"},
                            "date": {"type": "string"},
                            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        ["origin", "destination", "date", "passengers"],
                    ),
                    _tool(
                        "send_email",
                        {
                            "to": {"type": "array", "items": {"type": "string"}},
                            "subject": {"type": "string"},
                            "body": {"type": "string"},
                        },
                        ["to", "subject", "body"],
                    ),
                ]
            },
        }
    },
    "required": ["tool_calls"],
    "additionalProperties": False,
}

CASES = [
    Case(
        "flat",
        FLAT,
        "Describe a fictional user as JSON with name, age, email and active.",
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True},
    ),
    Case(
        "nested",
        NESTED,
        "Write a JSON order: id, status, the customer with an address in France, two items.",
        {
            "order_id": "A-1001",
            "status": "paid",
            "customer": {
                "name": "Jean Dupont",
                "address": {"street": "3 rue Royale", "city": "Paris", "country": "FR"},
            },
            "items": [
                {"sku": "BK-12", "quantity": 2, "price": 12.5},
                {"sku": "PN-3", "quantity": 1, "price": 3.2},
            ],
            "gift": False,
        },
    ),
    Case(
        "tool-call",
        TOOLS,
        "What is the weather in Oslo in celsius? Answer with a JSON tool call.",
        {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]},
    ),
    Case(
        "json_object",
        None,
        "List three fruits and their colours as a JSON object.",
        {"apple": "red", "banana": "yellow", "kiwi": {"inside": "green", "sizes": [1, 2.5]}},
    ),
]


@dataclass(frozen=True)
class Probe:
    feature: str
    schema: dict
    valid: Any
    invalid: Any


def _obj(value_schema: dict) -> dict:
    return {
        "type": "object",
        "properties": {"v": value_schema},
        "required": ["v"],
        "additionalProperties": False,
    }


_STR = {"type": "string"}
PROBES = [
    Probe("pattern", _obj({"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"}), "AB-12", "ab"),
    Probe(
        "format: date-time",
        _obj({"type": "string", "format": "date-time"}),
        "2024-01-02T03:04:05Z",
        "soon",
    ),
    Probe("format: email", _obj({"type": "string", "format": "email"}), "a@b.org", "nobody"),
    Probe(
        "format: uuid",
        _obj({"type": "string", "format": "uuid"}),
        "123e4567-e89b-12d3-a456-426614174000",
        "x",
    ),
    Probe(
        "minLength / maxLength",
        _obj({"type": "string", "minLength": 2, "maxLength": 4}),
        "abc",
        "abcdef",
    ),
    Probe("minimum / maximum", _obj({"type": "integer", "minimum": 1, "maximum": 9}), 5, 12),
    Probe("exclusiveMinimum", _obj({"type": "number", "exclusiveMinimum": 0}), 0.5, 0),
    Probe("multipleOf", _obj({"type": "integer", "multipleOf": 5}), 15, 7),
    Probe(
        "minItems / maxItems",
        _obj({"type": "array", "items": _STR, "minItems": 1, "maxItems": 2}),
        ["a"],
        [],
    ),
    Probe(
        "uniqueItems",
        _obj({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        [1, 2],
        [1, 1],
    ),
    Probe(
        "prefixItems",
        _obj({"type": "array", "prefixItems": [_STR, {"type": "integer"}], "items": False}),
        ["a", 1],
        [1, "a"],
    ),
    Probe("const", _obj({"const": "fixed"}), "fixed", "other"),
    Probe("enum (mixed types)", _obj({"enum": ["a", 1, None]}), 1, 2),
    Probe("anyOf", _obj({"anyOf": [_STR, {"type": "integer"}]}), 3, 2.5),
    Probe("oneOf", _obj({"oneOf": [_STR, {"type": "integer"}]}), "x", True),
    Probe("allOf", _obj({"allOf": [{"type": "integer"}, {"minimum": 3}]}), 4, 1),
    Probe("type list (nullable)", _obj({"type": ["string", "null"]}), None, 5),
    Probe(
        "$ref / $defs",
        {"$defs": {"p": {"type": "integer"}}, **_obj({"$ref": "#/$defs/p"})},
        3,
        "x",
    ),
    Probe(
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                    "required": ["kids"],
                    "additionalProperties": False,
                }
            },
            **_obj({"$ref": "#/$defs/node"}),
        },
        {"kids": [{"kids": []}]},
        {"kids": [{}]},
    ),
    Probe(
        "additionalProperties: schema",
        _obj({"type": "object", "additionalProperties": {"type": "integer"}}),
        {"a": 1},
        {"a": "x"},
    ),
    Probe(
        "patternProperties",
        _obj(
            {
                "type": "object",
                "patternProperties": {"^x": {"type": "integer"}},
                "additionalProperties": False,
            }
        ),
        {"x1": 1},
        {"y": 1},
    ),
    Probe("minProperties", _obj({"type": "object", "minProperties": 1}), {"a": 1}, {}),
    Probe("not", _obj({"not": {"type": "string"}}), 1, "s"),
    Probe(
        "if / then / else",
        _obj({"if": {"type": "integer"}, "then": {"minimum": 0}, "else": _STR}),
        1,
        -1,
    ),
    Probe(
        "dependentRequired",
        _obj(
            {
                "type": "object",
                "properties": {"a": _STR, "b": _STR},
                "dependentRequired": {"a": ["b"]},
            }
        ),
        {"a": "x", "b": "y"},
        {"a": "x"},
    ),
]
