"""The OpenAI-compatible server as a real ``kvfuse serve`` process, driven by the official ``openai`` client.

One server per module (start-up costs a model load). The model comes from the session's
``kvfuse_home`` (``$KVFUSE_HOME`` when set, converted once per CI run; otherwise a temp home converted
once per test session); the disk cache is a temp directory of this module.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from kvfuse_helpers import uncached_engine
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
SHORT = "The capital of France is"


def long_prompt(tag: str, facts: int = 40) -> str:
    """A prompt of roughly 12 tokens per fact (40 facts: ~450 tokens, more than one 256-token chunk)."""
    body = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(facts))
    return f"Notes ({tag}). {body}\nQuestion: what is 7 squared?\nAnswer:"


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    """The session's kvfuse home ($KVFUSE_HOME or a temp dir), with the model converted once."""
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-kv")


@pytest.fixture(scope="module")
def server(home, disk_dir):
    srv = ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(disk_dir)},
            "server": {"max_tokens_limit": 512},
        },
    )
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def local_engine(home):
    """The in-process engine on the same model, without a cache (the reference for greedy output)."""
    return uncached_engine(home, MODEL)


def local_greedy(
    engine, max_tokens: int, prompt: str | None = None, messages: list | None = None
) -> str:
    from kvfuse.generation import SamplingParams

    ids = engine.prompts.encode_prompt(prompt, messages=messages)
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)).text


def kv_stats(server) -> dict:
    return httpx.get(server.base_url + "/kv/stats", timeout=30).json()


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_matches_the_in_process_engine(client, local_engine):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=SHORT, max_tokens=8, temperature=0
    )
    assert raw.headers["x-request-id"].startswith("req_")
    r = raw.parse()
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == local_greedy(local_engine, 8, prompt=SHORT)
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def test_chat_matches_the_in_process_engine(client, local_engine):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == local_greedy(local_engine, 8, messages=messages)
    # content parts are accepted too and give the same prompt
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=parts, max_completion_tokens=8, temperature=0
    )
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert r2.usage.prompt_tokens == r.usage.prompt_tokens


def test_streaming_completion_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=SHORT, max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=SHORT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (
        len(with_reason) == 1
        and with_reason[0].choices[0].finish_reason == whole.choices[0].finish_reason
    )
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "Say hello."}]
    # both without the cache: the same computation, streamed or not (reuse is tested elsewhere)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"cache": False}
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"cache": False},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_repeated_long_prompt_reports_cached_tokens(client):
    prompt = long_prompt("repeat")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens >= 300
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # all but the last token, whose logits are needed
    assert cached == second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text  # reuse does not change greedy output


def test_cache_salt_is_a_separate_namespace(client):
    prompt = long_prompt("salted")
    # cached without salt
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    a = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"cache_salt": "project-a"},
    )
    assert a.usage.prompt_tokens_details.cached_tokens == 0  # a new salt starts empty
    b = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        extra_body={"cache_salt": "project-a"},
    )
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_cache_false_neither_reads_nor_writes(client, server):
    prompt = long_prompt("bypass")
    before = kv_stats(server)["engine"]["chunks_stored"]
    r1 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache": False}
    )
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert kv_stats(server)["engine"]["chunks_stored"] == before  # nothing written
    # a namespace no other test's prompts (sharing its first tokens) are in
    salt = {"cache_salt": "bypass"}
    r2 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=salt
    )
    assert r2.usage.prompt_tokens_details.cached_tokens == 0  # so nothing to read afterwards
    r3 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache": False, **salt}
    )
    # and the now-cached prefix is not read
    assert r3.usage.prompt_tokens_details.cached_tokens == 0


def test_sigterm_flushes_the_disk_tier_and_exits_zero(client, server, disk_dir):
    # The last request stores new chunks: memory at once, disk from the background writer.
    client.completions.create(
        model=MODEL, prompt=long_prompt("before-shutdown", facts=80), max_tokens=1, temperature=0
    )
    deadline = time.monotonic() + 30
    while kv_stats(server)["engine"]["saver"]["pending"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the saver puts entries into memory off the request path
    memory_entries = kv_stats(server)["tiers"]["memory"]["entries"]
    assert memory_entries > 0
    assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log_tail()
    on_disk = list(Path(disk_dir).rglob("*.kvf"))
    assert len(on_disk) == memory_entries  # every stored chunk reached the disk before exit
    assert "Traceback" not in server.log_tail(20000)
