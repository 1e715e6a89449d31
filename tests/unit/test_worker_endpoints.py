"""What routers read from a worker, without a model: vLLM's load gauges, /health's phases,
/tokenize's body rules (tests/integration/test_router_surface.py runs them against a server)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfuse.config import Config
from kvfuse.config.sections import ServerConfig
from kvfuse.server.app import create_app
from kvfuse.server.errors import APIError
from kvfuse.server.vllm_metrics import VLLMCollector, kv_cache_usage, prefix_cache
from kvfuse.server.workers import TokenizeRequest, chat_text, tokenize_ids


@pytest.mark.parametrize(
    "queue, usage",
    [
        ({"kv_bytes_used": 25, "kv_bytes_limit": 100, "running": 1, "max_running": 2}, 0.25),
        ({"kv_bytes_used": 300, "kv_bytes_limit": 100}, 1.0),  # over the budget: capped
        ({"kv_bytes_used": 0, "kv_bytes_limit": 0, "running": 8, "max_running": 32}, 0.25),
        ({"running": 3, "max_running": 4}, 0.75),  # no memory figures: the batch's share
        ({"running": 0, "max_running": 0}, 0.0),
        ({}, 0.0),
    ],
)
def test_kv_cache_usage(queue, usage):
    assert kv_cache_usage(queue) == pytest.approx(usage)


def test_prefix_cache_counts_every_prompt_token_once():
    assert prefix_cache({"tokens_reused": 30, "tokens_prefilled": 70}) == (100, 30)
    assert prefix_cache({}) == (0, 0)


class _Engine:
    class model:
        name = "m"

    def queue_state(self):
        return {"running": 2, "waiting": 5, "max_running": 8}

    def stats_snapshot(self):
        return {"tokens_reused": 10, "tokens_prefilled": 30}


def _samples(engine) -> dict:
    r = CollectorRegistry()
    r.register(VLLMCollector(lambda: engine, lambda: engine.queue_state() if engine else {}))
    text = generate_latest(r).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_vllm_series_have_vllms_names_and_labels():
    labels = (("engine", "0"), ("model_name", "m"))
    s = _samples(_Engine())
    assert s[("vllm:num_requests_running", labels)] == 2
    assert s[("vllm:num_requests_waiting", labels)] == 5
    assert s[("vllm:kv_cache_usage_perc", labels)] == 0.25
    assert s[("vllm:prefix_cache_queries_total", labels)] == 40
    assert s[("vllm:prefix_cache_hits_total", labels)] == 10
    assert s[("vllm:gpu_prefix_cache_hit_rate", labels)] == 0.25
    assert _samples(None) == {}  # before the engine exists: nothing, not zeros


def _health(app) -> httpx.Response:
    async def get():
        transport = httpx.ASGITransport(app=app)  # no lifespan: the engine never starts
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/health")

    return asyncio.run(get())


def test_health_is_503_while_starting_and_draining():
    app = create_app(Config())
    r = _health(app)
    assert r.status_code == 503 and r.json()["status"] == "starting"
    app.state.kvfuse.drain()
    r = _health(app)
    assert r.status_code == 503 and r.json()["status"] == "draining"


def test_owned_by_defaults_to_vllm():
    assert ServerConfig().owned_by == "vllm"


class _Tok:
    """A chat template that wraps each message: ``<u>text</u>``, ``<a>`` to generate."""

    def render_chat(self, messages, add_generation_prompt=True):
        body = "".join(f"<{m['role'][0]}>{m['content']}</{m['role'][0]}>" for m in messages)
        return body + ("<a>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def _req(**fields) -> TokenizeRequest:
    return TokenizeRequest.model_validate(fields)


@pytest.mark.parametrize(
    "fields, text",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "<u>hi</u><a>"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
            "<u>hi</u>",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Sure "},
                ],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            "<u>hi</u><a>Sure",  # open after the text (stripped, as Hugging Face does)
        ),
    ],
)
def test_chat_text(fields, text):
    assert chat_text(_Tok(), _req(**fields)) == text


def test_tokenize_defaults_follow_vllm():
    assert tokenize_ids(_Tok(), _req(prompt="ab")) == [0, 97, 98]  # special tokens: yes
    assert tokenize_ids(_Tok(), _req(prompt="ab", add_special_tokens=False)) == [97, 98]
    chat = tokenize_ids(_Tok(), _req(messages=[{"role": "user", "content": "a"}]))
    assert chat[0] != 0  # a chat: the template's text only
    forced = _req(messages=[{"role": "user", "content": "a"}], add_special_tokens=True)
    assert tokenize_ids(_Tok(), forced)[0] == 0


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": []}, "tools"),
        ({"prompt": "a", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        (
            {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True},
            "continue_final_message",  # with add_generation_prompt (true by default)
        ),
    ],
)
def test_tokenize_refusals_name_the_field(fields, param):
    with pytest.raises(APIError) as e:
        tokenize_ids(_Tok(), _req(**fields))
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("fields", [{}, {"prompt": "a", "messages": [{"role": "user"}]}])
def test_tokenize_needs_one_input(fields):
    with pytest.raises(ValueError, match="exactly one of prompt and messages"):
        _req(**fields)
