"""Conversations through a real ``kvfuse serve`` process and the official ``openai`` client: every
earlier token reused turn after turn with the same greedy answers, ``prompt_cache_key``, a
history resumed from disk after a restart, a history whose text re-tokenizes differently, and a
conversation that outgrows the context window."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from kvfuse_helpers import uncached_engine
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
TURNS = [
    "What is the capital of France?",
    "And the capital of Italy?",
    "Which of the two cities is larger?",
    "Name a famous museum in the first one.",
    "Thank you. What river runs through it?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


def start(home: Path, disk: Path, **config) -> ServerProcess:
    return ServerProcess(
        home,
        config={
            "model": MODEL,
            "cache": {"disk_path": str(disk), **config.pop("cache", {})},
            **config,
        },
    ).start()


@pytest.fixture(scope="module")
def server(home, tmp_path_factory):
    srv = start(home, tmp_path_factory.mktemp("conv-kv"))
    yield srv
    srv.close()


def client_of(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def converse(client: OpenAI, turns=TURNS, history=None, **kw) -> tuple[list[dict], list]:
    """Send ``turns`` one by one, each with the whole history and the previous answers."""
    messages = list(history or [{"role": "system", "content": SYSTEM}])
    usages = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kw
        )
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        usages.append(r.usage)
    return messages, usages


def metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def assert_history_reused(usages) -> None:
    for prev, u in zip(usages, usages[1:]):
        # the previous prompt and answer, less at most the answer's last token (never fed back)
        assert (
            u.prompt_tokens_details.cached_tokens >= prev.prompt_tokens + prev.completion_tokens - 1
        ), (prev, u)


def test_five_turns_reuse_every_earlier_token_with_the_same_greedy_answers(server):
    client = client_of(server)
    with_reuse, usages = converse(client, extra_body={"cache_salt": "five-turns"})
    without, _ = converse(client, extra_body={"cache": False})
    assert with_reuse == without  # token for token: the same text, turn after turn
    assert_history_reused(usages)
    # where each turn's reused KV came from, and its time spent saving on the request path
    for u in usages[1:]:
        extra = u.prompt_tokens_details.model_extra
        assert sum(extra["cached_entries_by_tier"].values()) >= 1 and 0 <= extra["save_ms"] < 1000
    assert (
        metric(server, "kvfuse_history_requests") >= 4
        and metric(server, "kvfuse_history_reused_tokens") > 0
    )
    assert (
        metric(server, "kvfuse_saved_chunks") > 0 and metric(server, "kvfuse_history_records") >= 1
    )


def test_prompt_cache_key_names_the_conversation(server):
    client = client_of(server)
    _, usages = converse(
        client, TURNS[:3], prompt_cache_key="conversation-42", extra_body={"cache_salt": "keyed"}
    )
    assert_history_reused(usages)
    bad = httpx.post(
        server.base_url + "/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "prompt_cache_key": "",
        },
        timeout=30,
    )
    assert bad.status_code == 400 and "prompt_cache_key" in bad.text


def test_a_conversation_on_disk_is_resumed_after_a_restart(home, tmp_path):
    disk = tmp_path / "kv"
    # a small memory tier: the conversation lives on disk; the restart empties memory altogether
    first = start(home, disk, cache={"memory_bytes": "16MiB"})
    try:
        messages, usages = converse(client_of(first), TURNS[:2])
    finally:
        first.close()  # saves and flushes what is queued
    second = start(home, disk, cache={"memory_bytes": "16MiB"})
    try:
        _, more = converse(client_of(second), TURNS[2:3], history=messages)
        prev = usages[-1]
        # no record of the ids survives the restart: the history is found by content on disk
        assert (
            more[0].prompt_tokens_details.cached_tokens
            >= prev.prompt_tokens + prev.completion_tokens - 1
        )
        stats = httpx.get(second.base_url + "/kv/stats", timeout=30).json()
        # read from disk (by the request, or by the prefetcher before it)
        assert stats["tiers"]["disk"]["hits"] > 0
    finally:
        second.close()


def test_a_history_that_tokenizes_differently_reuses_the_ids_that_ran(server, home):
    client = client_of(server)
    tok = uncached_engine(home, MODEL).model.tokenizer
    head = tok.encode(
        "Here is a note about the museums of Paris and Rome.", add_special_tokens=False
    )
    word = " extraordinarily"
    spelled = [tok.token_to_id(("Ġ" if i == 0 else "") + c) for i, c in enumerate(word.strip())]
    assert None not in spelled and spelled != tok.encode(word, add_special_tokens=False)
    first = head + spelled  # the history as it ran: the word letter by letter
    r1 = client.completions.create(
        model=MODEL,
        prompt=first,
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": "retokenized"},
    )
    text = tok.decode(first + [], skip_special_tokens=False) + " And what about Rome?"
    canonical = tok.encode(text, add_special_tokens=False)
    r2 = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": "retokenized"},
    )
    # the spelled-out ids were kept
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(first)
    assert r2.usage.prompt_tokens > len(canonical) - (
        len(tok.encode(word, add_special_tokens=False)) + 1
    ) and r2.usage.prompt_tokens != len(canonical)
    assert r1.usage.prompt_tokens == len(first)


def test_a_conversation_beyond_the_context_window_drops_its_oldest_turns_and_reuses_the_rest(
    home, tmp_path
):
    srv = start(home, tmp_path / "kv", context_tokens=400)
    try:
        client = client_of(srv)
        long_turns = [
            f"Tell me something about the number {i}. " + "It is a fine number. " * 12
            for i in range(6)
        ]
        messages, usages = converse(client, long_turns)
        # valid answers throughout
        assert all(m["content"] for m in messages if m["role"] == "assistant")
        assert all(u.prompt_tokens + MAX_TOKENS <= 400 for u in usages)
        assert metric(srv, "kvfuse_truncated_requests") >= 1
        # the kept turns' KV was reused where it moved
        assert metric(srv, "kvfuse_history_moved_tokens") > 0
        truncated = [u for u in usages[1:] if u.prompt_tokens < usages[0].prompt_tokens * 3]
        assert truncated and all(u.prompt_tokens_details.cached_tokens > 50 for u in truncated)
    finally:
        srv.close()


def test_truncation_keeps_the_system_prompt_and_the_last_turn(home):
    from kvfuse.config import EngineSettings
    from kvfuse.engine import Engine

    engine = Engine(uncached_engine(home, MODEL).model, None, EngineSettings.of(context_tokens=120))
    tok = engine.model.tokenizer
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(6):
        messages += [
            {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
    messages.append({"role": "user", "content": "And 7 plus 7?"})
    ids, dropped = engine.prompts.encode_chat(messages, reserve=16)
    text = tok.decode(ids, skip_special_tokens=False)
    assert dropped > 0 and len(ids) + 16 <= 120
    assert SYSTEM in text and "And 7 plus 7?" in text and "Question number 0" not in text
    assert engine.stats_snapshot()["truncated_requests"] == 1
