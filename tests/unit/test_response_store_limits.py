"""The Responses store's bounds: a response larger than max_response_bytes, or one that would take
its tenant past its responses or bytes, is refused (nothing stored); sizes are counted per row,
also in a store made before they were."""

from __future__ import annotations

import json
import sqlite3

import pytest

from kvfuse.history.response_store import (
    ResponseRefused,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    over_limits,
    stored_size,
)


@pytest.mark.parametrize(
    "size, count, used, limits, refused",
    [
        (100, 0, 0, StoreLimits(), None),
        (101, 0, 0, StoreLimits(max_response_bytes=100), "max_response_bytes"),
        (100, 0, 0, StoreLimits(max_response_bytes=100), None),
        (1, 2, 0, StoreLimits(tenant_responses=3), None),
        (1, 3, 0, StoreLimits(tenant_responses=3), "tenant_max_responses"),
        (10, 5, 90, StoreLimits(tenant_bytes=100), None),
        (11, 5, 90, StoreLimits(tenant_bytes=100), "tenant_max_bytes"),
    ],
)
def test_over_limits(size, count, used, limits, refused):
    why = over_limits(size, count, used, limits)
    assert (why is None) if refused is None else (refused in why)


def response(rid: str, tenant: str, text: str) -> StoredResponse:
    return StoredResponse(rid, tenant, 0.0, {"id": rid}, [{"role": "user", "content": text}])


def test_put_refuses_beyond_a_tenants_bytes_and_counts_each_tenant_apart(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")
    one = stored_size(response("a", "alice", "x" * 100))
    limits = StoreLimits(tenant_bytes=2 * one, tenant_responses=5)
    store.put(response("a", "alice", "x" * 100), limits)
    store.put(response("b", "alice", "x" * 100), limits)
    with pytest.raises(ResponseRefused, match="tenant_max_bytes"):
        store.put(response("c", "alice", "x" * 100), limits)
    store.put(response("b", "alice", "y" * 100), limits)  # replacing a row is not one more
    store.put(response("c", "bob", "x" * 100), limits)
    assert store.usage("alice") == (2, 2 * one) and store.usage("bob") == (1, one)
    store.delete("alice", "a")
    store.put(response("d", "alice", "x" * 100), limits)  # room again
    assert len(store) == 3


def test_a_store_made_before_sizes_gets_them(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL "
            "NOT NULL, expires_at REAL, previous_id TEXT, body TEXT NOT NULL, input_items TEXT "
            "NOT NULL, history TEXT NOT NULL, record BLOB);"
        )
        db.execute(
            "INSERT INTO responses VALUES ('a', 'alice', 0, NULL, NULL, ?, '[]', '[]', NULL)",
            (json.dumps({"id": "a"}),),
        )
    store = ResponseStore(path, ttl_s=None)
    assert store.usage("alice") == (1, len(json.dumps({"id": "a"})) + 4)
    assert store.get("alice", "a").body == {"id": "a"}


def test_kept_history_is_what_the_prompt_kept_without_the_instructions():
    from kvfuse.server.responses_api import conversation_kept as kept_history

    history = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "a"}]
    new = [{"role": "user", "content": [{"type": "text", "text": "big"}]}]
    new += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}]
    everything = history + [
        {"role": "user", "content": "big"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "hi"},
    ]
    assert kept_history(None, history, new, 0) == everything
    assert kept_history("be brief", history, new, 0) == everything
    assert kept_history("be brief", history, new, 4) == [{"role": "user", "content": "hi"}]
    sys = [{"role": "system", "content": "s"}]
    assert kept_history(None, sys + history, new, 2) == sys + everything[2:]


def test_a_purge_of_more_expired_responses_than_one_statement_holds(tmp_path, monkeypatch):
    from kvfuse.history import response_store

    monkeypatch.setattr(response_store, "PURGE_BATCH", 7)
    now = [1000.0]
    store = ResponseStore(tmp_path / "r.sqlite3", ttl_s=10, clock=lambda: now[0])
    for i in range(31):
        r = response(f"r{i}", "alice", "x")
        r.created_at, r.keys = now[0], [f"k{i % 30}", "shared"]
        store.put(r)
    now[0] += 5
    later = response("later", "alice", "z")
    later.created_at, later.keys = now[0], ["shared"]
    store.put(later)
    now[0] += 6  # the first 31 expired, "later" not: "shared" stays, it refers to it
    n, free = store.purge()
    assert n == 31 and sorted(free) == sorted(f"k{i}" for i in range(30))
    assert len(store) == 1 and store.get("alice", "later").id == "later"
