"""Compiling what a request asks for (a JSON schema, any JSON object, a regular expression, a
Lark grammar) into a ``Grammar``, once per grammar and tokenizer (the vocabulary's LRU).

Every kind goes through ``_compile``: the grammar text llguidance builds, then a pristine matcher
made from it, whose error (llguidance reports a bad schema as a matcher in an error state, never
as an exception) becomes a ``SchemaError`` naming what is wrong. The first mask is computed
there too, so that building the lexer for the grammar's first position happens on the caller's
thread (the server compiles off its event loop), not in the engine's step.

JSON is written in one layout: ``", "`` between items, ``": "`` after keys, no other
whitespace (``json.dumps``'s own). Free whitespace would let a small model pad an object with
newlines until ``max_tokens`` runs out, and a fixed layout makes ``done`` exact: nothing may
follow the closing brace.
"""

from __future__ import annotations

import json
import re

from .matcher import Grammar
from .vocab import vocabulary

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SchemaError(ValueError):
    """A schema (or grammar) that is invalid or that kvfuse cannot enforce; the message says
    what is wrong."""


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")


def json_schema(schema: dict, tokenizer, strict: bool = True) -> Grammar:
    """Outputs that are JSON values valid against ``schema`` (a JSON Schema, draft 2020-12).

    ``strict``: every keyword is enforced, and a schema using one the engine cannot enforce
    (``uniqueItems``, ``not``, ``if``/``then``/``else``, ``dependentRequired``, ...) is a
    ``SchemaError``; not strict: such keywords are ignored and the rest is enforced (an output
    may then break only the ignored keywords). ``tokenizer``: a ``Tokenizer``, a ``LoadedModel``
    (the model's end-of-sequence ids) or a ``Vocabulary``."""
    if not isinstance(schema, dict):
        raise SchemaError(f"the schema must be a JSON object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the schema is not JSON: {e}") from None
    options = {**JSON_LAYOUT, "lenient": not strict}

    def grammar(ll) -> str:
        return ll.LLMatcher.grammar_from_json_schema(text, overrides=options)

    return _compile(tokenizer, ("json_schema", text, bool(strict)), grammar, "a JSON schema")


def json_object(tokenizer) -> Grammar:
    """Outputs that are one JSON object (any keys, any values: OpenAI's ``json_object``)."""

    def grammar(ll) -> str:
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)

    return _compile(tokenizer, ("json_object",), grammar, "a JSON object")


def regex(pattern: str, tokenizer) -> Grammar:
    """Outputs that match ``pattern`` whole (Rust ``regex`` syntax: no look-around, no
    back-references)."""
    if not isinstance(pattern, str) or not pattern:
        raise SchemaError("the regular expression must be a non-empty string")

    def grammar(ll) -> str:
        return ll.LLMatcher.grammar_from_regex(pattern)

    return _compile(tokenizer, ("regex", pattern), grammar, "a regular expression")


def choice(options: list[str], tokenizer) -> Grammar:
    """Outputs that are exactly one of ``options`` (vLLM's ``guided_choice``)."""
    if not options or not all(isinstance(o, str) and o for o in options):
        raise SchemaError("the choices must be a non-empty list of non-empty strings")
    return regex("|".join(re.escape(o) for o in options), tokenizer)


def lark(grammar_text: str, tokenizer) -> Grammar:
    """Outputs of a Lark grammar in llguidance's dialect (it may embed JSON schemas with
    ``%json { ... }``: e.g. free text or a tool call)."""
    if not isinstance(grammar_text, str) or not grammar_text.strip():
        raise SchemaError("the grammar must be a non-empty string")

    def grammar(ll) -> str:
        return ll.LLMatcher.grammar_from_lark(grammar_text)

    return _compile(tokenizer, ("lark", grammar_text), grammar, "a Lark grammar")


def _compile(tokenizer, key: tuple, make_grammar, description: str) -> Grammar:
    vocab = vocabulary(tokenizer)

    def build() -> Grammar:
        import llguidance

        try:
            text = make_grammar(llguidance)
        except ValueError as e:
            raise SchemaError(_explain(str(e))) from None
        pristine = llguidance.LLMatcher(vocab.ll, text, log_level=0)
        if pristine.is_error():
            raise SchemaError(_explain(pristine.get_error()))
        pristine.compute_bitmask()  # the first position's lexer, built here rather than in a step
        if pristine.is_error():
            raise SchemaError(_explain(pristine.get_error()))
        return Grammar(pristine, vocab.size, description)

    return vocab.cache.get(key, build)


def _explain(error: str) -> str:
    """llguidance's message, with what to do about keywords it cannot enforce."""
    error = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    m = _UNIMPLEMENTED.search(error)
    if m:
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return (
            f"the schema uses {keys}, which kvfuse's grammar engine cannot enforce; remove "
            "it, or set strict to false to have it ignored"
        )
    return error
