"""Per-tenant quotas on a real ``kvfuse serve``, driven by the official ``openai`` client with
concurrent requests: one tenant's flood of new prompts evicts only its own entries (another
tenant's stay cached, below their share), a tenant over its requests per minute gets OpenAI's 429
with Retry-After, no request is ever a 5xx, and ``/metrics`` shows the per-tenant bytes, evictions
and rejections."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from kvfuse_helpers import SENTENCES
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
KEYS = {"alice": "sk-alice-91c3", "bob": "sk-bob-55e0", "carol": "sk-carol-2a7d"}
MIB = 1 << 20
QUOTA = 24 * MIB  # alice's and bob's memory quota; a 64-token chunk of SmolLM2 is ~1.5 MB
RPM = 4  # carol's requests per minute
TOKEN = "metrics-6b0e"
WORDS = sorted({w.strip(".,") for s in SENTENCES for w in s.split()})


@pytest.fixture(scope="module")
def server(kvfuse_home):
    ensure_model(kvfuse_home, MODEL)
    config = {
        "model": MODEL,
        # memory only (no disk to refill it from): what stays cached is what the memory tier kept
        "cache": {"disk": False, "chunk_size": 64, "memory_bytes": 2 * QUOTA + 4 * MIB},
        "engine": {"max_running": 8},
        "server": {
            "api_keys": [f"{key}:{tenant}" for tenant, key in KEYS.items()],
            "max_queue": 256,
            "metrics_token": TOKEN,
        },
        "tenants": {
            "alice": {"quota": {"memory_bytes": QUOTA, "requests_per_minute": 1000}},
            "bob": {"quota": {"memory_bytes": QUOTA}},
            "carol": {"quota": {"requests_per_minute": RPM}},
        },
    }
    srv = ServerProcess(kvfuse_home, config=config)
    srv.start()
    yield srv
    srv.close()


def client(server, tenant: str) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=KEYS[tenant], max_retries=0, timeout=600)


def prompt(seed: int) -> str:
    """~300 tokens of words in a seeded order: prompts share no chunk with each other."""
    rnd = random.Random(seed)
    return f"Ledger {seed}: " + " ".join(rnd.choice(WORDS) for _ in range(230)) + ".\nSummary:"


def cached(c: OpenAI, text: str) -> int:
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def metrics(server) -> dict[tuple[str, tuple], float]:
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def tenant_series(samples, name: str, tenant: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"tenant": tenant, **labels}.items()))), 0.0)


def test_a_tenants_flood_does_not_evict_another_tenants_entries(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    bob_prompts = [prompt(1000 + i) for i in range(2)]  # ~12 MB: half bob's quota
    for p in bob_prompts:
        cached(bob, p)
    reference = [cached(bob, p) for p in bob_prompts]
    assert all(n > 200 for n in reference), reference  # bob's repeats are cached before the flood

    # alice floods with 14 new prompts (~85 MB, 3.5x her quota) while bob keeps asking for his
    flood = [prompt(i) for i in range(14)]
    with ThreadPoolExecutor(8) as pool:
        floods = [pool.submit(cached, alice, p) for p in flood]
        repeats = [pool.submit(cached, bob, p) for p in bob_prompts * 2]
        assert [f.result() for f in floods] == [0] * len(flood)  # all new: nothing to reuse
        during = [f.result() for f in repeats]
    after = [cached(bob, p) for p in bob_prompts]
    assert during == reference * 2 and after == reference, (reference, during, after)

    m = metrics(server)
    used = {
        t: tenant_series(m, "kvfuse_tenant_used_bytes", t, tier="memory") for t in ("alice", "bob")
    }
    assert 0 < used["alice"] <= QUOTA and 0 < used["bob"] <= QUOTA, used
    assert tenant_series(m, "kvfuse_tenant_quota_bytes", "alice", tier="memory") == QUOTA
    assert tenant_series(m, "kvfuse_tenant_quota_evictions_total", "alice", tier="memory") > 0
    assert tenant_series(m, "kvfuse_tenant_quota_evictions_total", "bob", tier="memory") == 0
    # carol has no byte quota: no byte series of hers
    assert not any(k[0] == "kvfuse_tenant_used_bytes" and ("tenant", "carol") in k[1] for k in m)
    statuses = {dict(k[1])["status"] for k in m if k[0] == "kvfuse_http_requests_total"}
    assert not any(s.startswith("5") for s in statuses), statuses


def test_requests_beyond_the_rate_limit_get_openais_429(server):
    carol = client(server, "carol")

    def one(i: int):
        try:
            carol.completions.create(
                model=MODEL, prompt=f"Count to {i}:", max_tokens=1, temperature=0
            )
            return 200, None
        except openai.APIStatusError as e:
            return e.status_code, e

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(2 * RPM)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200] * RPM + [429] * RPM, statuses
    for status, e in results:
        if status != 429:
            continue
        assert isinstance(e, openai.RateLimitError)
        assert e.body["type"] == "requests" and e.body["code"] == "rate_limit_exceeded"
        assert f"Limit {RPM}, Used {RPM}" in e.body["message"]
        assert "tenants.carol.quota.requests_per_minute" in e.body["message"]
        assert 1 <= int(e.response.headers["retry-after"]) <= 60
        assert e.response.headers["x-ratelimit-limit-requests"] == str(RPM)
    # the chat and Responses endpoints count against the same limit
    with pytest.raises(openai.RateLimitError):
        carol.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
    with pytest.raises(openai.RateLimitError):
        carol.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    # so do every other authenticated route (issue 39 item 7): models, KV stats and deletes
    with pytest.raises(openai.RateLimitError):
        carol.models.list()
    for method, path in (("GET", "/v1/kv/stats"), ("DELETE", "/v1/kv")):
        r = httpx.request(
            method,
            server.base_url.rstrip("/") + path.removeprefix("/v1"),
            headers={"authorization": f"Bearer {KEYS['carol']}"},
        )
        assert r.status_code == 429 and "retry-after" in r.headers, (path, r.status_code)
    # other tenants are not limited by carol's quota
    assert cached(client(server, "bob"), "The capital of France is") == 0
    m = metrics(server)
    assert (
        tenant_series(
            m, "kvfuse_tenant_rejected_requests_total", "carol", limit="requests_per_minute"
        )
        == RPM + 5
    )
