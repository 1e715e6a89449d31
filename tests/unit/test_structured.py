"""kvfuse.structured on a tiny real tokenizer: masks against an independent oracle, end of
sequence only at the end, ``done``, logits wider than the vocabulary, schema errors, the cache.

The oracle enumerates every sentence of a small finite language (``json.dumps`` of each valid
instance, in the one layout kvfuse asks for): a token may come next exactly when the text so far
plus its bytes is a prefix of some sentence, end-of-sequence exactly when the text is one.
llguidance allows a subset of that: where the grammar forces the next bytes it leaves out a
token whose bytes a longer allowed token also starts with (``{`` when ``{"`` is forced), so that
forced text is tokenized as the tokenizer itself would; everything else must match exactly.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from json_tokenizer import VOCAB_SIZE, write_json_tokenizer

from kvfuse import structured as st
from kvfuse.models import Tokenizer
from kvfuse.structured.matcher import apply_bitmask
from kvfuse.structured.vocab import GrammarCache

EOS = 2
SPECIAL = {0, 1, 2}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_json_tokenizer(tmp_path_factory.mktemp("json-tok")))


def _obj(props: dict, required=None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


# (schema, every valid instance): small finite languages
LANGUAGES = [
    (_obj({"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}}), None),
    (_obj({"n": {"type": "integer", "minimum": 0, "maximum": 12}}), None),
    (_obj({"v": {"type": ["null", "boolean"]}}), None),
    ({"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}, None),
    (
        {"anyOf": [_obj({"t": {"const": "a"}}), _obj({"t": {"const": "b"}, "k": {"enum": [0]}})]},
        None,
    ),
]


def instances(schema: dict) -> list:
    """Every valid instance of the finite ``LANGUAGES`` schemas, built by hand per shape."""
    if "anyOf" in schema:
        return [{"t": "a"}, {"t": "b", "k": 0}]
    if schema["type"] == "array":
        return [[]] + [[x] for x in (1, 2)] + [list(p) for p in itertools.product((1, 2), repeat=2)]
    props = schema["properties"]
    choices = []
    for p in props.values():
        if "enum" in p:
            choices.append(p["enum"])
        elif p.get("type") == "boolean":
            choices.append([True, False])
        elif p.get("type") == "integer":
            choices.append(list(range(p["minimum"], p["maximum"] + 1)))
        else:
            choices.append([None, True, False])
    return [dict(zip(props, combo)) for combo in itertools.product(*choices)]


def oracle(sentences: list[bytes], prefix: bytes, table: list[bytes]) -> set[int]:
    out = {
        i
        for i, b in enumerate(table)
        if i not in SPECIAL and b and any(s.startswith(prefix + b) for s in sentences)
    }
    return out | ({EOS} if prefix in sentences else set())


def allowed_set(m) -> set[int]:
    return set(m.allowed().nonzero().flatten().tolist())


@pytest.mark.parametrize("schema", [s for s, _ in LANGUAGES], ids=lambda s: json.dumps(s)[:40])
def test_masks_allow_the_grammars_continuations_and_eos_only_at_the_end(tok, schema):
    table = tok.token_bytes()
    sentences = [json.dumps(v).encode() for v in instances(schema)]
    grammar = st.json_schema(schema, tok, strict=True)
    for sentence in sentences:
        m, prefix = grammar.matcher(), b""
        for t in tok.encode(sentence.decode(), add_special_tokens=False):
            got, want = allowed_set(m), oracle(sentences, prefix, table)
            assert got and got <= want, (prefix, sorted(got - want))
            for missing in want - got:  # only the forced-prefix case of the docstring
                assert any(
                    table[a].startswith(table[missing]) and len(table[a]) > len(table[missing])
                    for a in got
                ), (prefix, table[missing])
            assert EOS not in got and not m.done
            m.accept(t)
            prefix += table[t]
        assert prefix == sentence
        # complete: nothing may follow these sentences but end-of-sequence
        assert m.done and m.accepting and allowed_set(m) == {EOS}


def test_eos_is_allowed_when_complete_and_done_only_when_nothing_may_follow(tok):
    m = st.json_schema({"type": "integer", "minimum": 0, "maximum": 99}, tok).matcher()
    one, two = tok.encode("1", False)[0], tok.encode("2", False)[0]
    assert EOS not in allowed_set(m)
    m.accept(one)  # "1": complete, yet "12" may follow
    assert m.accepting and not m.done and {EOS, two} <= allowed_set(m)
    m.accept(two)  # "12": nothing may follow (100 > maximum)
    assert m.done and allowed_set(m) == {EOS}


def test_the_models_end_of_sequence_ids_are_all_allowed_at_the_end(tok):
    vocab = st.Vocabulary(tok, eos_token_ids=(2, 1))
    m = st.json_schema({"enum": ["ok"]}, vocab).matcher()
    for t in tok.encode('"ok"', False):
        m.accept(t)
    assert allowed_set(m) == {1, 2} and m.done


@pytest.mark.parametrize("width", [VOCAB_SIZE + 192, VOCAB_SIZE, VOCAB_SIZE - 20])
def test_the_mask_covers_logits_wider_or_narrower_than_the_vocabulary(tok, width):
    m = st.json_object(tok).matcher()
    ok = m.allowed()
    logits = torch.randn(width)
    before = logits.clone()
    out = m.mask(logits)
    n = min(width, VOCAB_SIZE)
    assert out.shape == logits.shape and out.dtype == logits.dtype
    assert torch.isinf(out[n:]).all()  # ids the tokenizer does not have: never
    keep = ok[:n]
    assert torch.equal(out[:n][keep], logits[:n][keep])  # allowed logits untouched
    assert bool(torch.isneginf(out[:n][~keep]).all())
    assert torch.equal(logits, before)  # the input is not modified


def test_apply_bitmask_takes_the_torch_path_for_other_dtypes():
    bits = np.array([1, 0, 1, 1] + [0] * 28, dtype=np.uint8)
    logits = torch.arange(6, dtype=torch.bfloat16)
    out = apply_bitmask(bits, 4, logits)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [0.0, -np.inf, 2.0, 3.0, -np.inf, -np.inf]


def test_json_object_allows_any_object_and_nothing_else(tok):
    grammar = st.json_object(tok)
    m = grammar.matcher()
    for t in tok.encode('{"a": [1, {"b": null}], "c": "d"}', False):
        assert allowed_set(m) >= {t}
        m.accept(t)
    assert m.done
    first = {tok.token_bytes()[i][:1] for i in allowed_set(grammar.matcher())}
    assert first == {b"{"}  # not an array, a string or a number


def test_a_refused_token_ends_the_output_without_raising(tok):
    m = st.json_schema({"enum": ["ok"]}, tok).matcher()
    m.accept(tok.encode("[", False)[0])  # outside the grammar (a caller past the mask)
    assert m.done


@pytest.mark.parametrize(
    "schema, strict, words",
    [
        ([], True, "must be a JSON object"),
        ({"type": "strin"}, True, "strin"),
        ({"type": "object", "required": "name"}, True, "required"),
        ({"properties": {"a": {"$ref": "#/$defs/nope"}}}, True, "/$defs/nope"),
        ({"type": "string", "pattern": "[unclosed"}, True, "unclosed"),
        ({"enum": []}, True, "nsatisfiable"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, False, "nsatisfiable"),
        ({"type": "array", "uniqueItems": True}, True, "uniqueItems"),
        ({"not": {"type": "string"}, "type": "integer"}, True, "not"),
        ({"minimum": float("nan"), "type": "number"}, True, "not JSON"),
    ],
)
def test_schema_errors_name_what_is_wrong(tok, schema, strict, words):
    with pytest.raises(st.SchemaError) as e:
        st.json_schema(schema, tok, strict=strict)
    assert words in str(e.value)
    assert isinstance(e.value, ValueError)


def test_strict_refuses_what_cannot_be_enforced_and_lax_ignores_it(tok):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    with pytest.raises(st.SchemaError, match="set strict to false"):
        st.json_schema(schema, tok, strict=True)
    m = st.json_schema(schema, tok, strict=False).matcher()
    for t in tok.encode("[1, 1]", False):  # uniqueItems ignored, the rest enforced
        assert t in allowed_set(m)
        m.accept(t)
    assert m.done


def test_regex_choice_and_lark(tok):
    def walk(grammar, text):
        m = grammar.matcher()
        for t in tok.encode(text, False):
            if t not in allowed_set(m):
                return False
            m.accept(t)
        return m.accepting

    assert walk(st.regex(r"[a-c]{2}-\d", tok), "ab-7")
    assert not walk(st.regex(r"[a-c]{2}-\d", tok), "ad-7")
    assert walk(st.choice(["yes", "no"], tok), "no") and not walk(st.choice(["yes"], tok), "ye!")
    tool = 'start: "call " %json {"type": "object", "properties": {"x": {"type": "integer"}}}'
    assert walk(st.lark(tool, tok), 'call {"x": 3}')
    with pytest.raises(st.SchemaError):
        st.choice([], tok)
    with pytest.raises(st.SchemaError):
        st.lark("start: undefined_rule", tok)


def test_compiled_grammars_are_cached_per_schema_text_and_tokenizer(tok, tmp_path):
    schema = _obj({"a": {"type": "integer"}, "b": {"type": "boolean"}})
    vocab = st.vocabulary(tok)
    assert st.vocabulary(tok) is vocab
    g = st.json_schema(schema, tok)
    assert st.json_schema(json.loads(json.dumps(schema)), tok) is g
    # another property order is another grammar (properties come in the schema's order)
    swapped = {**schema, "properties": dict(reversed(list(schema["properties"].items())))}
    assert st.json_schema(swapped, tok) is not g
    assert st.json_schema(schema, tok, strict=False) is not g
    other = Tokenizer(write_json_tokenizer(tmp_path / "other"))
    assert st.json_schema(schema, other) is not g


def test_the_grammar_cache_is_a_bounded_lru():
    cache, built = GrammarCache(2), []

    def build(k):
        return lambda: built.append(k) or k

    for k in ("a", "b", "a", "c", "b", "a"):
        cache.get(k, build(k))
    # a, b built; a hit; c evicts b; b rebuilt evicts a; a rebuilt
    assert built == ["a", "b", "c", "b", "a"] and len(cache) == 2
    assert (cache.hits, cache.misses) == (1, 5)
    none = GrammarCache(0)
    none.get("a", build("x"))
    none.get("a", build("y"))
    assert len(none) == 0 and built[-2:] == ["x", "y"]
    with pytest.raises(ValueError):
        GrammarCache(-1)


def test_a_loaded_models_end_of_sequence_ids_make_its_vocabulary(tok):
    class Model:  # what vocabulary() reads of a LoadedModel
        tokenizer = tok
        eos_token_ids = (2, 1)

    vocab = st.vocabulary(Model())
    assert vocab.eos_token_ids == (2, 1) and vocab is st.vocabulary(tok, (2, 1))
    assert st.vocabulary(tok).eos_token_ids == (2,)
