"""Tenants: API keys, cache isolation between tenants, and DELETE /v1/kv clearing only the caller's entries."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEYS = {"alice": "sk-alice-123", "bob": "sk-bob-456"}


def long_prompt(tag: str) -> str:
    body = " ".join(f"Entry {i}: item {i} costs {3 * i + 1} coins." for i in range(40))
    return f"Price list ({tag}). {body}\nWhat does item 5 cost?"


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    home = kvfuse_home
    ensure_model(home, MODEL)
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path_factory.mktemp("tenants-kv"))},
        "server": {"api_keys": [f"{key}:{tenant}" for tenant, key in KEYS.items()]},
    }
    srv = ServerProcess(home, config=config)
    srv.start()
    yield srv
    srv.close()


def client(server, tenant: str) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=KEYS[tenant], max_retries=0, timeout=300)


def cached(c: OpenAI, prompt: str, **extra_body) -> int:
    r = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra_body or None
    )
    return r.usage.prompt_tokens_details.cached_tokens


def delete_kv(server, tenant: str, **params) -> dict:
    r = httpx.delete(
        server.base_url + "/kv",
        params=params,
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_missing_or_wrong_key_is_401_with_an_openai_error_body(server):
    bad = OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert exc.value.status_code == 401
    assert exc.value.body["code"] == "invalid_api_key"  # the client hands over the "error" object
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer sk-alice"}):
        r = httpx.post(
            server.base_url + "/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers
        )
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert httpx.delete(server.base_url + "/kv").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


def test_tenants_never_share_cached_tokens(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    prompt = long_prompt("shared")
    assert cached(alice, prompt) == 0
    assert cached(alice, prompt) > 0  # alice's own repeat is cached
    assert cached(bob, prompt) == 0  # the same prompt from bob does not see alice's entries
    assert cached(bob, prompt) > 0
    # the same cache_salt in two tenants is still two namespaces
    assert cached(alice, prompt, cache_salt="team") == 0
    assert cached(bob, prompt, cache_salt="team") == 0


def test_delete_clears_only_the_callers_entries(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    prompt = long_prompt("delete")
    for c in (alice, bob):
        cached(c, prompt)
        cached(c, prompt, cache_salt="s1")
    assert cached(alice, prompt) > 0 and cached(bob, prompt) > 0

    # one namespace only
    out = delete_kv(server, "alice", cache_salt="s1")
    assert out["tenant"] == "alice" and out["cache_salt"] == "s1" and out["deleted"]["memory"] > 0
    assert cached(alice, prompt, cache_salt="s1") == 0
    assert cached(alice, prompt) > 0

    # everything of alice's (her default namespace and every cache_salt she used)
    out = delete_kv(server, "alice")
    assert out["cache_salt"] is None and out["deleted"]["memory"] > 0
    assert cached(alice, prompt) == 0
    assert cached(alice, prompt, cache_salt="s1") == 0
    assert cached(bob, prompt) > 0  # bob's entries are untouched
    assert cached(bob, prompt, cache_salt="s1") > 0
