"""Prompt-cache controls as pure rules: durations, retention, breakpoints (what a request's entries
become), the chat marks the server reads from message parts, the Responses API's input, and the
stored responses (tenants, expiry by an injected clock, the entries a deletion frees)."""

from __future__ import annotations

import pytest

from kvfuse.durations import parse_duration
from kvfuse.history.response_store import (
    ResponseExpired,
    ResponseNotFound,
    ResponseStore,
    StoredResponse,
)
from kvfuse.kv.keys import Namespace, prefix_keys, tail_key
from kvfuse.reuse.planner import Save, breakpoint_saves
from kvfuse.reuse.retention import Breakpoint, Retention, keep_until, write_policy
from kvfuse.server.errors import APIError
from kvfuse.server.responses_api import chat_request, input_messages, plain_messages
from kvfuse.server.schemas import ChatCompletionRequest, ResponseCreateRequest
from kvfuse.server.translate import chat_marks, retention

NOW = 1_000_000.0


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90s", 90),
        ("10m", 600),
        ("24h", 86400),
        ("7d", 604800),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("2w", 1209600),
        ("45", 45),
        (3600, 3600),
        (" 5M ", 300),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "h", "10x", "1h 30m", "-5s", "0s", "0", "nan", "inf", "3651d", "m10", True]
)
def test_bad_durations_name_the_forms(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_retention_parse():
    assert Retention.parse("in_memory") == Retention(memory_only=True)
    assert Retention.parse("24h") == Retention(ttl_s=86400.0)
    with pytest.raises(ValueError, match="in_memory"):
        Retention.parse("forever")
    with pytest.raises(ValueError):
        Retention(memory_only=True, ttl_s=5)


H = 3600.0
BP_SHORT = Breakpoint(300, ttl_s=60.0)
BP_LONG = Breakpoint(600, ttl_s=2 * H)
BP_PLAIN = Breakpoint(900)


@pytest.mark.parametrize(
    "end, retention, breakpoints, expected",
    [
        (256, None, (), (None, False)),  # the tiers' policy
        (256, None, (BP_LONG,), (None, False)),  # no expiry already outlives a minimum
        (256, Retention(memory_only=True), (), (None, True)),
        (
            256,
            Retention(memory_only=True),
            (BP_SHORT,),
            (NOW + 60, False),
        ),  # a minimum beats in_memory
        (
            512,
            Retention(memory_only=True),
            (BP_SHORT,),
            (None, True),
        ),  # past the breakpoint's prefix
        (512, Retention(memory_only=True), (BP_SHORT, BP_LONG), (NOW + 2 * H, False)),
        (256, Retention(ttl_s=H), (), (NOW + H, False)),
        (256, Retention(ttl_s=H), (BP_SHORT,), (NOW + H, False)),  # the longer of the two
        (256, Retention(ttl_s=H), (BP_SHORT, BP_LONG), (NOW + 2 * H, False)),
        (
            700,
            Retention(ttl_s=H),
            (BP_SHORT, BP_LONG, BP_PLAIN),
            (NOW + H, False),
        ),  # a breakpoint without ttl
        (
            600,
            Retention(ttl_s=H),
            (BP_LONG,),
            (NOW + 2 * H, False),
        ),  # an entry ending at the breakpoint is in it
    ],
)
def test_write_policy(end, retention, breakpoints, expected):
    assert write_policy(end, retention, breakpoints, NOW) == expected


@pytest.mark.parametrize(
    "end, retention, breakpoints, expected",
    [
        (256, None, (), None),
        (256, Retention(memory_only=True), (), None),
        (256, Retention(ttl_s=H), (), NOW + H),
        (256, None, (BP_SHORT,), NOW + 60),
        (512, None, (BP_SHORT,), None),
        (256, Retention(ttl_s=30), (BP_LONG,), NOW + 2 * H),
    ],
)
def test_keep_until(end, retention, breakpoints, expected):
    assert keep_until(end, retention, breakpoints, NOW) == expected


def test_breakpoint_stores_add_tails_inside_chunks_only():
    ns = Namespace("model", "float16", "L2", tenant="t")
    ids = list(range(1, 41))  # chunks of 16: [0,16) [16,32), then 8 more
    chain = prefix_keys(ids, 16, ns)
    bps = [
        Breakpoint(20),
        Breakpoint(32),
        Breakpoint(38, 5.0),
        Breakpoint(20, 9.0),
        Breakpoint(41),
        Breakpoint(5),
    ]
    got = breakpoint_saves(ids, chain, bps, 16, ns)
    assert got == [
        Save(tail_key(None, ids[0:5], ns), 0, 5),
        Save(tail_key(chain[0], ids[16:20], ns), 16, 20),
        Save(tail_key(chain[1], ids[32:38], ns), 32, 38),
    ]  # 32: a chunk boundary; 41: past the prompt; 20 twice: once
    planned = {got[1].key}
    assert [s.end for s in breakpoint_saves(ids, chain, bps, 16, ns, planned)] == [5, 38]


def test_breakpoint_tail_is_what_a_later_prompt_probes():
    """The key a breakpoint stores is one of the keys ``tail_probe`` asks for when a later prompt
    shares the first ``position`` tokens (and goes on differently)."""
    from kvfuse.reuse.planner import tail_probe

    ns = Namespace("model", "float16", "L2")
    ids = list(range(1, 41))
    later = ids[:37] + [99, 98, 97, 96, 95]
    stored = breakpoint_saves(ids, prefix_keys(ids, 16, ns), [Breakpoint(37)], 16, ns)[0]
    probe = tail_probe(later, prefix_keys(later, 16, ns), 2, 16, ns)
    assert stored.key in [e.key for e in probe]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


def test_chat_marks_from_parts_messages_and_defaults():
    req = chat(
        messages=[
            {"role": "system", "content": "sys", "cache_control": {"type": "ephemeral"}},
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "abcd",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                    {"type": "text", "text": "ef", "prompt_cache_breakpoint": {"mode": "explicit"}},
                    {"type": "text", "text": "ghi"},
                ],
            },
        ],
        prompt_cache_options={"ttl": "30m"},
    )
    # offsets in the joined content "abcd\nef\nghi": after "abcd" = 4, after "ef" = 7
    assert chat_marks(req) == [(0, 3, 1800.0), (1, 4, 3600.0), (1, 7, 1800.0)]


def test_chat_marks_errors_name_the_field():
    req = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "x",
                        "cache_control": {"type": "ephemeral", "ttl": "soon"},
                    }
                ],
            }
        ]
    )
    with pytest.raises(APIError) as e:
        chat_marks(req)
    assert e.value.status == 400 and e.value.param == "messages[0].content[0].cache_control.ttl"
    many = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 17
    with pytest.raises(APIError, match="at most 16"):
        chat_marks(chat(messages=[{"role": "user", "content": many}]))
    with pytest.raises(APIError) as e:
        retention("12 hours")
    assert e.value.param == "prompt_cache_retention"
    assert retention(None) is None and retention("in_memory") == Retention(memory_only=True)


def test_input_messages_shapes_and_items():
    messages, items = input_messages("Hello")
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert items[0]["role"] == "user" and items[0]["content"] == [
        {"type": "input_text", "text": "Hello"}
    ]
    assert items[0]["id"].startswith("msg_")
    messages, items = input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi."}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a", "cache_control": {"type": "ephemeral"}},
                    {"type": "input_text", "text": "b"},
                ],
            },
        ]
    )
    assert [m["role"] for m in messages] == ["developer", "assistant", "user"]
    assert messages[2]["content"][0]["cache_control"] == {"type": "ephemeral"}
    assert items[1]["content"] == [{"type": "output_text", "text": "Hi."}]
    assert plain_messages(messages) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    "value, match",
    [
        ("", "empty"),
        ([], "at least one"),
        ([{"type": "function_call", "name": "f"}], "function_call"),
        ([{"role": "tool", "content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "text parts"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": []}], "content"),
    ],
)
def test_input_messages_errors(value, match):
    with pytest.raises(APIError, match=match) as e:
        input_messages(value)
    assert e.value.status == 400 and e.value.param == "input"


def test_chat_request_puts_instructions_first_then_history():
    body = ResponseCreateRequest.model_validate(
        {
            "model": "m",
            "input": "q2",
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "prompt_cache_retention": "24h",
        }
    )
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    messages, _ = input_messages(body.input)
    req = chat_request(body, history, messages)
    assert [
        (m.role, m.content if isinstance(m.content, str) else m.content[0].text)
        for m in req.messages
    ] == [("system", "Be brief."), ("user", "q1"), ("assistant", "a1"), ("user", "q2")]
    assert req.max_completion_tokens == 7 and req.prompt_cache_retention == "24h"


class Clock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


def response(rid: str, tenant: str = "a", keys=(), previous=None, created=NOW) -> StoredResponse:
    return StoredResponse(
        rid,
        tenant,
        created,
        {"id": rid},
        [{"role": "user", "content": rid}],
        [{"id": "msg_1"}],
        previous,
        b"rec",
        list(keys),
    )


def test_response_store_tenants_and_persistence(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path, ttl_s=60, clock=Clock())
    store.put(response("resp_1", "a", ["k1", "k2"]))
    got = store.get("a", "resp_1")
    assert got.body == {"id": "resp_1"} and got.keys == ["k1", "k2"] and got.record == b"rec"
    assert got.expires_at == NOW + 60
    with pytest.raises(ResponseNotFound):
        store.get("b", "resp_1")  # another tenant's id is unknown to it
    with pytest.raises(ResponseNotFound):
        store.delete("b", "resp_1")
    store.close()
    again = ResponseStore(path, ttl_s=60, clock=Clock())  # a restart
    assert again.get("a", "resp_1").history == [{"role": "user", "content": "resp_1"}]
    assert [r.id for r in again.list("a")] == ["resp_1"] and again.list("b") == []
    again.close()


def test_response_store_frees_only_unshared_entries():
    store = ResponseStore(None, ttl_s=None)
    store.put(response("r1", keys=["c1", "c2", "t1"]))
    # shares the parent's chunks
    store.put(response("r2", keys=["c1", "c2", "c3", "t2"], previous="r1"))
    assert sorted(store.delete("a", "r1")) == ["t1"]
    with pytest.raises(ResponseNotFound):
        store.get("a", "r1")
    assert sorted(store.delete("a", "r2")) == ["c1", "c2", "c3", "t2"]
    assert len(store) == 0


def test_response_store_expiry_by_clock():
    clock = Clock()
    store = ResponseStore(None, ttl_s=100, clock=clock, purge_every_s=150)
    store.put(response("old", keys=["x"]))
    clock.t += 50
    store.put(response("new", keys=["y"], created=clock.t))
    assert store.purge() == (0, [])
    clock.t += 60  # "old" expired, "new" did not
    with pytest.raises(ResponseExpired) as e:
        store.get("a", "old")
    assert e.value.keys == ["x"]
    with pytest.raises(ResponseNotFound):
        store.get("a", "old")  # removed at that lookup
    assert store.get("a", "new").id == "new"
    clock.t += 100
    assert store.purge(force=False) == (1, ["y"])  # 160 s after the last purge: due
    assert store.purge(force=False) == (0, [])  # not again before purge_every_s
    with pytest.raises(ValueError):
        ResponseStore(None, ttl_s=0)
