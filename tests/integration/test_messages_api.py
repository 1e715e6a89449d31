"""Anthropic's Messages API on a real ``kvfuse serve`` process with SmolLM2, driven by the official
``anthropic`` client and by ``langchain-anthropic``: messages.create and messages.stream (text, the
final message, usage, the raw event sequence), stop reasons, a cache_control system block sent
twice (the second reads it from the cache and answers sooner), pre-warming with max_tokens 0,
count_tokens against the usage, and errors (bad key, unsupported fields and blocks, unknown
model) raised as the client's typed exceptions."""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import httpx
import pytest
from kvfuse_helpers import long_text

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEY = "sk-alice"
GREEDY = {"temperature": 0}  # the current SDK takes sampling parameters in extra_body
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def server(kvfuse_home: Path, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path_factory.mktemp("messages-kv"))},
        "server": {"api_keys": [f"{KEY}:alice"]},
    }
    srv = ServerProcess(kvfuse_home, config=config)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def total(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def count(client, **fields) -> int:
    return client.messages.count_tokens(model=MODEL, **fields).input_tokens


def test_create_returns_a_message_whose_usage_adds_up(client):
    m = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and m._request_id
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 16
    assert total(m.usage) == count(client, messages=QUESTION)
    assert m.usage.cache_creation.ephemeral_5m_input_tokens == m.usage.cache_creation_input_tokens


def test_stream_gives_the_same_text_events_and_usage(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=QUESTION, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert total(final.usage) == total(whole.usage)

    events = list(
        client.messages.create(
            model=MODEL, max_tokens=12, messages=QUESTION, stream=True, extra_body=GREEDY
        )
    )
    start, delta = events[0].message.usage, events[-2].usage
    assert total(start) == total(whole.usage) and start.output_tokens == 0
    assert delta.output_tokens == whole.usage.output_tokens


def test_the_raw_stream_is_anthropics_event_sequence(server):
    """The wire format, with the ``ping`` the client hides: ``event:`` lines naming each
    event's type, then its JSON."""
    body = {"model": MODEL, "max_tokens": 12, "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e.split("\n") for e in raw.strip().split("\n\n")]
    kinds = [lines[0].removeprefix("event: ") for lines in events]
    assert all(len(lines) == 2 and lines[1].startswith("data: {") for lines in events)
    assert all(f'"type":"{k}"' in lines[1] for k, lines in zip(kinds, events))
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1 and kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_stop_reasons(client):
    free = (
        client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
        .content[0]
        .text
    )
    m = client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    word = free.split()[-1]
    m = client.messages.create(
        model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=[word], extra_body=GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in "".join(b.text for b in m.content)


def test_a_cached_system_prompt_is_read_the_second_time_and_answers_sooner(client):
    system_text = "You answer questions about these notes.\n\n" + long_text(14)
    system = [{"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}]
    client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION)  # warm the server up

    def ask(question: str):
        t0 = time.perf_counter()
        m = client.messages.create(
            model=MODEL,
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": question}],
            extra_body=GREEDY,
        )
        return m, time.perf_counter() - t0

    first, t_first = ask("What is Part 3 about?")
    second, t_second = ask("Summarize Part 7.")
    u1, u2 = first.usage, second.usage
    assert u1.cache_read_input_tokens == 0 and u1.cache_creation_input_tokens > 1000
    # what the first wrote (the system prompt, up to its breakpoint) the second reads
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert u2.cache_creation_input_tokens == 0
    for m, question in ((first, "What is Part 3 about?"), (second, "Summarize Part 7.")):
        messages = [{"role": "user", "content": question}]
        assert total(m.usage) == count(client, system=system, messages=messages)
    assert t_second < t_first, (t_first, t_second)


def test_prewarming_and_one_hour_breakpoints(client):
    system = [
        {"type": "text", "text": long_text(6), "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Notes:\n" + long_text(3), "cache_control": {"type": "ephemeral"}},
    ]
    warm = client.messages.create(model=MODEL, max_tokens=0, system=system, messages=QUESTION)
    assert warm.content == [] and warm.usage.output_tokens == 0
    created = warm.usage.cache_creation
    assert created.ephemeral_1h_input_tokens > 500 and created.ephemeral_5m_input_tokens > 200
    m = client.messages.create(
        model=MODEL, max_tokens=4, system=system, messages=QUESTION, extra_body=GREEDY
    )
    assert m.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens
    assert m.content[0].text


def test_errors_are_the_clients_typed_exceptions(server, client):
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    error = exc.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("thinking:")
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert "'image'" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, extra_body={"x": 1})
    assert exc.value.body["error"]["message"].startswith("x: ")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nothing", max_tokens=4, messages=QUESTION)
    # Anthropic's own key header, as older clients and curl send it
    r = httpx.post(
        server.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": QUESTION},
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    )
    assert r.status_code == 200 and r.json() == {"input_tokens": count(client, messages=QUESTION)}


def test_langchain_anthropic_invoke_and_stream(server):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model=MODEL, base_url=server.url, api_key=KEY, max_tokens=12, temperature=0, max_retries=0
    )
    prompt = "What is the capital of France? Answer in one word."
    answer = llm.invoke(prompt)
    assert isinstance(answer.content, str) and answer.content.strip()
    assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    streamed = list(llm.stream(prompt))
    assert "".join(c.content for c in streamed) == answer.content
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    n = count(client, messages=[{"role": "user", "content": prompt}])
    assert answer.usage_metadata["input_tokens"] == n
    assert sum(c.usage_metadata["input_tokens"] for c in streamed if c.usage_metadata) == n
