"""The worker surface routers read, against a real ``kvfuse serve``: /version, owned_by, vLLM's
/metrics series, /health, /tokenize, /detokenize and the render endpoints with vLLM's shapes."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

import kvfuse
from kvfuse_testkit import ServerProcess, ensure_model

pytestmark = pytest.mark.integration

MODEL = "smollm2"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours of the rainbow, please."},
]


@pytest.fixture(scope="module")
def server(kvfuse_home, tmp_path_factory):
    ensure_model(kvfuse_home, MODEL)
    disk = str(tmp_path_factory.mktemp("router-kv"))
    srv = ServerProcess(kvfuse_home, config={"model": MODEL, "cache": {"disk_path": disk}})
    srv.start()
    yield srv
    srv.close()


def vllm_samples(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                assert s.labels == {"model_name": MODEL, "engine": "0"}
                out[s.name] = s.value
    return out


def test_version_and_models_say_vllm_type_worker(server):
    assert httpx.get(server.url + "/version").json() == {"version": kvfuse.__version__}
    client = OpenAI(base_url=server.base_url, api_key="x")
    card = client.models.list().data[0]
    assert card.id == MODEL and card.owned_by == "vllm"
    assert card.model_extra["max_model_len"] > 0 and card.model_extra["root"] == MODEL
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_tokenize_chat_counts_what_the_chat_prompt_is(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
    assert body["token_strs"] is None
    client = OpenAI(base_url=server.base_url, api_key="x")
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert done.usage.prompt_tokens == body["count"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert "Name three colours" in text["prompt"] and "<|im_start|>" in text["prompt"]


def test_tokenize_prompt_round_trips_and_gives_pieces(server):
    r = httpx.post(
        server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    )
    body = r.json()
    assert body["token_strs"] == ["Hello", "Ġworld"] and body["count"] == 2
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "tools": []}, 400, "tools"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        (
            "/v1/chat/completions/render",
            {"model": MODEL, "messages": MESSAGES, "bogus": 1},
            400,
            "bogus",
        ),
        ("/v1/chat/completions/render", {"model": "other", "messages": MESSAGES}, 404, "model"),
        ("/v1/completions/render", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ],
)
def test_bad_bodies_are_clear_4xx(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_vllm_gauges_and_prefix_cache_counters_move(server):
    before = vllm_samples(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_prefix_cache_hit_rate",
    ):
        assert name in before
    assert before["vllm:num_requests_running"] == 0 and before["vllm:kv_cache_usage_perc"] == 0
    client = OpenAI(base_url=server.base_url, api_key="x")
    long = [{"role": "user", "content": "Tell me about lighthouses. " * 80}]
    usages = [
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2).usage
        for _ in range(2)
    ]
    after = vllm_samples(server)
    queried = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queried == sum(u.prompt_tokens for u in usages)
    assert hits == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
    rate = after["vllm:prefix_cache_hits_total"] / after["vllm:prefix_cache_queries_total"]
    assert after["vllm:gpu_prefix_cache_hit_rate"] == pytest.approx(rate)


def test_tokenize_needs_no_key_where_v1_does(kvfuse_home, tmp_path):
    """As in vLLM: routers tokenize on every worker without the client's key."""
    disk = str(tmp_path / "kv")
    with ServerProcess(
        kvfuse_home,
        config={"model": MODEL, "cache": {"disk_path": disk}},
        args=["--api-key", "sk-a:alice"],
    ) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world"})
        assert r.status_code == 200 and r.json()["count"] == 2
        r = httpx.post(srv.url + "/detokenize", json={"tokens": r.json()["tokens"]})
        assert r.json() == {"prompt": "Hello world"}
        assert httpx.get(srv.url + "/version").status_code == 200


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_chat_render_gives_the_ids_the_completion_prefills(server):
    """Tools included: the render's ids are the prompt /v1/chat/completions counts, and the
    sampling parameters are the ones it applies, under vLLM's names."""
    body = {
        "model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 3,
        "temperature": 0.5, "seed": 7, "stop": ["\n\n"], "cache_salt": "s1",
    }  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "chatcmpl-" + r.headers["x-request-id"].removeprefix("req_")
    assert out["model"] == MODEL and out["cache_salt"] == "s1" and out["stream"] is False
    sp = out["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["n"]) == (3, 0.5, 7, 1)
    assert sp["stop"][0] == "\n\n" and "logprobs" not in sp
    client = OpenAI(base_url=server.base_url, api_key="x")
    kwargs = {k: v for k, v in body.items() if k != "cache_salt"}
    done = client.chat.completions.create(**kwargs, extra_body={"cache_salt": "s1"})
    assert done.usage.prompt_tokens == len(out["token_ids"])
    text = httpx.post(server.url + "/detokenize", json={"tokens": out["token_ids"]}).json()
    assert "get_weather" in text["prompt"]
    plain = httpx.post(
        server.url + "/v1/chat/completions/render", json={"model": MODEL, "messages": MESSAGES}
    ).json()
    assert len(plain["token_ids"]) < len(out["token_ids"])


def test_completion_render_is_a_list_of_one(server):
    r = httpx.post(
        server.url + "/v1/completions/render",
        json={"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "logprobs": 2},
    )
    assert r.status_code == 200, r.text
    (out,) = r.json()
    assert out["request_id"].startswith("cmpl-") and out["token_ids"] == [19556, 905]
    assert out["sampling_params"]["logprobs"] == 2 and out["sampling_params"]["max_tokens"] == 4
