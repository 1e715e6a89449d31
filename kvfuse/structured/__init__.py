"""Structured outputs: JSON schemas (and other grammars) compiled into per-sequence token masks.

``json_schema(schema, tokenizer, strict)`` and ``json_object(tokenizer)`` (and ``regex``,
``choice``, ``lark`` for other callers) give a ``Grammar``: the ``Structure`` that
``SamplingParams.structure`` takes. Each sequence decoding with it gets its own
``GrammarMatcher`` (``Grammar.matcher()``), the ``TokenConstraint`` whose mask sets every token
the grammar does not allow next to ``-inf`` before sampling, allows end-of-sequence only once the
output is complete, and whose ``done`` ends the sequence when nothing more may follow. Compiled
grammars are cached per tokenizer (``Vocabulary.cache``, a bounded LRU keyed by the schema's
text). An invalid schema, or one using a keyword that cannot be enforced under ``strict``, is a
``SchemaError`` (a ``ValueError``) whose message names what is wrong.

The grammar engine is llguidance, chosen over XGrammar and outlines-core by
``bench/structured.py`` on SmolLM2's and Gemma 3's tokenizers (docs/benchmarks.md, "Structured
outputs"): it compiles a schema in about a millisecond where XGrammar takes milliseconds to tens
of milliseconds on Gemma 3's 262k tokens and outlines-core from 0.1 s to over 10 s (its regular
expressions unroll nesting: ``json_object`` alone took 13 s on SmolLM2's vocabulary); it builds
the lexer lazily, so a new schema never stalls a request on a cold compile; it covers the most of
JSON Schema that it enforces (``$ref`` recursion, ``anyOf``/``oneOf``/``allOf``, formats,
patterns, numeric bounds, ``additionalProperties`` schemas) and refuses, by name, the few
keywords it does not enforce rather than ignoring them, which is what ``strict`` needs; its
per-token mask (tens of microseconds) is small next to a decode step. It reads the model's own
``tokenizer.json``, so no second tokenizer is loaded.
"""

from .compile import JSON_LAYOUT, SchemaError, choice, json_object, json_schema, lark, regex
from .matcher import Grammar, GrammarError, GrammarMatcher
from .vocab import DEFAULT_CACHE_SIZE, GrammarCache, Vocabulary, vocabulary

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "Grammar",
    "GrammarCache",
    "GrammarError",
    "GrammarMatcher",
    "JSON_LAYOUT",
    "SchemaError",
    "Vocabulary",
    "choice",
    "json_object",
    "json_schema",
    "lark",
    "regex",
    "vocabulary",
]
