"""Bad input gets an OpenAI-style 4xx and the server stays up; queue limit (429); disconnects cancel
work; property-based fuzzing of the published OpenAPI schema (no 5xx, ever)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
LIMIT = 512  # server.max_tokens_limit of the main server
BODY_LIMIT = 1024 * 1024
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def home(kvfuse_home) -> Path:
    ensure_model(kvfuse_home, MODEL)
    return kvfuse_home


@pytest.fixture(scope="module")
def server(home, tmp_path_factory):
    # One sequence at a time: the disconnect test needs a request that waits in the queue.
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path_factory.mktemp("errors-kv"))},
        "server": {"max_tokens_limit": LIMIT, "max_body_bytes": BODY_LIMIT},
        "engine": {"max_running": 1},
    }
    srv = ServerProcess(home, config=config)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def small_server(home, tmp_path_factory):
    """One request running and one waiting at most, at most 4 tokens each: for the 429 test and for fuzzing."""
    config = {
        "model": MODEL,
        "cache": {"disk_path": str(tmp_path_factory.mktemp("small-kv"))},
        "server": {"max_queue": 1, "max_tokens_limit": 4, "default_max_tokens": 4},
        "engine": {"max_running": 1},
    }
    srv = ServerProcess(home, config=config)
    srv.start()
    yield srv
    srv.close()


def ok_completion(**over):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **over}


def ok_chat(**over):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        **over,
    }


# (id, path, body (dict, or raw bytes), status, param, code)
BAD = [
    ("malformed-json", C, b'{"model": ', 400, None, "invalid_json"),
    ("body-not-object", C, b"[1, 2]", 400, None, None),
    ("no-body", C, b"", 400, None, None),
    ("max_tokens-string", C, ok_completion(max_tokens="5"), 400, "max_tokens", "invalid_type"),
    ("max_tokens-zero", C, ok_completion(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens-negative", C, ok_completion(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens-over-limit", C, ok_completion(max_tokens=LIMIT + 1), 400, "max_tokens", None),
    ("max_tokens-float", C, ok_completion(max_tokens=2.5), 400, "max_tokens", None),
    ("temperature-string", C, ok_completion(temperature="hot"), 400, "temperature", None),
    ("temperature-too-high", C, ok_completion(temperature=2.5), 400, "temperature", None),
    ("temperature-negative", C, ok_completion(temperature=-0.1), 400, "temperature", None),
    ("top_p-zero", C, ok_completion(top_p=0), 400, "top_p", None),
    ("top_p-too-high", C, ok_completion(top_p=1.5), 400, "top_p", None),
    ("seed-negative", C, ok_completion(seed=-1), 400, "seed", None),
    ("unknown-model", C, ok_completion(model="gpt-4"), 404, "model", "model_not_found"),
    ("missing-model", C, {"prompt": "hi"}, 400, "model", "missing_required_parameter"),
    ("missing-prompt", C, {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("empty-prompt", C, ok_completion(prompt=""), 400, "prompt", None),
    ("empty-prompt-list", C, ok_completion(prompt=[]), 400, "prompt", None),
    ("prompt-batch", C, ok_completion(prompt=["a", "b"]), 400, "prompt", None),
    ("prompt-wrong-type", C, ok_completion(prompt=5), 400, "prompt", None),
    ("prompt-bool-ids", C, ok_completion(prompt=[True, False]), 400, "prompt", None),
    ("token-id-outside-vocab", C, ok_completion(prompt=[10**9]), 400, "prompt", None),
    ("n-zero", C, ok_completion(n=0), 400, "n", None),
    ("n-over-128", C, ok_completion(n=129), 400, "n", None),
    ("best_of-over-n", C, ok_completion(n=2, best_of=3), 400, "best_of", None),
    ("logprobs-over-5", C, ok_completion(logprobs=6), 400, "logprobs", None),
    ("echo-wrong-type", C, ok_completion(echo="yes"), 400, "echo", None),
    (
        "frequency_penalty-over-2",
        C,
        ok_completion(frequency_penalty=2.5),
        400,
        "frequency_penalty",
        None,
    ),
    (
        "presence_penalty-under-2",
        C,
        ok_completion(presence_penalty=-3),
        400,
        "presence_penalty",
        None,
    ),
    (
        "repetition_penalty-zero",
        C,
        ok_completion(repetition_penalty=0),
        400,
        "repetition_penalty",
        None,
    ),
    ("top_k-under-minus-1", C, ok_completion(top_k=-2), 400, "top_k", None),
    ("min_p-over-1", C, ok_completion(min_p=1.5), 400, "min_p", None),
    ("logit_bias-key", C, ok_completion(logit_bias={"abc": 1}), 400, "logit_bias", None),
    (
        "logit_bias-outside-vocab",
        C,
        ok_completion(logit_bias={"999999": 1}),
        400,
        "logit_bias",
        None,
    ),
    ("logit_bias-over-100", C, ok_completion(logit_bias={"5": 101}), 400, "logit_bias", None),
    (
        "stop_token_ids-outside-vocab",
        C,
        ok_completion(stop_token_ids=[10**7]),
        400,
        "stop_token_ids",
        None,
    ),
    ("chat-top_logprobs-without-logprobs", CH, ok_chat(top_logprobs=2), 400, "top_logprobs", None),
    (
        "chat-top_logprobs-over-20",
        CH,
        ok_chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        None,
    ),
    ("stop-wrong-type", C, ok_completion(stop=5), 400, "stop", None),
    ("stop-empty-string", C, ok_completion(stop=[""]), 400, "stop", None),
    ("stream-wrong-type", C, ok_completion(stream="yes"), 400, "stream", None),
    ("cache_salt-wrong-type", C, ok_completion(cache_salt=5), 400, "cache_salt", None),
    ("cache-wrong-type", C, ok_completion(cache="no"), 400, "cache", None),
    (
        "context-window",
        C,
        ok_completion(prompt=[100] * 8200),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "context-window-with-max_tokens",
        C,
        ok_completion(prompt=[100] * 8000, max_tokens=500),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("chat-no-messages", CH, ok_chat(messages=[]), 400, "messages", None),
    ("chat-messages-string", CH, ok_chat(messages="hi"), 400, "messages", None),
    (
        "chat-bad-role",
        CH,
        ok_chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages",
        None,
    ),
    (
        "chat-image-part",
        CH,
        ok_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages",
        None,
    ),
    (
        "chat-max_completion_tokens-zero",
        CH,
        ok_chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
        None,
    ),
    ("chat-unknown-model", CH, ok_chat(model="nope"), 404, "model", "model_not_found"),
    ("chat-cache-wrong-type", CH, ok_chat(cache=1), 400, "cache", None),
]


@pytest.mark.parametrize(
    "path,body,status,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input_gets_an_openai_style_error(server, path, body, status, param, code):
    if isinstance(body, bytes):
        r = httpx.post(
            server.url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
    else:
        r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert param in err["message"]  # the message names the field
    assert r.headers["x-request-id"].startswith("req_")


def test_limits_are_named_in_the_message(server):
    r = httpx.post(server.url + C, json=ok_completion(max_tokens=LIMIT + 1))
    assert str(LIMIT) in r.json()["error"]["message"]
    r = httpx.post(server.url + C, json=ok_completion(prompt=[100] * 8200))
    assert "8192" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", [C, CH, "/v1/responses"])
def test_unknown_fields_are_refused_by_name(server, path):
    body = {
        C: ok_completion(logit_bias={"1": 2}, user="u1", stop=None),
        CH: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    }[path]
    assert httpx.post(server.url + path, json=body).status_code == 200
    r = httpx.post(server.url + path, json={**body, "frobnicate": True})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "frobnicate" and error["code"] == "unsupported_parameter"
    assert error["message"].startswith("frobnicate: this field is not supported")


def test_unknown_routes_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + C)
    assert r.status_code == 405 and "error" in r.json()


def test_body_over_the_limit_is_413(server):
    big = json.dumps(ok_completion(prompt="x" * (BODY_LIMIT + 10))).encode()
    r = httpx.post(server.url + C, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the size is checked while the body streams in
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    r = httpx.post(server.url + C, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]


def test_openai_client_raises_typed_errors(server):
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["code"] == "model_not_found"


def test_the_server_still_answers_normal_requests(server):
    assert httpx.get(server.url + "/health").status_code == 200
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_disconnects_cancel_running_and_queued_work(server):
    """A streaming client that leaves stops its generation; a queued client that leaves is skipped."""
    counting = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    running0 = metric(server, "kvfuse_requests_cancelled_total", stage="running")
    queued0 = metric(server, "kvfuse_requests_cancelled_total", stage="queued")
    generated0 = httpx.get(server.base_url + "/kv/stats").json()["engine"]["tokens_generated"]
    with httpx.stream("POST", server.url + C, json=counting, timeout=120) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        got = 0
        for line in events:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        # While the stream runs, a second request waits in the queue; its client gives up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + C, json=ok_completion(max_tokens=5), timeout=1.5)
        assert wait_for(
            lambda: metric(server, "kvfuse_requests_cancelled_total", stage="queued") > queued0, 30
        )
    # Leaving the `with` closed the streaming connection mid-generation.
    assert wait_for(
        lambda: metric(server, "kvfuse_requests_cancelled_total", stage="running") > running0, 60
    )
    generated = (
        httpx.get(server.base_url + "/kv/stats").json()["engine"]["tokens_generated"] - generated0
    )
    assert generated < 400  # stopped early
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_queue_full_is_429(small_server):
    """max_queue 1: with one request running and one waiting, the others are refused at once."""
    # ~600 tokens: a slow prefill
    prompt = " ".join(f"Line {i}: the value is {7 * i}." for i in range(60))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "cache": False}
    barrier = threading.Barrier(6)

    def post(_):
        barrier.wait()
        return httpx.post(small_server.url + C, json=body, timeout=300)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, [r.text for r in responses]
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "queue_full" and "retry-after" in refused.headers
    client = OpenAI(base_url=small_server.base_url, api_key="unused", max_retries=0)
    assert (
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens
        >= 0
    )


def test_fuzz_the_published_openapi_schema(small_server):
    """Schemathesis cases (valid and invalid) for every operation: never a 5xx; the server stays up."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    spec = httpx.get(small_server.url + "/openapi.json").json()
    assert (
        spec["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0][
            "maximum"
        ]
        == 4
    )
    # Name the served model in the positive cases, so that they reach the engine (a random name is a 404).
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "MessagesRequest",
        "CountTokensRequest",
    ):
        spec["components"]["schemas"][name]["properties"]["model"] = {
            "type": "string",
            "enum": [MODEL],
        }
    schema = schemathesis.openapi.from_dict(spec)
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(
                max_examples=15,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=small_server.url, timeout=120)
                if response.status_code >= 500:
                    failures.append(
                        (operation.label, case.body, response.status_code, response.text[:300])
                    )

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid (e.g. GET /health has no parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
    assert not failures, (failures[:3], small_server.log_tail(3000))
    assert httpx.get(small_server.url + "/health").status_code == 200
