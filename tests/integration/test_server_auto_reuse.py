"""Automatic reuse through the real server and the official ``openai`` client: a plain chat prompt
whose passages an earlier prompt held in another order reports span-reused tokens when
``blend.auto`` is on (SmolLM2's calibrated profile is ``prefix``, so the budget is set in the
config, as other blend tests do), none per request ``blend_auto: "off"``; with the profile's
``prefix`` blend the answer is a full prefill's; bad values are 400s; ``/metrics`` counts."""

from __future__ import annotations

import httpx
import openai
import pytest
from kvfuse_helpers import uncached_engine
from openai import OpenAI

from kvfuse.calibration import fictional_qa
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
# 10 passages, ~60 tokens each
PASSAGES = [d for i in (0, 1) for d in fictional_qa.item(i, 5).documents]


def messages(order: list[int], question: str) -> list[dict]:
    body = "".join(f"Passage: {PASSAGES[i]}\n\n" for i in order)
    return [
        {"role": "system", "content": "Answer from the passages, in a few words."},
        {"role": "user", "content": f"{body}Question: {question}"},
    ]


FIRST = messages(list(range(10)), "Who works as a baker?")
SECOND = messages([7, 2, 9, 0, 4, 1, 8, 3, 6, 5], "Which passages mention a town?")


@pytest.fixture(scope="module")
def home(kvfuse_home):
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


def start(home, tmp_path_factory, blend: dict) -> ServerProcess:
    disk = tmp_path_factory.mktemp("auto-kv")
    return ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(disk)},
            "blend": {"auto": "on", "auto_min_tokens": 256, **blend},
        },
    ).start()


@pytest.fixture(scope="module")
def server(home, tmp_path_factory):
    srv = start(home, tmp_path_factory, {"recompute_ratio": 0.3})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(client, msgs, **extra):
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, extra_body=extra or None
    )
    return r, r.usage.prompt_tokens_details.model_extra


def test_passages_seen_in_another_order_are_span_reused(client, server):
    first, d1 = ask(client, FIRST)
    assert d1["auto_reuse"] == "none_found" and d1["span_reused_tokens"] == 0
    second, d2 = ask(client, SECOND)
    assert d2["auto_reuse"] == "blended" and d2["blend"]["recompute_ratio"] == 0.3
    # the found passages' tokens (~60 each: edges lost)
    found = d2["span_reused_tokens"] + d2["recomputed_tokens"]
    assert d2["span_reused_tokens"] > 0 and found > 0.5 * second.usage.prompt_tokens
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        == d2["prefix_reused_tokens"] + d2["span_reused_tokens"]
    )
    assert (
        d2["prefilled_tokens"]
        == second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    )
    assert d2["recomputed_tokens"] > 0
    off, d3 = ask(client, messages([5, 6, 3, 8, 1], "Who plays the cello?"), blend_auto="off")
    assert (d3["auto_reuse"], d3["span_reused_tokens"]) == ("off", 0)
    # the system prompt at most
    assert d3["prefix_reused_tokens"] == off.usage.prompt_tokens_details.cached_tokens
    text = httpx.get(server.url + "/metrics", timeout=30).text
    hits = [
        line
        for line in text.splitlines()
        if line.startswith('kvfuse_auto_reuse_span_lookups_total{result="hit"}')
    ]
    assert hits and float(hits[0].split()[-1]) > 0
    assert 'kvfuse_auto_reuse_requests_total{status="blended"} 1.0' in text


def test_bad_values_are_400s(client):
    for extra, param in (
        ({"blend_auto": "maybe"}, "blend_auto"),
        ({"blend_auto": True}, "blend_auto"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, FIRST, **extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:  # a budget needs documents or automatic reuse
        ask(client, FIRST, blend_auto="off", recompute_ratio=0.5)
    assert e.value.body["param"] == "recompute_ratio"
    # a budget of its own
    _, d = ask(client, messages([3, 1, 4], "Who plays the flute?"), recompute_ratio=1.0)
    assert (
        d["auto_reuse"] == "blended"
        and d["blend"]["source"] == "request"
        and d["span_reused_tokens"] == 0
    )


def test_a_prefix_profile_answers_as_a_full_prefill(home, tmp_path_factory):
    srv = start(home, tmp_path_factory, {})  # recompute_ratio auto: SmolLM2's profile says prefix
    try:
        client = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
        ask(client, FIRST)
        second, d = ask(client, SECOND)
        assert (d["auto_reuse"], d["span_reused_tokens"], d["recomputed_tokens"]) == (
            "prefix",
            0,
            0,
        )
        engine = uncached_engine(home, MODEL)
        from kvfuse.generation import SamplingParams

        ids, _ = engine.prompts.encode_chat(SECOND)
        expected = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0.0)).text
        assert second.choices[0].message.content == expected
    finally:
        srv.close()
