"""A real ``kvfuse serve`` with API keys configured as SHA-256 digests and ``/metrics`` behind a token
read from a file, driven by the official ``openai`` client and plain HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from kvfuse.config.api_keys import key_digest
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
ALICE, BOB = "sk-alice-7f3e", "sk-bob-0c21"
METRICS_TOKEN = "scrape-9d1b"


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    tmp = tmp_path_factory.mktemp("security")
    token_file = tmp / "metrics-token"
    token_file.write_text(METRICS_TOKEN + "\n")
    config = {
        "model": MODEL,
        "cache": {"disk": False},
        # alice's key appears only as its digest; bob's plain (both forms work side by side)
        "server": {
            "api_keys": [f"{key_digest(ALICE)}:alice", f"{BOB}:bob"],
            "metrics_token_file": str(token_file),
        },
    }
    srv = ServerProcess(kvfuse_home, config=config)
    srv.start()
    yield srv
    srv.close()


def test_a_key_configured_as_its_digest_authenticates(server):
    for key in (ALICE, BOB):
        c = OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)
        r = c.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0
        )
        assert r.choices[0].text
    for wrong in (key_digest(ALICE), ALICE[:-1], "sha256:" + "0" * 64):
        c = OpenAI(base_url=server.base_url, api_key=wrong, max_retries=0, timeout=120)
        with pytest.raises(openai.AuthenticationError) as exc:
            c.models.list()
        assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"


def test_metrics_need_the_token_with_an_openai_style_401(server):
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {ALICE}"},
        {"Authorization": f"Basic {METRICS_TOKEN}"},
    ):
        r = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "server.metrics_token" in err["message"] and METRICS_TOKEN not in r.text
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(
        server.url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=30
    )
    assert r.status_code == 200 and "kvfuse_http_requests_total" in r.text
    # the refusals are counted like any request; /health stays open
    assert 'kvfuse_http_requests_total{endpoint="/metrics",status="401"} 4.0' in r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_no_secret_reaches_the_log(server):
    log = server.log_tail(200_000)
    for secret in (ALICE, BOB, METRICS_TOKEN):
        assert secret not in log
