"""Structured-output request fields -> one ``OutputFormat`` -> a compiled ``Grammar`` for
``SamplingParams.structure``.

The fields, as the APIs imitated document them:

- chat completions and completions: OpenAI's ``response_format``: ``{"type": "text"}``,
  ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "description",
  "schema", "strict"}}``;
- the Responses API: ``text.format``, the same three with the ``json_schema`` fields flattened
  (``{"type": "json_schema", "name", "schema", "strict", "description"}``);
- vLLM's extensions on both completions endpoints: ``guided_json`` (a schema, or its JSON text),
  ``guided_regex``, ``guided_choice``, and ``structured_outputs`` with ``json``, ``regex``,
  ``choice`` or ``json_object``. vLLM's grammar and whitespace options are refused by name.

Parsing is pure (``chat_format``, ``responses_format``, ``guided_format``: every mistake an
``APIError`` 400 naming the field); ``compile_format`` compiles through ``kvfuse.structured``,
whose ``SchemaError`` becomes a 400 naming the field too. OpenAI's rule that a ``json_object``
request must mention JSON in its messages is kept (``require_json_word``): the grammar makes the
output an object, but only the prompt tells the model what to put in it.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

from kvfuse.structured import (
    SchemaError,
    Vocabulary,
    choice,
    json_object,
    json_schema,
    regex,
    vocabulary,
)

from .errors import APIError, bad_request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class OutputFormat:
    """What a request constrains its output to. ``kind``: json_object, json_schema, regex or
    choice; ``param``: the request field it came from (what a 400 names)."""

    kind: str
    param: str
    schema: dict | None = None
    strict: bool = False
    name: str | None = None
    description: str | None = None
    pattern: str | None = None
    choices: tuple[str, ...] = ()

    def echo(self) -> dict[str, Any]:
        """As the Responses API reports it back (``text.format``)."""
        if self.kind == "json_schema":
            return {
                "type": "json_schema",
                "description": self.description,
                "name": self.name,
                "schema": self.schema,
                "strict": self.strict,
            }
        return {"type": self.kind}


def as_response_format(fmt: OutputFormat | None) -> dict[str, Any] | None:
    """A Responses API format as the chat request's ``response_format`` it stands for."""
    if fmt is None:
        return None
    if fmt.kind != "json_schema":
        return {"type": fmt.kind}
    spec = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}


def chat_format(value: Any, param: str = "response_format") -> OutputFormat | None:
    """OpenAI's ``response_format`` (chat completions, and completions as vLLM takes it);
    None for ``text`` or no field."""
    if value is None:
        return None
    kind = _type_of(value, param)
    _only(value, ("type", "json_schema") if kind == "json_schema" else ("type",), param, param)
    if kind != "json_schema":
        return None if kind == "text" else OutputFormat("json_object", param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            f'{param}.json_schema: required with type "json_schema": an object with name, schema '
            "and optionally strict and description",
            param=param,
        )
    return _schema_format(spec, param, f"{param}.json_schema")


def responses_format(text: Any) -> OutputFormat | None:
    """The Responses API's ``text`` field (``format``, ``verbosity``); None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text: must be an object with a format", param="text")
    _only(text, ("format", "verbosity"), "text", "text")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad_request(
            f'text.verbosity: only "medium" (the default) is supported, got {verbosity!r}',
            param="text.verbosity",
        )
    value = text.get("format")
    if value is None:
        return None
    kind = _type_of(value, "text.format")
    _only(
        value,
        ("type", *_SCHEMA_KEYS) if kind == "json_schema" else ("type",),
        "text.format",
        "text.format",
    )
    if kind != "json_schema":
        return None if kind == "text" else OutputFormat("json_object", "text.format")
    return _schema_format(value, "text.format", "text.format")


_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _only(value: dict, allowed: tuple[str, ...], where: str, param: str) -> None:
    """A 400 naming the first key of ``value`` not in ``allowed`` (never ignored: the output
    would not be what the client asked for)."""
    for key in value:
        if key not in allowed:
            raise bad_request(
                f"{where}.{key}: not supported by kvfuse; the keys taken are {', '.join(allowed)}",
                param=param,
            )


def _type_of(value: Any, param: str) -> str:
    if not isinstance(value, dict):
        raise bad_request(f'{param}: must be an object such as {{"type": "json_object"}}', param)
    kind = value.get("type")
    if kind not in _TYPES:
        raise bad_request(
            f"{param}.type: must be one of {', '.join(map(repr, _TYPES))}, got {kind!r}", param
        )
    return kind


def _schema_format(spec: dict, param: str, where: str) -> OutputFormat:
    """The ``json_schema`` fields (nested in chat, flattened in the Responses API), checked."""
    if where.endswith("json_schema"):
        _only(spec, _SCHEMA_KEYS, where, param)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"{where}.name: required: 1-64 characters of a-z, A-Z, 0-9, underscores and dashes, "
            f"got {name!r}",
            param=param,
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description: must be a string", param=param)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict: must be true, false or null", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema: must be a JSON Schema object", param=param)
    return OutputFormat("json_schema", param, schema, bool(strict), name, description)


# vLLM's fields that change what is constrained or how, and that kvfuse does not implement.
_REFUSED_GUIDED = {
    "guided_grammar": "grammars (guided_grammar) are not supported",
    "guided_whitespace_pattern": "the JSON layout is fixed (json.dumps's separators)",
}
_BACKENDS = (None, "auto", "guidance", "llguidance")
_STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")


def guided_format(fields: dict[str, Any]) -> OutputFormat | None:
    """vLLM's guided-decoding fields of a request (``guided_json``, ``guided_regex``,
    ``guided_choice``, ``structured_outputs``, ...), given as ``{name: value}`` for those set."""
    for name, why in _REFUSED_GUIDED.items():
        if fields.get(name) is not None:
            raise bad_request(f"{name}: not supported: {why}", param=name)
    backend = fields.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise bad_request(
            f"guided_decoding_backend: kvfuse's one backend is llguidance (auto, guidance); "
            f"got {backend!r}",
            param="guided_decoding_backend",
        )
    found = [
        f
        for f in (
            _guided_json(fields.get("guided_json")),
            _guided_regex(fields.get("guided_regex"), "guided_regex"),
            _guided_choice(fields.get("guided_choice"), "guided_choice"),
            _structured_outputs(fields.get("structured_outputs")),
        )
        if f is not None
    ]
    if len(found) > 1:
        raise bad_request(
            f"{found[1].param}: give one structured-output field, not several "
            f"({', '.join(f.param for f in found)})",
            param=found[1].param,
        )
    return found[0] if found else None


def _guided_json(value: Any, param: str = "guided_json") -> OutputFormat | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param}: not valid JSON: {e}", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON Schema object (or its JSON text)", param)
    return OutputFormat("json_schema", param, value, strict=True)


def _guided_regex(value: Any, param: str) -> OutputFormat | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}: must be a non-empty regular expression", param=param)
    return OutputFormat("regex", param, pattern=value)


def _guided_choice(value: Any, param: str) -> OutputFormat | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param}: must be a non-empty list of non-empty strings", param=param)
    return OutputFormat("choice", param, choices=tuple(value))


def _structured_outputs(value: Any) -> OutputFormat | None:
    """vLLM's newer ``structured_outputs`` object: one of json, regex, choice, json_object."""
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f'{param}: must be an object such as {{"json": {{...}}}}', param)
    unknown = sorted(
        k for k, v in value.items() if v not in (None, False) and k not in _STRUCTURED_KEYS
    )
    if unknown:
        raise bad_request(
            f"{param}.{unknown[0]}: not supported; kvfuse takes one of "
            f"{', '.join(_STRUCTURED_KEYS)}",
            param=param,
        )
    found = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(found) != 1:
        raise bad_request(f"{param}: give exactly one of {', '.join(_STRUCTURED_KEYS)}", param)
    key = found[0]
    if key == "json_object":
        return OutputFormat("json_object", param)
    if key == "json":
        return _guided_json(value["json"], param)
    if key == "regex":
        return _guided_regex(value["regex"], param)
    return _guided_choice(value["choice"], param)


GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "structured_outputs",
    "guided_decoding_backend",
    "guided_grammar",
    "guided_whitespace_pattern",
)


def request_format(req) -> OutputFormat | None:
    """The one structured-output field of a completions or chat completions request
    (``response_format`` or one of vLLM's)."""
    fmt = chat_format(getattr(req, "response_format", None))
    guided = guided_format({k: getattr(req, k, None) for k in GUIDED_FIELDS})
    if fmt is not None and guided is not None:
        raise bad_request(
            f"{guided.param}: give one structured-output field, not both response_format and "
            f"{guided.param}",
            param=guided.param,
        )
    return fmt or guided


def require_json_word(fmt: OutputFormat | None, texts: list[str], param: str) -> None:
    """OpenAI's rule for ``json_object``: the messages must say JSON somewhere (any case)."""
    if fmt is None or fmt.kind != "json_object" or fmt.param == "structured_outputs":
        return
    if not any("json" in t.lower() for t in texts):
        raise bad_request(
            f"'{param}' must contain the word 'json' in some form, to use '{fmt.param}' of "
            "type 'json_object'.",
            param=param,
        )


class Grammars:
    """The server's grammar compiler: the served model's vocabulary for the grammar engine, built
    on the first structured request (seconds for a large vocabulary, paid only by servers that
    get one), and the size of its compiled-grammar cache (``server.grammar_cache_size``)."""

    def __init__(self, model, cache_size: int | None):
        self.model, self.cache_size = model, cache_size
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()

    @classmethod
    def default(cls, model) -> Grammars:
        """The model's shared vocabulary (``kvfuse.structured.vocabulary``), default cache size."""
        return cls(model, None)

    def vocabulary(self) -> Vocabulary:
        with self._lock:
            if self._vocab is None:
                self._vocab = (
                    vocabulary(self.model)
                    if self.cache_size is None
                    else Vocabulary(self.model.tokenizer, self.model.eos_token_ids, self.cache_size)
                )
            return self._vocab


def compile_format(fmt: OutputFormat | None, grammars: Grammars):
    """The ``Grammar`` of ``fmt`` (None: free text); a 400 naming ``fmt.param`` when its
    schema is invalid or cannot be enforced. Compiles: call it off the event loop."""
    if fmt is None:
        return None
    vocab = grammars.vocabulary()
    try:
        if fmt.kind == "json_object":
            return json_object(vocab)
        if fmt.kind == "json_schema":
            return json_schema(fmt.schema, vocab, strict=fmt.strict)
        if fmt.kind == "regex":
            return regex(fmt.pattern, vocab)
        return choice(list(fmt.choices), vocab)
    except SchemaError as e:
        what = f"schema for {fmt.param} {fmt.name!r}" if fmt.name else f"{fmt.param}"
        raise APIError(400, f"Invalid {what}: {e}", param=fmt.param, code="invalid_value") from None
