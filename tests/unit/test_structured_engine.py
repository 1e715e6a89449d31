"""Structured outputs through the engine, on a tiny random model with a byte-level tokenizer: every
constrained output, greedy or sampled, ends by itself and parses and validates against its
schema; constrained and free requests share the batched steps, and the free ones come out as
they would alone.

A random model has no wish to write JSON, which makes it a hard test: whatever the grammar allows,
it may pick. The schemas here have finite languages (enums, bounded integers and strings,
``maxItems``), so each output must end within ``max_tokens``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from json_tokenizer import VOCAB_SIZE, write_json_tokenizer
from kvfuse_helpers import tiny_loaded_model

from kvfuse import structured as st
from kvfuse.config import EngineSettings
from kvfuse.engine import Engine, Prompt, Request
from kvfuse.generation import SamplingParams
from kvfuse.store import TieredStore
from kvfuse.tiers import MemoryTier


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return tiny_loaded_model(
        tiny_model_dir("llama"), write_json_tokenizer(tmp_path_factory.mktemp("json-tok"))
    )


def _obj(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


SCHEMAS = {
    "flat": _obj(
        {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        }
    ),
    "nested": _obj(
        {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z][0-9]$"}}),
            },
            "owner": _obj({"city": {"enum": ["Oslo", "Paris"]}, "vip": {"type": "null"}}),
        }
    ),
    "tool-call": {
        "anyOf": [
            _obj(
                {"name": {"const": "get_weather"}, "arguments": _obj({"city": {"enum": ["Oslo"]}})}
            ),
            _obj(
                {
                    "name": {"const": "add"},
                    "arguments": _obj({"a": {"type": "integer", "minimum": -9, "maximum": 9}}),
                }
            ),
        ]
    },
}


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def check(result, schema: dict | None) -> None:
    assert result.finish_reason == "stop", (result.finish_reason, result.text)
    value = json.loads(result.text)
    jsonschema.validate(value, schema if schema is not None else {"type": "object"})
    assert all(t < VOCAB_SIZE for t in result.token_ids)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_greedy_and_sampled_outputs_parse_and_validate(model, name):
    schema = SCHEMAS[name]
    grammar = st.json_schema(schema, model, strict=True)
    engine = Engine(model, None, EngineSettings.of(chunk_size=16))
    runs = [SamplingParams(max_tokens=200, structure=grammar)] + [
        SamplingParams(max_tokens=200, temperature=1.0, seed=s, structure=grammar) for s in range(4)
    ]
    for i, params in enumerate(runs):
        check(engine.generate(prompt_ids(i), params), schema)
    engine.close()


def test_json_object_outputs_are_objects_or_unfinished_ones(model):
    """Any object: an unbounded language, in which a random model may well run out of tokens
    (``length``); an output that ends by itself is an object, one cut short is the start of one
    (test_structured walks complete objects to their end)."""
    engine = Engine(model, None, EngineSettings.of(chunk_size=16))
    grammar = st.json_object(model)
    for s in range(4):
        temperature = 0.0 if s == 0 else 1.0
        params = SamplingParams(max_tokens=60, temperature=temperature, seed=s, structure=grammar)
        r = engine.generate(prompt_ids(s), params)
        if r.finish_reason == "stop":
            check(r, None)
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 60
            assert r.text.startswith("{") and all(t < VOCAB_SIZE for t in r.token_ids)
    engine.close()


def test_the_free_model_would_not_write_json(model):
    """The other tests would pass vacuously if this model wrote JSON anyway."""
    engine = Engine(model, None, EngineSettings.of(chunk_size=16))
    r = engine.generate(prompt_ids(0), SamplingParams(max_tokens=30, ignore_eos=True))
    with pytest.raises(ValueError):
        json.loads(r.text)
    engine.close()


def test_constrained_and_free_requests_share_steps_and_free_ones_are_unchanged(model):
    free = [(prompt_ids(20 + i), SamplingParams(max_tokens=24, ignore_eos=True)) for i in range(3)]
    alone = Engine(model, None, EngineSettings.of(chunk_size=16, max_running=1))
    reference = [alone.generate(ids, p).token_ids for ids, p in free]
    alone.close()
    grammars = {n: st.json_schema(s, model) for n, s in SCHEMAS.items()}
    constrained = [
        (prompt_ids(30 + i), SamplingParams(max_tokens=200, temperature=1.0, seed=i, structure=g))
        for i, g in enumerate(grammars.values())
    ]
    engine = Engine(
        model, TieredStore(MemoryTier(64 << 20)), EngineSettings.of(chunk_size=16, max_running=8)
    )
    results: dict[int, object] = {}
    for i, (ids, params) in enumerate(free + constrained):
        engine.submit(
            Request(Prompt.plain(ids), params, on_done=lambda o, i=i: results.__setitem__(i, o))
        )
    steps = peak = 0
    while engine.has_work():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running()))
    assert [results[i].result.token_ids for i in range(3)] == reference
    for i, name in enumerate(grammars):
        check(results[3 + i].result, SCHEMAS[name])
    longest = max(len(results[i].result.token_ids) for i in results)
    total = sum(len(results[i].result.token_ids) for i in results)
    assert peak == 6 and steps < longest + 20 < total  # one pass for all, not one each
    engine.close()
