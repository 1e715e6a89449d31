"""The Responses API on a real ``kvfuse serve`` process, driven by the official ``openai`` client:
previous_response_id chains (equal to chat completions of the whole history, reusing the stored
KV, across a restart), streaming events, tenants, deletion freeing entries, errors; and expiry of
stored responses on an in-process server whose clock the test drives."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model, free_port

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEYS = {"alice": "sk-alice", "bob": "sk-bob"}
# ~400 tokens
NOTES = " ".join(f"Station {i} on the line is called Halt {i * 7 % 31}." for i in range(30))
QUESTIONS = [
    "Which station is called Halt 14?",
    "And which one is Halt 21?",
    "Name the first station.",
]


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


@pytest.fixture(scope="module")
def server(home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp / "kv")},
        "responses": {"path": str(tmp / "responses.sqlite3")},
        "server": {"api_keys": [f"{key}:{tenant}" for tenant, key in KEYS.items()]},
    }
    srv = ServerProcess(home, config=config)
    srv.start()
    yield srv
    srv.close()


def client(server, tenant: str = "alice") -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=KEYS[tenant], max_retries=0, timeout=300)


def ask(c: OpenAI, text: str, previous: str | None = None, **extra):
    return c.responses.create(
        model=MODEL,
        input=text,
        previous_response_id=previous,
        instructions="Answer briefly.",
        max_output_tokens=20,
        temperature=0,
        **extra,
    )


def chat_reference(c: OpenAI, messages: list[dict]) -> str:
    """The same conversation through chat completions, without the cache (a full prefill)."""
    r = c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, extra_body={"cache": False}
    )
    return r.choices[0].message.content


def settled_disk_entries(base_url: str, headers: dict | None = None) -> int:
    """The disk tier's entry count once the background saves have landed (two equal reads)."""
    last = None
    for _ in range(100):
        stats = httpx.get(base_url + "/kv/stats", headers=headers or {}, timeout=30).json()
        n = stats["tiers"]["disk"]["entries"]
        if n == last and stats["tiers"]["store"]["queue_depth"] == 0:
            return n
        last = n
        time.sleep(0.3)
    raise AssertionError("the disk tier never settled")


def test_chain_equals_chat_history_reuses_kv_and_survives_restart(server):
    c = client(server)
    first = ask(c, NOTES + "\n" + QUESTIONS[0])
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = ask(c, QUESTIONS[1], previous=first.id)
    assert second.previous_response_id == first.id
    # the whole first turn (notes, question and answer) was reused, not only whole chunks
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    server.stop()
    server.start()  # a restart between steps: stored responses and the disk tier survive
    c = client(server)
    third = ask(c, QUESTIONS[2], previous=second.id)
    details = third.usage.input_tokens_details
    assert details.cached_tokens > second.usage.input_tokens
    # after the restart: from disk
    assert details.model_extra["cached_entries_by_tier"].get("disk", 0) > 0
    assert c.responses.retrieve(first.id).output_text == first.output_text

    messages = [{"role": "system", "content": "Answer briefly."}]
    for question, step in zip(
        [NOTES + "\n" + QUESTIONS[0], *QUESTIONS[1:]], [first, second, third]
    ):
        messages.append({"role": "user", "content": question})
        assert step.output_text == chat_reference(c, messages), f"step {len(messages) // 2} differs"
        messages.append({"role": "assistant", "content": step.output_text})

    items = c.responses.input_items.list(third.id, order="asc")
    assert [i.role for i in items.data] == ["user"] and items.data[0].content[0].text == QUESTIONS[
        2
    ]


def test_streaming_events_and_a_streamed_response_is_stored(server):
    c = client(server)
    kinds, deltas, final = [], [], None
    for event in c.responses.create(
        model=MODEL,
        input="Say hello to Velmora harbour.",
        max_output_tokens=12,
        temperature=0,
        stream=True,
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) <= {"response.output_text.delta"} and deltas
    assert (
        final is not None and final.output_text == "".join(deltas) and final.usage.output_tokens > 0
    )
    assert c.responses.retrieve(final.id).output_text == final.output_text
    follow = ask(c, "Again, please.", previous=final.id)
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_other_tenants_get_404(server):
    mine = ask(client(server, "alice"), "What is two plus two?")
    bob = client(server, "bob")
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as e:
        ask(bob, "Go on.", previous=mine.id)
    assert "not found" in str(e.value) and "alice" not in str(e.value)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(mine.id)
    assert client(server, "alice").responses.retrieve(mine.id).id == mine.id


def test_delete_frees_the_responses_entries(server):
    c = client(server)
    r = c.responses.create(
        model=MODEL,
        input=NOTES + "\nWhich station is called Halt 3?",
        max_output_tokens=8,
        temperature=0,
        extra_body={"cache_salt": "delete-test"},
    )
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    before = settled_disk_entries(server.base_url, auth)
    out = httpx.delete(
        f"{server.base_url}/responses/{r.id}",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=60,
    ).json()
    assert out["deleted"] is True and out["id"] == r.id
    freed = out["freed_entries"]
    assert freed.get("memory", 0) >= 2 and freed.get("disk", 0) >= 2  # its chunk(s) and its tail
    assert settled_disk_entries(server.base_url, auth) == before - freed["disk"]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    again = c.responses.create(
        model=MODEL,
        input=NOTES + "\nWhich station is called Halt 3?",
        max_output_tokens=8,
        temperature=0,
        extra_body={"cache_salt": "delete-test"},
    )
    assert again.usage.input_tokens_details.cached_tokens == 0  # nothing of it was left


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"previous_response_id": "resp_doesnotexist"}, 404, "response_id"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            400,
            "input",
        ),
        ({"max_output_tokens": 100000}, 400, "max_output_tokens"),
        ({"prompt_cache_retention": "forever"}, 400, "prompt_cache_retention"),
        ({"model": "gpt-4o"}, 404, "model"),
    ],
)
def test_errors_are_clear(server, fields, status, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    r = httpx.post(
        server.base_url + "/responses",
        json=body,
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_store_false_is_not_kept(server):
    c = client(server)
    r = c.responses.create(
        model=MODEL, input="Hello.", max_output_tokens=4, temperature=0, store=False
    )
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


# --------------------------------------------------------------- expiry, on an in-process server


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def clocked(home, tmp_path_factory):
    """An in-process server (uvicorn on a thread, real HTTP) whose stored responses expire by a clock
    the test moves."""
    from kvfuse.config import load_config
    from kvfuse.server.app import create_app

    tmp = tmp_path_factory.mktemp("responses-clock")
    config = load_config(
        overrides={
            "home": str(home),
            "model": MODEL,
            "cache.disk_path": str(tmp / "kv"),
            "responses.path": str(tmp / "r.sqlite3"),
            "responses.ttl": "1h",
        }
    )
    clock = Clock()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config, clock=clock),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.started
    yield (
        OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300
        ),
        clock,
        f"http://127.0.0.1:{port}",
    )
    server.should_exit = True
    thread.join(60)


def test_stored_responses_expire_and_free_their_entries(clocked):
    c, clock, url = clocked
    r = c.responses.create(
        model=MODEL, input=NOTES + "\nWhich station is Halt 9?", max_output_tokens=6, temperature=0
    )
    clock.t += 1800
    assert c.responses.retrieve(r.id).id == r.id  # half-way: still there
    follow = c.responses.create(
        model=MODEL, input="Thanks.", previous_response_id=r.id, max_output_tokens=4, temperature=0
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0
    entries = settled_disk_entries(url + "/v1")
    clock.t += 1900  # r expired (created 3700 s ago); follow not yet (1900 s)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(r.id)
    assert "expired" in str(e.value)
    # the expired response's own entries (its tail) are freed; those its follow-up shares are kept
    # r's tail; its first chunk is follow's too
    assert settled_disk_entries(url + "/v1") == entries - 1
    assert c.responses.retrieve(follow.id).id == follow.id
    with pytest.raises(openai.NotFoundError):
        c.responses.create(
            model=MODEL, input="More.", previous_response_id=r.id, max_output_tokens=4
        )


def test_metrics_count_responses(server):
    ask(client(server), "Count me.")
    text = httpx.get(server.url + "/metrics", timeout=30).text
    created = [
        line
        for line in text.splitlines()
        if line.startswith('kvfuse_responses_total{event="created"}')
    ]
    assert created and float(created[0].split()[-1]) >= 1
    assert "kvfuse_stored_responses " in text and 'kvfuse_tier_expired_total{tier="disk"}' in text
