"""A forced call's schema, narrowed so that a call always ends.

A grammar lets a JSON integer have any number of digits and an object any number of keys, and a
small model that starts repeating itself (Gemma 3 270M does, asked for arguments it has no reason
to give: ``"a": 1000000000..., "c": ..., "d": ...``) goes on until ``max_tokens`` cuts the call
short: an invalid call, where ``tool_choice: required`` promises a valid one. So, in the grammar
only (the tool's definition is unchanged):

- an integer without ``minimum`` / ``maximum`` is bounded to JSON's safe integers,
  ``±(2**53 - 1)`` (what JavaScript clients read exactly): at most 16 digits;
- an object that declares ``properties`` and says nothing of other keys (no
  ``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``) takes only its
  declared keys; not inside ``allOf``, whose branches may declare an object's keys between them.

The narrowed schema allows less than the tool's, so every call it allows is valid against the
tool's own schema. Pure: ``bounded`` returns a new schema.
"""

from __future__ import annotations

from typing import Any

SAFE_INTEGER = 2**53 - 1
_LOWER = ("minimum", "exclusiveMinimum")
_UPPER = ("maximum", "exclusiveMaximum")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else")
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded(schema: Any, close: bool = True) -> Any:
    """``schema`` narrowed as the module docstring says (``close``: objects may be closed)."""
    if not isinstance(schema, dict):
        return schema  # true / false, or something the grammar compiler will refuse
    out = dict(schema)
    if _is(schema.get("type"), "integer"):
        if not any(k in schema for k in _LOWER):
            out["minimum"] = -SAFE_INTEGER
        if not any(k in schema for k in _UPPER):
            out["maximum"] = SAFE_INTEGER
    if close and "properties" in schema and not any(k in schema for k in _OPEN):
        out["additionalProperties"] = False
    for key in _ONE:
        if key in schema:
            out[key] = bounded(schema[key])
    for key in _MANY:
        if isinstance(schema.get(key), list):
            out[key] = [bounded(s) for s in schema[key]]
    if isinstance(schema.get("allOf"), list):
        out["allOf"] = [bounded(s, close=False) for s in schema["allOf"]]
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            out[key] = {name: bounded(s) for name, s in schema[key].items()}
    return out


def _is(kind: Any, name: str) -> bool:
    return kind == name or (isinstance(kind, list) and name in kind)
